"""`ubtree bench e2e` through real vLLM engines (CPU, in-process): records are written complete.

Tiny random Llama + untrained drafter (gamma 4), two token-id prompts injected as one
prompt set, 8 new tokens, methods ar and ubtree (B = 4, W = 2, K = 4), concurrency 1 and
2, T = 0 and 1: two engines, eight measurements, eight records in a temporary file.
"""
from __future__ import annotations

import pytest

from ubtree_vllm.bench import records as rec
from ubtree_vllm.bench.e2e import run_e2e, summary_table
from ubtree_vllm.bench.prompts import PromptSet
from ubtree_vllm.bench.report import regenerate
from ubtree_vllm.bench.settings import E2ESettings, validate
from vllm_engines import ENGINE_KWARGS

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


def test_one_complete_record_per_measurement(bench, tiny_drafter):
    path, rows = bench
    written = rec.read_records(path)
    assert written == rows and len(rows) == 2 * 2 * 2  # methods x concurrency x temperatures
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
    table = summary_table(rows)
    assert len(table.splitlines()) == 1 + len(rows) and "tok/s" in table
    regenerate(path)
    readme = (path.parent / "README.md").read_text()
    assert "## Speed (vLLM end-to-end)" in readme and readme.count("| toy |") >= len(rows)


def test_stage_timing_writes_step_records_that_add_up(tiny_target, tiny_drafter, tmp_path):
    from ubtree_vllm.bench.stage_timing import METRICS, STAGES, WALL, metric_of

    path = tmp_path / "records.jsonl"
    settings = validate(E2ESettings(target=str(tiny_target), drafter=str(tiny_drafter), datasets=("toy",),
                                    temperatures=(0.0,), num_prompts=2, max_new_tokens=8, methods=("ubtree",),
                                    tree_budgets=(4,), beam_width=2, top_k=4, stage_timing=True),
                        check_datasets=False)
    rows = run_e2e(settings, [PROMPTS], tiny_target, ENGINE, records_path=path, log=lambda line: None)
    assert rec.read_records(path) == rows  # stage records only: no e2e (speed) record
    values = {r["metric"]: r["value"] for r in rows}
    assert all(r["kind"] == "microbench" and r["unit"] == "ms" and r["tree_budget"] == 4 for r in rows)
    assert set(values) == set(METRICS) and all(v > 0 for v in values.values())
    step = {s: values[metric_of(s)] for s in STAGES}
    # Stages nest, and the runner's two calls lie inside the engine step.
    assert step["execute_model"] >= step["prepare_inputs_vllm"] + step["tree_plan"] + step["forward"]
    assert step["sample_tokens"] >= sum(step[s] for s in ("accept", "kv_commit", "feature_commit",
                                                            "draft_context", "draft", "drafts_to_host"))
    assert values[WALL] >= step["execute_model"] + step["sample_tokens"]
    regenerate(path)
    readme = (path.parent / "README.md").read_text()
    assert "## Step time by stage" in readme and "drafts_to_host" in readme
