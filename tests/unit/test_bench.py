"""`ubtree bench`: the pure parts of e2e (tau, TPOT, speedup, records, flag checks) and the microbench on CPU."""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_args import e2e_args
import torch
from transformers import LlamaConfig

from ubtree_vllm import cli
from ubtree_vllm.bench import cli as bench_cli
from ubtree_vllm.bench import e2e
from ubtree_vllm.bench import records as rec
from ubtree_vllm.bench.measurement import (NUM_ACCEPTED, NUM_DRAFTS, RunResult, SpeedupTable, e2e_record,
                                           mean_tpot_ms, request_tpot_s, spec_counters, summarize_run,
                                           tau_from_deltas)
from ubtree_vllm.bench.microbench import MICROBENCHES, MicrobenchSettings, run_microbenches
from ubtree_vllm.bench.settings import (BenchArgumentError, E2ESettings, MethodRun, mtp_run, ngram_run,
                                        planned_methods, settings_from_args, ubtree_chain_run, ubtree_run, validate,
                                        with_served_attention)
from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.io import save_drafter
from ubtree_vllm.drafter.proposer import UBTreeDrafter


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    """Untrained tiny drafter: vocab 512, hidden 64, gamma 4, K 16."""
    torch.manual_seed(0)
    target = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=2, num_key_value_heads=1)
    cfg = DrafterConfig.for_target(target, "tiny-llama", block_size=4, top_k=16, num_layers=1, selector_rank=16)
    return save_drafter(UBTreeDrafter(cfg), tmp_path_factory.mktemp("bench") / "drafter", dtype=torch.float32)


# ---- measurement -------------------------------------------------------------------------

def counter(name, value, engine="0"):
    return SimpleNamespace(name=name, value=value, labels={"engine": engine})


def output(tokens, first=None, last=None):
    metrics = None if first is None else SimpleNamespace(first_token_ts=first, last_token_ts=last)
    return SimpleNamespace(metrics=metrics, outputs=[SimpleNamespace(token_ids=list(range(tokens)))])


def test_spec_counters_sum_label_sets_and_ignore_other_metrics():
    metrics = [counter(NUM_DRAFTS, 10), counter(NUM_DRAFTS, 5, engine="1"), counter(NUM_ACCEPTED, 7),
               counter("vllm:num_requests_running", 3)]
    assert spec_counters(metrics) == {NUM_DRAFTS: 15.0, NUM_ACCEPTED: 7.0}
    assert spec_counters([]) == {NUM_DRAFTS: 0.0, NUM_ACCEPTED: 0.0}


def test_tau_is_one_plus_accepted_per_draft_over_the_deltas():
    before = {NUM_DRAFTS: 100.0, NUM_ACCEPTED: 80.0}  # warm-up and earlier runs
    after = {NUM_DRAFTS: 140.0, NUM_ACCEPTED: 180.0}
    assert tau_from_deltas(before, after) == (1.0 + 100 / 40, 40, 100)
    assert tau_from_deltas(before, before) == (None, 0, 0)  # no speculation in this run
    with pytest.raises(ValueError, match="backwards"):
        tau_from_deltas(after, before)


def test_tpot_excludes_the_prefill_token_and_skips_short_or_statless_requests():
    assert request_tpot_s(SimpleNamespace(first_token_ts=10.0, last_token_ts=10.9), 10) == pytest.approx(0.1)
    assert request_tpot_s(SimpleNamespace(first_token_ts=10.0, last_token_ts=10.0), 1) is None
    assert request_tpot_s(None, 10) is None
    assert request_tpot_s(SimpleNamespace(first_token_ts=0.0, last_token_ts=0.0), 10) is None  # never filled
    outputs = [output(10, 1.0, 1.9), output(5, 2.0, 2.8), output(1, 3.0, 3.0), output(8)]
    assert mean_tpot_ms(outputs) == pytest.approx(1000 * (0.1 + 0.2) / 2)
    assert mean_tpot_ms([output(1, 3.0, 3.0)]) is None


def test_summarize_run_counts_tokens_over_wall_time():
    result = summarize_run([output(10, 1.0, 1.9), output(6, 2.0, 2.5)], 2.0,
                           {NUM_DRAFTS: 0.0, NUM_ACCEPTED: 0.0}, {NUM_DRAFTS: 8.0, NUM_ACCEPTED: 6.0})
    assert (result.num_requests, result.output_tokens, result.tokens_per_s) == (2, 16, 8.0)
    assert result.tau == pytest.approx(1.75) and result.tpot_ms == pytest.approx(100.0)


def test_speedup_pairs_with_ar_of_the_same_dataset_temperature_and_concurrency():
    table = SpeedupTable()
    assert table.speedup("ubtree", "mt_bench", 0.0, 1, 300.0) is None  # no ar yet
    assert table.speedup("ar", "mt_bench", 0.0, 1, 100.0) == 1.0
    assert table.speedup("ar", "mt_bench", 1.0, 1, 50.0) == 1.0
    assert table.speedup("ubtree", "mt_bench", 0, 1, 300.0) == pytest.approx(3.0)
    assert table.speedup("ubtree", "mt_bench", 1.0, 1, 100.0) == pytest.approx(2.0)
    assert table.speedup("ubtree", "mt_bench", 0.0, 4, 300.0) is None  # other concurrency
    assert table.speedup("ubtree", "humaneval", 0.0, 1, 300.0) is None  # other dataset


