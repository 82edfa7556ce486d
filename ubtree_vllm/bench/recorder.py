"""The records of `ubtree bench e2e`'s measured runs, in the invocation's mode: e2e + round cost, --agreement,
--stage-timing, --sampling-options (each run paired with ar's), and the one-line summaries the bench prints."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ubtree_vllm.bench.agreement import agreement_record, tokens_in_prompt_order
from ubtree_vllm.bench.engines import Engine, Log
from ubtree_vllm.bench.measurement import RunResult, SpeedupTable, e2e_record
from ubtree_vllm.bench.prompts import PromptSet
from ubtree_vllm.bench.round_cost import CARRIED, round_cost_records
from ubtree_vllm.bench.sampling_options import NONE, option_records
from ubtree_vllm.bench.settings import E2ESettings, engine_core_mode
from ubtree_vllm.bench.stage_timing import stage_records

class OptionLedger:
    """What the --sampling-options records of a run compare with: ar's tok/s with the same option in the same cell
    (ar runs first), and the round time of the same engine without an option ("none" runs first in a cell)."""

    def __init__(self) -> None:
        self._ar_tokens_per_s: dict[tuple, float] = {}
        self._no_option_round_ms: dict[tuple, float] = {}

    def records(self, label: str, drafter: str | None, record: Mapping[str, Any], option: str) -> list[dict[str, Any]]:
        """The cost records of one run (its e2e ``record``, measured with ``option``) of engine ``label``."""
        cell = (record["dataset"], record["temperature"], record["concurrency"])
        if record["method"] == "ar":
            self._ar_tokens_per_s[(*cell, option)] = record["output_tokens_per_s"]
        engine = (label, drafter, *cell)
        new = option_records(record, option, self._ar_tokens_per_s.get((*cell, option)),
                             self._no_option_round_ms.get(engine), {k: record.get(k) for k in CARRIED})
        if option == NONE and new:
            self._no_option_round_ms[engine] = new[0]["value"]
        return new


class Recorder:
    """Turns each measured run into the records of the invocation's mode (e2e + round cost, --agreement,
    --stage-timing, --sampling-options), pairs them with ar's, appends them when a path is given."""

    def __init__(self, settings: E2ESettings, target: str, cuda_graphs: bool, records_path: str | Path | None,
                 log: Log) -> None:
        self.settings, self.target, self.cuda_graphs, self.records_path, self.log = (
            settings, target, cuda_graphs, records_path, log)
        self.speedups = SpeedupTable()
        self.rows: list[dict[str, Any]] = []
        self.greedy_ar: dict[tuple[str, int], list[list[int]]] = {}  # --agreement: ar's outputs per (dataset, conc)
        self.options = OptionLedger()  # --sampling-options: the baselines each option's records compare with
        self.engine_core = engine_core_mode(settings)  # the e2e records' notes name it

    def take(self, engine: Engine, prompt_set: PromptSet, temperature: float, concurrency: int, option: str | None,
             result: RunResult, outputs: list[Any], stage_times: Any = None, records: bool = True,
             note: str = "") -> list[dict[str, Any]]:
        """The records of one measured run (appended if a path); ``records=False`` (--profile): log it only;
        ``note``: how the run was measured, added to the run's own note in the records."""
        from ubtree_vllm.bench.records import append_record

        settings, run, drafter = self.settings, engine.run, engine.drafter
        if note:
            run = dataclasses.replace(run, note=f"{run.note}; {note}" if run.note else note)
        speedup = (None if option else
                   self.speedups.speedup(run.method, prompt_set.dataset, temperature, concurrency, result.tokens_per_s))
        where = dict(target=self.target, drafter=drafter, dataset=prompt_set.dataset, temperature=temperature,
                     concurrency=concurrency, max_new_tokens=settings.max_new_tokens, cuda_graphs=self.cuda_graphs,
                     tp=settings.tensor_parallel_size)
        record = e2e_record(run, result, speedup=speedup, drafter_training=engine.drafter_training,
                            engine_core=self.engine_core, **where)
        self.log(f"bench e2e: {summary_line(record)}" + (f" option={option}" if option else ""))
        if not records:  # the profiler slows the steps: tables only, no records
            new = []
        elif settings.agreement:  # greedy outputs against ar's: agreement records only
            tokens = tokens_in_prompt_order(outputs, prompt_set.prompts)
            cell = (prompt_set.dataset, concurrency)
            if run.method == "ar":
                self.greedy_ar[cell] = tokens
            new = [] if run.method == "ar" else [agreement_record(
                run, self.greedy_ar[cell], tokens, target=self.target, drafter=drafter, dataset=prompt_set.dataset,
                concurrency=concurrency, max_new_tokens=settings.max_new_tokens, cuda_graphs=self.cuda_graphs,
                tau=result.tau, tp=settings.tensor_parallel_size)]
        elif settings.stage_timing:  # timed steps are slower: stage records only
            new = stage_records(run, result, stage_times, **where)
        elif option:  # --sampling-options: the option's cost records only
            new = self.options.records(engine.label, drafter, record, option)
        else:  # + its round cost in plain steps against this invocation's ar cell
            new = [record, *round_cost_records([*(r for r in self.rows if r["method"] == "ar"), record])]
        if self.records_path is not None:
            new = [append_record(r, self.records_path) for r in new]
        self.rows.extend(new)
        return new


SUMMARY_COLUMNS = (("method", "method", 12), ("B", "tree_budget", 4), ("dataset", "dataset", 10),
                   ("T", "temperature", 4), ("conc", "concurrency", 4), ("tau", "tau", 6),
                   ("tok/s", "output_tokens_per_s", 9), ("TPOT ms", "tpot_ms", 8), ("speedup", "speedup_vs_ar", 7))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def summary_line(record: dict[str, Any]) -> str:
    return " ".join(f"{name}={_cell(record[key])}" for name, key, _ in SUMMARY_COLUMNS)


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [" ".join(f"{name:>{width}}" for name, _, width in SUMMARY_COLUMNS)]
    lines += [" ".join(f"{_cell(r[key]):>{width}}" for _, key, width in SUMMARY_COLUMNS) for r in rows]
    return "\n".join(lines)
