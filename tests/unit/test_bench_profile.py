"""`ubtree bench e2e --profile`: the per-step tables from a real torch.profiler run (CPU)."""
from __future__ import annotations

import gzip
import json

import pytest
import torch

from ubtree_vllm.bench.profile import profiled, python_profiled, run_name
from ubtree_vllm.bench.settings import BenchArgumentError, E2ESettings, validate
from ubtree_vllm.vllm.stage_clock import StageClock


def test_run_name_names_engine_and_cell():
    assert run_name("ubtree-mrv2:64", "mt_bench", 0.0, 1) == "ubtree-mrv2-B64_mt_bench_T0_c1"
    assert run_name("ubtree-mrv2:64", "mt_bench", 0.0, 1, "json_schema") == \
        "ubtree-mrv2-B64_mt_bench_T0_c1_json_schema"
    assert run_name("ar", "humaneval", 1.0, 32) == "ar_humaneval_T1_c32"
    assert run_name("ubtree-mrv2-lookup:64@flash_merge", "mt_bench", 0.0, 1) == \
        "ubtree-mrv2-lookup-B64-flash_merge_mt_bench_T0_c1"


def test_profiled_block_writes_stage_table_and_trace(tmp_path, monkeypatch):
    monkeypatch.setenv("UBTREE_STAGE_TIMING", "ranges")
    clock = StageClock.from_env(torch.device("cpu"))
    steps = [0]
    with profiled(tmp_path, "run", steps, trace=True):
        for _ in range(4):
            with clock.stage("draft"):
                x = torch.ones(32, 32) @ torch.ones(32, 32)
            torch.softmax(x, -1)
        steps[0] = 4
    text = (tmp_path / "run.txt").read_text()
    assert text.startswith("# run: 4 engine steps")
    stage = next(line for line in text.splitlines() if line.startswith("draft "))
    assert float(stage.split()[1]) == 1.0  # one draft range per step
    assert "aten::mm" in text and "aten::_softmax" in text
    with gzip.open(tmp_path / "run.trace.json.gz") as f:
        assert any(e.get("name") == "ubtree:draft" for e in json.load(f)["traceEvents"])


def _busy_python(n: int) -> int:
    return sum(i * i for i in range(n))


def test_python_profile_names_the_host_functions_per_step(tmp_path):
    steps = [0]
    with python_profiled(tmp_path, "run", steps):
        for _ in range(5):
            _busy_python(20_000)
        steps[0] = 5
    text = (tmp_path / "run.py.txt").read_text()
    assert text.startswith("# run: 5 engine steps under cProfile")
    own, cumulative = text.split("## functions by cumulative")
    row = next(line for line in cumulative.splitlines() if "(_busy_python)" in line)
    assert float(row.split()[-3]) == 1.0  # one call per step
    assert "test_bench_profile.py" in row and "(_busy_python)" in own


def test_ranges_mode_neither_syncs_nor_sums(monkeypatch):
    monkeypatch.setenv("UBTREE_STAGE_TIMING", "ranges")
    clock = StageClock.from_env(torch.device("cpu"))
    with clock.stage("a"):
        pass
    assert clock.snapshot() == {} and not clock.enabled
    monkeypatch.setenv("UBTREE_STAGE_TIMING", "sometimes")
    with pytest.raises(ValueError, match="UBTREE_STAGE_TIMING"):
        StageClock.from_env(torch.device("cpu"))


def test_profile_is_its_own_mode_but_takes_sampling_options():
    with pytest.raises(BenchArgumentError, match="--profile"):
        validate(E2ESettings(methods=("ar",), stage_timing=True, profile_dir="x"))
    with pytest.raises(BenchArgumentError, match="--profile and --agreement"):
        validate(E2ESettings(methods=("ar",), temperatures=(0.0,), agreement=True, profile_dir="x"))
    # each option's rounds profiled beside the cell without one (tables only)
    both = validate(E2ESettings(methods=("ar",), profile_dir="x", sampling_options=("json_schema",),
                                engine_core="in-process"))
    assert both.profile_dir == "x" and both.sampling_options == ("none", "json_schema")
