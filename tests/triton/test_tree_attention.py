"""triton_ops.tree_attention against its torch twin, and the twin against per-branch attention.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (fp32 only):
tests/conftest.py sets ``TRITON_INTERPRET=1`` for CPU-only torch builds before triton is
imported. On CUDA the same cases run on the GPU, plus bf16/fp16 and head size 256.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ubtree_vllm.triton_ops import tree_attention
from ubtree_vllm.triton_ops.reference import context_attention_reference, tree_attention_reference
from ubtree_vllm.triton_ops.tree_attention_inputs import TreeAttentionInputs, make_inputs, random_parents

from kernel_device import CUDA, DEVICE, assert_written_rows


# Per request: (committed context length, parents of its tree nodes, root first).
# Context lengths: empty, shorter than a block, not a multiple of the block size, more than
# one BLOCK_N tile (64 tokens); trees: a star, a deep branch, a chain.
REQUESTS = [
    (0, [-1, 0, 0, 1]),
    (5, [-1, 0, 1, 2, 0, 4]),
    (37, [-1, 0, 0, 0]),
    (70, [-1, 0, 1]),
]


def make_case(requests=REQUESTS, **kwargs) -> TreeAttentionInputs:
    """Requests laid out as vLLM flattens them: 3 prefill rows first, then root + nodes per request."""
    return make_inputs(requests, device=DEVICE, **kwargs)


def run_both(case: TreeAttentionInputs, out_dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel, reference) outputs, both starting from the same NaN-filled buffer."""
    out = torch.full_like(case.query, float("nan"), dtype=out_dtype or case.query.dtype)
    ref = tree_attention_reference(*case.args(), out.clone())
    got = tree_attention(*case.args(), out)
    assert got is out
    return got, ref


def assert_rows_match(got: torch.Tensor, ref: torch.Tensor, case: TreeAttentionInputs, atol: float, rtol: float) -> None:
    assert_written_rows(got, ref, case.row_index, atol, rtol)


@pytest.mark.parametrize("head_size", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_reference(block_size, num_heads, num_kv_heads, head_size):
    case = make_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, block_size=block_size)
    got, ref = run_both(case)
    assert_rows_match(got, ref, case, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [2, 5, 16])
def test_split_context_matches_reference(num_splits):
    """The context split over programs and merged by log-sum-exp gives the rows of one walk: chunks past a
    short context stay empty, the last split adds the path rows, skipped entries stay untouched."""
    gen = torch.Generator().manual_seed(3)
    requests = [(ctx, random_parents(7, 4, 3, gen)) for ctx in (3, 190, 0, 17, 64, 141)]
    for case in (make_case(num_heads=8, num_kv_heads=2, head_size=32),
                 make_case(requests, num_heads=6, num_kv_heads=2, head_size=32)):
        out = torch.full_like(case.query, float("nan"))
        ref = tree_attention_reference(*case.args(), out.clone())
        assert tree_attention(*case.args(), out, num_splits=num_splits) is out
        assert_rows_match(out, ref, case, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(4, 4, 64), (6, 2, 32)])
def test_context_given_by_log_sum_exp_matches_reference(num_heads, num_kv_heads, head_size):
    """The context part from elsewhere (FlashAttention's context-only out + lse; here its torch twin) merged with
    the kernel's path rows gives the whole-row attention; the request with no context (lse +inf) gets the path
    alone; rows that are no tree row stay untouched."""
    gen = torch.Generator().manual_seed(5)
    requests = [*REQUESTS, *((ctx, random_parents(9, 4, 3, gen)) for ctx in (130, 1))]
    case = make_case(requests, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size)
    context_out, context_lse = context_attention_reference(
        case.query, case.key_cache, case.value_cache, case.block_table, case.row_index, case.row_req,
        case.row_context_len, case.scale)
    assert torch.isinf(context_lse).any(), "the empty-context request must reach the kernel"
    out = torch.full_like(case.query, float("nan"))
    ref = tree_attention_reference(*case.args(), out.clone())
    assert tree_attention(*case.args(), out, context_out=context_out, context_lse=context_lse) is out
    assert_rows_match(out, ref, case, atol=1e-4, rtol=1e-4)
    with pytest.raises(AssertionError, match="no context walk to split"):
        tree_attention(*case.args(), out, num_splits=2, context_out=context_out, context_lse=context_lse)


