"""``tree_attention: "flash_exact"`` on the CPU: the virtual sequences hold exactly what plain decoding attends over
(the request's context, then the row's root -> row path), in scratch pages only, and FA3's split counts as
predicted (ubtree_vllm/vllm/attention/exact_rows.py; the FA3 call itself runs on the GPU)."""
from __future__ import annotations

import pytest
import torch

from ubtree_vllm.triton_ops.reference import _context_kv, tree_attention_reference
from ubtree_vllm.triton_ops.tree_attention_inputs import make_inputs, random_parents
from ubtree_vllm.vllm.attention.exact_rows import (copy_rows_to_scratch, fa3_split_counts, max_covered_entries,
                                                   pages_per_row, scratch_pages, split_count_slice, virtual_rows)

BLOCK = 16


def with_scratch(inputs, extra_pages):
    """The inputs' cache grown by ``extra_pages`` pages of noise (the pages the scheduler never hands out)."""
    base = torch.cat([inputs.key_cache, inputs.value_cache], dim=-1).transpose(1, 2)  # [nb, H_kv, bs, 2D]
    grown = torch.cat([base, torch.randn(extra_pages, *base.shape[1:], dtype=base.dtype)])
    key_cache, value_cache = grown.transpose(1, 2).split(inputs.key_cache.shape[-1], dim=-1)
    return grown, key_cache, value_cache


def tree_requests(seed):
    gen = torch.Generator().manual_seed(seed)
    # contexts with tails of 0, 1, 7 and 15 tokens past a page boundary; deep and bushy trees
    return [(context, random_parents(nodes, 6, 3, gen)) for context, nodes in ((48, 12), (33, 20), (7, 9), (95, 17))]


def padded_entries(inputs, unused):
    """The inputs' tree rows as row-buffer entries, with ``unused`` entries of -1 between and after them."""
    rows = inputs.row_index.shape[0]
    order = torch.randperm(rows + unused, generator=torch.Generator().manual_seed(1))

    def spread(values, fill):
        out = torch.full((rows + unused, *values.shape[1:]), fill, dtype=values.dtype)
        out[order[:rows]] = values
        return out
    return (spread(inputs.row_index, -1), spread(inputs.row_req, 0), spread(inputs.row_context_len, 0),
            spread(inputs.row_path, -1))