def test_e2e_record_is_valid_and_carries_the_tree_fields(tmp_path):
    result = RunResult(num_requests=80, output_tokens=20480, wall_s=10.0, tpot_ms=1.25, tau=3.456789,
                       num_drafts=100, num_accepted=246)
    settings = E2ESettings(drafter="checkpoints/d", block_size=16)
    record = e2e_record(ubtree_run(settings, 32), result, target="smollm2-135m-instruct", drafter="checkpoints/d",
                        dataset="mt_bench", temperature=1, concurrency=4, max_new_tokens=256, cuda_graphs=True,
                        speedup=2.5, engine_core="process",
                        drafter_training={"cumulative_label_rows": 7, "cumulative_distinct_tokens": 5})
    written = rec.append_record(record, tmp_path / "records.jsonl")
    assert (written["cumulative_label_rows"], written["cumulative_distinct_tokens"]) == (7, 5)  # the drafter's
    assert written["output_tokens_per_s"] == 2048.0 and written["tau"] == 3.4568 and written["speedup_vs_ar"] == 2.5
    assert (written["tree_budget"], written["beam_width"], written["top_k"], written["block_size"]) == (32, 12, 64, 16)
    assert written["temperature"] == 1.0 and written["batch_size"] == written["concurrency"] == 4
    assert "246 accepted / 100 drafts" in written["notes"] and written["drafter"] == "checkpoints/d"
    assert "engine core in a process of its own" in written["notes"]
    ar = e2e_record(MethodRun("ar"), RunResult(80, 20480, 20.0, 2.5, None, 0, 0), target="t", drafter="checkpoints/d",
                    dataset="mt_bench", temperature=0.0, concurrency=1, max_new_tokens=256, cuda_graphs=False,
                    speedup=1.0, engine_core="in-process", drafter_training={"cumulative_label_rows": 7})
    rec.validate_record({**dict.fromkeys(rec.FIELDS), **ar})
    assert ar["tau"] is None and ar["drafter"] is None and ar["tree_budget"] is None
    assert "cumulative_label_rows" not in ar  # no drafter, no training amount
    assert "no speculation" in ar["notes"] and "engine core in the LLM object's process" in ar["notes"]


def test_engine_core_mode_follows_the_flag_then_vllms_variable(monkeypatch):
    """--engine-core wins; unset, VLLM_ENABLE_V1_MULTIPROCESSING decides as vLLM reads it (unset: own process). The
    mode sets the engines' environment and whether an --interleave child may start the engine core's process."""
    from ubtree_vllm.bench.engine_process import child_is_daemon
    from ubtree_vllm.bench.settings import engine_core_env, engine_core_mode

    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert engine_core_mode(E2ESettings()) == "process"
    for value, mode in (("0", "in-process"), ("false", "in-process"), ("1", "process"), ("True", "process")):
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", value)
        assert engine_core_mode(E2ESettings()) == mode
    assert engine_core_mode(E2ESettings(engine_core="process")) == "process"  # the flag over the variable
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert engine_core_env(E2ESettings(engine_core="process")) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    assert engine_core_env(E2ESettings(engine_core="in-process")) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # on CUDA the engine core is spawned, never forked
    assert engine_core_env(E2ESettings(engine_core="process")) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                                                                   "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    assert engine_core_env(E2ESettings(engine_core="in-process")) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert child_is_daemon(E2ESettings(engine_core="in-process"))
    assert not child_is_daemon(E2ESettings(engine_core="process"))  # a daemon may not start the core's process


def test_engine_core_flag_is_checked_before_any_engine(monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    args = e2e_args(methods="ar", engine_core="process")
    assert settings_from_args(args).engine_core == "process"
    with pytest.raises(BenchArgumentError, match="--engine-core: unknown mode 'thread'; allowed: process, in-process"):
        validate(E2ESettings(methods=("ar",), engine_core="thread"), check_datasets=False)
    for flag, extra in (("--stage-timing", {"stage_timing": True}), ("--profile", {"profile_dir": "p"})):
        with pytest.raises(BenchArgumentError, match="needs the engine core in this process"):
            validate(E2ESettings(methods=("ar",), engine_core="process", **extra), check_datasets=False)
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process by vLLM's variable: allowed
        validate(E2ESettings(methods=("ar",), **extra), check_datasets=False)
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING")


def test_ngram_run_is_vllm_prompt_lookup_without_a_drafter(tmp_path):
    settings = E2ESettings(drafter="checkpoints/d", block_size=16, ngram_k=6, ngram_lookup_max=5, ngram_lookup_min=3)
    run = ngram_run(settings)
    assert run.speculative_config == {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 5,
                                      "prompt_lookup_min": 3}
    assert (run.tree_budget, run.beam_width, run.top_k, run.block_size) == (6, 1, 1, None)
    assert run.env == {} and not run.uses_drafter  # the platform's default runner
    assert ngram_run(E2ESettings()).speculative_config == {"method": "ngram", "num_speculative_tokens": 8,
                                                           "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    result = RunResult(num_requests=2, output_tokens=64, wall_s=2.0, tpot_ms=3.0, tau=2.5, num_drafts=20,
                       num_accepted=30)
    record = e2e_record(run, result, target="t", drafter="checkpoints/d", dataset="mt_bench", temperature=0.0,
                        concurrency=1, max_new_tokens=32, cuda_graphs=False, speedup=1.25, engine_core="process")
    written = rec.append_record(record, tmp_path / "records.jsonl")
    assert written["method"] == "ngram" and written["drafter"] is None and written["tau"] == 2.5
    assert (written["tree_budget"], written["beam_width"], written["top_k"]) == (6, 1, 1)
    assert "30 accepted / 20 drafts" in written["notes"]  # tau from the spec-decode counters
    assert "k=6" in written["notes"] and "lookup window 3-5 tokens" in written["notes"]


def test_lookup_method_is_the_v1_tree_with_the_prompt_lookup_branch(drafter_dir):
    settings = E2ESettings(drafter="d", block_size=16, ngram_lookup_max=5, ngram_lookup_min=3)
    run = ubtree_run(settings, 32, "ubtree-lookup")
    assert run.speculative_config["prompt_lookup"] is True and run.env == {"UBTREE_VLLM_RUNNER": "v1"}
    assert (run.speculative_config["prompt_lookup_min"], run.speculative_config["prompt_lookup_max"]) == (3, 5)
    assert "prompt-lookup branch, lookup window 3-5 tokens" in run.note
    assert ubtree_run(settings, 32).speculative_config["prompt_lookup"] is False  # the plain tree, pinned
    mrv2 = ubtree_run(settings, 32, "ubtree-mrv2-lookup")  # the same branch on Model Runner V2
    assert mrv2.speculative_config == run.speculative_config and mrv2.env == {"UBTREE_VLLM_RUNNER": "mrv2"}
    with pytest.raises(BenchArgumentError, match="--ngram-lookup-max must be <= 16 with the lookup methods "
                                                 r"\(ubtree-lookup, ubtree-mrv2-lookup"):
        validate(E2ESettings(drafter=str(drafter_dir), methods=("ubtree-lookup",), tree_budgets=(8,),
                             ngram_lookup_max=17))


def test_fallback_chain_run_is_a_single_path_through_the_plugin():
    run = ubtree_chain_run(E2ESettings(drafter="d", block_size=16), note="why")
    assert run.method == "ubtree-chain" and run.note == "why"
    assert run.speculative_config == {"method": "ubtree", "model": "d", "num_speculative_tokens": 16,
                                      "beam_width": 1, "top_k": 1, "prompt_lookup": False}
    assert ubtree_run(E2ESettings(drafter="d", block_size=16), 8).beam_width == 8  # W capped at B


# ---- flag validation ---------------------------------------------------------------------



def test_e2e_flags_are_parsed_and_ordered(drafter_dir):
    settings = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree,ar", tree_budgets="4,8",
                                           beam_width=2, top_k=4, concurrency="1,4", temperatures="0,0.7"))
    assert settings.concurrency == (1, 4) and settings.temperatures == (0.0, 0.7)
    assert (settings.block_size, settings.vocab_size, settings.target_name) == (4, 512, "tiny-llama")
    assert planned_methods(settings) == ["ar", "ubtree:4", "ubtree:8"]  # ar first, one engine per B
    defaults = settings_from_args(e2e_args(drafter=str(drafter_dir), tree_budgets="16,32,48", top_k=16))
    assert planned_methods(defaults) == ["ar", "dflash-chain", "ubtree:16", "ubtree:32", "ubtree:48"]
    assert settings_from_args(e2e_args(methods="ar")).drafter is None  # ar needs no drafter
    ngram = settings_from_args(e2e_args(methods="ngram,ar", ngram_k=5, ngram_lookup_max=3, ngram_lookup_min=3))
    assert ngram.drafter is None and planned_methods(ngram) == ["ar", "ngram"]  # nor does ngram
    assert (ngram.ngram_k, ngram.ngram_lookup_max, ngram.ngram_lookup_min) == (5, 3, 3)
    assert (defaults.ngram_k, defaults.ngram_lookup_max, defaults.ngram_lookup_min) == (8, 4, 2)
    every = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree,dflash-chain,ngram,ar",
                                        tree_budgets="16", top_k=16))
    assert planned_methods(every) == ["ar", "ngram", "dflash-chain", "ubtree:16"]
    tasks = settings_from_args(e2e_args(methods="ar,ngram", datasets="spec_bench:summarization,spec_bench:rag"))
    assert tasks.datasets == ("spec_bench:summarization", "spec_bench:rag")  # Spec-Bench by task (issue 16)
    both = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree-mrv2,ubtree", tree_budgets="4,8",
                                       top_k=16))
    assert planned_methods(both) == ["ubtree:4", "ubtree:8", "ubtree-mrv2:4", "ubtree-mrv2:8"]


