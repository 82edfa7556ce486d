"""`ubtree bench e2e` through real vLLM engines (CPU, in-process): records are written complete.

Tiny random Llama + untrained drafter (gamma 4), two token-id prompts injected as one
prompt set, 8 new tokens, methods ar and ubtree (B = 4, W = 2, K = 4), concurrency 1 and
2, T = 0 and 1: two engines, eight measurements, eight records in a temporary file.

ngram runs only in a subprocess with vLLM's default multiprocess engine (what `ubtree bench e2e`
uses): its proposer imports numba, and once llvmlite is loaded in a process, vLLM 0.32's CPU
kernel-override scan (`triton_utils.dispatcher._rebind_kernels`) fails in every later worker
started there, so an in-process ngram engine would break each engine after it in this session.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ubtree_vllm.bench import records as rec
from ubtree_vllm.bench.e2e import run_e2e
from ubtree_vllm.bench.recorder import summary_table
from ubtree_vllm.bench.prompts import PromptSet
from ubtree_vllm.bench.report import regenerate
from ubtree_vllm.bench.settings import E2ESettings, ngram_run, validate
from vllm_engines import ENGINE_KWARGS, REPO_ROOT, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

PROMPTS = PromptSet("toy", ((1, 17, 42, 99, 7, 300, 12), (1, 250, 3, 64, 128, 5, 77, 401, 9, 33, 18)))
# run_e2e sets the seed, max_num_seqs, stats logging and tokenizer skipping itself.
ENGINE = {k: v for k, v in ENGINE_KWARGS.items()
          if k not in ("seed", "max_num_seqs", "disable_log_stats", "skip_tokenizer_init")}


@pytest.fixture(scope="module")
def bench(tiny_target, tiny_drafter, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "records.jsonl"
    settings = validate(E2ESettings(target=str(tiny_target), drafter=str(tiny_drafter), datasets=("toy",),
                                    temperatures=(0.0, 1.0), num_prompts=2, max_new_tokens=8,
                                    methods=("ar", "ubtree"), tree_budgets=(4,), beam_width=2, top_k=4,
                                    concurrency=(1, 2)), check_datasets=False)
    rows = run_e2e(settings, [PROMPTS], tiny_target, ENGINE, records_path=path, log=lambda line: None)
    return path, rows


def test_each_tree_run_records_its_round_cost_against_the_same_cell(bench):
    path, rows = bench
    e2e = {(r["method"], r["concurrency"], r["temperature"]): r for r in rows if r["kind"] == "e2e"}
    costs = [r for r in rows if r["kind"] == "microbench"]
    assert [(r["method"], r["concurrency"], r["temperature"]) for r in costs] == [
        ("ubtree", c, t) for c in (1, 2) for t in (0.0, 1.0)]
    for r in costs:
        tree, ar = e2e[("ubtree", r["concurrency"], r["temperature"])], e2e[("ar", r["concurrency"], r["temperature"])]
        assert r["metric"] == "round_over_plain_step" and r["unit"] == "plain steps"
        assert abs(r["value"] - tree["tpot_ms"] * tree["tau"] / ar["tpot_ms"]) < 1e-3


def test_one_complete_record_per_measurement(bench, tiny_drafter):
    path, rows = bench
    written = rec.read_records(path)
    assert written == rows
    rows = [r for r in rows if r["kind"] == "e2e"]
    assert len(rows) == 2 * 2 * 2  # methods x concurrency x temperatures
    assert [(r["method"], r["concurrency"], r["temperature"]) for r in rows] == [
        (m, c, t) for m in ("ar", "ubtree") for c in (1, 2) for t in (0.0, 1.0)]
    for r in rows:
        assert list(r) == list(rec.FIELDS)
        assert r["kind"] == "e2e" and r["dataset"] == "toy" and r["target"] == "tiny-llama"
        assert r["num_prompts"] == 2 and r["max_new_tokens"] == 8 and r["batch_size"] == r["concurrency"]
        assert r["hardware"].startswith("CPU (") and r["cuda_graphs"] is False and r["tp"] == 1
        assert r["vllm"] == rec.vllm_version() and r["command"] and r["date"]
        assert r["output_tokens_per_s"] > 0 and r["tpot_ms"] > 0 and r["speedup_vs_ar"] > 0
        assert "sliding window" in r["notes"]
    for r in rows[:4]:
        assert r["tau"] is None and r["speedup_vs_ar"] == 1.0 and r["drafter"] is None
        assert (r["tree_budget"], r["beam_width"], r["top_k"], r["block_size"]) == (None, None, None, None)
    for r in rows[4:]:
        assert 1.0 <= r["tau"] <= 1.0 + 4 and r["drafter"] == str(tiny_drafter)
        assert (r["tree_budget"], r["beam_width"], r["top_k"], r["block_size"]) == (4, 2, 4, 4)
        assert "accepted /" in r["notes"]


def test_summary_and_report_show_the_speed_rows(bench):
    path, rows = bench
    rows = [r for r in rows if r["kind"] == "e2e"]
    table = summary_table(rows)
    assert len(table.splitlines()) == 1 + len(rows) and "tok/s" in table
    regenerate(path)
    readme = (path.parent / "README.md").read_text()
    assert "## Speed (vLLM end-to-end)" in readme and readme.count("| toy |") >= len(rows)


def test_compared_drafters_run_against_the_same_ar_in_one_invocation(tiny_target, tiny_drafter, tmp_path):
    """--compare-drafters: the tree engine runs once per drafter after ar, each record names its drafter, and both
    pair with the one ar run (speedup and round cost)."""
    import shutil

    other = tmp_path / "other-drafter"
    shutil.copytree(tiny_drafter, other)
    path = tmp_path / "records.jsonl"
    settings = validate(E2ESettings(target=str(tiny_target), drafter=str(tiny_drafter), compare_drafters=(str(other),),
                                    datasets=("toy",), temperatures=(0.0,), num_prompts=2, max_new_tokens=8,
                                    methods=("ar", "ubtree"), tree_budgets=(4,), beam_width=2, top_k=4),
                        check_datasets=False)
    lines: list[str] = []
    rows = run_e2e(settings, [PROMPTS], tiny_target, ENGINE, records_path=path, log=lines.append)
    assert rec.read_records(path) == rows
    e2e = [r for r in rows if r["kind"] == "e2e"]
    assert [(r["method"], r["drafter"]) for r in e2e] == [("ar", None), ("ubtree", str(tiny_drafter)),
                                                          ("ubtree", str(other))]
    ar = e2e[0]
    for tree in e2e[1:]:
        assert abs(tree["speedup_vs_ar"] - tree["output_tokens_per_s"] / ar["output_tokens_per_s"]) < 1e-3
    costs = [r for r in rows if r["kind"] == "microbench"]
    assert [r["drafter"] for r in costs] == [str(tiny_drafter), str(other)]
    assert any(f"(drafter {other})" in line for line in lines)


def test_stage_timing_writes_step_records_that_add_up(tiny_target, tiny_drafter, tmp_path):
    from ubtree_vllm.bench.stage_timing import METRICS, MRV2_ONLY, STAGES, WALL, metric_of

    path = tmp_path / "records.jsonl"
    settings = validate(E2ESettings(target=str(tiny_target), drafter=str(tiny_drafter), datasets=("toy",),
                                    temperatures=(0.0,), num_prompts=2, max_new_tokens=8, methods=("ubtree",),
                                    tree_budgets=(4,), beam_width=2, top_k=4, stage_timing=True),
                        check_datasets=False)
    rows = run_e2e(settings, [PROMPTS], tiny_target, ENGINE, records_path=path, log=lambda line: None)
    assert rec.read_records(path) == rows  # stage records only: no e2e (speed) record
    values = {r["metric"]: r["value"] for r in rows}
    assert all(r["kind"] == "microbench" and r["unit"] == "ms" and r["tree_budget"] == 4 for r in rows)
    assert set(values) == set(METRICS) - {metric_of(s) for s in MRV2_ONLY} and all(v > 0 for v in values.values())
    step = {s: values[metric_of(s)] for s in STAGES if s not in MRV2_ONLY}
    # Stages nest, and the runner's two calls lie inside the engine step.
    assert step["execute_model"] >= step["prepare_inputs_vllm"] + step["tree_plan"] + step["forward"]
    assert step["sample_tokens"] >= sum(step[s] for s in ("accept", "kv_commit", "feature_commit",
                                                            "draft_context", "draft", "drafts_to_host"))
    assert values[WALL] >= step["execute_model"] + step["sample_tokens"]
    regenerate(path)
    readme = (path.parent / "README.md").read_text()
    assert "## Step time by stage" in readme and "drafts_to_host" in readme


def test_ngram_config_is_vllm_prompt_lookup_on_the_default_runner(tiny_target):
    """What vLLM builds from the ngram run's speculative_config (no engine, see the module docstring)."""
    from vllm.engine.arg_utils import EngineArgs

    from ubtree_vllm.vllm.config import ADDITIONAL_CONFIG_KEY, CPU_WORKER_CLASS_PATH, GPU_WORKER_CLASS_PATH

    run = ngram_run(E2ESettings(ngram_k=5, ngram_lookup_max=3, ngram_lookup_min=2))
    config = EngineArgs(model=str(tiny_target), speculative_config=dict(run.speculative_config),
                        **ENGINE).create_engine_config()
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == \
        ("ngram", 5, 3, 2)
    assert ADDITIONAL_CONFIG_KEY not in config.additional_config  # not a UBTree engine: vLLM's own runner
    assert config.parallel_config.worker_cls not in (CPU_WORKER_CLASS_PATH, GPU_WORKER_CLASS_PATH)