def test_split_count_fills_a_small_grid_only():
    from ubtree_vllm.triton_ops.tree_attention import MAX_SPLITS, SPLIT_CHOICES, auto_num_splits

    assert auto_num_splits(15, 132) == MAX_SPLITS  # SmolLM2 at batch 1, B = 64: 5 tiles x 3 kv heads
    assert auto_num_splits(99, 132) == 2  # 3 wanted: the largest power of two below
    assert auto_num_splits(27, 132) == 8  # 10 wanted
    assert auto_num_splits(132, 132) == auto_num_splits(390, 132) == 1  # a full device: one walk per program
    # only the precompiled counts, for every grid: no split count is compiled at run time
    assert {auto_num_splits(p, 132) for p in range(1, 400)} == set(SPLIT_CHOICES)
    with pytest.raises(AssertionError, match="num_splits"):
        case = make_case()
        tree_attention(*case.args(), torch.empty_like(case.query), num_splits=MAX_SPLITS + 1)


def _compiled_variants(kernel) -> int:
    """How many specialisations of a JIT kernel this process has compiled (over the devices)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:  # older Triton: {device: {key: kernel}}
        return sum(len(c) for c in kernel.cache.values())
    return sum(len(entry[0]) for entry in caches.values())


@pytest.mark.skipif(not CUDA, reason="compilation is a GPU matter (the interpreter compiles nothing)")
def test_no_compile_when_the_row_count_changes():
    """The first launch of a configuration compiles every split variant; later launches whose row counts pick
    other split counts (the eager steps of a server, a prefill beside tree rows) compile nothing."""
    from ubtree_vllm.triton_ops.tree_attention import (SPLIT_CHOICES, _tree_attention_combine_kernel,
                                                       _tree_attention_kernel, auto_num_splits, launch_meta)

    case = make_case(num_heads=6, num_kv_heads=3, head_size=64, dtype=torch.bfloat16)
    args = case.args()
    out = torch.full_like(case.query, float("nan"))
    tree_attention(*args, out)
    before = (_compiled_variants(_tree_attention_kernel), _compiled_variants(_tree_attention_combine_kernel))
    rows_per_tile = launch_meta(2, 64, case.key_cache.shape[1], torch.bfloat16)["ROWS"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    seen = set()
    for tiles in (1, 2, 3, 5, 9, 17, 33, 45, 60):
        rows = tiles * rows_per_tile
        seen.add(auto_num_splits(tiles * 3, sms))
        # more entries, the extra ones unused (-1): the row count a mixed step brings (a prefill beside tree rows)
        pad = rows - case.row_index.shape[0]
        if pad < 0:
            continue
        grow = lambda t, fill: torch.cat([t, torch.full((pad, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)])
        got = torch.full_like(case.query, float("nan"))
        tree_attention(case.query, case.key, case.value, case.key_cache, case.value_cache, case.block_table,
                       grow(case.row_index, -1), grow(case.row_req, 0), grow(case.row_context_len, 0),
                       grow(case.row_path, -1), case.scale, got)
        assert_written_rows(got, out, case.row_index, atol=2e-2, rtol=2e-2)
    assert len(seen) > 1, "the row counts must reach several split counts"
    assert seen <= set(SPLIT_CHOICES)
    after = (_compiled_variants(_tree_attention_kernel), _compiled_variants(_tree_attention_combine_kernel))
    assert after == before, f"compiled at run time: {before} -> {after} (main, combine) variants"


def test_int32_indices_and_no_path_padding():
    case = make_case(index_dtype=torch.int32, extra_path_pad=0)
    got, ref = run_both(case)
    assert_rows_match(got, ref, case, atol=1e-4, rtol=1e-4)


def test_path_longer_than_one_path_tile():
    """A 70-deep chain, only its deepest node: the path spans two BLOCK_N = 64 tiles of fresh rows."""
    case = make_case([(20, [-1] + list(range(69)))], num_heads=2, num_kv_heads=1, head_size=16)
    keep = case.row_index.shape[0] - 1  # only the deepest node: path of 70 rows
    case.row_index, case.row_req = case.row_index[keep:], case.row_req[keep:]
    case.row_context_len, case.row_path = case.row_context_len[keep:], case.row_path[keep:]
    got, ref = run_both(case)
    assert_rows_match(got, ref, case, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_size", [32, 256])
def test_random_tree_wider_than_one_row_tile(head_size):
    """80 nodes with random parents-first parents (a B = 64-sized tree and more): every node's
    ancestors are spread over two BLOCK_N = 64 tiles of fresh rows (three of BLOCK_N = 32 at head
    size 256), each masked per query row by its path's bits in the tile."""
    gen = torch.Generator().manual_seed(5)
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, 80)]
    case = make_case([(9, parents), (0, [-1, 0])], num_heads=4, num_kv_heads=2, head_size=head_size)
    got, ref = run_both(case)
    assert_rows_match(got, ref, case, atol=1e-4, rtol=1e-4)