def test_compared_drafters_rerun_only_the_engines_that_draft(drafter_dir, tmp_path):
    import shutil

    from ubtree_vllm.bench.settings import planned_engines

    other = tmp_path / "other"
    shutil.copytree(drafter_dir, other)
    settings = settings_from_args(e2e_args(drafter=str(drafter_dir), compare_drafters=str(other), tree_budgets="16",
                                           methods="ar,ngram,ubtree-mrv2", top_k=16))
    engines = planned_engines(settings)
    assert [(label, s.drafter) for label, s in engines] == [
        ("ar", str(drafter_dir)), ("ngram", str(drafter_dir)), ("ubtree-mrv2:16", str(drafter_dir)),
        ("ubtree-mrv2:16", str(other))]
    assert engines[-1][1].block_size == 4 and not engines[-1][1].compare_drafters  # validated on its own
    assert planned_engines(dataclasses.replace(settings, compare_drafters=())) == [
        (label, dataclasses.replace(settings, compare_drafters=())) for label in ("ar", "ngram", "ubtree-mrv2:16")]
    for value, message in (("/no/such", "--compare-drafters: drafter folder not found: /no/such"),
                           (str(drafter_dir), "--compare-drafters names --drafter or a folder twice"),
                           (f"{other},{other}", "--compare-drafters names --drafter or a folder twice")):
        with pytest.raises(BenchArgumentError, match=message):
            settings_from_args(e2e_args(drafter=str(drafter_dir), compare_drafters=value, tree_budgets="16", top_k=16))
    with pytest.raises(BenchArgumentError, match="--compare-drafters reruns the methods that draft"):
        settings_from_args(e2e_args(methods="ar,ngram", compare_drafters=str(other)))


def test_mrv2_runs_build_their_engine_under_the_runner_switch(monkeypatch):
    run = ubtree_run(E2ESettings(drafter="d", block_size=16), 32, "ubtree-mrv2")
    assert run.method == "ubtree-mrv2" and run.env == {"UBTREE_VLLM_RUNNER": "mrv2"}
    assert run.speculative_config["method"] == "ubtree" and "UBTREE_VLLM_RUNNER=mrv2" in run.note
    assert ubtree_run(E2ESettings(drafter="d", block_size=16), 32).env == {"UBTREE_VLLM_RUNNER": "v1"}
    # both UBTree runners own a stage clock (ubtree, its single-path fallback, ubtree-mrv2); ar and ngram do not
    from ubtree_vllm.bench.stage_timing import uses_runner_clock

    settings = E2ESettings(drafter="d", block_size=16)
    assert uses_runner_clock(ubtree_run(settings, 32)) and uses_runner_clock(ubtree_chain_run(settings))
    assert uses_runner_clock(run) and not uses_runner_clock(MethodRun("ar")) and not uses_runner_clock(MethodRun("ngram"))
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", "v1")
    with e2e.environment(run.env):
        assert os.environ["UBTREE_VLLM_RUNNER"] == "mrv2"
    assert os.environ["UBTREE_VLLM_RUNNER"] == "v1"
    monkeypatch.delenv("UBTREE_VLLM_RUNNER")
    with pytest.raises(RuntimeError), e2e.environment(run.env):
        raise RuntimeError("engine failed")
    assert "UBTREE_VLLM_RUNNER" not in os.environ


def test_budget_policy_default_and_fixed_reach_the_tree_engines_and_their_records(drafter_dir):
    """No --budget-schedule: MRV2 tree methods run the serving default (load-adaptive) and their records say which
    schedule; V1 ones keep B. --fixed-budget pins B everywhere; with --budget-schedule it is refused."""
    default = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree-mrv2,ubtree", tree_budgets="16",
                                          top_k=16))
    mrv2, v1 = ubtree_run(default, 16, "ubtree-mrv2"), ubtree_run(default, 16, "ubtree")
    assert "budget_policy" not in mrv2.speculative_config and mrv2.budget_schedule == "1-8:16,9-16:8,17-32:4,33-1024:2"
    assert "the default policy" in mrv2.note and v1.budget_schedule is None
    fixed = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree-mrv2", tree_budgets="16", top_k=16,
                                        fixed_budget=True))
    run = ubtree_run(fixed, 16, "ubtree-mrv2")
    assert run.speculative_config["budget_policy"] == "fixed" and run.budget_schedule is None
    with pytest.raises(BenchArgumentError, match="--fixed-budget pins B at every step and --budget-schedule"):
        settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree-mrv2", tree_budgets="16", top_k=16,
                                    fixed_budget=True, budget_schedule="1-4:16"))