NGRAM_BENCH = """
import json
import sys

from ubtree_vllm.bench.e2e import run_e2e
from ubtree_vllm.bench.prompts import PromptSet
from ubtree_vllm.bench.settings import E2ESettings, validate

if __name__ == "__main__":  # spawned engine-core processes re-import this file
    target, drafter, records, engine, prompts = sys.argv[1], sys.argv[2], sys.argv[3], *map(json.loads, sys.argv[4:])
    settings = validate(E2ESettings(target=target, drafter=drafter, datasets=("toy",), temperatures=(0.0,),
                                    num_prompts=2, max_new_tokens=16, methods=("ngram", "ubtree"),
                                    tree_budgets=(4,), beam_width=2, top_k=4, ngram_k=3, ngram_lookup_max=2,
                                    ngram_lookup_min=1), check_datasets=False)
    run_e2e(settings, [PromptSet("toy", tuple(map(tuple, prompts)))], target, engine, records_path=records)
"""


def test_ngram_then_ubtree_in_engine_core_processes(tiny_target, tiny_drafter, tmp_path):
    """ngram, then ubtree, as `ubtree bench e2e` runs them: ngram's tau from the spec-decode counters, no drafter,
    and the engine after it starts (no ar: the speedup pairing is a unit test)."""
    script, path = tmp_path / "ngram_bench.py", tmp_path / "records.jsonl"
    script.write_text(NGRAM_BENCH)
    command = [sys.executable, str(script), str(tiny_target), str(tiny_drafter), str(path), json.dumps(ENGINE),
               json.dumps(PROMPTS.prompts)]
    proc = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=600, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ngram, ubtree = rec.read_records(path)
    assert (ngram["method"], ubtree["method"]) == ("ngram", "ubtree")
    assert ngram["drafter"] is None and (ngram["tree_budget"], ngram["beam_width"], ngram["top_k"]) == (3, 1, 1)
    assert 1.0 <= ngram["tau"] <= 1.0 + 3 and ngram["output_tokens_per_s"] > 0
    assert "accepted /" in ngram["notes"] and "k=3" in ngram["notes"] and "window 1-2 tokens" in ngram["notes"]
    assert 1.0 <= ubtree["tau"] <= 1.0 + 4 and ubtree["drafter"] == str(tiny_drafter)


