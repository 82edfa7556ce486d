"""``tree_attention: "flash_exact"`` on the CPU: each row's virtual sequence holds exactly what plain decoding attends
over at that position (a root: its request's context and itself; a tree row: the context, then its root -> row path),
the copies write scratch pages only, and FA3's split counts are plain decoding's (ubtree_vllm/vllm/attention/
exact_rows.py; the FA3 call itself is checked against FA3's lone decode on the GPU, last test)."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from ubtree_vllm.triton_ops.reference import _context_kv, tree_attention_reference
from ubtree_vllm.triton_ops.tree_attention_inputs import make_inputs, random_parents
from ubtree_vllm.vllm.attention.exact_rows import (FA3_DECODE_BLOCK_N, copy_rows_to_scratch, fa3_split_counts,
                                                   max_covered_entries, pages_per_row, plain_split_counts,
                                                   scratch_pages, split_count_slice, virtual_rows,
                                                   virtual_rows_by_kernel)

BLOCK = 16
# Where the copies' Triton kernel runs: the GPU where there is one (a launch cannot take CPU tensors there), else CPU
# tensors under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 for a CPU-only torch)
KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rows_on(rows, device):
    """A VirtualRows with every tensor (tuples of them included) on ``device``."""
    def moved(x):
        if isinstance(x, tuple):
            return tuple(moved(t) for t in x)
        return x.to(device) if isinstance(x, torch.Tensor) else x

    return dataclasses.replace(rows, **{f.name: moved(getattr(rows, f.name)) for f in dataclasses.fields(rows)})


def copy_where_the_kernel_runs(key_cache, value_cache, key, value, rows):
    """copy_rows_to_scratch on this module's CPU tensors, run on KERNEL_DEVICE; the caches are updated in place."""
    if KERNEL_DEVICE.type == "cpu":
        copy_rows_to_scratch(key_cache, value_cache, key, value, rows)
        return

    on_device = rows_on(rows, KERNEL_DEVICE)
    caches = key_cache.to(KERNEL_DEVICE), value_cache.to(KERNEL_DEVICE)
    copy_rows_to_scratch(*caches, key.to(KERNEL_DEVICE), value.to(KERNEL_DEVICE), on_device)
    key_cache.copy_(caches[0].cpu())
    value_cache.copy_(caches[1].cpu())


def tree_requests(seed):
    gen = torch.Generator().manual_seed(seed)
    # contexts with tails of 0, 1, 7 and 15 tokens past a page boundary; deep and bushy trees
    return [(context, random_parents(nodes, 6, 3, gen)) for context, nodes in ((48, 12), (33, 20), (7, 9), (95, 17))]