def test_budget_schedule_reaches_the_tree_engines_and_their_records(drafter_dir, tmp_path):
    settings = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ar,ngram,ubtree-mrv2", tree_budgets="16",
                                           top_k=16, budget_schedule="1-4:16, 5-32:8".replace(" ", "")))
    assert settings.budget_schedule == ((1, 4, 16), (5, 32, 8))
    run = ubtree_run(settings, 16, "ubtree-mrv2")
    assert run.speculative_config["num_speculative_tokens_per_batch_size"] == [[1, 4, 16], [5, 32, 8]]
    assert run.budget_schedule == "1-4:16,5-32:8" and "load-adaptive budget 1-4:16,5-32:8" in run.note
    assert "num_speculative_tokens_per_batch_size" not in ngram_run(settings).speculative_config  # trees only
    result = RunResult(num_requests=8, output_tokens=800, wall_s=1.0, tpot_ms=1.0, tau=3.0, num_drafts=10,
                       num_accepted=20)
    record = e2e_record(with_served_attention(run, None), result, target="t", drafter=str(drafter_dir),
                        dataset="mt_bench", temperature=0.0, concurrency=8, max_new_tokens=100, cuda_graphs=True,
                        speedup=1.5, engine_core="process")
    assert rec.append_record(record, tmp_path / "r.jsonl")["budget_schedule"] == "1-4:16,5-32:8"
    pinned_run = with_served_attention(ubtree_run(E2ESettings(drafter="d", block_size=4), 16), None)
    pinned = e2e_record(pinned_run, result, target="t", drafter="d",
                        dataset="mt_bench", temperature=0.0, concurrency=8, max_new_tokens=100, cuda_graphs=True,
                        speedup=1.5, engine_core="process")
    assert pinned["budget_schedule"] is None
    from ubtree_vllm.bench.report import budget_label, latest

    assert budget_label(record) == "16 (1-4:16,5-32:8)" and budget_label(pinned) == 16
    shown, hidden = latest([{**dict.fromkeys(rec.FIELDS), **record}, {**dict.fromkeys(rec.FIELDS), **pinned,
                                                                       "drafter": str(drafter_dir)}])
    assert len(shown) == 2 and hidden == 0  # a scheduled run and a pinned one are two configurations


def test_tree_attention_mode_reaches_the_tree_engines_and_their_records(drafter_dir, tmp_path):
    settings = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ar,ubtree-mrv2", tree_budgets="16",
                                           top_k=16, tree_attention="flash_merge"))
    run = ubtree_run(settings, 16, "ubtree-mrv2", "flash_merge")
    assert run.speculative_config["tree_attention"] == "flash_merge" and "tree_attention=flash_merge" in run.note
    result = RunResult(num_requests=8, output_tokens=800, wall_s=1.0, tpot_ms=1.0, tau=3.0, num_drafts=10,
                       num_accepted=20)
    record = e2e_record(run, result, target="t", drafter=str(drafter_dir), dataset="mt_bench", temperature=0.0,
                        concurrency=1, max_new_tokens=100, cuda_graphs=True, speedup=1.5, engine_core="process")
    assert rec.append_record(record, tmp_path / "r.jsonl")["tree_attention"] == "flash_merge"
    default = ubtree_run(settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree-mrv2",
                                                     tree_budgets="16", top_k=16)), 16, "ubtree-mrv2")
    # the bench's default is the serving default "auto", named to the engine; the record names what the engine served
    assert default.speculative_config["tree_attention"] == "auto" and default.tree_attention == "auto"
    served = with_served_attention(default, "flash_exact")
    assert served.tree_attention == "flash_exact" and served.note.endswith("tree_attention auto (served flash_exact)")
    served = e2e_record(served, result, target="t", drafter=str(drafter_dir), dataset="mt_bench", temperature=0.0,
                        concurrency=1, max_new_tokens=100, cuda_graphs=True, speedup=1.5, engine_core="process")
    assert rec.append_record(served, tmp_path / "r.jsonl")["tree_attention"] == "flash_exact"
    on_cpu = with_served_attention(default, None)  # the CPU backend has no tree_attention mode
    assert on_cpu.tree_attention is None and on_cpu.note.endswith("(served by the CPU backend)")
    explicit = with_served_attention(ubtree_run(settings, 16, "ubtree-mrv2", "flash_merge"), "flash_merge")
    assert explicit.note == run.note  # a mode the user named is in the note already
    from ubtree_vllm.bench.report import budget_label

    assert budget_label(record) == "16 (1-8:16,9-16:8,17-32:4,33-1024:2; flash_merge attention)"  # the default policy


def test_coupled_edge_weight_reaches_the_coupled_engines_and_their_t1_records(drafter_dir, tmp_path):
    """--coupled-edge-weight sets speculative_config.coupled_edge_weight of the coupled MRV2 methods only; the records
    name the weight at T > 0 (where coupling drafts), the serving default when the flag is left out."""
    from ubtree_vllm.bench.report import budget_label
    from ubtree_vllm.config import DEFAULT_COUPLED_EDGE_WEIGHT

    settings = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree-mrv2-lookup", tree_budgets="16",
                                           top_k=16, coupled_edge_weight="1.5"))
    run = ubtree_run(settings, 16, "ubtree-mrv2-lookup")
    assert run.speculative_config["coupled_edge_weight"] == 1.5 and run.coupled_edge_weight == 1.5
    assert ubtree_run(settings, 16, "ubtree-mrv2-lookup-uncoupled").coupled_edge_weight is None
    assert ubtree_run(settings, 16, "ubtree").coupled_edge_weight is None  # the V1 runner does not couple
    result = RunResult(num_requests=8, output_tokens=800, wall_s=1.0, tpot_ms=1.0, tau=3.0, num_drafts=10,
                       num_accepted=20)
    kwargs = dict(target="t", drafter=str(drafter_dir), dataset="mt_bench", concurrency=1, max_new_tokens=100,
                  cuda_graphs=True, speedup=1.5, engine_core="process")
    sampled = rec.append_record(e2e_record(run, result, temperature=1.0, **kwargs), tmp_path / "r.jsonl")
    assert sampled["coupled_edge_weight"] == 1.5 and "coupled edge weight 1.5" in str(budget_label(sampled))
    assert e2e_record(run, result, temperature=0.0, **kwargs)["coupled_edge_weight"] is None
    default = ubtree_run(settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree-mrv2",
                                                     tree_budgets="16", top_k=16)), 16, "ubtree-mrv2")
    assert "coupled_edge_weight" not in default.speculative_config
    assert default.coupled_edge_weight == DEFAULT_COUPLED_EDGE_WEIGHT
    for bad in ("0", "x", "17"):
        with pytest.raises(BenchArgumentError, match="--coupled-edge-weight"):
            settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree-mrv2", tree_budgets="16",
                                        top_k=16, coupled_edge_weight=bad))


