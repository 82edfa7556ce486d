"""The report's "Where UBTree stands" section: the newest three-way comparison of every cell.

Issue 16's goal is UBTree (default settings) at least as fast as both no speculation (``ar``) and vLLM's
n-gram speculation in every (set, temperature, requests in flight) cell. Older invocations stay in the
report's other tables; here each cell shows only its newest ``ubtree bench e2e`` invocation that ran
``ar``, ``ngram`` and a UBTree method together on GPU hardware (speedups are over that invocation's
own ``ar``), one row per UBTree run of it.

Standard library only (imported by ``report.py``, whose top level the CLI parser imports).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

NGRAM_METHOD = "ngram"  # vLLM's drafter-free speculation, the baseline every speedup is also compared with


def on_gpu(record: dict[str, Any]) -> bool:
    return not str(record["hardware"]).startswith("CPU")


def same_invocation(r: dict[str, Any]) -> tuple:
    """Records of one `ubtree bench e2e` invocation's cell: same machine, commit, date, command, target, set, T,
    concurrency (two invocations of one day and commit, each with its own ar, stay apart)."""
    return (r["hardware"], str(r["commit"]), r["date"], str(r.get("command")), r["target"], str(r["dataset"]),
            r["temperature"], r["concurrency"] or 1)


def newest_cells(records: Sequence[dict[str, Any]],
                 holds: Callable[[list[dict[str, Any]]], Any]) -> dict[tuple, list[dict[str, Any]]]:
    """{(target, dataset, T, concurrency): the newest (file order) GPU invocation cell's speed records (those with a
    ``speedup_vs_ar``) for which ``holds(cell)`` is truthy}, in (target, dataset, T, concurrency) order."""
    cells: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if r["kind"] == "e2e" and on_gpu(r) and r.get("speedup_vs_ar") is not None:
            cells.setdefault(same_invocation(r), []).append(r)
    # dicts keep insertion order: a later invocation replaces an earlier one
    newest = {key[4:]: cell for key, cell in cells.items() if holds(cell)}
    return dict(sorted(newest.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]), kv[0][2], kv[0][3])))


def newest_three_way_cells(records: Sequence[dict[str, Any]],
                           tree_methods: Sequence[str]) -> dict[tuple, list[dict[str, Any]]]:
    """:func:`newest_cells` of the invocation cells that hold ar, ngram and at least one of ``tree_methods``."""
    def three_way(cell: list[dict[str, Any]]) -> bool:
        methods = {r["method"] for r in cell}
        return {"ar", NGRAM_METHOD} <= methods and bool(methods & set(tree_methods))

    return newest_cells(records, three_way)


def standing_rows(records: Sequence[dict[str, Any]], tree_methods: Sequence[str],
                  budget: Callable[[dict[str, Any]], Any] = lambda r: r["tree_budget"]) -> list[list[Any]]:
    """[target, set, T, in flight, method, B (``budget(record)``), tau, speedup, ngram speedup, >= max(ar, ngram),
    commit, date] rows."""
    rows = []
    for (target, dataset, temperature, concurrency), cell in newest_three_way_cells(records, tree_methods).items():
        ngram = next(r for r in cell if r["method"] == NGRAM_METHOD)
        best_other = max(1.0, ngram["speedup_vs_ar"])
        for tree in (r for r in cell if r["method"] in tree_methods):
            rows.append([target, dataset, temperature, concurrency, tree["method"], budget(tree), tree["tau"],
                         tree["speedup_vs_ar"], ngram["speedup_vs_ar"], tree["speedup_vs_ar"] >= best_other,
                         tree["commit"], tree["date"]])
    return rows


HEADER = ["target", "set", "T", "in flight", "method", "B", "tau", "speedup over ar", "ngram's", ">= max(ar, ngram)",
          "commit", "date"]
INTRO = ("The newest `ubtree bench e2e` invocation of each set, temperature and number of requests in flight that "
         "ran no speculation (`ar`), vLLM's n-gram speculation (`ngram`) and a UBTree method with the shipped drafter "
         "together on a GPU; "
         "speedups are over that invocation's own `ar`. Goal (issue 16): UBTree at least max(1, ngram's) in every "
         "cell. Older invocations are in the tables below.")
