"""Benchmark records (append + validation) and the generated report."""
from __future__ import annotations

import json

import pytest

from ubtree_vllm import cli
from ubtree_vllm.bench import records as rec
from ubtree_vllm.bench import report
from ubtree_vllm.bench.report import HEADER, regenerate

E2E = {"kind": "e2e", "method": "ubtree", "target": "smollm2-135m-instruct", "drafter": "checkpoints/d",
       "dataset": "mt_bench", "num_prompts": 80, "max_new_tokens": 256, "temperature": 0.0, "batch_size": 16,
       "tree_budget": 64, "beam_width": 12, "top_k": 64, "block_size": 16, "tau": 3.5}


def append_ar_and_ngram(path, cell, ngram_speedup: float, ngram_tau: float) -> None:
    """An invocation cell's baselines: ar (100 tok/s) and vLLM's n-gram (k = 8) at ``ngram_speedup``."""
    off = {"tree_budget": None, "beam_width": None, "top_k": None, "block_size": None, "drafter": None, "tau": None}
    rec.append_record({**cell, **off, "method": "ar", "output_tokens_per_s": 100.0, "speedup_vs_ar": 1.0}, path=path)
    rec.append_record({**cell, **off, "method": "ngram", "tree_budget": 8, "beam_width": 1, "top_k": 1,
                       "tau": ngram_tau, "output_tokens_per_s": 100.0 * ngram_speedup, "speedup_vs_ar": ngram_speedup},
                      path=path)


def test_append_fills_provenance_and_writes_one_line(tmp_path):
    path = tmp_path / "docs" / "records.jsonl"
    written = rec.append_record(E2E, path=path)
    rec.append_record({**E2E, "method": "ubtree-single", "top_k": 1, "beam_width": 1, "tree_budget": 16,
                       "tau": 2.5}, path=path)
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == written
    assert list(written) == list(rec.FIELDS)  # every field present, in the documented order
    assert written["date"] and written["hardware"]
    assert written["hardware"].startswith("CPU (") or "x " in written["hardware"]
    assert written["vllm"] == rec.vllm_version() and written["output_tokens_per_s"] is None
    assert rec.read_records(path)[1]["method"] == "ubtree-single"


@pytest.mark.parametrize("change,match", [
    ({"kind": "bench"}, "kind"),
    ({"speed": 1.0}, "speed"),
    ({"tau": "fast"}, "tau"),
    ({"num_prompts": 8.5}, "num_prompts"),
    ({"cuda_graphs": 1}, "cuda_graphs"),
    ({"tau": None}, "tau or output_tokens_per_s"),
    ({"dataset": None}, "dataset"),
])
def test_invalid_records_are_refused_before_writing(tmp_path, change, match):
    path = tmp_path / "records.jsonl"
    with pytest.raises(ValueError, match=match):
        rec.append_record({**E2E, **change}, path=path)
    assert not path.exists()


def test_kind_specific_requirements():
    rec.validate_record({**dict.fromkeys(rec.FIELDS), "kind": "microbench", "metric": "draft_postprocess_ms",
                         "value": 1.4, "unit": "ms"})
    with pytest.raises(ValueError, match="unit"):
        rec.validate_record({"kind": "microbench", "metric": "m", "value": 1.0})
    with pytest.raises(ValueError, match="tokens_seen"):
        rec.validate_record({"kind": "train", "method": "ubtree", "target": "t", "drafter": "d", "loss": 1.0,
                             "wall_time_s": 3.0, "steps": 10})


def test_read_records_names_the_bad_line(tmp_path):
    path = tmp_path / "records.jsonl"
    rec.append_record(E2E, path=path)
    with open(path, "a") as handle:
        handle.write(json.dumps({"kind": "nope"}) + "\n")
    with pytest.raises(ValueError, match=r"records.jsonl:2: "):
        rec.read_records(path)