def test_skipped_entries_of_a_fixed_size_launch():
    """row_index -1 entries (the unused tail of CUDA-graph buffers, interleaved here) are skipped."""
    case = make_case()
    m = case.row_index.shape[0]
    order = torch.arange(2 * m, device=DEVICE)
    real = order % 2 == 0  # entries 0, 2, 4, ... real; 1, 3, 5, ... skipped
    def spread(x, fill):
        full = torch.full((2 * m, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)
        full[real] = x
        return full
    padded = TreeAttentionInputs(**{**case.__dict__, "row_index": spread(case.row_index, -1),
                                    "row_req": spread(case.row_req, 7), "row_context_len": spread(case.row_context_len, 9),
                                    "row_path": spread(case.row_path, 3)})
    out = torch.full_like(case.query, float("nan"))
    got = tree_attention(*padded.args(), out)
    ref = tree_attention_reference(*padded.args(), torch.full_like(case.query, float("nan")))
    assert_rows_match(got, ref, case, atol=1e-4, rtol=1e-4)
    assert_rows_match(ref, tree_attention_reference(*case.args(), torch.full_like(case.query, float("nan"))), case,
                      atol=0, rtol=0)


def test_no_tree_rows_leaves_out_untouched():
    case = make_case()
    empty = case.row_index[:0]
    case.row_index, case.row_req, case.row_context_len = empty, empty, empty
    case.row_path = case.row_path[:0]
    out = torch.full_like(case.query, float("nan"))
    assert tree_attention(*case.args(), out) is out
    assert torch.isnan(out).all()


def test_reference_is_causal_attention_along_each_branch():
    """Independent check of the oracle: a tree row == causal SDPA over context + its branch."""
    case = make_case(num_heads=8, num_kv_heads=2, head_size=16, block_size=16)
    ref = tree_attention_reference(*case.args(), torch.zeros_like(case.query))
    group = 4
    for r in range(case.row_index.shape[0]):
        req, ctx = int(case.row_req[r]), int(case.row_context_len[r])
        slots = [(int(case.block_table[req, p // 16]), p % 16) for p in range(ctx)]
        path = [p for p in case.row_path[r].tolist() if p >= 0]
        k = torch.stack([case.key_cache[b, s] for b, s in slots] + [case.key[p] for p in path])
        v = torch.stack([case.value_cache[b, s] for b, s in slots] + [case.value[p] for p in path])
        q = case.query[path]  # the branch's own queries, last one is the row
        k, v = k.repeat_interleave(group, dim=1).transpose(0, 1), v.repeat_interleave(group, dim=1).transpose(0, 1)
        causal = torch.ones(len(path), ctx + len(path), dtype=torch.bool, device=DEVICE).tril(ctx)
        branch = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=causal, scale=case.scale)
        torch.testing.assert_close(ref[int(case.row_index[r])], branch[:, -1], atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_kernel_matches_reference_half_precision_on_cuda(dtype, head_size, num_heads, num_kv_heads):
    case = make_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=dtype)
    got, ref = run_both(case)
    assert_rows_match(got.float(), ref.float(), case, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(9, 3, 64), (32, 8, 128)])
def test_flash_context_then_path_merge_matches_reference_on_cuda(num_heads, num_kv_heads, head_size):
    """tree_attention "flash_merge": FlashAttention's context-only rows (vllm/attention/flash.py's call) merged
    with the kernel's path rows equal the whole-row reference, as closely as the Triton walk does; a request
    with no context takes the path alone."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    from ubtree_vllm.vllm.attention.flash import committed_context_lens, flash_context_attention

    case = make_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.bfloat16,
                     block_size=16)
    query_lens = case.query_start_loc[1:] - case.query_start_loc[:-1]
    context_out, context_lse = flash_context_attention(
        case.query, case.key_cache, case.value_cache, case.query_start_loc,
        committed_context_lens(case.query_start_loc, case.seq_lens), int(query_lens.max()),
        int(case.seq_lens.max()), case.block_table, case.scale, get_flash_attn_version(head_size=head_size))
    out = torch.full_like(case.query, float("nan"))
    ref = tree_attention_reference(*case.args(), out.clone())
    tree_attention(*case.args(), out, context_out=context_out, context_lse=context_lse)
    assert_rows_match(out.float(), ref.float(), case, atol=2e-2, rtol=2e-2)
    walked, _ = run_both(case)
    merged_err = (out.float() - ref.float()).abs()[case.row_index.long()].max()
    walked_err = (walked.float() - ref.float()).abs()[case.row_index.long()].max()
    assert merged_err <= 2 * walked_err + 1e-3, (merged_err, walked_err)


@pytest.mark.gpu
def test_fp32_output_from_bf16_inputs_on_cuda():
    case = make_case(dtype=torch.bfloat16)
    got, ref = run_both(case, out_dtype=torch.float32)
    assert_rows_match(got, ref, case, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("change,message", [
    (lambda c: setattr(c, "key", c.key.half()), "key dtype torch.float16 != query dtype"),
    (lambda c: setattr(c, "query", c.query.long()), "query dtype must be bf16/fp16/fp32"),
    (lambda c: setattr(c, "query", c.query[..., :32]), "head size mismatch: query 32, key 64"),
    (lambda c: setattr(c, "query", c.query[:, :6]), "GQA needs num_heads (6) divisible by num_kv_heads (4)"),
    (lambda c: setattr(c, "row_path", c.row_path.float()), "row_path must be int32/int64"),
    (lambda c: setattr(c, "row_req", c.row_req[1:]), "row_req must be [M="),
    (lambda c: setattr(c, "query", c.query.transpose(1, 2).contiguous().transpose(1, 2)),
     "query must have a unit last-dim stride"),
    (lambda c: setattr(c, "key_cache", c.key_cache[:, :, :, None]), "key_cache/value_cache must both be"),
])
def test_launcher_contract_errors(change, message):
    case = make_case(num_heads=8, num_kv_heads=4)
    change(case)
    out = torch.empty_like(case.query)
    with pytest.raises(AssertionError) as err:
        tree_attention(*case.args(), out)
    assert message in str(err.value)


def test_head_size_must_be_a_power_of_two():
    case = make_case(head_size=48)
    with pytest.raises(AssertionError, match="power of two >= 16, got 48"):
        tree_attention(*case.args(), torch.empty_like(case.query))


def test_entries_in_any_order_with_tiles_spanning_requests():
    """Six requests (16-row tiles cut through them), entries shuffled so requests interleave."""
    from ubtree_vllm.triton_ops.tree_attention_inputs import random_parents

    gen = torch.Generator().manual_seed(3)
    requests = [(ctx, random_parents(7, 4, 3, gen)) for ctx in (3, 90, 0, 17, 64, 41)]
    case = make_case(requests, num_heads=8, num_kv_heads=2, head_size=32)
    order = torch.randperm(case.row_index.shape[0], generator=gen).to(DEVICE)
    shuffled = TreeAttentionInputs(**{**case.__dict__, "row_index": case.row_index[order], "row_req": case.row_req[order],
                                      "row_context_len": case.row_context_len[order], "row_path": case.row_path[order]})
    got, ref = run_both(shuffled)
    assert_rows_match(got, ref, shuffled, atol=1e-4, rtol=1e-4)


DEVICE_TRITON = Path(sys.prefix) / "device-triton"  # the H200's Triton, put there by scripts/setup_env.sh


@pytest.mark.parametrize("compiler", ["installed", "device"])
def test_kernels_compile_for_hopper_without_a_gpu(compiler):
    """The interpreter accepts more than the compiler, and Triton versions differ in what they reject:
    compile every configuration to an sm_90 cubin with the installed Triton and with the H200's."""
    import subprocess

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if compiler == "device":
        if not (DEVICE_TRITON / "triton").is_dir():
            pytest.skip(f"no device Triton at {DEVICE_TRITON} (run scripts/setup_env.sh)")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DEVICE_TRITON), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "ubtree_vllm.triton_ops.compile_check", "--arch", "90"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("cubin") == 55, proc.stdout
    if compiler == "device":
        assert f"from {DEVICE_TRITON}" in proc.stdout, proc.stdout
