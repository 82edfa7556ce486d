"""The figures of an e2e record, computed from what vLLM reports (pure, no vLLM import).

tau     1 + accepted / drafts, from the deltas of vLLM's spec-decode counters
        (`vllm:spec_decode_num_drafts`: one per request per verification round;
        `vllm:spec_decode_num_accepted_tokens`) read with `LLM.get_metrics()` before and
        after one measured run. The counters accumulate over the engine's lifetime (warm-up
        and earlier runs included), hence the deltas. None without speculation.
tok/s   total output tokens of the run / wall time of the run (first submit -> last finish).
TPOT    mean over requests of (last_token_ts - first_token_ts) / (n - 1), n = output tokens,
        from `RequestOutput.metrics` (vLLM V1's `RequestStateStats`, engine-core monotonic
        timestamps of the first and the last new-token event; filled only when the engine
        runs with `disable_log_stats=False`). The prefill's token is excluded, as in vLLM's
        own `vllm:request_time_per_output_token`. Requests with n < 2 are skipped.
speedup tok/s / tok/s of the `ar` run with the same dataset, temperature and concurrency
        measured in the same invocation (1.0 for ar itself, None without an ar run).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ubtree_vllm.bench.settings import MethodRun

NUM_DRAFTS = "vllm:spec_decode_num_drafts"
NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def spec_counters(metrics: Iterable[Any]) -> dict[str, float]:
    """{NUM_DRAFTS: total, NUM_ACCEPTED: total} summed over label sets; 0 when absent."""
    totals = {NUM_DRAFTS: 0.0, NUM_ACCEPTED: 0.0}
    for metric in metrics:
        if metric.name in totals:
            totals[metric.name] += float(metric.value)
    return totals


def tau_from_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> tuple[float | None, int, int]:
    """(tau or None when no draft was verified, drafts, accepted) between two counter readings."""
    drafts = int(round(after[NUM_DRAFTS] - before[NUM_DRAFTS]))
    accepted = int(round(after[NUM_ACCEPTED] - before[NUM_ACCEPTED]))
    if drafts < 0 or accepted < 0:
        raise ValueError(f"spec-decode counters went backwards ({before} -> {after}); was the engine replaced?")
    return (1.0 + accepted / drafts if drafts else None), drafts, accepted


def request_tpot_s(metrics: Any, num_tokens: int) -> float | None:
    """(last_token_ts - first_token_ts) / (n - 1) of one request; None without stats or with n < 2."""
    if metrics is None or num_tokens < 2:
        return None
    first, last = getattr(metrics, "first_token_ts", 0.0), getattr(metrics, "last_token_ts", 0.0)
    if not first or last < first:
        return None
    return (last - first) / (num_tokens - 1)


def mean_tpot_ms(outputs: Iterable[Any]) -> float | None:
    """Mean TPOT in ms over finished RequestOutputs (see module docstring); None if no request qualifies."""
    values = [t for o in outputs if (t := request_tpot_s(o.metrics, len(o.outputs[0].token_ids))) is not None]
    return 1000.0 * sum(values) / len(values) if values else None


@dataclass(frozen=True)
class RunResult:
    """One measured run: a prompt list through one engine at one temperature and concurrency."""

    num_requests: int
    output_tokens: int
    wall_s: float
    tpot_ms: float | None
    tau: float | None
    num_drafts: int
    num_accepted: int
    engine_steps: int = 0  # LLMEngine.step calls of the run

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0


def summarize_run(outputs: list[Any], wall_s: float, before: Mapping[str, float],
                  after: Mapping[str, float], engine_steps: int = 0) -> RunResult:
    tau, drafts, accepted = tau_from_deltas(before, after)
    return RunResult(num_requests=len(outputs), output_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
                     wall_s=wall_s, tpot_ms=mean_tpot_ms(outputs), tau=tau, num_drafts=drafts,
                     num_accepted=accepted, engine_steps=engine_steps)


class SpeedupTable:
    """AR tokens/s per (dataset, temperature, concurrency) of this invocation."""

    def __init__(self) -> None:
        self._ar: dict[tuple[str, float, int], float] = {}

    def speedup(self, method: str, dataset: str, temperature: float, concurrency: int,
                tokens_per_s: float) -> float | None:
        """Register an ar measurement (returns 1.0) or pair another method with it (None if no ar yet)."""
        key = (dataset, float(temperature), int(concurrency))
        if method == "ar":
            self._ar[key] = tokens_per_s
            return 1.0 if tokens_per_s > 0 else None
        base = self._ar.get(key)
        return tokens_per_s / base if base else None


def e2e_record(run: MethodRun, result: RunResult, *, target: str, drafter: str | None, dataset: str,
               temperature: float, concurrency: int, max_new_tokens: int, cuda_graphs: bool,
               speedup: float | None, engine_core: str, tp: int = 1,
               drafter_training: Mapping[str, int] | None = None) -> dict[str, Any]:
    """The e2e record of one measurement (provenance is filled by records.append_record). A method with a
    drafter also names the drafter's training amount, ``drafter_training`` (``drafter/io.py:training_totals``:
    cumulative_label_rows, cumulative_distinct_tokens), so the records of two trainings of one folder stay apart.
    ``engine_core``: where vLLM's engine core ran ("process" or "in-process", bench/settings.py:engine_core_mode)."""
    counters = (f"{result.num_accepted} accepted / {result.num_drafts} drafts" if run.speculative_config
                else "no speculation")
    where = "in a process of its own" if engine_core == "process" else "in the LLM object's process"
    notes = (f"vLLM offline LLM engine (engine core {where}), at most {concurrency} request(s) in flight (sliding "
             f"window), 1 warm-up request; tau from spec-decode counter deltas ({counters}); TPOT from "
             f"RequestOutput.metrics first/last token timestamps; {result.output_tokens} tokens in {result.wall_s:.2f}s")
    if run.note:
        notes += f"; {run.note}"
    return {
        "kind": "e2e", "method": run.method, "target": target,
        "drafter": drafter if run.uses_drafter else None,
        "dataset": dataset, "num_prompts": result.num_requests, "max_new_tokens": max_new_tokens,
        "temperature": float(temperature), "batch_size": concurrency, "concurrency": concurrency, "tp": tp,
        "cuda_graphs": cuda_graphs, "tree_budget": run.tree_budget, "beam_width": run.beam_width,
        "top_k": run.top_k, "block_size": run.block_size, "budget_schedule": run.budget_schedule,
        "tree_attention": run.tree_attention,
        # at T = 0 coupling changes nothing: the record names a weight only where the trees used one
        "coupled_edge_weight": run.coupled_edge_weight if temperature > 0 else None,
        "tau": None if result.tau is None else round(result.tau, 4),
        "output_tokens_per_s": round(result.tokens_per_s, 3),
        "tpot_ms": None if result.tpot_ms is None else round(result.tpot_ms, 4),
        "speedup_vs_ar": None if speedup is None else round(speedup, 4),
        **(dict(drafter_training) if run.uses_drafter and drafter_training else {}),
        "notes": notes,
    }