def test_agreement_mode_compares_greedy_outputs_with_ar(tiny_target, tiny_drafter, tmp_path):
    """fp32 on the CPU: the tree's greedy outputs equal ar's, so every divergence rate is 0; no e2e records."""
    from ubtree_vllm.bench.agreement import METRIC

    path = tmp_path / "records.jsonl"
    settings = validate(E2ESettings(target=str(tiny_target), drafter=str(tiny_drafter), datasets=("toy",),
                                    temperatures=(0.0,), num_prompts=2, max_new_tokens=12, methods=("ar", "ubtree"),
                                    tree_budgets=(4, 8), beam_width=2, top_k=4, concurrency=(1, 2), agreement=True),
                        check_datasets=False)
    rows = run_e2e(settings, [PROMPTS], tiny_target, ENGINE, records_path=path, log=lambda line: None)
    assert rec.read_records(path) == rows
    assert [(r["method"], r["tree_budget"], r["concurrency"]) for r in rows] == [
        ("ubtree", b, c) for b in (4, 8) for c in (1, 2)]
    for r in rows:
        assert r["kind"] == "microbench" and r["metric"] == METRIC and r["unit"] == "fraction"
        assert r["value"] == 0.0 and r["num_prompts"] == 2 and "0 of 2 greedy outputs differ" in r["notes"]
        assert list(r) == list(rec.FIELDS)