def test_report_regenerates_tables_and_plots(tmp_path):
    path = tmp_path / "benchmarks" / "records.jsonl"
    rec.append_record({**E2E, "tau": 3.0}, path=path)
    rec.append_record(E2E, path=path)  # supersedes the first (same configuration)
    rec.append_record({**E2E, "method": "ubtree-single", "top_k": 1, "beam_width": 1, "tree_budget": 16,
                       "tau": 2.5}, path=path)
    rec.append_record({**E2E, "temperature": 1.0, "tau": 3.1}, path=path)
    rec.append_record({**E2E, "temperature": 1.0, "tau": 3.3, "cumulative_label_rows": 9}, path=path)  # another training
    rec.append_record({"kind": "train", "method": "ubtree", "target": "t", "drafter": "checkpoints/d", "loss": 1.25,
                       "tokens_seen": 1000, "wall_time_s": 120.0, "steps": 50}, path=path)
    files = regenerate(path)
    readme = (tmp_path / "benchmarks" / "README.md").read_text()
    assert readme.startswith(HEADER)
    assert "### mt_bench, T = 0.0" in readme and "### mt_bench, T = 1.0" in readme
    assert "of which 1 superseded" in readme and "| 3.00 |" not in readme.split("## Training")[0].split("T = 1.0")[0]
    assert "| 1.40 |" in readme  # ubtree tau 3.5 / single-path tau 2.5
    assert "| 3.10 |" in readme and "| 3.30 |" in readme  # two trainings of one drafter folder: both shown
    assert "## Training runs" in readme and "| 1.25 |" in readme
    assert {f.name for f in files} == {"README.md", "tau_T0.png", "tau_T1.png"}
    assert all(f.stat().st_size > 0 for f in files)
    regenerate(path)
    assert (tmp_path / "benchmarks" / "README.md").read_text() == readme  # deterministic


def test_speed_plots_show_the_newest_bench_run_per_chart(tmp_path):
    """Speedup bars (batch 1) and throughput against concurrency come from GPU `bench e2e` records only,
    each chart from one commit: the newest one measured for it."""
    path = tmp_path / "records.jsonl"
    gpu = dict(E2E, hardware="1x NVIDIA H200", command="cli.py bench e2e --target default", tau=None,
               output_tokens_per_s=100.0, num_prompts=6, batch_size=1, concurrency=1)
    rows = [
        {**gpu, "commit": "old", "method": "dflash-chain", "speedup_vs_ar": 0.9},
        {**gpu, "commit": "new", "method": "ar", "drafter": None, "tree_budget": None, "speedup_vs_ar": 1.0},
        {**gpu, "commit": "new", "method": "ubtree", "speedup_vs_ar": 0.5},
        {**gpu, "commit": "new", "method": "ubtree", "speedup_vs_ar": 0.7, "dataset": "humaneval"},
        {**gpu, "commit": "new", "method": "ar", "drafter": None, "tree_budget": None, "concurrency": 4,
         "batch_size": 4, "output_tokens_per_s": 350.0, "speedup_vs_ar": 1.0},
        {**gpu, "commit": "new", "method": "ubtree", "speedup_vs_ar": 9.9, "hardware": "CPU (2 cores)"},
        {**gpu, "commit": "new", "method": "ubtree", "speedup_vs_ar": 9.9, "command": "pytest tests/x.py",
         "dataset": "synthetic"},
    ]
    for row in rows:
        rec.append_record(row, path=path)
    records = rec.read_records(path)
    speed = report._bench_speed(records)
    assert {(r["method"], r["dataset"], r["commit"]) for r in speed} == {
        ("dflash-chain", "mt_bench", "old"), ("ar", "mt_bench", "new"), ("ubtree", "mt_bench", "new"),
        ("ubtree", "humaneval", "new")}  # the CPU and the non-bench records are left out
    chart = report._newest_commit([r for r in speed if r["method"] != "ar"], records)
    assert {r["commit"] for r in chart} == {"new"}
    names = {f.name for f in regenerate(path)}
    assert {"speedup_smollm2-135m-instruct_T0.png", "throughput_smollm2-135m-instruct_mt_bench_T0.png"} <= names
    assert "throughput_smollm2-135m-instruct_humaneval_T0.png" not in names  # one concurrency only


