"""`ubtree bench microbench`: the GPU-only entries (tree-attention-vs-flash, verify-forward, projection).

CPU: their pure parts (tree and input builders, config writer, prompts, record assembly),
the `--which` / `--drafter` checks and the error without CUDA. GPU (`gpu` marker): each
entry end to end with tiny iteration counts.
"""
from __future__ import annotations

import json

import pytest
import torch

from ubtree_vllm import cli
from ubtree_vllm.bench import records as rec
from ubtree_vllm.bench.attention_bench import (MAX_DEPTH, TREE_NODES, AttentionTiming, attention_records,
                                               tree_inputs)
from ubtree_vllm.bench.attention_bench import QWEN3_8B_ATTENTION
from ubtree_vllm.bench.attention_numerics import (SMOLLM2_ATTENTION, VERIFY_ROWS, NumericsResult, bf16_ulp,
                                                  linear_layers, linear_records, numerics_records, path_sequences,
                                                  path_sequences_reference, rows_mismatch, ulp_errors)
from ubtree_vllm.bench.fa3_virtual_rows import VirtualRowsResult, virtual_rows_records
from ubtree_vllm.bench.microbench import (MICROBENCHES, MicrobenchSettings, check_selection, parse_which,
                                          run_microbenches, summary_fields)
from ubtree_vllm.bench.settings import BenchArgumentError
from ubtree_vllm.bench.timing import CPU_CLOCK, GRAPH_CLOCK, time_launches
from ubtree_vllm.bench.verify_bench import (CHAIN_TOKENS, QWEN3_8B_CONFIG, TREE_TOKENS, verify_prompts,
                                            verify_records, write_target_config)
from ubtree_vllm.triton_ops.tree_attention_inputs import path_to, random_parents


def full(record):
    return {**dict.fromkeys(rec.FIELDS), **record}


# ---- tree and inputs ---------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(5))
def test_random_parents_are_a_parents_first_tree_within_the_depth_bound(seed):
    parents = random_parents(TREE_NODES, MAX_DEPTH, 12, torch.Generator().manual_seed(seed))
    assert len(parents) == TREE_NODES + 1 and parents[0] == -1
    assert all(0 <= p < j for j, p in enumerate(parents) if j)
    depths = [len(path_to(parents, n)) - 1 for n in range(len(parents))]
    assert max(depths) <= MAX_DEPTH and max(depths) >= 4  # a window of 12 gives a deep, branching tree
    assert len(set(parents[1:])) > 1  # not a chain
    assert parents == random_parents(TREE_NODES, MAX_DEPTH, 12, torch.Generator().manual_seed(seed))


def test_random_parents_respect_a_tight_depth_bound_and_reject_bad_sizes():
    parents = random_parents(30, 2, 30, torch.Generator().manual_seed(0))
    assert max(len(path_to(parents, n)) - 1 for n in range(31)) <= 2
    assert random_parents(0, 3, 1, torch.Generator()) == [-1]
    with pytest.raises(ValueError, match="max_depth >= 1"):
        random_parents(4, 0, 1, torch.Generator())


def test_bench_inputs_are_one_request_with_64_tree_rows_on_a_qwen3_8b_layer():
    inputs = tree_inputs(100, torch.device("cpu"))
    assert inputs.query.shape == (TREE_NODES + 1, 32, 128) and inputs.query.dtype == torch.bfloat16
    assert inputs.key.shape == inputs.value.shape == (TREE_NODES + 1, 8, 128)
    assert inputs.key_cache.shape[1:] == (16, 8, 128)
    assert inputs.row_index.tolist() == list(range(1, TREE_NODES + 1))
    assert inputs.row_req.tolist() == [0] * TREE_NODES and inputs.row_context_len.tolist() == [100] * TREE_NODES
    assert inputs.query_start_loc.tolist() == [0, TREE_NODES + 1] and inputs.seq_lens.tolist() == [165]
    assert inputs.block_table.shape == (1, 11) and inputs.block_table.dtype == torch.int32  # cdiv(165, 16)
    assert len(set(inputs.block_table.flatten().tolist())) == 11
    paths = inputs.row_path.tolist()
    assert inputs.row_path.shape[1] == max(sum(p >= 0 for p in path) for path in paths) <= MAX_DEPTH + 1
    for row, path in zip(inputs.row_index.tolist(), paths):
        path = [p for p in path if p >= 0]
        assert path[0] == 0 and path[-1] == row and path == sorted(path)  # root first, ends at the row