def test_tree_attention_modes_run_side_by_side_in_one_invocation(drafter_dir):
    """--tree-attention triton,flash_merge: one engine per tree method, budget and mode (an A/B beside the same ar)."""
    from ubtree_vllm.bench.settings import parse_label

    settings = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ar,ubtree-mrv2", tree_budgets="16,32",
                                           top_k=16, tree_attention="triton,flash_merge"))
    labels = planned_methods(settings)
    assert labels == ["ar", "ubtree-mrv2:16@triton", "ubtree-mrv2:16@flash_merge", "ubtree-mrv2:32@triton",
                      "ubtree-mrv2:32@flash_merge"]
    assert [parse_label(label) for label in labels[:3]] == [("ar", None, "auto"), ("ubtree-mrv2", 16, "triton"),
                                                            ("ubtree-mrv2", 16, "flash_merge")]
    runs = [ubtree_run(settings, 16, "ubtree-mrv2", mode) for mode in settings.tree_attention]
    assert [run.tree_attention for run in runs] == ["triton", "flash_merge"]
    default = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ar,ubtree-mrv2", tree_budgets="16",
                                          top_k=16))
    assert default.tree_attention == ("auto",) and planned_methods(default) == ["ar", "ubtree-mrv2:16"]
    assert parse_label("ubtree-mrv2:16") == ("ubtree-mrv2", 16, "auto")
    for bad, message in (("flash", "--tree-attention: unknown mode 'flash'"),
                         ("triton,triton", "--tree-attention lists a mode twice")):
        with pytest.raises(BenchArgumentError, match=message):
            settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree-mrv2", tree_budgets="16", top_k=16,
                                        tree_attention=bad))
    roots = settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ar,ubtree-mrv2-lookup", tree_budgets="16",
                                        top_k=16, tree_attention="triton,triton_stock_roots"))
    assert planned_methods(roots) == ["ar", "ubtree-mrv2-lookup:16@triton", "ubtree-mrv2-lookup:16@triton_stock_roots"]
    with pytest.raises(BenchArgumentError, match="triton_stock_roots runs on Model Runner V2 only; drop ubtree "):
        settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree,ubtree-mrv2", tree_budgets="16",
                                    top_k=16, tree_attention="triton_stock_roots"))


@pytest.mark.parametrize("overrides,pattern", [
    ({"methods": "ar,medusa"}, r"--methods: unknown method 'medusa'; allowed: ar, ngram, mtp, dflash-chain, ubtree, "
                               r"ubtree-mrv2"),
    ({"methods": "ubtree-mrv2", "tree_budgets": "3"}, r"--tree-budgets: B=3 is below the drafter's block size 4; "
                                                      r"ubtree-mrv2 run on Model Runner V2, which needs B >= gamma"),
    ({"methods": "ubtree,ubtree-mrv2-lookup", "tree_budgets": "3"},
     r"block size 4; ubtree-mrv2-lookup run on Model Runner V2, which needs B >= gamma"),
    ({"methods": "ubtree,ubtree-mrv2-lookup", "tensor_parallel_size": 2},
     r"--tensor-parallel-size > 1: ubtree-mrv2-lookup run on Model Runner V2, which does not support "
     r"tensor parallelism"),
    ({"methods": "ar,ar"}, r"--methods lists a method twice"),
    ({"datasets": "mt_bench,gsm8k"}, r"--datasets: unknown dataset 'gsm8k'; allowed: spec_bench, mt_bench, humaneval, "
                                     r"spec_bench:translation, spec_bench:summarization, spec_bench:qa, "
                                     r"spec_bench:math_reasoning, spec_bench:rag"),
    ({"datasets": "spec_bench:writing"}, r"--datasets: unknown dataset 'spec_bench:writing'"),
    ({"tree_budgets": "16,2000"}, r"--tree-budgets: B=2000 is out of range \[1, 48\] for --beam-width 12, "
                                  r"--top-k 16 and the drafter's block size 4"),
    ({"tree_budgets": "0"}, r"--tree-budgets: B=0 is out of range"),
    ({"tree_budgets": "16,x"}, r"--tree-budgets must be a comma-separated list of integers, got '16,x'"),
    ({"concurrency": "1,0"}, r"--concurrency: each value must be >= 1, got 0"),
    ({"concurrency": ""}, r"--concurrency must be a comma-separated list of integers"),
    ({"temperatures": "0,-1"}, r"--temperatures: each value must be a finite number >= 0, got -1"),
    ({"num_prompts": 0}, r"--num-prompts must be >= 1, got 0"),
    ({"top_k": 600}, r"--top-k must be in \[1, 512\] \(the drafter's vocabulary\), got 600"),
    ({"drafter": None}, r"--drafter is required for --methods ar,dflash-chain,ubtree \(only 'ar', 'ngram' and 'mtp' run "
                        r"without a drafter\)"),
    ({"drafter": None, "methods": "ngram,ubtree"}, r"--drafter is required for --methods ngram,ubtree"),
    ({"ngram_k": 0}, r"--ngram-k must be >= 1, got 0"),
    ({"ngram_lookup_min": 0, "methods": "ngram"}, r"--ngram-lookup-min must be >= 1, got 0"),
    ({"ngram_lookup_max": 1}, r"--ngram-lookup-max must be >= --ngram-lookup-min \(2\), got 1"),
    ({"drafter": "/no/such/drafter"}, r"--drafter: drafter folder not found: /no/such/drafter"),
    ({"budget_schedule": "1-4"}, r"--budget-schedule must be comma-separated FIRST-LAST:BUDGET entries "
                                 r"\(e.g. 1-4:64,5-32:16\), got '1-4'"),
    ({"budget_schedule": "4-1:8"}, r"--budget-schedule: entry '4-1:8' needs 1 <= FIRST <= LAST and BUDGET >= 0"),
    ({"budget_schedule": "1-4:32"}, r"--budget-schedule verifies up to 32 nodes per tree; every --tree-budgets "
                                    r"value must be >= it, got 16"),
    ({"budget_schedule": "1-4:8", "methods": "ar,ngram"}, r"--budget-schedule applies to the tree methods"),
])
def test_bad_e2e_flags_name_the_flag_and_the_allowed_values(drafter_dir, overrides, pattern):
    args = e2e_args(drafter=str(drafter_dir), top_k=16, tree_budgets="16")
    for key, value in overrides.items():
        setattr(args, key, value)
    with pytest.raises(BenchArgumentError, match=pattern):
        settings_from_args(args)