def covered_step(requests, padding, *, device="cpu", num_heads=6, num_kv_heads=2, head_size=32, dtype=torch.float32,
                 seed=0, scratch_rows=None):
    """A covered uniform-decode-like step as Model Runner V2 hands it to attention: the requests' rows (root first),
    then ``padding`` rows of no request and one padded request (first row the first padding row, no keys); entry m of
    the row buffers = row m (roots and padding: -1); this forward's K/V written at the requests' linear slots (root
    at L, node j at L + j, as vLLM's cache update does); the cache grown by the scratch pages."""
    inputs = make_inputs(requests, device="cpu", num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                         block_size=BLOCK, dtype=dtype, extra_path_pad=0, prefill_rows=0, seed=seed)
    real = inputs.query.shape[0]
    num_rows = real + padding
    gen = torch.Generator().manual_seed(seed + 1)

    def pad(x):
        return torch.cat([x, torch.randn(padding, *x.shape[1:], generator=gen).to(x.dtype)])

    query, key, value = pad(inputs.query), pad(inputs.key), pad(inputs.value)
    entries = inputs.row_index.long()
    row_index = torch.full((num_rows,), -1, dtype=torch.long)
    row_req, row_context_len = torch.zeros(num_rows, dtype=torch.long), torch.zeros(num_rows, dtype=torch.long)
    row_path = torch.full((num_rows, inputs.row_path.shape[1]), -1, dtype=torch.long)
    row_index[entries], row_req[entries] = entries, inputs.row_req.long()
    row_context_len[entries], row_path[entries] = inputs.row_context_len.long(), inputs.row_path.long()
    scratch = scratch_pages(inputs.key_cache.shape[0], BLOCK, row_path.shape[1],
                            max_entries=num_rows if scratch_rows is None else scratch_rows)
    base = torch.cat([inputs.key_cache, inputs.value_cache], dim=-1).transpose(1, 2)  # [nb, H_kv, bs, 2D]
    grown = torch.cat([base, torch.randn(scratch.num_pages, *base.shape[1:], generator=gen).to(dtype)])
    key_cache, value_cache = grown.transpose(1, 2).split(head_size, dim=-1)
    for r, (context, parents) in enumerate(requests):  # this forward's K/V at the linear slots
        first = int(inputs.query_start_loc[r])
        positions = torch.arange(context, context + len(parents))
        pages = inputs.block_table[r, positions // BLOCK].long()
        key_cache[pages, positions % BLOCK] = key[first:first + len(parents)]
        value_cache[pages, positions % BLOCK] = value[first:first + len(parents)]
    starts = torch.cat([inputs.query_start_loc, torch.tensor([real], dtype=torch.int32)])  # + one padded request
    block_table = torch.cat([inputs.block_table, torch.zeros_like(inputs.block_table[:1])])
    seq_lens = torch.cat([inputs.seq_lens, torch.zeros(1, dtype=torch.int32)])
    step = types.SimpleNamespace(
        query=query, key=key, value=value, key_cache=key_cache, value_cache=value_cache, row_index=row_index,
        row_req=row_req, row_context_len=row_context_len, row_path=row_path, block_table=block_table,
        query_start_loc=starts, seq_lens=seq_lens, scratch=scratch, scale=inputs.scale, num_real=real,
        roots=inputs.query_start_loc[:-1].long(), scheduler_pages=inputs.key_cache.shape[0])
    return {name: (t.to(device) if isinstance(t, torch.Tensor) else t) for name, t in vars(step).items()}


def layout(step):
    return virtual_rows(step["row_index"], step["row_req"], step["row_context_len"], step["row_path"],
                        step["block_table"], step["query_start_loc"], step["seq_lens"], step["scratch"], BLOCK)


def expected_attention(step):
    """[T, H, D] fp32: each real row's attention as plain decoding computes it at its position (tree reference: a
    root over its context and itself, a tree row over its context and its path); padding rows NaN."""
    rows, roots = step["row_index"], step["roots"]
    entries = torch.cat([rows[rows >= 0], roots])
    requests = torch.cat([step["row_req"][rows >= 0], torch.arange(roots.shape[0])])
    contexts = torch.cat([step["row_context_len"][rows >= 0],
                          (step["seq_lens"][:-1] - (step["query_start_loc"][1:-1] - step["query_start_loc"][:-2]))])
    paths = torch.cat([step["row_path"][rows >= 0],
                       torch.nn.functional.pad(roots[:, None], (0, step["row_path"].shape[1] - 1), value=-1)])
    out = torch.full(step["query"].shape, float("nan"))
    return tree_attention_reference(step["query"], step["key"], step["value"], step["key_cache"], step["value_cache"],
                                    step["block_table"], entries, requests, contexts, paths, step["scale"], out)


@pytest.mark.parametrize("seed", [0, 1])
def test_each_rows_virtual_sequence_is_what_plain_decoding_attends_over(seed):
    step = covered_step(tree_requests(seed), padding=5, dtype=torch.bfloat16, seed=seed)
    key_cache, value_cache, scratch = step["key_cache"], step["value_cache"], step["scratch"]
    before = key_cache[:scratch.first_page].clone(), value_cache[:scratch.first_page].clone()
    rows = layout(step)
    copy_where_the_kernel_runs(key_cache, value_cache, step["key"], step["value"], rows)

    # only scratch pages were written
    assert torch.equal(key_cache[:scratch.first_page], before[0])
    assert torch.equal(value_cache[:scratch.first_page], before[1])
    num_rows = step["query"].shape[0]
    assert rows.tree.tolist() == (step["row_index"] >= 0).tolist()
    assert rows.root.nonzero().flatten().tolist() == step["roots"].tolist()
    assert rows.cu_seqlens_q.tolist() == list(range(num_rows + 1)) and rows.num_reqs == len(step["roots"]) + 1
    for m in range(num_rows):
        seq_len = int(rows.seq_lens[m])
        seen = _context_kv(key_cache, value_cache, rows.block_table, m, seq_len)
        if rows.tree[m]:
            path, context, request = ([p for p in step["row_path"][m].tolist() if p >= 0],
                                      int(step["row_context_len"][m]), int(step["row_req"][m]))
            # the private pages are the row's own run of scratch pages
            first = scratch.first_page + m * scratch.pages_per_row
            assert rows.block_table[m, context // BLOCK: context // BLOCK + scratch.pages_per_row].tolist() == list(
                range(first, first + scratch.pages_per_row))
        elif rows.root[m]:
            request = int((step["roots"] == m).nonzero())
            path, context = [m], int(step["seq_lens"][request]) - int(
                step["query_start_loc"][request + 1] - step["query_start_loc"][request])
        else:  # padding rows attend to nothing
            assert m >= step["num_real"] and seq_len == 0 and not rows.block_table[m].any()
            continue
        want = _context_kv(key_cache, value_cache, step["block_table"], request, context)
        assert seq_len == context + len(path) and int(rows.request[m]) == request
        assert torch.equal(seen[0], torch.cat([want[0], step["key"][path]]))
        assert torch.equal(seen[1], torch.cat([want[1], step["value"][path]]))

    # attention over the virtual sequences alone is the tree attention of the same rows, bit for bit
    every = torch.arange(num_rows)
    got = tree_attention_reference(
        step["query"], step["key"][:0], step["value"][:0], key_cache, value_cache, rows.block_table,
        torch.where(rows.seq_lens > 0, every, -1), every, rows.seq_lens, torch.full((num_rows, 1), -1), step["scale"],
        torch.full(step["query"].shape, float("nan")))
    torch.testing.assert_close(got, expected_attention(step), equal_nan=True, atol=0, rtol=0)


def test_rows_past_the_scratch_pages_are_left_alone():
    step = covered_step(tree_requests(2)[:2], padding=0, scratch_rows=20)
    rows = layout(step)
    assert rows.tree.tolist() == [bool(i >= 0 and m < 20) for m, i in enumerate(step["row_index"].tolist())]
    # every copy lands inside the scratch pages (the dump page included), none past them
    for pages, _ in (rows.tail_dst, rows.path_dst):
        assert int(pages.min()) >= step["scratch"].first_page and int(pages.max()) == step["scratch"].dump_page
    assert int(rows.block_table.max()) < step["scratch"].dump_page
    copy_where_the_kernel_runs(step["key_cache"], step["value_cache"], step["key"], step["value"], rows)


def test_split_counts_are_plain_decodings_at_each_rows_position():
    # SmolLM2's shape (key blocks of 192, 3 KV heads) on 132 SMs
    alone = types.SimpleNamespace(seq_lens=torch.tensor([1000, 1001, 1160, 0], dtype=torch.int32),
                                  root=torch.tensor([True, False, False, False]), request=torch.tensor([0, 0, 0, 0]),
                                  num_reqs=2)
    # one request: each row as if decoded alone (6 blocks -> 6 splits; 1160 keys -> 7 blocks -> 7 splits); padding 1
    assert plain_split_counts(alone, 64, 3, 132, 32).tolist() == [6, 6, 7, 1]
    assert plain_split_counts(alone, 64, 3, 132, 32).tolist()[:3] == fa3_split_counts(
        alone.seq_lens[:3], 64, 3, 132, alone=True).tolist()
    # two requests of 6 and 40 blocks: blocks per SM ceil(46 * 1.1 * 3 / 132) = 2 for rows of both
    two = types.SimpleNamespace(seq_lens=torch.tensor([1000, 1100, 7680, 7700], dtype=torch.int32),
                                root=torch.tensor([True, False, True, False]), request=torch.tensor([0, 0, 1, 1]),
                                num_reqs=2)
    assert plain_split_counts(two, 64, 3, 132, 32).tolist() == [3, 3, 20, 21]
    # ... which is the scheduler's count for a batch holding the row and the other request's root
    assert plain_split_counts(two, 64, 3, 132, 32)[3] == fa3_split_counts(torch.tensor([1000, 7700]), 64, 3, 132,
                                                                            alone=False)[1]
    assert plain_split_counts(two, 64, 3, 132, 4).tolist() == [3, 3, 4, 4]


def layout_where_the_kernel_runs(*args):
    """virtual_rows_by_kernel (same arguments) run on KERNEL_DEVICE, its tensors brought back to the CPU."""
    rows = virtual_rows_by_kernel(*(a.to(KERNEL_DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
    return rows_on(rows, torch.device("cpu"))


def kernel_layout(step, head_size=64, num_kv_heads=3, sms=132, max_splits=32):
    """A covered step's layout by the kernel, on the CPU (SmolLM2's attention shape and the H100's SMs by default)."""
    names = ("row_index", "row_req", "row_context_len", "row_path", "block_table", "query_start_loc", "seq_lens")
    return layout_where_the_kernel_runs(*(step[n] for n in names), step["scratch"], BLOCK, head_size, num_kv_heads,
                                        sms, max_splits)


def many_requests(count, context, seed):
    """``count`` requests of short random trees at contexts around ``context`` (tails of every length)."""
    gen = torch.Generator().manual_seed(seed)
    return [(context + i % BLOCK, random_parents(1 + i % 4, 3, 2, gen)) for i in range(count)]


def long_contexts(seed):
    """Five requests at 3,000 to 8,000 keys: FA3 split counts of several per sequence."""
    requests = [(3000 + 1237 * i, random_parents(3, 2, 2, torch.Generator().manual_seed(seed + i))) for i in range(5)]
    return covered_step(requests, padding=1, num_heads=2, num_kv_heads=1, head_size=8, seed=seed)


def root_marked_tree(step):
    """``step`` with its second request's root row marked a tree row (a layout MRV2 never hands over, where the torch
    form counts no root for that request): the kernel must agree there too."""
    root = int(step["roots"][1])
    step = dict(step, row_index=step["row_index"].clone(), row_path=step["row_path"].clone())
    step["row_index"][root] = root
    step["row_path"][root, 0] = root
    return step


CASES = ["trees", "cut scratch", "no padding", "70 requests", "132-page contexts", "long contexts", "root marked tree"]


@pytest.mark.parametrize("case", CASES)
def test_the_layout_kernel_is_the_torch_layout(case):
    """virtual_rows_by_kernel (one Triton launch: triton_ops/virtual_rows.py) gives the torch form's every tensor, bit
    for bit and dtype for dtype, and plain_split_counts' split counts: bushy trees with padding rows and a padded
    request, scratch pages for fewer rows than the step has, more requests than one scan chunk (64), block tables
    wider than one column chunk (128), contexts of thousands of keys (split counts of several, which move with the
    batch's total), a root row marked as a tree row."""
    steps = {"trees": lambda: covered_step(tree_requests(0), padding=3, seed=0),
             "cut scratch": lambda: covered_step(tree_requests(1), padding=2, seed=1, scratch_rows=20),
             "no padding": lambda: covered_step(tree_requests(2), padding=0, seed=2),
             "70 requests": lambda: covered_step(many_requests(70, 40, 3), padding=1, num_heads=2, num_kv_heads=1,
                                                 head_size=8, seed=3),
             "132-page contexts": lambda: covered_step(many_requests(3, 132 * BLOCK - 8, 4), padding=2, num_heads=2,
                                                       num_kv_heads=1, head_size=8, seed=4),
             "long contexts": lambda: long_contexts(5),
             "root marked tree": lambda: root_marked_tree(long_contexts(6))}
    step = steps[case]()
    for head_size, num_kv_heads, sms, max_splits in ((64, 3, 132, 32), (128, 8, 132, 32), (128, 8, 2, 4),
                                                     (64, 1, 7, 32)):
        want = layout(step)
        got = kernel_layout(step, head_size, num_kv_heads, sms, max_splits)
        for field in dataclasses.fields(want):
            if field.name in ("split_counts", "num_reqs", "dump_page"):
                continue
            mine, theirs = getattr(got, field.name), getattr(want, field.name)
            pairs = zip(mine, theirs) if isinstance(mine, tuple) else ((mine, theirs),)
            for a, b in pairs:
                assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)) and torch.equal(a, b), field.name
        assert got.num_reqs == want.num_reqs and got.dump_page == want.dump_page == step["scratch"].dump_page
        splits = plain_split_counts(want, head_size, num_kv_heads, sms, max_splits)
        assert got.split_counts.dtype == splits.dtype and torch.equal(got.split_counts, splits)
    if case == "132-page contexts":
        assert step["block_table"].shape[1] > 128
    if case == "70 requests":
        assert step["seq_lens"].shape[0] > 64
    if case == "long contexts":  # the split counts differ from row to row there
        assert len(set(kernel_layout(step, 128, 8, 132, 32).split_counts.tolist())) >= 3
    with pytest.raises(ValueError, match="head_size 96"):
        kernel_layout(step, head_size=96)
    assert FA3_DECODE_BLOCK_N.keys() == {64, 128}


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


def test_only_flash_attention_3_layers_of_known_head_sizes_take_exact_rows():
    from ubtree_vllm.vllm.attention.exact_rows import check_exact_rows_layer

    check_exact_rows_layer(types.SimpleNamespace(vllm_flash_attn_version=3, head_size=128))
    with pytest.raises(NotImplementedError, match=r"needs FlashAttention 3 \(Hopper\); this layer runs "
                                                  r"FlashAttention 2"):
        check_exact_rows_layer(types.SimpleNamespace(vllm_flash_attn_version=2, head_size=64))
    with pytest.raises(NotImplementedError, match=r"supports head sizes \[64, 128\] .* got 96"):
        check_exact_rows_layer(types.SimpleNamespace(vllm_flash_attn_version=3, head_size=96))
    # what FlashAttention's own call passes and the exact rows' call does not (vLLM's FlashAttentionImpl attributes)
    plain = dict(vllm_flash_attn_version=3, head_size=64, sliding_window=(-1, -1), alibi_slopes=None,
                 logits_soft_cap=0, sinks=None, kv_cache_dtype="auto")
    check_exact_rows_layer(types.SimpleNamespace(**plain))
    for feature, value, name in (("sliding_window", (4095, 0), "a sliding window"),
                                 ("alibi_slopes", torch.ones(4), "ALiBi"),
                                 ("logits_soft_cap", 30.0, "a logits soft cap"),
                                 ("sinks", torch.zeros(4), "attention sinks"),
                                 ("kv_cache_dtype", "fp8_e4m3", "a quantized KV cache")):
        with pytest.raises(NotImplementedError, match=rf"this layer uses {name}$"):
            check_exact_rows_layer(types.SimpleNamespace(**{**plain, feature: value}))


def test_auto_takes_exact_rows_where_the_engine_arguments_allow_them():
    from ubtree_vllm.vllm.attention.exact_rows import serves_exact_rows_by_default

    hopper = dict(mrv2=True, capability_major=9, dtype=torch.bfloat16, head_size=64, attention_backend=None,
                  kv_cache_dtype="auto", sliding_window=None)
    assert serves_exact_rows_by_default(**hopper)
    assert serves_exact_rows_by_default(**{**hopper, "dtype": torch.float16, "head_size": 128,
                                           "attention_backend": "FLASH_ATTN"})
    for change in ({"mrv2": False}, {"capability_major": 8}, {"capability_major": 10}, {"capability_major": None},
                   {"dtype": torch.float32}, {"head_size": 96}, {"attention_backend": "TRITON_ATTN"},
                   {"kv_cache_dtype": "fp8"}, {"sliding_window": 4096}):
        assert not serves_exact_rows_by_default(**{**hopper, **change}), change


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


def test_the_flash_attention_impl_computes_every_row_with_one_layout_per_forward(monkeypatch):
    """TreeFlashAttentionImpl._exact_rows with FlashAttention's call played by the paged reference: every real row of
    the forward, roots included, gets plain decoding's attention at its position (context + path, from the layer's
    fresh K/V), in place; the layout is built by the forward's first layer and reused by the others."""
    import sys

    from ubtree_vllm.vllm.attention import exact_rows, flash
    from ubtree_vllm.vllm.attention.flash import TreeFlashAttentionImpl
    from ubtree_vllm.vllm.attention.state import TreeForwardState

    monkeypatch.setitem(sys.modules, "vllm.vllm_flash_attn",
                        types.SimpleNamespace(flash_attn_varlen_func=paged_decode_reference))
    monkeypatch.setattr(exact_rows, "copy_rows_to_scratch", copy_where_the_kernel_runs)
    monkeypatch.setattr(exact_rows, "virtual_rows_by_kernel", layout_where_the_kernel_runs)
    state = TreeForwardState()
    monkeypatch.setattr(flash, "tree_forward_state", lambda: state)
    step = covered_step(tree_requests(3), padding=3, num_heads=4, num_kv_heads=2, head_size=64, seed=3)
    buffers = types.SimpleNamespace(row_index=step["row_index"], row_req=step["row_req"],
                                    row_context_len=step["row_context_len"], row_path=step["row_path"])
    impl = types.SimpleNamespace(scale=step["scale"], num_heads=4, num_kv_heads=2, head_size=64,
                                 ubtree_exact_scratch=step["scratch"])
    metadata = types.SimpleNamespace(block_table=step["block_table"], query_start_loc=step["query_start_loc"],
                                     seq_lens=step["seq_lens"], max_num_splits=0,
                                     max_seq_len=int(step["seq_lens"].max()))
    want = expected_attention(step)
    real = step["num_real"]
    layouts = []
    for _ in range(2):  # two layers of one forward
        output = torch.full(step["query"].shape, float("nan"))
        TreeFlashAttentionImpl._exact_rows(impl, step["query"], step["key"], step["value"], step["key_cache"],
                                           step["value_cache"], metadata, output, buffers)
        layouts.append(state.step_cache[flash._EXACT_ROWS][1][0])
        torch.testing.assert_close(output[:real], want[:real], atol=0, rtol=0)
    assert layouts[0] is layouts[1]


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_exact_rows_are_the_lone_decode_of_each_row_on_gpu(graph):
    """The premise and the code of "flash_exact" at once (H100/H200): SmolLM2's attention shape in bf16, one request
    whose context crosses several FA3 key blocks (so a batch of 65 sequences would split differently from one): every
    row's output from :func:`attend_rows_exactly`, root and tree rows, has the bits of FlashAttention 3 decoding that
    row's sequence alone (its own length as max_seqlen_k, as plain decoding at batch 1 calls it) with vLLM's graph
    cap of 32 splits; also when the layout, the pinned metadata, the copies and the call are captured in a CUDA graph
    and replayed (the engine captures them in its FULL graphs of uniform decode steps)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    from ubtree_vllm.bench.attention_bench import bench_parents
    from ubtree_vllm.vllm.attention.exact_rows import (attend_rows_exactly, check_scheduler_metadata_layout, num_sms,
                                                       pinned_scheduler_metadata)

    device = torch.device("cuda")
    check_scheduler_metadata_layout(device, 9, 3, 64, torch.bfloat16, BLOCK)  # the layout the pinning assumes
    step = covered_step([(1000, bench_parents(0))], padding=3, device=device, num_heads=9, num_kv_heads=3,
                        head_size=64, dtype=torch.bfloat16)
    query, max_seq_len, splits = step["query"], int(step["seq_lens"].max()), 32
    output = torch.zeros_like(query)

    def forward():  # as the FLASH_ATTN impl serves it: the layout kernel, then the pinned metadata
        names = ("row_index", "row_req", "row_context_len", "row_path", "block_table", "query_start_loc", "seq_lens")
        rows = virtual_rows_by_kernel(*(step[n] for n in names), step["scratch"], BLOCK, 64, 3, num_sms(device),
                                      splits)
        metadata = pinned_scheduler_metadata(rows, max_seq_len, 9, 3, 64, torch.bfloat16, BLOCK, splits)
        copy_rows_to_scratch(step["key_cache"], step["value_cache"], step["key"], step["value"], rows)
        attend_rows_exactly(query, step["key_cache"], step["value_cache"], output, rows, step["scale"], max_seq_len,
                            metadata, splits)
        return rows

    if graph:
        forward()  # warm-up outside the capture
        torch.cuda.synchronize()
        captured = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured):
            rows = forward()
        output.zero_()
        captured.replay()
    else:
        rows = forward()
    torch.cuda.synchronize()
    lone = torch.empty_like(output[:1])
    for m in range(step["num_real"]):
        flash_attn_varlen_func(
            q=query[m:m + 1], k=step["key_cache"], v=step["value_cache"], out=lone, max_seqlen_q=1,
            cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32, device=device), max_seqlen_k=int(rows.seq_lens[m]),
            seqused_k=rows.seq_lens[m:m + 1], block_table=rows.block_table[m:m + 1], softmax_scale=step["scale"],
            causal=True, fa_version=3, num_splits=splits)
        differ = (output[m] != lone[0]).float().mean()
        assert torch.equal(output[m], lone[0]), f"row {m}: {differ:.3f} of the elements differ"