# ---- record assembly ---------------------------------------------------------------------

def test_attention_records_carry_both_times_the_ratio_and_the_shape():
    records = attention_records([AttentionTiming(512, 0.03, 0.02, None, GRAPH_CLOCK),
                                 AttentionTiming(2048, 0.09, 0.045, None, GRAPH_CLOCK)],
                                iters=5, warmup=1, hardware="1x NVIDIA H200")
    assert [(r["metric"], r["value"], r["unit"]) for r in records] == [
        ("tree_attention_ms", 0.03, "ms"), ("flash_attention_ms", 0.02, "ms"), ("tree_attention_over_flash", 1.5, "x"),
        ("tree_attention_ms", 0.09, "ms"), ("flash_attention_ms", 0.045, "ms"), ("tree_attention_over_flash", 2.0, "x")]
    for r in records:
        rec.validate_record(full(r))
        assert "32 query heads, 8 KV heads, head size 128, bfloat16, page size 16" in r["notes"]
        assert r["kind"] == "microbench" and r["tree_budget"] == 64 and r["cuda_graphs"] is True
    # the context length keeps the two lengths apart in the report (target is an identity field)
    assert records[0]["target"] == "qwen3-8b (context 512)" and "context 2048 tokens" in records[3]["notes"]


def test_attention_records_carry_the_flash_merge_time_and_its_ratio():
    records = attention_records([AttentionTiming(512, 0.03, 0.02, None, GRAPH_CLOCK, merge_ms=0.025)],
                                iters=5, warmup=1, hardware="1x NVIDIA H200")
    assert [(r["metric"], r["value"]) for r in records][-2:] == [("flash_merge_ms", 0.025),
                                                                ("flash_merge_over_flash", 1.25)]
    for r in records:
        rec.validate_record(full(r))


def test_attention_records_without_flash_attention_keep_the_triton_time_and_say_why():
    (record,) = attention_records([AttentionTiming(512, 0.03, None, "ImportError: no FA", "eager")],
                                  iters=5, warmup=1, hardware="h")
    assert record["metric"] == "tree_attention_ms" and record["cuda_graphs"] is False
    assert "FlashAttention unavailable, only the Triton time recorded: ImportError: no FA" in record["notes"]


def test_attention_records_carry_flashinfer_times_or_say_why_it_did_not_run():
    ran = attention_records([AttentionTiming(512, 0.03, 0.02, None, GRAPH_CLOCK, merge_ms=0.025, flashinfer_ms=0.03,
                                             flashinfer_plan_ms=0.2)], iters=5, warmup=1, hardware="h")
    assert [(r["metric"], r["value"]) for r in ran][-3:] == [("flashinfer_custom_mask_ms", 0.03),
                                                            ("flashinfer_custom_mask_over_flash", 1.5),
                                                            ("flashinfer_plan_ms", 0.2)]
    missed = attention_records([AttentionTiming(512, 0.03, 0.02, None, GRAPH_CLOCK, merge_ms=0.025,
                                                flashinfer_error="RuntimeError: nvcc not found")],
                               iters=5, warmup=1, hardware="h")
    assert not any(r["metric"].startswith("flashinfer") for r in missed)
    assert "FlashInfer's custom-mask prefill did not run: RuntimeError: nvcc not found" in missed[0]["notes"]


def test_flashinfer_tree_mask_and_page_layout():
    from ubtree_vllm.bench.flashinfer_tree import paged_kv_layout, tree_mask, tree_prefill_plan_args
    from ubtree_vllm.triton_ops.tree_attention_inputs import make_inputs

    mask = tree_mask(3, [-1, 0, 0, 1])
    assert mask.tolist() == [[True, True, True, True, False, False, False],
                             [True, True, True, True, True, False, False],
                             [True, True, True, True, False, True, False],
                             [True, True, True, True, True, False, True]]
    indptr, indices, last = paged_kv_layout(torch.tensor([[7, 2, 9], [4, 5, 6]]), [17, 16], 16)
    assert indptr.tolist() == [0, 2, 3] and indices.tolist() == [7, 2, 4] and last.tolist() == [1, 16]
    requests = [(20, [-1, 0, 1]), (0, [-1, 0])]
    inputs = make_inputs(requests, device="cpu", prefill_rows=0)
    args = tree_prefill_plan_args(inputs, requests, device="cpu")
    assert args["qo_indptr"].tolist() == [0, 3, 5] and args["paged_kv_indptr"].tolist() == [0, 2, 3]
    assert args["custom_mask"].numel() == 3 * 23 + 2 * 2 and args["page_size"] == 16
    with pytest.raises(ValueError, match="prefill_rows=0"):
        tree_prefill_plan_args(make_inputs(requests, device="cpu", prefill_rows=2), requests, device="cpu")


