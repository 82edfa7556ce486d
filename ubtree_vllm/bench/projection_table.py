"""The report's projection table from the projection's round-cost records (bench/projection.py measures them).

Kept apart from the measurement, which runs engines through ``bench/e2e.py``, so the report imports no engine
code: ``tau / round_over_plain_step`` at each of :data:`PROJECTED_TAUS`, labelled as a projection.
"""
from __future__ import annotations

from typing import Any

TARGET = "qwen3-8b-dummy"
PROJECTED_TAUS = (4.0, 6.0, 8.0)


def projection_rows(micro: list[dict[str, Any]]) -> list[list[Any]]:
    """Report rows [method, B, conc, round cost, speedup at each PROJECTED_TAUS, hardware, commit] of the records."""
    from ubtree_vllm.bench.round_cost import METRIC

    rows = [r for r in micro if r["metric"] == METRIC and str(r["target"]).startswith(TARGET)]
    rows.sort(key=lambda r: (str(r["hardware"]), str(r["method"]), r["concurrency"] or 0, r["tree_budget"] or 0))
    return [[r["method"], r["tree_budget"], r["concurrency"], r["value"], *(tau / r["value"] for tau in PROJECTED_TAUS),
             r["hardware"], r["commit"]] for r in rows]