def test_report_cli(tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    rec.append_record(E2E, path=path)
    assert cli.main(["report", "--records", str(path), "--out-dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "README.md").is_file()
    assert "README.md" in capsys.readouterr().out


def test_report_ablation_pivot_speed_and_microbench_sections(tmp_path):
    path = tmp_path / "records.jsonl"
    shipped, ablation = "checkpoints/smollm2-ubtree", "runs/ablations/beta0/drafter"
    single = {"method": "ubtree-single", "top_k": 1, "beam_width": 1, "tree_budget": 16}
    for drafter, tau in ((ablation, 1.6), (shipped, 1.9)):  # the shipped one is listed first anyway
        rec.append_record({**E2E, "drafter": drafter, "tree_budget": 64, "tau": tau - 0.5}, path=path)
        rec.append_record({**E2E, "drafter": drafter, "tree_budget": 64, "tau": tau}, path=path)  # latest wins
        rec.append_record({**E2E, **single, "drafter": drafter, "tau": 1.1}, path=path)
    rec.append_record({**E2E, "drafter": shipped, "tree_budget": 32, "tau": 9.9}, path=path)  # not B = 64
    rec.append_record({**E2E, "drafter": shipped, "dataset": "humaneval", "temperature": 1.0, "tree_budget": 64,
                       "tau": 1.7}, path=path)
    speed = {**E2E, "drafter": shipped, "dataset": "humaneval", "num_prompts": 2, "concurrency": 4, "batch_size": 4}
    rec.append_record({**speed, "method": "ar", "tree_budget": None, "beam_width": None, "top_k": None,
                       "block_size": None, "drafter": None, "tau": None, "output_tokens_per_s": 100.0,
                       "tpot_ms": 9.5, "speedup_vs_ar": 1.0}, path=path)
    rec.append_record({**speed, "tree_budget": 32, "tau": 2.25, "output_tokens_per_s": 250.0, "tpot_ms": 3.75,
                       "speedup_vs_ar": 2.5}, path=path)
    # A later speed run of the same drafter, dataset and T: not a tau evaluation, kept out of the pivot.
    fast = {**E2E, "drafter": shipped, "num_prompts": 8, "batch_size": 1, "output_tokens_per_s": 50.0}
    rec.append_record({**fast, "tree_budget": 64, "tau": 7.7}, path=path)
    rec.append_record({**fast, "method": "dflash-chain", "tree_budget": 16, "top_k": 1, "beam_width": 1,
                       "tau": 7.1}, path=path)
    rec.append_record({"kind": "train", "method": "ubtree", "target": "smollm2-135m-instruct", "drafter": shipped,
                       "steps": 900, "tokens_seen": 1_000_000, "cumulative_label_rows": 2_500_000, "loss": 3.5,
                       "wall_time_s": 60.0}, path=path)
    for metric, value in (("lm_head_topk_ms", 0.125), ("draft_postprocess_ms", 0.375)):
        rec.append_record({"kind": "microbench", "method": "ubtree", "target": "t", "drafter": ablation,
                           "metric": metric, "value": value, "unit": "ms", "tree_budget": 64, "beam_width": 12,
                           "top_k": 64, "block_size": 16, "batch_size": 1}, path=path)
    regenerate(path)
    readme = (tmp_path / "README.md").read_text()
    ablations = readme.split("## Ablations: tau by drafter")[1].split("\n## ")[0]
    rows = [line for line in ablations.splitlines() if line.startswith("| ") and "drafter |" not in line]
    assert rows[0].startswith("| smollm2-ubtree (shipped) | `checkpoints/smollm2-ubtree` | 80 | 2.5M |")
    assert "| humaneval T=1.0 | mt_bench T=0.0 |" in ablations
    assert rows[0].endswith("| 1.70 | 1.90 (1.10) |")  # humaneval T=1 has no single-path record
    assert rows[1].startswith("| beta0 | `runs/ablations/beta0/drafter` | 80 | – | – | 1.60 (1.10) |")
    assert "9.90" not in ablations and "7.70" not in ablations and "7.10" not in ablations
    speed = readme.split("## Speed (vLLM end-to-end)")[1].split("\n## ")[0]
    speed_rows = [line for line in speed.splitlines() if line.startswith("| ar") or line.startswith("| ubtree")]
    assert speed_rows[0].startswith("| ar | smollm2-135m-instruct | – | – |")  # ar first
    assert "| ubtree | smollm2-135m-instruct | smollm2-ubtree | 32 | 12 | 64 | humaneval | 0.0 | 4 | 2.25 | 250.00 | " \
           "3.75 | 2.50 |" in speed_rows[1]
    micro = readme.split("## Microbenchmarks")[1].split("\n## ")[0]
    assert "| draft_postprocess_ms | 0.38 | ms | ubtree | t | beta0 | 64 | 12 | 64 | 16 | 1 |" in micro
    assert readme.index("## End-to-end") < readme.index("## Ablations") < readme.index("## Speed") \
        < readme.index("## Microbenchmarks")


def test_hardware_names_the_cpu_when_asked_even_beside_a_gpu(monkeypatch):
    import os

    import torch

    from ubtree_vllm.bench.records import hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    assert hardware() == "1x NVIDIA H200"
    assert hardware("cuda") == "1x NVIDIA H200"
    assert hardware("cpu") == f"CPU ({os.cpu_count()} cores)"


def test_goals_section_judges_each_goal_from_gpu_records(tmp_path):
    """Goals: per e2e cell UBTree vs the single path (T=0) and vs ar; post-processing ms; tree vs chain verify.
    CPU records never count."""
    path = tmp_path / "records.jsonl"
    gpu = {"hardware": "1x NVIDIA H200", "commit": "abc1234", "date": "2026-11-30"}
    cell = {**E2E, **gpu, "dataset": "mt_bench", "temperature": 0.0, "concurrency": 1, "batch_size": 1,
            "num_prompts": 8}
    off = {"tree_budget": None, "beam_width": None, "top_k": None, "block_size": None, "drafter": None, "tau": None}
    rec.append_record({**cell, **off, "method": "ar", "output_tokens_per_s": 100.0, "speedup_vs_ar": 1.0}, path=path)
    rec.append_record({**cell, "method": "dflash-chain", "tree_budget": 16, "beam_width": 1, "top_k": 1, "tau": 1.5,
                       "output_tokens_per_s": 120.0, "speedup_vs_ar": 1.2}, path=path)
    rec.append_record({**cell, "tree_budget": 64, "tau": 2.5, "output_tokens_per_s": 180.0, "speedup_vs_ar": 1.8},
                      path=path)
    rec.append_record({**cell, "tree_budget": 16, "tau": 2.0, "output_tokens_per_s": 90.0, "speedup_vs_ar": 0.9},
                      path=path)
    rec.append_record({**cell, "hardware": "CPU (2 cores)", "dataset": "humaneval", "tree_budget": 64, "tau": 2.5,
                       "output_tokens_per_s": 9.0, "speedup_vs_ar": 9.0}, path=path)  # CPU: not a goal figure
    micro = {"kind": "microbench", "method": "ubtree", "target": "t", "drafter": "checkpoints/d", "unit": "ms",
             "tree_budget": 64, "beam_width": 12, "top_k": 64, "block_size": 16, "batch_size": 1, **gpu}
    rec.append_record({**micro, "metric": "draft_postprocess_ms", "value": 2.5}, path=path)
    rec.append_record({**micro, "metric": "draft_postprocess_graphed_ms", "value": 0.75, "cuda_graphs": True},
                      path=path)
    rec.append_record({**micro, "metric": "tree_verify_over_chain16", "value": 1.25, "unit": "x"}, path=path)
    regenerate(path)
    goals = (tmp_path / "README.md").read_text().split("## Goals")[1].split("\n## ")[0]
    rows = [line for line in goals.splitlines() if line.startswith("| ") and "goal |" not in line
            and not line.startswith("|---")]
    assert "| UBTree speedup >= 1.3x the single path's (T=0) | smollm2-135m-instruct, mt_bench, T=0.0, conc 1, " \
           "B=64 | 1.50x (1.80 vs 1.20) | yes |" in goals
    assert "B=16 | 0.75x (0.90 vs 1.20) | no |" in goals
    assert "| UBTree throughput >= no speculation | smollm2-135m-instruct, mt_bench, T=0.0, conc 1, B=64 | 1.80x | yes" \
        in goals
    assert "| draft post-processing <= 1.0 ms per round | t, eager, batch 1 | 2.50 ms | no |" in goals
    assert "| draft post-processing <= 1.0 ms per round | t, CUDA graph, batch 1 | 0.75 ms | yes |" in goals
    assert "| 64-node verification <= 1.15x the 16-token chain | t | 1.250x | no |" in goals
    assert "humaneval" not in goals and len(rows) == 7


def test_goals_show_per_goal_and_cell_only_the_newest_invocation_that_measured_it(tmp_path):
    """Two `bench e2e` invocations of one cell on one day and commit (the command tells them apart): the newer one's
    rows replace the older one's for the goals it measured (vs ar, vs ngram); the single-path goal, which only the
    older one measured, keeps the older one's rows; a cell only the older one ran keeps its rows."""
    path = tmp_path / "records.jsonl"
    cell = {**E2E, "hardware": "1x NVIDIA H200", "commit": "abc1234", "date": "2026-11-30", "temperature": 0.0,
            "concurrency": 1, "batch_size": 1, "num_prompts": 6}
    off = {"tree_budget": None, "beam_width": None, "top_k": None, "block_size": None, "drafter": None, "tau": None}
    ngram = {**off, "method": "ngram", "tree_budget": 8, "beam_width": 1, "top_k": 1, "tau": 1.5}
    chain = {"method": "dflash-chain", "tree_budget": 16, "beam_width": 1, "top_k": 1}
    older, newer = "ubtree bench e2e --methods ar,ngram,dflash-chain,ubtree", "ubtree bench e2e --methods all"
    for concurrency in (1, 4):
        run = {**cell, "command": older, "concurrency": concurrency}
        rec.append_record({**run, **off, "method": "ar", "output_tokens_per_s": 100.0, "speedup_vs_ar": 1.0},
                          path=path)
        rec.append_record({**run, **ngram, "output_tokens_per_s": 125.0, "speedup_vs_ar": 1.25}, path=path)
        rec.append_record({**run, **chain, "output_tokens_per_s": 120.0, "speedup_vs_ar": 1.2}, path=path)
        rec.append_record({**run, "tree_budget": 16, "output_tokens_per_s": 50.0, "speedup_vs_ar": 0.5}, path=path)
    run = {**cell, "command": newer}
    rec.append_record({**run, **off, "method": "ar", "output_tokens_per_s": 200.0, "speedup_vs_ar": 1.0}, path=path)
    rec.append_record({**run, **ngram, "output_tokens_per_s": 300.0, "speedup_vs_ar": 1.5}, path=path)
    rec.append_record({**run, "method": "ubtree-mrv2", "output_tokens_per_s": 240.0, "speedup_vs_ar": 1.2}, path=path)
    regenerate(path)
    goals = (tmp_path / "README.md").read_text().split("## Goals")[1].split("\n## ")[0]
    rows = [line.split(" | ")[:3] for line in goals.splitlines() if line.startswith("| UBTree")]
    where = "smollm2-135m-instruct, mt_bench, T=0.0"
    assert rows == [
        ["| UBTree speedup >= 1.3x the single path's (T=0)", f"{where}, conc 1, B=16", "0.42x (0.50 vs 1.20)"],
        ["| UBTree throughput >= no speculation", f"{where}, conc 1, B=64 (MRV2)", "1.20x"],
        ["| UBTree throughput >= no speculation", f"{where}, conc 4, B=16", "0.50x"],
        ["| UBTree throughput >= the n-gram baseline's (k=8)", f"{where}, conc 1, B=64 (MRV2)", "0.80x (1.20 vs 1.50)"],
        ["| UBTree throughput >= the n-gram baseline's (k=8)", f"{where}, conc 4, B=16", "0.40x (0.50 vs 1.25)"],
    ]  # not the older invocation's conc-1 rows "0.50x" (vs ar) and "0.40x (0.50 vs 1.25)" (vs ngram)


def test_ngram_is_a_baseline_beside_every_speedup_over_ar(tmp_path, monkeypatch):
    """ngram (vLLM's drafter-free prompt lookup): a Goals row per tree run against it, its own series in the
    speedup chart, a method row after ar in the tables, never the single path."""
    path = tmp_path / "records.jsonl"
    cell = {**E2E, "hardware": "1x NVIDIA H200", "commit": "abc1234", "date": "2026-11-30", "temperature": 0.0,
            "concurrency": 1, "batch_size": 1, "num_prompts": 8, "command": "ubtree bench e2e --methods all"}
    append_ar_and_ngram(path, cell, ngram_speedup=1.25, ngram_tau=1.75)
    rec.append_record({**cell, "method": "dflash-chain", "tree_budget": 16, "beam_width": 1, "top_k": 1, "tau": 1.5,
                       "output_tokens_per_s": 120.0, "speedup_vs_ar": 1.2}, path=path)
    for budget, speedup in ((64, 1.8), (16, 1.0)):
        rec.append_record({**cell, "tree_budget": budget, "tau": 2.5, "output_tokens_per_s": 100.0 * speedup,
                           "speedup_vs_ar": speedup}, path=path)
    charts = {}
    grouped_bars = report._grouped_bars

    def capture(rows, value, ylabel, title, out, reference_line=None):
        series = report._ordered_series(rows)
        charts[out.name] = [report._series_label(*s, series) for s in series]
        return grouped_bars(rows, value, ylabel, title, out, reference_line)

    monkeypatch.setattr(report, "_grouped_bars", capture)
    regenerate(path)
    assert charts["speedup_smollm2-135m-instruct_T0.png"] == ["ngram", "dflash-chain", "ubtree B=16", "ubtree B=64"]
    assert charts["tau_T0.png"][0] == "ngram"  # ar has no tau
    readme = (tmp_path / "README.md").read_text()
    goals = readme.split("## Goals")[1].split("\n## ")[0]
    assert "| UBTree throughput >= the n-gram baseline's (k=8) | smollm2-135m-instruct, mt_bench, T=0.0, conc 1, " \
           "B=64 | 1.44x (1.80 vs 1.25) | yes |" in goals
    assert "B=16 | 0.80x (1.00 vs 1.25) | no |" in goals
    assert "B=64 | 1.50x (1.80 vs 1.20) | yes |" in goals  # the single path is still dflash-chain
    speed = readme.split("## Speed (vLLM end-to-end)")[1].split("\n## ")[0]
    methods = [line.split(" | ")[0][2:] for line in speed.splitlines() if line.startswith("| ") and "---" not in line]
    assert methods[1:] == ["ar", "ngram", "dflash-chain", "ubtree", "ubtree"]  # after the header
    e2e = readme.split("## End-to-end")[1].split("\n## ")[0]
    assert "| ngram | smollm2-135m-instruct | – | 8 | 1 | 1 | – | 8 | 1 | 1.75 | – | 125.00 |" in e2e  # no vs single


def test_vs_single_pairs_a_row_with_the_single_path_of_its_own_invocation(tmp_path):
    """A later invocation's single path (a retrained drafter, other prompts) is no baseline for an older row: each
    tree row's `vs single` divides by its own invocation's single-path tau, and a row without one shows none."""
    path = tmp_path / "records.jsonl"
    cell = {**E2E, "hardware": "1x NVIDIA H200", "date": "2026-11-30", "temperature": 0.0, "concurrency": 1,
            "batch_size": 1, "output_tokens_per_s": 100.0, "speedup_vs_ar": 1.0}
    chain = {"method": "dflash-chain", "tree_budget": 16, "beam_width": 1, "top_k": 1}
    rec.append_record({**cell, **chain, "commit": "aaa1111", "num_prompts": 8, "tau": 1.25}, path=path)
    rec.append_record({**cell, "commit": "aaa1111", "num_prompts": 8, "tau": 2.5}, path=path)
    rec.append_record({**cell, "commit": "bbb2222", "num_prompts": 8, "tree_budget": 32, "tau": 3.0}, path=path)
    rec.append_record({**cell, **chain, "commit": "ccc3333", "num_prompts": 16, "tau": 2.0}, path=path)
    regenerate(path)
    e2e = (tmp_path / "README.md").read_text().split("## End-to-end")[1].split("\n## ")[0]
    rows = {line.split(" | ")[15]: line.split(" | ") for line in e2e.splitlines()
            if line.startswith("| ubtree |") or line.startswith("| dflash-chain |")}
    assert rows["aaa1111"][9:11] == ["2.50", "2.00"]  # against 1.25 of its own run, not the later 2.0
    assert rows["bbb2222"][9:11] == ["3.00", "–"]  # its run had no single path
    assert rows["ccc3333"][9:11] == ["2.00", "1.00"]


def test_standing_shows_each_cells_newest_three_way_invocation(tmp_path):
    """"Where UBTree stands": per (set, T, in flight) the newest invocation that ran ar, ngram and UBTree together,
    judged against max(1, ngram's); an invocation without ngram, a CPU one or an older one does not show."""
    path = tmp_path / "records.jsonl"
    off = {"tree_budget": None, "beam_width": None, "top_k": None, "block_size": None, "drafter": None, "tau": None}

    def invocation(commit, concurrency, tree_speedup, ngram_speedup=None, hardware="1x NVIDIA H200"):
        cell = {**E2E, "hardware": hardware, "commit": commit, "date": "2026-12-03", "temperature": 0.0,
                "concurrency": concurrency, "batch_size": 1, "num_prompts": 40, "command": f"bench {commit}"}
        rec.append_record({**cell, **off, "method": "ar", "output_tokens_per_s": 100.0, "speedup_vs_ar": 1.0},
                          path=path)
        if ngram_speedup is not None:
            rec.append_record({**cell, **off, "method": "ngram", "tree_budget": 8, "beam_width": 1, "top_k": 1,
                               "tau": 1.8, "output_tokens_per_s": 100.0 * ngram_speedup,
                               "speedup_vs_ar": ngram_speedup}, path=path)
        rec.append_record({**cell, "method": "ubtree-mrv2-lookup", "tau": 4.0, "output_tokens_per_s": 100 * tree_speedup,
                           "speedup_vs_ar": tree_speedup}, path=path)

    invocation("old1234", 1, 0.9, 1.2)
    invocation("new1234", 1, 2.0, 1.2)  # replaces the old one at 1 in flight
    invocation("new1234", 8, 0.99, 0.7)  # below ar: not met
    invocation("new1234", 4, 1.1, 1.3)  # below ngram: not met
    invocation("nongram", 16, 1.5)  # no ngram in its invocation: not a three-way comparison
    invocation("cpu1234", 32, 3.0, 1.0, hardware="CPU (2 cores)")
    regenerate(path)
    section = (tmp_path / "README.md").read_text().split("## Where UBTree stands")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| smollm2")]
    assert [row.split(" | ")[3] for row in rows] == ["1", "4", "8"]
    assert "| 1 | ubtree-mrv2-lookup | 64 | 4.00 | 2.00 | 1.20 | yes | new1234 |" in rows[0]
    assert "| 1.10 | 1.30 | no |" in rows[1] and "| 0.99 | 0.70 | no |" in rows[2]


def test_standing_and_goals_judge_the_shipped_drafter_and_name_a_wider_beam(tmp_path):
    """--compare-drafters puts another drafter's tree runs in an invocation: the sections on where the product stands
    leave them out (and an invocation of those alone does not count); a --beam-width run says its W."""
    path = tmp_path / "records.jsonl"
    cell = {**E2E, "hardware": "1x NVIDIA H200", "commit": "abc1234", "date": "2026-12-06", "temperature": 1.0,
            "concurrency": 1, "batch_size": 1, "num_prompts": 24, "command": "bench --compare-drafters"}
    append_ar_and_ngram(path, cell, ngram_speedup=0.8, ngram_tau=1.1)
    tree = {**cell, "method": "ubtree-mrv2-lookup", "output_tokens_per_s": 160.0, "speedup_vs_ar": 1.6}
    rec.append_record(tree, path=path)
    rec.append_record({**tree, "drafter": "runs/slice-x (not shipped)", "speedup_vs_ar": 1.5}, path=path)
    rec.append_record({**tree, "beam_width": 24, "speedup_vs_ar": 1.4}, path=path)
    later = {**cell, "command": "bench --drafter runs/slice-x"}  # newer, but no shipped tree run in it
    append_ar_and_ngram(path, later, ngram_speedup=0.9, ngram_tau=1.1)
    rec.append_record({**later, "method": "ubtree-mrv2-lookup", "drafter": "runs/slice-x (not shipped)",
                       "output_tokens_per_s": 120.0, "speedup_vs_ar": 1.2}, path=path)
    regenerate(path)
    readme = (tmp_path / "README.md").read_text()
    standing = readme.split("## Where UBTree stands")[1].split("\n## ")[0]
    rows = [line.split(" | ") for line in standing.splitlines() if line.startswith("| smollm2")]
    assert [(row[5], row[7]) for row in rows] == [("64", "1.60"), ("64, W = 24", "1.40")]
    goals = readme.split("## Goals")[1].split("\n## ")[0]
    assert "B=64, W = 24 (MRV2, lookup branch) | 1.40x" in goals
    assert "1.50x" not in goals and "1.20x" not in goals


def test_drafter_goals_prefer_the_shipped_training_and_say_what_was_not_measured():
    """Issue 15's goal rows: the newest GPU bench records of the shipped folder's shipped training (the label rows of
    the newest train record into it), an earlier training's only where the shipped one has none, the n-gram run of
    the tree record's own invocation, and "not measured" where nothing ran."""
    from ubtree_vllm.bench.drafter_goals import drafter_goal_rows

    base = {**E2E, "hardware": "1x NVIDIA H200", "commit": "c1", "date": "2026-12-05", "command": "bench",
            "concurrency": 1, "batch_size": 1, "output_tokens_per_s": 100.0, "dataset": "mt_bench"}
    shipped, older = {"cumulative_label_rows": 210_000_000}, {"cumulative_label_rows": 190_000_000}
    records = [
        {**base, **older, "method": "dflash-chain", "tree_budget": 16, "tau": 2.1, "speedup_vs_ar": 1.3},
        {"kind": "train", "drafter": "checkpoints/d", **shipped},
        {**base, "method": "ar", "drafter": None, "tau": None, "speedup_vs_ar": 1.0},
        {**base, "method": "ngram", "drafter": None, "tree_budget": 8, "tau": 1.8, "speedup_vs_ar": 1.5},
        {**base, **shipped, "method": "ubtree-mrv2-lookup", "tau": 4.5, "speedup_vs_ar": 2.0},
        {**base, **older, "method": "ubtree-mrv2-lookup", "tau": 9.0, "speedup_vs_ar": 9.0, "command": "other"},
        {**base, **shipped, "method": "ubtree-mrv2-lookup", "tau": 9.0, "tree_budget": 32, "speedup_vs_ar": 9.0},
        {**base, **shipped, "method": "ubtree-mrv2-lookup", "hardware": "CPU (2 cores)", "tau": 9.0},
        {**base, **shipped, "method": "ubtree-mrv2-lookup", "tree_attention": "flash_merge", "tau": 9.0},
    ]
    records.append({**base, **shipped, "method": "ubtree-mrv2-lookup", "tau": 3.5, "num_prompts": 16,
                    "command": "smaller run"})  # newer, but fewer prompts than the goals' measurement
    rows = {(row[0], row[1]): row[2:] for row in drafter_goal_rows(records)}
    assert rows[("tree tau (T=0) >= 4.0", "mt_bench")] == ["4.50", True, 80, "210.0M", "c1", "2026-12-05"]
    assert rows[("single-path tau (T=0) >= 2.0", "mt_bench")][:4] == ["2.10", True, 80, "190.0M"]  # the fallback
    assert rows[("speedup over ar (T=0) >= 1.8x", "mt_bench")][:2] == ["2.00x", True]
    assert rows[("speedup (T=0) >= ngram's", "mt_bench")][:2] == ["2.00x vs 1.50x", True]
    assert rows[("tree tau (T=1) >= 3.0", "mt_bench")] == ["not measured", None, None, None, None, None]
    assert rows[("tree tau (T=0) >= 4.0", "humaneval")][0] == "not measured"
    # a smaller run stands in where no full run exists
    records.append({**base, **shipped, "dataset": "humaneval", "method": "ubtree-mrv2-lookup", "tau": 5.0,
                    "num_prompts": 16})
    rows = {(row[0], row[1]): row[2:] for row in drafter_goal_rows(records)}
    assert rows[("tree tau (T=0) >= 4.0", "humaneval")][:3] == ["5.00", True, 16]