# ---- tree-attention-numerics: the pure parts ---------------------------------------------------------------

def test_bf16_ulp_is_the_spacing_of_bfloat16_at_the_value():
    x = torch.tensor([1.0, 1.5, -0.75, 3.0e-3, 0.0, 2.0 ** 100])
    ulp = bf16_ulp(x)
    assert ulp.tolist()[:3] == [2.0 ** -7, 2.0 ** -7, 2.0 ** -8] and ulp[5] == 2.0 ** 93
    assert ulp[3] == 2.0 ** (-9 - 7) and ulp[4] == 2.0 ** (-126 - 7)  # 3e-3 in [2^-9, 2^-8); zero: smallest normal
    values = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 7
    rounding = ulp_errors(values.bfloat16(), values)
    assert 0.2 < rounding.mean() < 0.3 and rounding.max() <= 0.5  # round-to-nearest: at most half a spacing


@pytest.mark.parametrize("context_len", [0, 32])
def test_path_sequences_hold_each_tree_row_as_a_lone_decode_of_context_then_path(context_len):
    from ubtree_vllm.triton_ops.reference import tree_attention_reference
    from ubtree_vllm.triton_ops.tree_attention_inputs import make_inputs

    parents = random_parents(20, 6, 4, torch.Generator().manual_seed(1))
    inputs = make_inputs([(context_len, parents)], device="cpu", dtype=torch.float32, num_heads=6, num_kv_heads=2,
                         head_size=32, block_size=16, extra_path_pad=0, prefill_rows=0)
    seqs = path_sequences(inputs, context_len)
    depth = [len(path_to(parents, n)) - 1 for n in range(1, len(parents))]
    assert seqs.seq_lens.tolist() == [context_len + d + 1 for d in depth]
    assert torch.equal(seqs.block_table[:, :context_len // 16],
                       inputs.block_table[[0] * 20, :context_len // 16])  # the context's pages, shared
    assert torch.equal(seqs.key_cache[:inputs.key_cache.shape[0]], inputs.key_cache)  # the original cache, then paths'
    rows = inputs.row_index.long()
    tree = tree_attention_reference(*inputs.args(), torch.zeros_like(inputs.query))[rows]
    assert torch.equal(path_sequences_reference(seqs, inputs.scale), tree)  # the same numbers in the same order


def test_path_sequences_need_whole_context_pages_of_one_request():
    from ubtree_vllm.triton_ops.tree_attention_inputs import make_inputs

    inputs = make_inputs([(20, [-1, 0, 1])], device="cpu", prefill_rows=0)
    with pytest.raises(ValueError, match="multiple of the page size 16"):
        path_sequences(inputs, 20)
    with pytest.raises(ValueError, match="committed context 32"):
        path_sequences(inputs, 32)


def test_numerics_records_give_three_errors_and_the_mismatch_per_shape_and_context():
    errors = {"tree": torch.tensor([0.25, 0.5, 1.0]), "merge": torch.tensor([0.25, 0.25, 0.5]),
              "plain": torch.tensor([0.0, 0.5, 0.5])}
    rows = numerics_records([NumericsResult(SMOLLM2_ATTENTION, 512, errors, 0.125)], "1x test GPU")
    assert [(r["metric"], r["value"], r["unit"]) for r in rows] == [
        ("tree_attention_error_ulp", round(1.75 / 3, 5), "ulp"), ("flash_merge_error_ulp", round(1.0 / 3, 5), "ulp"),
        ("plain_attention_error_ulp", round(1.0 / 3, 5), "ulp"), ("tree_plain_mismatch", 0.125, "fraction")]
    assert {r["target"] for r in rows} == {"smollm2-135m (context 512)"}
    assert "9 query heads, 3 KV heads, head size 64" in rows[0]["notes"] and "tree: p99.9" in rows[0]["notes"]
    assert all(full(r)["kind"] == "microbench" for r in rows)


def test_rows_mismatch_counts_the_elements_whose_bits_change_with_the_row_count(monkeypatch):
    x = torch.randint(-3, 4, (65, 32)).float()
    weight = torch.randint(-3, 4, (48, 32)).float()
    assert rows_mismatch(x, weight, 17) == 0.0  # small integers: every sum is exact in any order
    linear = torch.nn.functional.linear

    def batch_dependent(rows, w):  # a library whose multi-row kernel rounds the first output column differently
        out = linear(rows, w)
        if rows.shape[0] > 1:
            out[:, 0] += 1
        return out

    monkeypatch.setattr(torch.nn.functional, "linear", batch_dependent)
    assert rows_mismatch(x, weight, 9) == pytest.approx(1 / 48)


def test_linear_records_cover_each_layer_of_the_shape_at_each_verification_width():
    assert linear_layers(SMOLLM2_ATTENTION) == {"qkv_proj": (576, 960), "o_proj": (576, 576),
                                                "gate_up_proj": (576, 3072), "down_proj": (1536, 576)}
    assert linear_layers(QWEN3_8B_ATTENTION)["qkv_proj"] == (4096, 6144)
    rows = linear_records(SMOLLM2_ATTENTION, torch.device("cpu"), "CPU (test)")
    assert [r["target"] for r in rows[:3]] == [f"smollm2-135m qkv_proj (rows {m})" for m in VERIFY_ROWS]
    assert len(rows) == 12 and {r["metric"] for r in rows} == {"linear_rows_mismatch"}
    assert all(0 <= r["value"] <= 1 and r["unit"] == "fraction" for r in rows)


@pytest.mark.parametrize("name", ["tree-attention-numerics", "fa3-virtual-rows"])
def test_numerics_entries_refuse_contexts_off_the_page_size(name):
    with pytest.raises(BenchArgumentError, match=f"multiple of the page size 16 for {name}"):
        MICROBENCHES[name].run(MicrobenchSettings(context_lens=(512, 100)))


def test_virtual_rows_records_give_both_mismatches_and_say_whether_the_layout_held():
    held = VirtualRowsResult("smollm2-135m", 512, 0.25, 0.0, True, (1, 3))
    rows = virtual_rows_records([held, VirtualRowsResult("qwen3-8b", 2048, 0.5, 0.125, False, (2, 8))], "1x GPU")
    assert [(r["target"], r["metric"], r["value"]) for r in rows] == [
        ("smollm2-135m (context 512)", "virtual_batch_mismatch", 0.25),
        ("smollm2-135m (context 512)", "virtual_batch_pinned_mismatch", 0.0),
        ("qwen3-8b (context 2048)", "virtual_batch_mismatch", 0.5),
        ("qwen3-8b (context 2048)", "virtual_batch_pinned_mismatch", 0.125)]
    assert "lone split counts 1-3" in rows[0]["notes"] and "metadata held the predicted" in rows[0]["notes"]
    assert "did NOT hold" in rows[2]["notes"]
    assert all(full(r)["kind"] == "microbench" and r["unit"] == "fraction" for r in rows)


def test_write_target_config_is_qwen3_8b(tmp_path):
    config = json.loads((write_target_config(tmp_path / "t") / "config.json").read_text())
    expected = {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936, "rope_theta": 1000000,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
                "torch_dtype": "bfloat16", "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert {k: config[k] for k in expected} == expected
    small = json.loads((write_target_config(tmp_path / "s", {"num_hidden_layers": 2}) / "config.json").read_text())
    assert small == {**QWEN3_8B_CONFIG, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match="unknown Qwen3 config field"):
        write_target_config(tmp_path / "x", {"num_layers": 2})


def test_verify_prompts_share_the_prefix_and_start_their_new_tokens_distinctly():
    prefix, prompts = verify_prompts(64, (CHAIN_TOKENS, TREE_TOKENS), 6, 1000)
    assert len(prefix) == 64 and set(prompts) == {17, 65}
    firsts = []
    for n, group in prompts.items():
        assert len(group) == 6
        for prompt in group:
            assert len(prompt) == 64 + n and prompt[:64] == prefix and all(0 <= t < 1000 for t in prompt)
            firsts.append(prompt[64])
    assert len(set(firsts)) == 12
    with pytest.raises(ValueError, match="distinct first tokens"):
        verify_prompts(8, (17, 65), 6, 10)


def test_verify_records_report_both_medians_and_the_ratio():
    records = verify_records({17: 20.0, 65: 25.0}, context_len=1024, iters=20, warmup=3, hardware="1x NVIDIA H200",
                             min_cache_hits=1024)
    assert [(r["metric"], r["value"], r["unit"]) for r in records] == [
        ("verify_forward_chain17_ms", 20.0, "ms"), ("verify_forward_tree65_ms", 25.0, "ms"),
        ("tree_verify_over_chain16", 1.25, "x")]
    for r in records:
        rec.validate_record(full(r))
        assert r["target"] == "qwen3-8b-dummy (context 1024)" and r["cuda_graphs"] is True
        assert "cache hits per timed request: at least 1024 tokens" in r["notes"]


def test_summary_fields_show_only_the_fields_a_record_sets():
    assert summary_fields({"target": "t", "tree_budget": 64, "beam_width": None, "top_k": None, "block_size": 16,
                           "hardware": "h"}) == "target=t B=64 gamma=16, h"


def test_time_launches_on_cpu_gives_one_sample_per_iteration():
    calls = []
    times, clock = time_launches(lambda: calls.append(1), torch.device("cpu"), iters=3, warmup=2)
    assert len(times) == 3 and len(calls) == 5 and clock == CPU_CLOCK and all(t >= 0 for t in times)
    with pytest.raises(ValueError, match="iters must be >= 1"):
        time_launches(lambda: None, torch.device("cpu"), iters=0, warmup=0)


# ---- --which and --drafter ---------------------------------------------------------------

def test_which_all_is_every_entry_and_only_the_drafter_entries_need_the_drafter():
    assert parse_which("all") == tuple(MICROBENCHES) == ("draft-postprocess", "tree-attention-vs-flash",
                                                         "tree-attention-numerics", "fa3-virtual-rows",
                                                         "verify-forward", "draft-stage", "projection", "grammar-rows",
                                                         "tree-linear-state")
    assert parse_which("verify-forward, draft-postprocess") == ("verify-forward", "draft-postprocess")
    assert [n for n, m in MICROBENCHES.items() if m.uses_drafter] == ["draft-postprocess", "draft-stage"]
    assert [n for n, m in MICROBENCHES.items() if m.gpu_only] == ["tree-attention-vs-flash", "tree-attention-numerics",
                                                                  "fa3-virtual-rows", "verify-forward", "projection",
                                                                  "tree-linear-state"]


@pytest.mark.parametrize("names,pattern", [
    (("verify",), r"--which: unknown microbenchmark 'verify'; allowed: draft-postprocess, tree-attention-vs-flash, "
                  r"tree-attention-numerics, fa3-virtual-rows, verify-forward, draft-stage, projection, grammar-rows, "
                  r"tree-linear-state, all"),
    (("draft-postprocess", "draft-postprocess"), r"--which lists a microbenchmark twice"),
    (("draft-postprocess",), r"--drafter is required for --which draft-postprocess"),
])
def test_bad_selection_names_the_flag(names, pattern):
    with pytest.raises(BenchArgumentError, match=pattern):
        check_selection(names, MicrobenchSettings(device="cpu"))


def test_bad_which_value_is_a_one_line_cli_error(capsys):
    assert cli.main(["bench", "microbench", "--which", "draft-postprocess,", "--no-record"]) == 1
    assert capsys.readouterr().err.strip() == ("ubtree bench: error: --which must be a comma-separated list of "
                                               "microbenchmark names, got 'draft-postprocess,'")
    assert cli.main(["bench", "microbench", "--no-record"]) == 1  # default entry, no --drafter
    assert capsys.readouterr().err.strip() == ("ubtree bench: error: --drafter is required for --which "
                                               "draft-postprocess")


@pytest.mark.parametrize("name", ["tree-attention-vs-flash", "tree-attention-numerics", "fa3-virtual-rows",
                                  "verify-forward", "projection", "tree-linear-state"])
def test_gpu_only_entries_name_themselves_without_cuda_and_run_nothing(name, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "records.jsonl"
    with pytest.raises(BenchArgumentError, match=rf"^--which {name} needs a CUDA device \(torch.cuda.is_available"):
        run_microbenches(("draft-postprocess", name), MicrobenchSettings(drafter="unused", device="cpu"), path)
    assert not path.exists()  # checked before draft-postprocess ran
    with pytest.raises(BenchArgumentError, match=rf"--which {name} needs a CUDA device"):
        MICROBENCHES[name].run(MicrobenchSettings())


def test_gpu_only_entries_refuse_device_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(BenchArgumentError, match="--which verify-forward needs a CUDA device, got --device cpu"):
        check_selection(("verify-forward",), MicrobenchSettings(device="cpu"))


# ---- GPU ---------------------------------------------------------------------------------

@pytest.mark.gpu
def test_tree_attention_vs_flash_on_gpu(tmp_path):
    rows = run_microbenches(("tree-attention-vs-flash",),
                            MicrobenchSettings(iters=3, warmup=1, context_lens=(64, 300)), tmp_path / "r.jsonl")
    assert rec.read_records(tmp_path / "r.jsonl") == rows
    metrics = [r["metric"] for r in rows]
    assert metrics.count("tree_attention_ms") == 2 and all(r["value"] > 0 for r in rows)
    if "flash_attention_ms" not in metrics:
        pytest.fail(f"FlashAttention did not run on this GPU: {rows[0]['notes']}")
    per_context = ["tree_attention_ms", "flash_attention_ms", "tree_attention_over_flash", "flash_merge_ms",
                   "flash_merge_over_flash"]
    if "flashinfer_custom_mask_ms" in metrics:  # where FlashInfer could compile its kernel
        per_context += ["flashinfer_custom_mask_ms", "flashinfer_custom_mask_over_flash", "flashinfer_plan_ms"]
    assert metrics == per_context * 2


@pytest.mark.gpu
def test_tree_attention_numerics_on_gpu(tmp_path):
    rows = run_microbenches(("tree-attention-numerics",), MicrobenchSettings(context_lens=(64,)), tmp_path / "r.jsonl")
    per_case = ["tree_attention_error_ulp", "flash_merge_error_ulp", "plain_attention_error_ulp", "tree_plain_mismatch"]
    assert [r["metric"] for r in rows] == per_case * 2 + ["linear_rows_mismatch"] * 24  # 2 shapes x 4 layers x 3 M
    assert all(0 <= r["value"] <= 1 for r in rows[8:])
    assert [r["target"] for r in rows[::4]] == ["qwen3-8b (context 64)", "smollm2-135m (context 64)"]
    errors = [r["value"] for r in rows if r["unit"] == "ulp"]
    assert all(0 < e < 4 for e in errors), errors  # bf16 outputs of an fp32-accumulating kernel: about 1/4 ulp


@pytest.mark.gpu
def test_fa3_virtual_rows_on_gpu(tmp_path):
    rows = run_microbenches(("fa3-virtual-rows",), MicrobenchSettings(context_lens=(512,)), tmp_path / "r.jsonl")
    assert [r["metric"] for r in rows] == ["virtual_batch_mismatch", "virtual_batch_pinned_mismatch"] * 2
    assert all(0 <= r["value"] <= 1 for r in rows)
    print("\n".join(f"{r['target']} {r['metric']} {r['value']}: {r['notes']}" for r in rows))


@pytest.mark.gpu
def test_verify_forward_on_gpu_with_a_two_layer_target():
    rows = run_microbenches(("verify-forward",), MicrobenchSettings(
        iters=2, warmup=1, verify_config_overrides={"num_hidden_layers": 2},
        verify_engine_kwargs={"gpu_memory_utilization": 0.4}))
    assert [r["metric"] for r in rows] == ["verify_forward_chain17_ms", "verify_forward_tree65_ms",
                                           "tree_verify_over_chain16"]
    assert all(r["value"] > 0 for r in rows) and rows[0]["target"].startswith("qwen3-8b-dummy num_hidden_layers=2")
    assert "at least 1024 tokens" in rows[0]["notes"]


@pytest.mark.gpu
def test_projection_on_gpu_with_a_four_layer_target():
    from ubtree_vllm.bench.projection import TARGET, run_projection

    rows = list(run_projection(target_overrides={"num_hidden_layers": 4}, engine_kwargs={"gpu_memory_utilization": 0.4},
                               budgets=(16,), concurrency=(1,), num_prompts=2, new_tokens=16))
    assert [(r["metric"], r["tree_budget"], r["concurrency"]) for r in rows] == [("round_over_plain_step", 16, 1)]
    assert rows[0]["value"] > 0 and rows[0]["target"] == TARGET and rows[0]["drafter"] == "untrained"
    assert rows[0]["method"] == "ubtree-mrv2-lookup" and "projection input" in rows[0]["notes"]