@pytest.mark.parametrize("seed", [0, 1])
def test_each_virtual_sequence_is_its_rows_context_then_its_path(seed):
    inputs = make_inputs(tree_requests(seed), device="cpu", num_heads=6, num_kv_heads=2, head_size=32,
                         block_size=BLOCK, dtype=torch.bfloat16, extra_path_pad=2, prefill_rows=2, seed=seed)
    row_index, row_req, row_context_len, row_path = padded_entries(inputs, unused=5)
    num_entries, path_width = row_path.shape
    scheduler_pages = inputs.key_cache.shape[0]
    scratch = scratch_pages(scheduler_pages, BLOCK, path_width, max_entries=num_entries)
    _, key_cache, value_cache = with_scratch(inputs, scratch.num_pages)
    before = key_cache[:scheduler_pages].clone(), value_cache[:scheduler_pages].clone()

    rows = virtual_rows(row_index, row_req, row_context_len, row_path, inputs.block_table, scratch, BLOCK)
    copy_rows_to_scratch(key_cache, value_cache, inputs.key, inputs.value, rows)

    # only scratch pages were written
    assert torch.equal(key_cache[:scheduler_pages], before[0]) and torch.equal(value_cache[:scheduler_pages], before[1])
    assert rows.valid.tolist() == (row_index >= 0).tolist()
    assert rows.cu_seqlens_q.tolist() == list(range(num_entries + 1))
    for e in range(num_entries):
        if row_index[e] < 0:
            assert rows.seq_lens[e] == 0 and rows.query_rows[e] == 0 and not rows.block_table[e].any()
            continue
        path = [p for p in row_path[e].tolist() if p >= 0]
        context = int(row_context_len[e])
        assert rows.seq_lens[e] == context + len(path) and rows.query_rows[e] == row_index[e]
        seen_k, seen_v = _context_kv(key_cache, value_cache, rows.block_table, e, int(rows.seq_lens[e]))
        want_k, want_v = _context_kv(key_cache, value_cache, inputs.block_table, int(row_req[e]), context)
        assert torch.equal(seen_k, torch.cat([want_k, inputs.key[path]]))
        assert torch.equal(seen_v, torch.cat([want_v, inputs.value[path]]))
        # the private pages are the entry's own run of scratch pages
        private = rows.block_table[e, context // BLOCK: context // BLOCK + scratch.pages_per_row].tolist()
        first = scratch.first_page + e * scratch.pages_per_row
        assert private == list(range(first, first + scratch.pages_per_row))

    # attention over the virtual sequences (no path rows) is the tree attention of the same rows
    valid = rows.valid
    want = tree_attention_reference(*inputs.args(), torch.zeros(inputs.query.shape, dtype=torch.float32))
    entries = torch.arange(num_entries)
    got = tree_attention_reference(
        inputs.query[rows.query_rows], inputs.key[:0], inputs.value[:0], key_cache, value_cache, rows.block_table,
        torch.where(valid, entries, -1), entries, rows.seq_lens, torch.full((num_entries, 1), -1), inputs.scale,
        torch.zeros(num_entries, *inputs.query.shape[1:], dtype=torch.float32))
    assert torch.equal(got[valid], want[rows.query_rows[valid]])


def test_entries_past_the_scratch_pages_are_left_alone():
    inputs = make_inputs(tree_requests(2)[:2], device="cpu", num_heads=4, num_kv_heads=2, head_size=16,
                         block_size=BLOCK, prefill_rows=0, seed=2)
    num_entries, path_width = inputs.row_path.shape
    scheduler_pages = inputs.key_cache.shape[0]
    scratch = scratch_pages(scheduler_pages, BLOCK, path_width, max_entries=num_entries - 3)
    _, key_cache, value_cache = with_scratch(inputs, scratch.num_pages)
    rows = virtual_rows(inputs.row_index, inputs.row_req, inputs.row_context_len, inputs.row_path,
                        inputs.block_table, scratch, BLOCK)
    assert rows.valid.tolist() == [True] * (num_entries - 3) + [False] * 3
    # every copy lands inside the scratch pages (the dump page included), none past them
    for pages, _ in (rows.tail_dst, rows.path_dst):
        assert int(pages.min()) >= scratch.first_page and int(pages.max()) == scratch.dump_page
    assert int(rows.block_table.max()) < scratch.dump_page
    copy_rows_to_scratch(key_cache, value_cache, inputs.key, inputs.value, rows)


def test_scratch_pages_cover_the_widest_uniform_decode_step():
    assert pages_per_row(16, 17) == 2 and pages_per_row(16, 2) == 2 and pages_per_row(16, 1) == 1
    assert pages_per_row(32, 17) == 2 and pages_per_row(128, 17) == 2 and pages_per_row(16, 33) == 3
    schedule = ((1, 8, 64), (9, 16, 32), (17, 32, 16), (33, 1024, 8))
    # max(8 * 65, 16 * 33, 32 * 17, 64 * 9) at 64 requests; capped by the token budget
    assert max_covered_entries(64, schedule, 64, 8192) == 64 * 9
    assert max_covered_entries(64, schedule, 4, 8192) == 4 * 65
    assert max_covered_entries(64, schedule, 256, 2048) == 2048
    assert max_covered_entries(8, None, 16, 8192) == 16 * 9
    assert max_covered_entries(64, ((1, 8, 64), (9, 1024, 0)), 12, 8192) == 8 * 65
    scratch = scratch_pages(1000, 16, 17, 520)
    assert (scratch.first_page, scratch.pages_per_row, scratch.num_pages, scratch.dump_page) == (1000, 2, 1041, 2040)
    # a covered forward of up to 520 rows (8 requests x 65) gets exact rows, a wider one the Triton kernel's
    assert scratch.serves(520) and scratch.serves(65) and not scratch.serves(528)


def test_fa3_split_counts_follow_the_scheduler_alone_and_in_one_batch():
    # SmolLM2's shape: key blocks of 192, 3 KV heads, 132 SMs; blocks [1, 1, 2, 4, 40, 42]
    lens = torch.tensor([1, 192, 193, 600, 7680, 7873], dtype=torch.int32)
    # alone: one block per split while ceil(n * 1.1 * 3 / 132) = 1 (n <= 40; the cap 32 at 40), then 2 (42 -> 21)
    assert fa3_split_counts(lens, 64, 3, 132, alone=True).tolist() == [1, 1, 2, 4, 32, 21]
    # one batch: 90 blocks in all -> ceil(90 * 1.1 * 3 / 132) = 3 blocks per split for every sequence
    assert fa3_split_counts(lens, 64, 3, 132, alone=False).tolist() == [1, 1, 1, 2, 14, 14]
    # Qwen3-8B's shape: key blocks of 128, 8 KV heads; 16 blocks alone -> ceil(16 * 1.1 * 8 / 132) = 2 -> 8 splits
    assert fa3_split_counts(torch.tensor([128, 129, 2048]), 128, 8, 132, alone=True).tolist() == [1, 2, 8]
    assert fa3_split_counts(lens, 64, 3, 132, alone=True, max_splits=1).tolist() == [1] * 6
    assert fa3_split_counts(lens, 64, 3, 132, alone=True).dtype == torch.int32
    with pytest.raises(ValueError, match=r"head_size 96: FA3's decode tile is known here for \[64, 128\]"):
        fa3_split_counts(lens, 96, 3, 132, alone=True)


def test_fa3_split_counts_sit_after_the_rounded_prepare_seqlen_q():
    assert split_count_slice(4) == slice(4, 8)
    assert split_count_slice(5) == slice(8, 13)
    assert split_count_slice(64) == slice(64, 128)


def paged_decode_reference(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                           block_table, scheduler_metadata, fa_version, num_splits):
    """FlashAttention's varlen call for one-query-row sequences, as the torch paged reference (fp32 math)."""
    assert max_seqlen_q == 1 and causal and fa_version == 3 and int(seqused_k.max()) <= max_seqlen_k
    num_seqs = seqused_k.shape[0]
    assert cu_seqlens_q.tolist() == list(range(num_seqs + 1)) and q.shape[0] == num_seqs
    seqs = torch.arange(num_seqs)
    empty = k[0, :0]  # [0, H_kv, D]
    return tree_attention_reference(q, empty, empty, k, v, block_table, torch.where(seqused_k > 0, seqs, -1), seqs,
                                    seqused_k, torch.full((num_seqs, 1), -1), softmax_scale, out)


def test_the_flash_attention_impl_computes_the_covered_rows_once_per_forward_layout(monkeypatch):
    """TreeFlashAttentionImpl._exact_rows with FlashAttention's call played by the paged reference: every tree row of
    the forward gets its tree attention (context + path, from the layer's fresh K/V), every other row keeps what it
    held; the layout is built by the forward's first layer and reused by the others."""
    import sys
    import types

    from ubtree_vllm.vllm.attention import flash
    from ubtree_vllm.vllm.attention.flash import TreeFlashAttentionImpl
    from ubtree_vllm.vllm.attention.state import TreeForwardState

    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn",
                        types.SimpleNamespace(flash_attn_varlen_func=paged_decode_reference))
    state = TreeForwardState()
    monkeypatch.setattr(flash, "tree_forward_state", lambda: state)

    inputs = make_inputs(tree_requests(3), device="cpu", num_heads=4, num_kv_heads=2, head_size=64, block_size=BLOCK,
                         dtype=torch.float32, extra_path_pad=0, prefill_rows=3, seed=3)
    num_tokens = inputs.query.shape[0]
    buffers = types.SimpleNamespace(row_index=torch.full((num_tokens + 4,), -1), row_req=torch.zeros(num_tokens + 4, dtype=torch.long),
                                    row_context_len=torch.zeros(num_tokens + 4, dtype=torch.long),
                                    row_path=torch.full((num_tokens + 4, inputs.row_path.shape[1]), -1))
    tree_rows = inputs.row_index.shape[0]
    buffers.row_index[:tree_rows], buffers.row_req[:tree_rows] = inputs.row_index, inputs.row_req
    buffers.row_context_len[:tree_rows], buffers.row_path[:tree_rows] = inputs.row_context_len, inputs.row_path
    scratch = scratch_pages(inputs.key_cache.shape[0], BLOCK, inputs.row_path.shape[1], max_entries=num_tokens)
    _, key_cache, value_cache = with_scratch(inputs, scratch.num_pages)
    impl = types.SimpleNamespace(scale=inputs.scale, num_heads=4, num_kv_heads=2, head_size=64,
                                 ubtree_exact_scratch=scratch)
    metadata = types.SimpleNamespace(block_table=inputs.block_table, max_num_splits=0,
                                     max_seq_len=int(inputs.seq_lens.max()))
    want = tree_attention_reference(*inputs.args(), torch.full(inputs.query.shape, float("nan")))
    layouts = []
    for _ in range(2):  # two layers of one forward
        output = torch.full(inputs.query.shape, float("nan"))
        TreeFlashAttentionImpl._exact_rows(impl, inputs.query, inputs.key, inputs.value, key_cache, value_cache,
                                           metadata, output, buffers)
        layouts.append(state.step_cache[flash._EXACT_ROWS][1][0])
        torch.testing.assert_close(output, want, equal_nan=True, atol=0, rtol=0)
    assert layouts[0] is layouts[1]


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_exact_rows_are_the_lone_decode_of_each_row_on_gpu(graph):
    """The premise and the code of "flash_exact" at once (H100/H200): for SmolLM2's attention shape in bf16, one request
    whose context crosses several FA3 key blocks (so a batch of 65 rows would split differently from one row), every
    tree row's output from :func:`attend_rows_exactly` has the bits of FlashAttention 3 decoding that row's sequence
    alone (its own length as max_seqlen_k, as plain decoding at batch 1 calls it) with vLLM's graph cap of 32 splits;
    also when the layout, the pinned metadata, the copies and the call are
    captured in a CUDA graph and replayed (the engine captures them in its FULL graphs of uniform decode steps)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from ubtree_vllm.bench.attention_bench import bench_parents
    from ubtree_vllm.vllm.attention.exact_rows import attend_rows_exactly, pinned_scheduler_metadata

    device = torch.device("cuda")
    inputs = make_inputs([(1000, bench_parents(0))], device=device, num_heads=9, num_kv_heads=3, head_size=64,
                         block_size=BLOCK, dtype=torch.bfloat16, extra_path_pad=0, prefill_rows=0, seed=0)
    num_tokens = inputs.query.shape[0]
    entries = torch.full((num_tokens,), -1, dtype=torch.long, device=device)
    row_req, row_context_len = torch.zeros_like(entries), torch.zeros_like(entries)
    row_path = torch.full((num_tokens, inputs.row_path.shape[1]), -1, dtype=torch.long, device=device)
    rows_at = inputs.row_index.long()  # entry m = row m, as Model Runner V2 lays out a covered step
    entries[rows_at], row_req[rows_at] = rows_at, inputs.row_req.long()
    row_context_len[rows_at], row_path[rows_at] = inputs.row_context_len.long(), inputs.row_path.long()
    scratch = scratch_pages(inputs.key_cache.shape[0], BLOCK, row_path.shape[1], max_entries=num_tokens)
    _, key_cache, value_cache = with_scratch(inputs, scratch.num_pages)
    max_seq_len, splits = int(inputs.seq_lens.max()), 32
    output = torch.zeros_like(inputs.query)

    def forward():
        rows = virtual_rows(entries, row_req, row_context_len, row_path, inputs.block_table, scratch, BLOCK)
        metadata = pinned_scheduler_metadata(rows, max_seq_len, 9, 3, 64, torch.bfloat16, BLOCK, splits)
        copy_rows_to_scratch(key_cache, value_cache, inputs.key, inputs.value, rows)
        attend_rows_exactly(inputs.query, key_cache, value_cache, output, rows, inputs.scale, max_seq_len, metadata,
                            splits)
        return rows

    if graph:
        forward()  # warm-up outside the capture
        torch.cuda.synchronize()
        output.zero_()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            rows = forward()
        output.zero_()
        captured.replay()
    else:
        rows = forward()
    torch.cuda.synchronize()
    lone = torch.empty_like(output[:1])
    for m in rows_at.tolist():
        flash_attn_varlen_func(
            q=inputs.query[m:m + 1], k=key_cache, v=value_cache, out=lone, max_seqlen_q=1,
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=device), max_seqlen_k=int(rows.seq_lens[m]),
            seqused_k=rows.seq_lens[m:m + 1], block_table=rows.block_table[m:m + 1], softmax_scale=inputs.scale,
            causal=True, fa_version=3, num_splits=splits)
        assert torch.equal(output[m], lone[0]), f"row {m}: {(output[m] != lone[0]).float().mean():.3f} of the bits differ"
