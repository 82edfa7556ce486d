"""`ubtree bench e2e --stage-timing`: where the time of one engine step goes.

With the flag, every engine is built with ``UBTREE_STAGE_TIMING=1`` (see
``ubtree_vllm/vllm/stage_clock.py``: the UBTree runner synchronizes the device at each stage
boundary and sums each stage's wall time). Around every measured run the totals are reset
and read back through ``LLM.collective_rpc("ubtree_stage_times")``. Each run gives
microbench records, one per metric:

  step_wall_ms          run wall time / engine steps (`LLMEngine.step` calls); every method
  step_<stage>_ms       stage total / engine steps, for the UBTree runner's stages (STAGES)

So the stage values are means over all steps of the run (the prefill step included) and
add up, per step, to the runner's share of ``step_wall_ms``; the rest is vLLM's engine core
(scheduler, output processing). The syncs make a timed step slower than an untimed one, so
a run with the flag appends no e2e (speed) record.
"""
from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from ubtree_vllm.bench.measurement import RunResult
from ubtree_vllm.bench.settings import MethodRun, environment

ENV = "UBTREE_STAGE_TIMING"
RPC = "ubtree_stage_times"
# The runners' stages in call order. V1 (vllm/runner.py): execute_model > (prepare_inputs_vllm,
# tree_plan, forward); sample_tokens > (accept, kv_commit, feature_commit, draft_context, draft,
# drafts_to_host). MRV2 (vllm/mrv2/model_runner.py): execute_model > (prepare_inputs_vllm,
# tree_layout; the rest is the forward); sample_tokens > (accept, kv_commit, draft_context, draft).
STAGES = ("execute_model", "prepare_inputs_vllm", "tree_plan", "tree_layout", "forward", "sample_tokens", "accept",
          "kv_commit", "feature_commit", "draft_context", "draft", "drafts_to_host")
# The stages only one runner has.
V1_ONLY = ("tree_plan", "forward", "feature_commit", "drafts_to_host")
MRV2_ONLY = ("tree_layout",)
WALL = "step_wall_ms"


def metric_of(stage: str) -> str:
    return f"step_{stage}_ms"


METRICS = (WALL, *(metric_of(s) for s in STAGES))


def stage_timing_env(mode: str | None) -> contextlib.AbstractContextManager[None]:
    """``UBTREE_STAGE_TIMING=mode`` while engines are built (engine-core processes inherit it): "1" for
    ``--stage-timing``, "ranges" for ``--profile`` (bench/profile.py); None leaves it unset."""
    return environment({ENV: mode} if mode else {})


def uses_runner_clock(run: MethodRun) -> bool:
    """Whether the engine runs a UBTree runner (V1 or MRV2, pinned by its runner switch), which owns the
    stage clock; the other methods get the step wall time only."""
    return run.env.get("UBTREE_VLLM_RUNNER") in ("v1", "mrv2")


def read_stage_times(llm: Any, reset: bool) -> dict[str, tuple[int, float]]:
    """The first worker's {stage: (calls, seconds)} (tensor parallel workers run the same steps)."""
    return llm.collective_rpc(RPC, kwargs={"reset": reset})[0]


def stage_values(result: RunResult, times: Mapping[str, tuple[int, float]] | None) -> dict[str, float]:
    """{metric: ms per engine step} of one run; stages the run never entered are left out."""
    if result.engine_steps < 1:
        raise ValueError("a stage-timed run needs at least one engine step")
    per_step = 1000.0 / result.engine_steps
    values = {WALL: result.wall_s * per_step}
    for stage in STAGES:
        if times and stage in times:
            values[metric_of(stage)] = times[stage][1] * per_step
    return values


def stage_records(run: MethodRun, result: RunResult, times: Mapping[str, tuple[int, float]] | None, *,
                  target: str, drafter: str | None, dataset: str, temperature: float, concurrency: int,
                  max_new_tokens: int, cuda_graphs: bool, tp: int = 1) -> list[dict[str, Any]]:
    """Microbench records (one per metric) of one stage-timed run."""
    notes = (f"ubtree bench e2e --stage-timing: mean per engine step over {result.engine_steps} steps "
             f"({result.num_requests} requests, {result.output_tokens} tokens, at most {concurrency} in flight); "
             f"the runner synchronizes the device at stage boundaries")
    common = {"kind": "microbench", "method": run.method, "target": target,
              "drafter": drafter if run.uses_drafter else None, "dataset": dataset,
              "num_prompts": result.num_requests, "max_new_tokens": max_new_tokens, "temperature": float(temperature),
              "batch_size": concurrency, "concurrency": concurrency, "tp": tp, "cuda_graphs": cuda_graphs,
              "tree_budget": run.tree_budget, "beam_width": run.beam_width, "top_k": run.top_k,
              "block_size": run.block_size, "budget_schedule": run.budget_schedule,
              "tree_attention": run.tree_attention, "tau": None if result.tau is None else round(result.tau, 4),
              "unit": "ms", "notes": notes}
    return [{**common, "metric": metric, "value": round(value, 5)}
            for metric, value in stage_values(result, times).items()]
