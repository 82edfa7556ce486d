"""The report's "Drafter goals" section: issue 15's goals against the newest GPU bench records of the shipped drafter.

Each goal is read, per benchmark set, from the newest ``ubtree bench e2e`` record (file order) on GPU hardware at one
request in flight with a drafter under ``checkpoints/`` (the shipped folder). The folder is retrained over sessions
and records name the drafter's cumulative label rows: records of the shipped training (the label rows of the newest
``train`` record that exported into the folder) come first, and a goal never measured with it falls back to an
earlier training of the folder, its label rows in the row. Within each, records of at least ``GOAL_PROMPTS``
prompts (the issue's measurement) come before smaller runs, which stand in only where no full run exists (the row
names its prompt count).

* tree tau at T = 0 and at T = 1: the serving default on CUDA (``DEFAULT_TREE_METHOD``: Model Runner V2 with the
  prompt-lookup branch, the default tree attention) at B = ``GOAL_BUDGET``;
* single-path tau at T = 0: ``SINGLE_PATH_METHODS``;
* speedup at T = 0: that tree record's speedup over the ``ar`` run of its own invocation, against ``SPEEDUP_GOAL``
  and against the ``ngram`` run of the same invocation.

Standard library only (imported by ``report.py``, whose top level the CLI parser imports).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ubtree_vllm.bench.standing import NGRAM_METHOD, on_gpu, same_invocation

DEFAULT_TREE_METHOD = "ubtree-mrv2-lookup"
# a record's tree_attention under the serving default "auto": flash_exact on compute capability 9, else triton
# (records before the bench named the served mode leave it out for "triton", then the default)
DEFAULT_TREE_ATTENTION = (None, "triton", "flash_exact")
SINGLE_PATH_METHODS = ("ubtree-single", "dflash-chain", "ubtree-chain")
SHIPPED_PREFIX = "checkpoints/"
GOAL_BUDGET = 64
GOAL_PROMPTS = 80  # per set, as issue 15 measures its goals
SETS = ("spec_bench", "mt_bench", "humaneval")
TREE_TAU_T0, TREE_TAU_T1, SINGLE_TAU, SPEEDUP_GOAL = 4.0, 3.0, 2.0, 1.8
HEADER = ["goal", "set", "measured", "met", "prompts", "drafter label rows", "commit", "date"]
INTRO = ("Issue 15's goals, each from the newest GPU `ubtree bench e2e` record at one request in flight of the "
         f"drafter under `{SHIPPED_PREFIX}`: of the shipped training (the label rows of the newest `train` record "
         "into the folder) where one exists, else of an earlier training of the folder (its label rows say which): "
         "tree = "
         f"`{DEFAULT_TREE_METHOD}` (the CUDA serving default, default tree attention) at B = {GOAL_BUDGET}; single path = "
         f"{' / '.join(SINGLE_PATH_METHODS)}; speedups over the `ar` run of the tree record's own invocation, and "
         f"`{NGRAM_METHOD}`'s from the same invocation. Runs of at least {GOAL_PROMPTS} prompts per set (the issue's "
         "measurement) come first; a smaller run stands in only where none exists. A goal with no such record is "
         "listed as not measured.")


def _batch1_gpu_bench(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """GPU `bench e2e` records (with tokens/s) at one request in flight, of every method (ar and ngram included)."""
    return [r for r in records if r["kind"] == "e2e" and on_gpu(r) and r.get("output_tokens_per_s") is not None
            and (r["concurrency"] or 1) == 1]


def of_shipped_drafter(record: dict[str, Any]) -> bool:
    """Whether ``record`` names the drafter under :data:`SHIPPED_PREFIX` (the one the repository ships)."""
    return str(record.get("drafter") or "").startswith(SHIPPED_PREFIX)


def shipped_label_rows(records: Sequence[dict[str, Any]]) -> int | None:
    """The cumulative label rows of the newest `train` record that exported into the shipped folder."""
    trained = [r for r in records if r["kind"] == "train" and of_shipped_drafter(r)]
    return trained[-1].get("cumulative_label_rows") if trained else None


def _newest(rows: Sequence[dict[str, Any]], dataset: str, temperature: float, methods: Sequence[str],
            shipped: int | None, budget: int | None = None) -> dict[str, Any] | None:
    """The newest record of the shipped folder for (set, T) among ``methods`` (at ``budget`` when given): of the
    shipped training (``shipped`` label rows) when there is one, else of any training of the folder; in each, of
    ``GOAL_PROMPTS`` prompts or more when there is one."""
    found = [r for r in rows if r["dataset"] == dataset and r["temperature"] == temperature
             and r["method"] in methods and of_shipped_drafter(r)
             and r.get("tau") is not None and (budget is None or r["tree_budget"] == budget)
             and r.get("tree_attention") in DEFAULT_TREE_ATTENTION]
    mine = [r for r in found if shipped is not None and r.get("cumulative_label_rows") == shipped]
    for candidates in (mine, found):
        if candidates:
            full = [r for r in candidates if (r.get("num_prompts") or 0) >= GOAL_PROMPTS]
            return (full or candidates)[-1]
    return None


def _row(goal: str, dataset: str, record: dict[str, Any] | None, measured: str | None, met: bool | None) -> list[Any]:
    if record is None:
        return [goal, dataset, "not measured", None, None, None, None, None]
    rows = record.get("cumulative_label_rows")
    return [goal, dataset, measured, met, record["num_prompts"], f"{rows / 1e6:.1f}M" if rows else None,
            record["commit"], record["date"]]


def drafter_goal_rows(records: Sequence[dict[str, Any]]) -> list[list[Any]]:
    """[goal, set, measured, met, prompts, drafter label rows, commit, date] per goal and set (HEADER)."""
    bench, shipped = _batch1_gpu_bench(records), shipped_label_rows(records)
    rows: list[list[Any]] = []
    for dataset in SETS:
        tree0 = _newest(bench, dataset, 0.0, (DEFAULT_TREE_METHOD,), shipped, GOAL_BUDGET)
        tree1 = _newest(bench, dataset, 1.0, (DEFAULT_TREE_METHOD,), shipped, GOAL_BUDGET)
        single = _newest(bench, dataset, 0.0, SINGLE_PATH_METHODS, shipped)
        rows.append(_row(f"tree tau (T=0) >= {TREE_TAU_T0}", dataset, tree0, tree0 and f"{tree0['tau']:.2f}",
                         tree0 is not None and tree0["tau"] >= TREE_TAU_T0))
        rows.append(_row(f"single-path tau (T=0) >= {SINGLE_TAU}", dataset, single, single and f"{single['tau']:.2f}",
                         single is not None and single["tau"] >= SINGLE_TAU))
        rows.append(_row(f"tree tau (T=1) >= {TREE_TAU_T1}", dataset, tree1, tree1 and f"{tree1['tau']:.2f}",
                         tree1 is not None and tree1["tau"] >= TREE_TAU_T1))
        speedup = tree0 and tree0.get("speedup_vs_ar")
        rows.append(_row(f"speedup over ar (T=0) >= {SPEEDUP_GOAL}x", dataset, tree0 if speedup else None,
                         speedup and f"{speedup:.2f}x", bool(speedup) and speedup >= SPEEDUP_GOAL))
        ngram = next((r for r in bench if same_invocation(r) == same_invocation(tree0)
                      and r["method"] == NGRAM_METHOD and r.get("speedup_vs_ar")), None) if speedup else None
        rows.append(_row("speedup (T=0) >= ngram's", dataset, tree0 if ngram else None,
                         ngram and f"{speedup:.2f}x vs {ngram['speedup_vs_ar']:.2f}x",
                         ngram is not None and speedup >= ngram["speedup_vs_ar"]))
    return rows