def test_sampling_options_mode_records_each_options_cost_per_round(tiny_target, tiny_drafter, tmp_path):
    """--sampling-options (issue 18's cost per option): each engine runs the cell without an option, then with each;
    the records are the options' round times (speedup over ar with the same option) and what each added over the same
    engine without it; no e2e records; the report tabulates them."""
    from ubtree_vllm.bench.sampling_options import ADDED_METRIC, ROUND_METRIC

    path = tmp_path / "records.jsonl"
    options = ("penalties", "logit_bias", "logprobs", "min_p", "min_tokens")
    settings = validate(E2ESettings(target=str(tiny_target), drafter=str(tiny_drafter), datasets=("toy",),
                                    temperatures=(0.0,), num_prompts=2, max_new_tokens=8, methods=("ar", "ubtree"),
                                    tree_budgets=(4,), beam_width=2, top_k=4, sampling_options=options),
                        check_datasets=False)
    lines: list[str] = []
    rows = run_e2e(settings, [PROMPTS], tiny_target, ENGINE, records_path=path, log=lines.append)
    assert rec.read_records(path) == rows and all(r["kind"] == "microbench" for r in rows)
    rounds = {(r["method"], r["sampling_options"]): r for r in rows if r["metric"] == ROUND_METRIC}
    added = {(r["method"], r["sampling_options"]): r for r in rows if r["metric"] == ADDED_METRIC}
    assert list(rounds) == [(m, o) for m in ("ar", "ubtree") for o in ("none", *options)]
    assert list(added) == [(m, o) for m in ("ar", "ubtree") for o in options]
    for (method, option), r in added.items():
        assert r["value"] == pytest.approx(rounds[(method, option)]["value"] - rounds[(method, "none")]["value"],
                                           abs=2e-4)
    for (method, option), r in rounds.items():
        assert r["unit"] == "ms" and r["value"] > 0 and list(r) == list(rec.FIELDS)
        ar = rounds[("ar", option)]
        assert r["speedup_vs_ar"] == pytest.approx(r["output_tokens_per_s"] / ar["output_tokens_per_s"], abs=1e-3)
        if method == "ubtree":
            assert r["tau"] >= 1.0 and r["tree_budget"] == 4 and r["drafter"] == str(tiny_drafter)
            assert r["value"] == pytest.approx(r["tpot_ms"] * r["tau"], rel=1e-3)
    assert any("option=penalties" in line for line in lines)
    regenerate(path)
    readme = (path.parent / "README.md").read_text()
    assert "## Sampling options: cost per round" in readme and readme.count("| penalties |") == 2


