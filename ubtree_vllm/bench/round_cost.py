"""Round cost in plain decode steps, derived from the e2e records of one invocation.

A speculative request emits tau tokens per round, so its round time is TPOT * tau; a plain
(no speculation) request emits one token per step, so its step time is its TPOT. For every
speculative e2e record with an `ar` record of the same dataset, temperature and concurrency
in the same invocation, `round_over_plain_step` = (TPOT * tau) / TPOT_ar: the cost of one
draft + verify round in plain steps (the speedup is then tau / round_over_plain_step).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

METRIC = "round_over_plain_step"
_CELL = ("dataset", "temperature", "concurrency")
# The e2e record fields a derived microbench record copies (what ran, on which drafter and its training).
CARRIED = ("method", "target", "drafter", "dataset", "num_prompts", "max_new_tokens", "temperature", "batch_size",
           "concurrency", "tp", "cuda_graphs", "tree_budget", "beam_width", "top_k", "block_size",
           "budget_schedule", "tree_attention", "coupled_edge_weight", "cumulative_label_rows",
           "cumulative_distinct_tokens")


def round_cost_records(records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Microbench records (one per speculative e2e record that has its ar cell), in input order."""
    plain = {tuple(r[k] for k in _CELL): r for r in records if r.get("method") == "ar" and r.get("tpot_ms")}
    out = []
    for r in records:
        if r.get("method") == "ar" or not r.get("tpot_ms") or not r.get("tau"):
            continue
        ar = plain.get(tuple(r[k] for k in _CELL))
        if ar is None:
            continue
        value = r["tpot_ms"] * r["tau"] / ar["tpot_ms"]
        out.append({**{k: r.get(k) for k in CARRIED}, "kind": "microbench", "metric": METRIC,
                    "value": round(value, 4), "unit": "plain steps", "tau": r["tau"],
                    "notes": (f"round time = TPOT {r['tpot_ms']:.4g} ms x tau {r['tau']:.4g}; plain step = ar TPOT "
                              f"{ar['tpot_ms']:.4g} ms, same invocation")})
    return out