def test_bad_flag_is_a_one_line_cli_error(capsys):
    assert cli.main(["bench", "e2e", "--methods", "ar", "--concurrency", "0"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "ubtree bench: error: --concurrency: each value must be >= 1, got 0"
    assert cli.main(["bench", "e2e", "--methods", "ar,ngram", "--ngram-lookup-min", "5"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "ubtree bench: error: --ngram-lookup-max must be >= --ngram-lookup-min (5), got 4"


def test_ngram_flags_parse_from_the_command_line():
    parser = argparse.ArgumentParser()
    bench_cli._add_e2e_args(parser)
    args = parser.parse_args(["--methods", "ar,ngram", "--ngram-k", "12", "--ngram-lookup-max", "6",
                              "--ngram-lookup-min", "1"])
    settings = settings_from_args(args)
    assert (settings.ngram_k, settings.ngram_lookup_max, settings.ngram_lookup_min) == (12, 6, 1)
    assert ngram_run(settings).speculative_config == {"method": "ngram", "num_speculative_tokens": 12,
                                                      "prompt_lookup_max": 6, "prompt_lookup_min": 1}


def test_mtp_run_is_the_targets_own_chain_without_a_drafter(tmp_path):
    """mtp: vLLM's "method": "mtp" with --mtp-k tokens per round, drafter-free; --mtp-k and --load-format parse and
    are checked; the records of a dummy-weights invocation say so in their target."""
    parser = argparse.ArgumentParser()
    bench_cli._add_e2e_args(parser)
    settings = settings_from_args(parser.parse_args(["--methods", "ar,mtp", "--mtp-k", "3", "--load-format", "dummy"]))
    assert (settings.mtp_k, settings.load_format) == (3, "dummy")
    assert planned_methods(settings) == ["ar", "mtp"]  # no --drafter needed
    run = mtp_run(settings)
    assert run.speculative_config == {"method": "mtp", "num_speculative_tokens": 3}
    assert (run.tree_budget, run.beam_width, run.top_k) == (3, 1, 1) and not run.uses_drafter
    result = RunResult(num_requests=1, output_tokens=32, wall_s=1.0, tpot_ms=3.0, tau=2.0, num_drafts=10,
                       num_accepted=10)
    record = e2e_record(run, result, target="random-qwen3-next (dummy weights)", drafter=None, dataset="mt_bench",
                        temperature=0.0, concurrency=1, max_new_tokens=32, cuda_graphs=False, speedup=1.5,
                        engine_core="process")
    written = rec.append_record(record, tmp_path / "records.jsonl")
    assert written["method"] == "mtp" and written["drafter"] is None and "k=3" in written["notes"]
    with pytest.raises(BenchArgumentError, match="--mtp-k must be >= 1, got 0"):
        validate(E2ESettings(methods=("ar", "mtp"), mtp_k=0))
    with pytest.raises(BenchArgumentError, match="--load-format: unknown load format 'pt'; allowed: auto, dummy"):
        validate(E2ESettings(methods=("ar",), load_format="pt"))
    with pytest.raises(BenchArgumentError, match="--load-format dummy: ubtree-mrv2-lookup load the drafter"):
        validate(E2ESettings(methods=("ar", "ubtree-mrv2-lookup"), load_format="dummy"))


def test_mtp_needs_a_target_with_mtp_layers_and_their_weights(tmp_path):
    """check_mtp_target, before any engine: no MTP layer in config.json, or MTP layers without mtp.* tensors under
    the saved weights, is a clear error naming the fix; --load-format dummy needs no tensors."""
    import json

    from safetensors.torch import save_file

    target = tmp_path / "t"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen3NextForCausalLM"]}))
    save_file({"model.embed_tokens.weight": torch.zeros(2, 2)}, str(target / "model.safetensors"))
    with pytest.raises(BenchArgumentError, match="needs a target with MTP layers"):
        e2e.check_mtp_target(target, "dummy")
    (target / "config.json").write_text(json.dumps({"mtp_num_hidden_layers": 1}))
    with pytest.raises(BenchArgumentError, match="pass --load-format dummy"):
        e2e.check_mtp_target(target, "auto")
    e2e.check_mtp_target(target, "dummy")
    save_file({"mtp.fc.weight": torch.zeros(2, 2)}, str(target / "model-mtp.safetensors"))
    e2e.check_mtp_target(target, "auto")


def test_injected_prompt_sets_skip_the_dataset_check(drafter_dir):
    settings = E2ESettings(drafter=str(drafter_dir), datasets=("toy",), methods=("ar",))
    assert validate(settings, check_datasets=False).datasets == ("toy",)
    with pytest.raises(BenchArgumentError, match="--datasets"):
        validate(settings)


# ---- microbench --------------------------------------------------------------------------

def test_microbench_names_match_the_registry():
    assert tuple(MICROBENCHES) == bench_cli.MICROBENCH_NAMES


def test_draft_postprocess_microbench_on_cpu(drafter_dir, tmp_path, capsys):
    path = tmp_path / "records.jsonl"
    status = cli.main(["bench", "microbench", "--drafter", str(drafter_dir), "--device", "cpu", "--iters", "2",
                       "--warmup", "1", "--tree-budget", "8", "--beam-width", "3", "--top-k", "4",
                       "--records", str(path)])
    assert status == 0
    records = rec.read_records(path)
    assert [r["metric"] for r in records] == ["lm_head_topk_ms", "selector_scoring_ms", "tree_construction_ms",
                                              "draft_postprocess_ms"]
    for r in records:
        assert r["kind"] == "microbench" and r["unit"] == "ms" and r["value"] > 0
        assert (r["tree_budget"], r["beam_width"], r["top_k"], r["block_size"]) == (8, 3, 4, 4)
        assert r["hardware"].startswith("CPU (") and r["drafter"] == str(drafter_dir)
        assert "median over 2 rounds" in r["notes"]
    stages = sum(r["value"] for r in records[:3])
    assert records[3]["value"] == pytest.approx(stages, rel=0.5)
    out = capsys.readouterr().out
    assert "draft_postprocess_ms" in out and "README.md" in out
    assert "## Microbenchmarks" in (tmp_path / "README.md").read_text()


def test_draft_stage_microbench_on_cpu(drafter_dir):
    """Eager drafting stage and the acceptance walk on the CPU (the graphed stage needs CUDA)."""
    rows = run_microbenches(("draft-stage",), MicrobenchSettings(drafter=str(drafter_dir), device="cpu", iters=2,
                                                                   warmup=1, tree_budget=8, beam_width=3, top_k=4))
    assert [r["metric"] for r in rows] == ["draft_stage_eager_ms", "acceptance_ms"]
    assert all(r["value"] > 0 and r["cuda_graphs"] is False and "context 512" in r["notes"] for r in rows)
    with pytest.raises(BenchArgumentError, match="--drafter: drafter folder not found"):
        run_microbenches(("draft-stage",), MicrobenchSettings(drafter="/no/such/drafter", device="cpu"))


def test_grammar_rows_microbench_on_the_default_tokenizer(default_target_dir):
    """Structured output's scheduler rows of a 64-node tree: a host-side ms record; the tree has the stated shape."""
    import random

    from ubtree_vllm.bench.grammar_bench import build_tree

    tokens, parents = build_tree([1, 2, 3], list(range(100, 130)), 64, random.Random(0))
    assert len(tokens) == len(parents) == 64 and tokens[:3] == [1, 2, 3] and parents[:3] == [0, 1, 2]
    assert all(3 <= p <= j for j, p in enumerate(parents) if j >= 3) and all(100 <= t < 130 for t in tokens[3:])
    rows = run_microbenches(("grammar-rows",), MicrobenchSettings(iters=3, warmup=1, tree_budget=64))
    assert [row["method"] for row in rows] == ["ubtree", "ubtree-node-walk"]  # the serving walk and the other
    for row in rows:
        assert (row["metric"], row["unit"], row["tree_budget"]) == ("grammar_rows_ms", "ms", 64) and row["value"] > 0
        assert row["hardware"].startswith("CPU (") and "64-node tree" in row["notes"]
    assert "traverse_draft_tree" in rows[0]["notes"] and "node-by-node" in rows[1]["notes"]


def test_node_by_node_grammar_hides_only_the_matcher():
    from types import SimpleNamespace

    from ubtree_vllm.bench.grammar_bench import NodeByNodeGrammar
    from ubtree_vllm.compat import xgrammar_tree_traversal

    grammar = SimpleNamespace(matcher=SimpleNamespace(traverse_draft_tree=print), is_terminated=lambda: False)
    assert xgrammar_tree_traversal(grammar) is print
    hidden = NodeByNodeGrammar(grammar)
    assert xgrammar_tree_traversal(hidden) is None and hidden.is_terminated() is False


def test_microbench_without_records_and_its_errors(drafter_dir):
    rows = run_microbenches(("draft-postprocess",), MicrobenchSettings(drafter=str(drafter_dir), device="cpu",
                                                                         iters=2, warmup=0, tree_budget=48, top_k=16))
    assert [(r["tree_budget"], r["beam_width"], r["top_k"], r["block_size"]) for r in rows] == [(48, 12, 16, 4)] * 4
    with pytest.raises(BenchArgumentError, match="--which: unknown microbenchmark 'verify'"):
        run_microbenches(("verify",), MicrobenchSettings(drafter=str(drafter_dir)))
    with pytest.raises(BenchArgumentError, match="--drafter: drafter folder not found"):
        run_microbenches(("draft-postprocess",), MicrobenchSettings(drafter="/no/such/drafter", device="cpu"))
    with pytest.raises(BenchArgumentError, match="--tree-budget/--beam-width/--top-k: tree_budget must be in"):
        run_microbenches(("draft-postprocess",), MicrobenchSettings(drafter=str(drafter_dir), device="cpu",
                                                                      tree_budget=64, top_k=2, iters=1))
    with pytest.raises(BenchArgumentError, match="--iters must be >= 1"):
        run_microbenches(("draft-postprocess",), MicrobenchSettings(drafter=str(drafter_dir), iters=0))


def test_agreement_counts_prompts_whose_greedy_output_differs(drafter_dir):
    from types import SimpleNamespace

    from ubtree_vllm.bench.agreement import agreement_record, first_divergence, tokens_in_prompt_order

    assert first_divergence([1, 2, 3], [1, 2, 3]) is None and first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2 and first_divergence([], [4]) == 0
    prompts = [(7, 8), (9,), (7, 8)]
    outs = [SimpleNamespace(prompt_token_ids=list(p), outputs=[SimpleNamespace(token_ids=t)])
            for p, t in (((9,), [3]), ((7, 8), [1]), ((7, 8), [2]))]  # completion order, a repeated prompt
    assert tokens_in_prompt_order(outs, prompts) == [[1], [3], [2]]
    with pytest.raises(ValueError, match=r"no output for prompt\(s\) \[2\]"):
        tokens_in_prompt_order(outs[:2], prompts)
    run = with_served_attention(ubtree_run(E2ESettings(drafter="d", block_size=16), 32, "ubtree-mrv2"), "triton")
    record = agreement_record(run, [[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9], [7]], target="t", drafter="d",
                              dataset="toy", concurrency=1, max_new_tokens=3, cuda_graphs=True, tau=2.5)
    assert (record["metric"], record["value"], record["unit"]) == ("greedy_divergence_rate", 0.66667, "fraction")
    assert "2 of 3 greedy outputs differ" in record["notes"] and "token 0.5" in record["notes"]
    assert record["tree_budget"] == 32 and record["method"] == "ubtree-mrv2" and record["tau"] == 2.5
    assert record["tree_attention"] == "triton"  # the mode the engine served, as in the e2e records
    exact = ubtree_run(E2ESettings(drafter="d", block_size=16), 32, "ubtree-mrv2", tree_attention="flash_exact")
    assert agreement_record(exact, [[1]], [[1]], target="t", drafter="d", dataset="toy", concurrency=1,
                            max_new_tokens=1, cuda_graphs=True, tau=1.0)["tree_attention"] == "flash_exact"
    with pytest.raises(BenchArgumentError, match="add ar to --methods"):
        settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ubtree", tree_budgets="4", top_k=4,
                                    temperatures="0", agreement=True))
    with pytest.raises(BenchArgumentError, match="--temperatures must be 0"):
        settings_from_args(e2e_args(drafter=str(drafter_dir), methods="ar,ubtree", tree_budgets="4", top_k=4,
                                    temperatures="0,1", agreement=True))
    assert settings_from_args(e2e_args(methods="ar,ngram", temperatures="0", agreement=True)).agreement


def test_tree_linear_state_forms_compute_the_same_step():
    """tree-linear-state times two forms of one step: on a small shape (CPU, Triton interpreter) their outputs
    and their commits of the deepest node agree, and that node is as deep as the tree goes."""
    from ubtree_vllm.bench.linear_state_bench import LinearStateShape, deepest_nodes, step_functions, tree_inputs

    inputs = tree_inputs(LinearStateShape("tiny", 2, 16, 8), 2, 24, torch.device("cpu"))
    parents = inputs[5]
    for row, node in zip(parents.tolist(), deepest_nodes(parents).tolist()):
        depth = [0] * len(row)
        for t in range(1, len(row)):
            depth[t] = depth[row[t]] + 1
        assert depth[node] == max(depth) > 1
    caches = {form: torch.zeros_like(inputs[-1]) for form in ("node_states", "paths")}
    outputs = {form: step_functions(inputs, 16 ** -0.5, cache)[form]() for form, cache in caches.items()}
    torch.testing.assert_close(outputs["paths"], outputs["node_states"], rtol=1e-4, atol=1e-4)
    assert caches["node_states"].abs().sum() > 0
    torch.testing.assert_close(caches["paths"], caches["node_states"], rtol=1e-4, atol=1e-4)


# ---- --interleave ------------------------------------------------------------------------

def test_interleave_cuts_prompts_into_chunks_and_rotates_the_engines():
    from ubtree_vllm.bench.interleave import chunk_bounds, chunk_count, turn_order

    assert chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert chunk_bounds(2, 5) == [(0, 1), (1, 2)]  # never an empty chunk
    assert chunk_bounds(7, 1) == [(0, 7)]
    assert [turn_order(3, k) for k in range(4)] == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert chunk_count(48, 4, 1) == 4 and chunk_count(48, 4, 4) == 4  # chunks of 12 >= 2 x 4
    assert chunk_count(48, 4, 16) == 1 and chunk_count(48, 4, 64) == 1  # one chunk: engines alternate by cell
    assert chunk_count(80, 4, 16) == 2


def test_interleaved_notes_give_the_speedup_of_each_chunk():
    from ubtree_vllm.bench.interleave import chunk_speedups

    assert chunk_speedups([300.0, 330.0, 240.0], [100.0, 110.0, 120.0]) == "speedup over ar per chunk: 3.00, 3.00, 2.00"
    assert chunk_speedups([50.0], [0.0]) == "speedup over ar per chunk: -"  # an ar chunk that timed nothing


def test_interleave_flag_is_checked():
    assert settings_from_args(e2e_args(methods="ar,ngram", interleave=4)).interleave == 4
    assert settings_from_args(e2e_args(methods="ar")).interleave == 1
    with pytest.raises(BenchArgumentError, match="--interleave must be >= 1"):
        settings_from_args(e2e_args(methods="ar", interleave=0))
    with pytest.raises(BenchArgumentError, match="--profile and --stage-timing time one engine at a time"):
        settings_from_args(e2e_args(methods="ar", interleave=2, stage_timing=True))


def test_random_hybrid_writes_a_chat_ready_target_and_its_drafter(default_target_dir, tmp_path, monkeypatch):
    """`bench random-hybrid` (shrunk here): a random bf16 hybrid in its family's HF class with the default target's
    tokenizer and vocabulary, an untrained drafter for it, and bench e2e sees a recurrent hybrid (prefix caching off
    for all its engines)."""
    import json

    from transformers import AutoConfig

    from ubtree_vllm.bench import random_hybrid
    from ubtree_vllm.bench.e2e import is_recurrent_hybrid
    from ubtree_vllm.cli import main

    config_name, model_name, fields = random_hybrid.SHAPES["qwen3-next"]
    small = dict(fields, hidden_size=64, intermediate_size=64, num_hidden_layers=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32, layer_types=["linear_attention", "full_attention"], num_experts=2)
    monkeypatch.setitem(random_hybrid.SHAPES, "qwen3-next", (config_name, model_name, small))
    assert main(["bench", "random-hybrid", "--out", str(tmp_path), "--family", "qwen3-next",
                 "--tokenizer-from", str(default_target_dir)]) == 0
    target, drafter = tmp_path / "random-qwen3-next", tmp_path / "random-qwen3-next-drafter"
    config = AutoConfig.from_pretrained(target)
    assert config.architectures == ["Qwen3NextForCausalLM"] and config.dtype == torch.bfloat16
    assert config.vocab_size == AutoConfig.from_pretrained(default_target_dir).vocab_size
    assert (target / "tokenizer.json").is_file() and is_recurrent_hybrid(target)
    drafter_config = json.loads((drafter / "config.json").read_text())
    assert drafter_config["vocab_size"] == config.vocab_size and drafter_config["hidden_size"] == 64
    assert not is_recurrent_hybrid(default_target_dir)
    # its one MTP layer runs vLLM's mtp method on vLLM's random weights only (the HF class saves none for it)
    assert config.mtp_num_hidden_layers == 1
    e2e.check_mtp_target(target, "dummy")
    with pytest.raises(BenchArgumentError, match="no mtp.\\* tensors"):
        e2e.check_mtp_target(target, "auto")
    with pytest.raises(SystemExit):
        main(["bench", "random-hybrid", "--out", str(tmp_path), "--family", "kimi-linear"])