def test_interleaved_engines_take_turns_and_pair_with_ar(tiny_target, tiny_drafter, tmp_path):
    """--interleave 2: both engines up at once, each cell's two prompts run chunk by chunk in turn; the records are
    those of the sequential plan (ar first, speedup and round cost against it), their notes say how they ran, and
    fp32 greedy outputs still equal ar's (agreement mode, interleaved too)."""
    from ubtree_vllm.bench.agreement import METRIC

    path = tmp_path / "records.jsonl"
    settings = validate(E2ESettings(target=str(tiny_target), drafter=str(tiny_drafter), datasets=("toy",),
                                    temperatures=(0.0, 1.0), num_prompts=2, max_new_tokens=8, methods=("ar", "ubtree"),
                                    tree_budgets=(4,), beam_width=2, top_k=4, concurrency=(1, 2), interleave=2),
                        check_datasets=False)
    lines: list[str] = []
    rows = run_e2e(settings, [PROMPTS], tiny_target, ENGINE, records_path=path, log=lines.append)
    assert rec.read_records(path) == rows
    e2e = [r for r in rows if r["kind"] == "e2e"]
    assert [(r["method"], r["concurrency"], r["temperature"]) for r in e2e] == [
        (m, c, t) for c in (1, 2) for t in (0.0, 1.0) for m in ("ar", "ubtree")]  # cell by cell, ar first
    for ar, tree in zip(e2e[::2], e2e[1::2]):
        assert ar["speedup_vs_ar"] == 1.0 and ar["num_prompts"] == tree["num_prompts"] == 2
        assert abs(tree["speedup_vs_ar"] - tree["output_tokens_per_s"] / ar["output_tokens_per_s"]) < 1e-3
        chunks = 2 if tree["concurrency"] == 1 else 1  # 2 prompts: no chunk of 2 x 2 at concurrency 2
        assert f"interleaved: {chunks} chunks of the prompts, the 2 engines in turn" in tree["notes"]
        assert ("speedup over ar per chunk: " in tree["notes"]) == (chunks > 1)
        assert "speedup over ar per chunk" not in ar["notes"]
        assert 1.0 <= tree["tau"] <= 5.0
    assert [r["metric"] for r in rows if r["kind"] == "microbench"] == ["round_over_plain_step"] * 4
    assert sum("starting engine" in line for line in lines) == 2
    agreement = run_e2e(validate(E2ESettings(target=str(tiny_target), drafter=str(tiny_drafter), datasets=("toy",),
                                             temperatures=(0.0,), num_prompts=2, max_new_tokens=12,
                                             methods=("ar", "ubtree"), tree_budgets=(4,), beam_width=2, top_k=4,
                                             agreement=True, interleave=2), check_datasets=False),
                        [PROMPTS], tiny_target, ENGINE, log=lambda line: None)
    assert [(r["metric"], r["value"]) for r in agreement] == [(METRIC, 0.0)]


def test_interleaved_engines_run_their_engine_cores_in_processes_of_their_own(tiny_target, tiny_drafter, tmp_path):
    """--interleave with --engine-core process (vLLM's default, as `vllm serve` runs): each engine's child starts
    the engine core's process (a daemonic child could not), the records say where the cores ran, and fp32 greedy
    outputs still equal ar's."""
    from ubtree_vllm.bench.agreement import METRIC

    common = dict(target=str(tiny_target), drafter=str(tiny_drafter), datasets=("toy",), num_prompts=2,
                  methods=("ar", "ubtree"), tree_budgets=(4,), beam_width=2, top_k=4, interleave=2,
                  engine_core="process")
    rows = run_e2e(validate(E2ESettings(temperatures=(0.0,), max_new_tokens=8, **common), check_datasets=False),
                   [PROMPTS], tiny_target, ENGINE, log=lambda line: None)
    e2e = [r for r in rows if r["kind"] == "e2e"]
    assert [r["method"] for r in e2e] == ["ar", "ubtree"]
    assert all("engine core in a process of its own" in r["notes"] for r in e2e)
    assert 1.0 <= e2e[1]["tau"] <= 5.0
    agreement = run_e2e(validate(E2ESettings(temperatures=(0.0,), max_new_tokens=12, agreement=True, **common),
                                 check_datasets=False), [PROMPTS], tiny_target, ENGINE, log=lambda line: None)
    assert [(r["metric"], r["value"]) for r in agreement] == [(METRIC, 0.0)]

