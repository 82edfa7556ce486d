"""The runner's stage clock (diagnosis mode) and the stage-time records built from it."""
from __future__ import annotations

import torch

from ubtree_vllm.bench.measurement import RunResult
from ubtree_vllm.bench.settings import MethodRun
from ubtree_vllm.bench.stage_timing import WALL, metric_of, stage_records, stage_values
from ubtree_vllm.vllm.stage_clock import StageClock


def test_disabled_clock_records_nothing_and_costs_one_shared_context():
    clock = StageClock(torch.device("cpu"), enabled=False)
    assert clock.stage("a") is clock.stage("b")
    with clock.stage("a"):
        pass
    assert clock.snapshot() == {}


def test_enabled_clock_sums_nested_stages_and_resets():
    clock = StageClock(torch.device("cpu"), enabled=True)
    for _ in range(3):
        with clock.stage("outer"):
            with clock.stage("inner"):
                sum(range(1000))
    times = clock.snapshot(reset=True)
    assert times["outer"][0] == times["inner"][0] == 3
    assert times["outer"][1] >= times["inner"][1] > 0
    assert clock.snapshot() == {}


def test_stage_values_are_ms_per_engine_step():
    result = RunResult(num_requests=1, output_tokens=10, wall_s=0.5, tpot_ms=None, tau=2.0, num_drafts=5,
                       num_accepted=5, engine_steps=10)
    values = stage_values(result, {"forward": (10, 0.2), "unknown": (1, 9.0)})
    assert values == {WALL: 50.0, metric_of("forward"): 20.0}  # stages outside STAGES are not recorded
    run = MethodRun("ar")
    records = stage_records(run, result, None, target="t", drafter="d", dataset="toy", temperature=0.0,
                            concurrency=1, max_new_tokens=8, cuda_graphs=False)
    assert [(r["metric"], r["value"], r["drafter"]) for r in records] == [(WALL, 50.0, None)]


def test_stage_records_name_the_budget_schedule_and_tree_attention():
    """A stage-timed run under a load-adaptive schedule says which (the 64-in-flight runs of 2026-12-05 compared
    schedules, and their first records could not tell them apart)."""
    result = RunResult(num_requests=1, output_tokens=10, wall_s=0.5, tpot_ms=None, tau=2.0, num_drafts=5,
                       num_accepted=5, engine_steps=10)
    run = MethodRun("ubtree-mrv2", tree_budget=64, budget_schedule="1-48:8,49-1024:0", tree_attention="flash_merge")
    (record,) = stage_records(run, result, None, target="t", drafter="d", dataset="toy", temperature=0.0,
                              concurrency=64, max_new_tokens=8, cuda_graphs=True)
    assert record["budget_schedule"] == "1-48:8,49-1024:0" and record["tree_attention"] == "flash_merge"
    from ubtree_vllm.bench.records import validate_record
    validate_record(record)
