"""Tree-mask attention of speculative tree rows over a paged KV cache plus fresh path K/V.

Tree row r (a non-root node of a draft tree) must attend to exactly what a
non-speculative decode at that node would see:

* the committed context: positions 0 .. row_context_len[r] - 1 of request row_req[r],
  read from the paged cache through ``block_table[row_req[r]]``;
* its ancestors-or-self: the fresh K/V rows ``key/value[row_path[r, j]]`` of this forward,
  for the valid (>= 0) entries of the root-first, -1 padded path.

Design: the tree rows of one request share their whole committed context, so a program
takes a tile of ``ROWS`` consecutive entries for one kv head and flattens (entry, query head
of the GQA group, padded to ``GROUP_PAD``) into ``BLOCK_M = ROWS * GROUP_PAD`` (64; 32 for
head size 256) query vectors. For each request present in the tile (entries of a request are
adjacent in the plan's layout, so a tile holds one or two; any order is still correct) it
runs one online softmax (fp32 max / sum / accumulator, base-2 exponent) over that request's
context in tiles of ``BLOCK_N`` tokens -- each K/V tile is loaded once for all the request's
query vectors of the tile, and each token's block id and offset come from the block table, so
any block size and any (shuffled) table works -- then over this forward's fresh K/V rows from
the request's root (path entry 0) to its deepest path row, again in dense ``BLOCK_N`` tiles,
each query vector masked to the rows of its own path (-1 entries match no row), and writes
``acc / sum`` into ``out[row_index]`` for that request's vectors. Rows of ``out`` not in
``row_index`` are never touched. A row with nothing to attend to (not produced by the plan:
its path always holds the row itself) gets zeros. Entries with ``row_index == -1`` are
skipped: a CUDA graph captures one launch over fixed-size buffers (one entry per token of
the forward) and each replay fills only the step's tree rows.

Split context. At batch 1 that grid is tiny (SmolLM2 at B = 64: 5 tiles x 3 kv heads, 15
programs on 132 SMs) and each program walks the whole context, so the launch takes as long as
one sequential walk. When the grid has fewer programs than the device has SMs, the launcher
gives it ``NUM_SPLITS`` programs per tile and head (a third grid axis): all but the last split
every request's context into ``BLOCK_N``-aligned chunks, and the last walks this forward's path
rows alone, beside them rather than after one of them. Each program writes its unnormalised
partial (running max and sum in base 2, fp32 accumulator) to a scratch buffer, and
``_tree_attention_combine_kernel`` merges the splits of each live entry and head by
log-sum-exp into ``out``. The split count depends on host-known shapes only (M, H_kv, the SM
count), so a captured graph replays the same launches; with one split the kernel writes ``out``
itself, as before. The count is a power of two (``SPLIT_CHOICES``), and the first launch of a
configuration compiles all of them: steps outside CUDA graphs (a prefill beside tree rows) have
row counts of their own, and on the H200 (2026-12-03 sweep) each new count compiled mid-serving
plausibly made 4 and 8 requests in flight slower than 1 on the first dataset measured there.

Context given (``context_out`` / ``context_lse``). When another kernel already attended every
row to its committed context -- FlashAttention called with the context lengths as ``seqused_k``,
not causal, returning its log-sum-exp -- the kernel skips (a): each query vector's running state
starts as that partial (max = lse in base 2, sum 1, accumulator = the normalised output, which
is the same online-softmax state), then (b) adds the path rows and normalises. A non-finite lse
(FlashAttention reports +inf for a row with no keys) starts empty. One split: the context walk
it would split is not there.

The launcher reads no device value (no host sync); the grid is ``(cdiv(M, ROWS), H_kv, NUM_SPLITS)``.
Test oracle: :func:`ubtree_vllm.triton_ops.reference.tree_attention_reference`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

try:  # Triton is optional at import time: CPU-only installs can import this module.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    @triton.jit
    def _online_softmax_tile(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
        """Fold one K/V tile into the running (max, sum, acc); all statistics in base 2.

        q [M, D]; k, v [N, D]; valid: bool, [M, N] or broadcastable to it; m_i, l_i [M] fp32;
        acc [M, D] fp32. Returns the updated (m_i, l_i, acc).
        """
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [M, N]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: m_i starts at -1e30
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # masked entries: exp2(-inf) = 0
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _bit_or(a, b):
        """Combine function of an OR-reduction (tl.reduce)."""
        return a | b

    # Per-step values are not specialised on (Triton would compile a variant per value class at run time):
    # the entry count and the split-partial strides that scale with it.
    @triton.jit(do_not_specialize=["num_entries", "stride_pa_split", "stride_pm_split", "stride_cl_h"])
    def _tree_attention_kernel(
            # Outputs
            out_ptr, stride_out_t, stride_out_h,
            # Inputs
            query_ptr, stride_q_t, stride_q_h,
            key_ptr, stride_k_t, stride_k_h,
            value_ptr, stride_v_t, stride_v_h,
            key_cache_ptr, stride_kc_block, stride_kc_slot, stride_kc_h,
            value_cache_ptr, stride_vc_block, stride_vc_slot, stride_vc_h,
            block_table_ptr, stride_bt_req,
            row_index_ptr, row_req_ptr, row_context_len_ptr,
            row_path_ptr, stride_path_row,
            # Split partials (NUM_SPLITS > 1): acc [S, M, H, D] fp32, (max, sum) [S, M, H, 2] fp32
            part_acc_ptr, stride_pa_split, stride_pa_entry, stride_pa_h,
            part_ml_ptr, stride_pm_split, stride_pm_entry, stride_pm_h,
            # Context given (CONTEXT_GIVEN): normalised output [T, H, D] and natural log-sum-exp [H, T] per row
            ctx_out_ptr, stride_co_t, stride_co_h, ctx_lse_ptr, stride_cl_h, stride_cl_t,
            # Scalars
            qk_scale, num_entries, path_len,
            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, ROWS: tl.constexpr, HEAD_SIZE: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
            NUM_SPLITS: tl.constexpr, CONTEXT_GIVEN: tl.constexpr, PATH_PAD: tl.constexpr):
        tl.static_assert(BLOCK_N <= 64, "a path row tile is one 64-bit mask per query vector")
        # One tile = ROWS consecutive entries x the GROUP query heads of one kv head, flattened
        # into BLOCK_M = ROWS * GROUP_PAD query vectors m = (entry e(m), head g(m)).
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)  # this program's chunk of each request's context; the last one adds the path
        offs_m = tl.arange(0, ROWS * GROUP_PAD)
        entry = tile * ROWS + offs_m // GROUP_PAD  # [BLOCK_M]
        g = offs_m % GROUP_PAD
        in_range = entry < num_entries
        row = tl.load(row_index_ptr + entry, mask=in_range, other=-1).to(tl.int64)
        live = row >= 0  # row_index -1: an unused entry of a fixed-size (CUDA-graph) launch
        row = tl.where(live, row, 0)
        req = tl.load(row_req_ptr + entry, mask=live, other=0).to(tl.int64)
        heads = kv_head * GROUP + g
        offs_d = tl.arange(0, HEAD_SIZE)
        q = tl.load(query_ptr + row[:, None] * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :],
                    mask=(live & (g < GROUP))[:, None], other=0.0)  # [BLOCK_M, D]
        offs_n = tl.arange(0, BLOCK_N)
        no_req = tl.full([], 1 << 62, tl.int64)
        # The tile's requests one after the other (entries of a request are usually adjacent,
        # so a tile holds one or two): every query vector of request `cur` shares its context tiles.
        cur = tl.min(tl.where(live, req, no_req), axis=0)
        while cur < no_req:
            sel = live & (req == cur)  # [BLOCK_M]
            context_len = tl.max(tl.where(sel, tl.load(row_context_len_ptr + entry, mask=sel, other=0), 0),
                                 axis=0).to(tl.int32)
            m_i = tl.full([ROWS * GROUP_PAD], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([ROWS * GROUP_PAD], dtype=tl.float32)
            acc = tl.zeros([ROWS * GROUP_PAD, HEAD_SIZE], dtype=tl.float32)
            if CONTEXT_GIVEN:  # (a) done elsewhere: its partial is the starting state (module docstring)
                vec = sel & (g < GROUP)
                lse = tl.load(ctx_lse_ptr + heads * stride_cl_h + row * stride_cl_t, mask=vec,
                              other=float("inf")).to(tl.float32)  # [BLOCK_M]
                some = (lse > -1.0e30) & (lse < 1.0e30)  # NaN compares false: starts empty too
                o_ctx = tl.load(ctx_out_ptr + row[:, None] * stride_co_t + heads[:, None] * stride_co_h
                                + offs_d[None, :], mask=(vec & some)[:, None], other=0.0).to(tl.float32)
                m_i = tl.where(some, lse * 1.4426950408889634, m_i)
                l_i = tl.where(some, 1.0, l_i)
                acc = tl.where(some[:, None], o_ctx, acc)
                ctx_hi = 0  # no context walk below
                ctx_lo = 0
            else:
                # (a) this split's chunk of the committed context, BLOCK_N tokens at a time through the block table.
                # With several splits the last one takes no context (its chunk starts past it): it walks the path
                # rows alone, beside the context chunks instead of after one of them.
                chunk = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS - 1 if NUM_SPLITS > 1 else 1), BLOCK_N) * BLOCK_N
                ctx_lo = split * chunk
                ctx_hi = tl.minimum(context_len, ctx_lo + chunk)
            for start in range(ctx_lo, ctx_hi, BLOCK_N):
                pos = start + offs_n  # [BLOCK_N]
                valid = pos < ctx_hi
                block_id = tl.load(block_table_ptr + cur * stride_bt_req + pos // BLOCK_SIZE,
                                   mask=valid, other=0).to(tl.int64)
                slot = pos % BLOCK_SIZE
                k = tl.load(key_cache_ptr + (block_id * stride_kc_block + slot * stride_kc_slot
                                             + kv_head * stride_kc_h)[:, None] + offs_d[None, :],
                            mask=valid[:, None], other=0.0)  # [BLOCK_N, D]
                v = tl.load(value_cache_ptr + (block_id * stride_vc_block + slot * stride_vc_slot
                                               + kv_head * stride_vc_h)[:, None] + offs_d[None, :],
                            mask=valid[:, None], other=0.0)
                m_i, l_i, acc = _online_softmax_tile(q, k, v, valid[None, :], m_i, l_i, acc, qk_scale,
                                                     DOT_PRECISION)
            # (b) ancestors-or-self among this forward's rows, as tiles of BLOCK_N rows from the root
            # (path entry 0) to the deepest path row of the request's vectors, each vector masked to
            # the rows of its own path: dense tiles instead of one dependent gather per path entry.
            # Only in the last split.
            if split == NUM_SPLITS - 1:
                # the vectors' paths, loaded once ([BLOCK_M, PATH_PAD] int32 rows, -1 padded)
                offs_p = tl.arange(0, PATH_PAD)
                path = tl.load(row_path_ptr + entry[:, None] * stride_path_row + offs_p[None, :],
                               mask=sel[:, None] & (offs_p[None, :] < path_len), other=-1).to(tl.int32)
                lo = tl.min(tl.where(sel, tl.max(tl.where(offs_p[None, :] == 0, path, -1), axis=1),
                                     2147483647), axis=0).to(tl.int64)
                hi = tl.max(tl.max(path, axis=1), axis=0).to(tl.int64)
                offs_n64 = offs_n.to(tl.int64)
                for row_start in range(lo, hi + 1, BLOCK_N):
                    rows = row_start + offs_n  # [BLOCK_N]
                    in_tile = rows <= hi
                    k = tl.load(key_ptr + (rows * stride_k_t + kv_head * stride_k_h)[:, None] + offs_d[None, :],
                                mask=in_tile[:, None], other=0.0)  # [BLOCK_N, D]
                    v = tl.load(value_ptr + (rows * stride_v_t + kv_head * stride_v_h)[:, None] + offs_d[None, :],
                                mask=in_tile[:, None], other=0.0)
                    # each vector's path rows inside this tile as one 64-bit mask (bit n: row row_start + n), one
                    # OR-reduction over the path's columns; then the [BLOCK_M, BLOCK_N] mask is a shift per entry
                    rel = path.to(tl.int64) - row_start  # [BLOCK_M, PATH_PAD]
                    hit = (path >= 0) & (rel >= 0) & (rel < BLOCK_N)  # -1 padding matches no row
                    bits = tl.reduce(tl.where(hit, tl.full([], 1, tl.int64) << tl.where(hit, rel, 0), 0), 1,
                                     _bit_or)  # [BLOCK_M] int64
                    on_path = ((bits[:, None] >> offs_n64[None, :]) & 1) != 0  # [BLOCK_M, BLOCK_N]
                    m_i, l_i, acc = _online_softmax_tile(q, k, v, on_path, m_i, l_i, acc, qk_scale,
                                                         DOT_PRECISION)
            mine = (sel & (g < GROUP))[:, None]
            if NUM_SPLITS == 1:
                l_i = tl.where(l_i > 0.0, l_i, 1.0)  # empty row -> zeros instead of 0 / 0
                o = acc / l_i[:, None]
                tl.store(out_ptr + row[:, None] * stride_out_t + heads[:, None] * stride_out_h + offs_d[None, :],
                         o.to(out_ptr.dtype.element_ty), mask=mine)
            else:  # this split's partial, merged by _tree_attention_combine_kernel
                tl.store(part_acc_ptr + split * stride_pa_split + entry[:, None] * stride_pa_entry
                         + heads[:, None] * stride_pa_h + offs_d[None, :], acc, mask=mine)
                ml = part_ml_ptr + split * stride_pm_split + entry * stride_pm_entry + heads * stride_pm_h
                tl.store(ml, m_i, mask=sel & (g < GROUP))
                tl.store(ml + 1, l_i, mask=sel & (g < GROUP))
            cur = tl.min(tl.where(live & (req > cur), req, no_req), axis=0)

    @triton.jit(do_not_specialize=["stride_pa_split", "stride_pm_split"])
    def _tree_attention_combine_kernel(
            out_ptr, stride_out_t, stride_out_h,
            row_index_ptr,
            part_acc_ptr, stride_pa_split, stride_pa_entry, stride_pa_h,
            part_ml_ptr, stride_pm_split, stride_pm_entry, stride_pm_h,
            HEAD_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
        # One program per (entry, query head): out[row] = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s.
        entry = tl.program_id(0)
        head = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        offs_d = tl.arange(0, HEAD_SIZE)
        # the entry's row, broadcast over splits and over the head dimension (vector masks only)
        # row_index -1: an unused entry of a fixed-size launch, nothing written, nothing to merge
        use = (offs_s < NUM_SPLITS) & (tl.load(row_index_ptr + entry + offs_s * 0) >= 0)  # [S]
        row_d = tl.load(row_index_ptr + entry + offs_d * 0).to(tl.int64)  # [D]
        ml = part_ml_ptr + offs_s * stride_pm_split + entry * stride_pm_entry + head * stride_pm_h
        m_s = tl.load(ml, mask=use, other=-1.0e30)  # [S]
        l_s = tl.load(ml + 1, mask=use, other=0.0)
        acc = tl.load(part_acc_ptr + offs_s[:, None] * stride_pa_split + entry * stride_pa_entry
                      + head * stride_pa_h + offs_d[None, :], mask=use[:, None], other=0.0)  # [S, D]
        weight = tl.exp2(m_s - tl.max(m_s, axis=0))  # [S]; empty splits (max -1e30, sum 0) weigh nothing
        total = tl.sum(l_s * weight, axis=0)
        total = tl.where(total > 0.0, total, 1.0)  # empty row -> zeros instead of 0 / 0
        o = tl.sum(acc * weight[:, None], axis=0) / total  # [D]
        tl.store(out_ptr + tl.where(row_d >= 0, row_d, 0) * stride_out_t + head * stride_out_h + offs_d,
                 o.to(out_ptr.dtype.element_ty), mask=row_d >= 0)


_LOG = logging.getLogger(__name__)
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_LOG2E = 1.4426950408889634


MAX_SPLITS = 16
_INTERPRETER_SMS = 4  # the SM count the split rule assumes under the Triton interpreter (CPU tests)


def launch_meta(group: int, head_size: int, block_size: int, dtype: torch.dtype,
                num_splits: int = 1, context_given: bool = False, path_width: int = 17) -> dict[str, object]:
    """The kernel's compile-time parameters for a GQA group size, head size, KV block size, dtype, split count,
    whether the context part comes from elsewhere (``context_out`` / ``context_lse``) and the row paths' width
    (``row_path.shape[1]``: 17 for gamma = 16)."""
    group_pad = 1 << (group - 1).bit_length()
    block_m = 64 if head_size <= 128 else 32  # query vectors per program
    return {"GROUP": group, "GROUP_PAD": group_pad, "ROWS": max(1, block_m // group_pad), "HEAD_SIZE": head_size,
            "BLOCK_SIZE": block_size, "BLOCK_N": 64 if head_size <= 128 else 32,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "NUM_SPLITS": num_splits,
            "CONTEXT_GIVEN": context_given, "PATH_PAD": max(2, 1 << (path_width - 1).bit_length())}


# The split counts the automatic rule picks: powers of two, so an engine compiles at most these few variants of
# the kernel, all when a configuration is first launched (precompile_split_variants), never at run time.
SPLIT_CHOICES = tuple(1 << i for i in range(MAX_SPLITS.bit_length()))


def auto_num_splits(num_programs: int, num_sms: int) -> int:
    """Context splits for a grid of ``num_programs`` (tiles x kv heads): when the grid is smaller than the device,
    the largest of SPLIT_CHOICES that gives every SM at most about two programs, else 1."""
    if num_programs >= num_sms:
        return 1
    wanted = min(MAX_SPLITS, -(-2 * num_sms // num_programs))
    return 1 << (wanted.bit_length() - 1)


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a host-side property query, cached; no sync)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def _interpreting() -> bool:
    """True when ``@triton.jit`` produced interpreter functions (TRITON_INTERPRET=1 at import)."""
    return type(_tree_attention_kernel).__name__ == "InterpretedFunction"


def tree_attention(
        # [T, H, D] query rows of the forward
        query: torch.Tensor,
        # [T, H_kv, D] the layer's fresh key / value rows of the forward
        key: torch.Tensor, value: torch.Tensor,
        # [num_blocks, block_size, H_kv, D] paged cache views (may be non-contiguous)
        key_cache: torch.Tensor, value_cache: torch.Tensor,
        # [num_reqs, max_blocks] int32/int64 block ids per request
        block_table: torch.Tensor,
        # [M] int32/int64 global row of each tree row to compute; -1 = skip the entry
        row_index: torch.Tensor,
        # [M] int32/int64 request (row of block_table) of each tree row
        row_req: torch.Tensor,
        # [M] int32/int64 committed context length of the row's request
        row_context_len: torch.Tensor,
        # [M, P] int32/int64 global rows of the root->row path (ancestors-or-self), -1 padded
        row_path: torch.Tensor,
        scale: float,
        # [T, H, D] mutable: rows row_index are overwritten, the others untouched
        out: torch.Tensor,
        # context splits (module docstring); None: auto_num_splits from the grid and the SM count
        num_splits: int | None = None,
        # [n, H, D] each row's attention over its committed context alone (normalised), and [H, n] fp32 its
        # natural log-sum-exp (FlashAttention's out / softmax_lse), for the first n <= T rows (every tree row
        # among them); given: the kernel adds only the path rows
        context_out: torch.Tensor | None = None, context_lse: torch.Tensor | None = None) -> torch.Tensor:
    """Write ``softmax(q K^T * scale) V`` of every tree row into ``out[row_index]``; returns ``out``.

    See the module docstring for what each row attends to. Asserts the contract (ranks,
    shapes, dtypes, devices, unit last-dim stride); reads no device value.
    """
    context_given = context_out is not None
    assert context_given == (context_lse is not None), "context_out and context_lse come together"
    if context_given:
        rows = context_out.shape[0]
        assert context_out.shape[1:] == query.shape[1:] and rows <= query.shape[0], (
            f"context_out must be [n <= T, H, D] for query {tuple(query.shape)}, got {tuple(context_out.shape)}")
        assert context_lse.shape == (query.shape[1], rows) and context_lse.dtype == torch.float32, (
            f"context_lse must be [H, n] = {(query.shape[1], rows)} fp32, got "
            f"{tuple(context_lse.shape)} {context_lse.dtype}")
        assert context_out.stride(-1) == 1 and context_out.device == context_lse.device == query.device, (
            "context_out needs a unit last-dim stride; context_out/context_lse on the query's device")
        assert num_splits in (None, 1), "with the context given there is no context walk to split"
        num_splits = 1
    assert query.dim() == 3, f"query must be [T, H, D], got shape {tuple(query.shape)}"
    assert key.dim() == 3 and value.shape == key.shape, (
        f"key/value must both be [T, H_kv, D], got {tuple(key.shape)} and {tuple(value.shape)}")
    assert key_cache.dim() == 4 and value_cache.shape == key_cache.shape, (
        "key_cache/value_cache must both be [num_blocks, block_size, H_kv, D], got "
        f"{tuple(key_cache.shape)} and {tuple(value_cache.shape)}")
    assert out.shape == query.shape, f"out shape {tuple(out.shape)} != query shape {tuple(query.shape)}"
    num_heads, head_size = query.shape[1:]
    num_kv_heads = key.shape[1]
    assert key.shape[2] == head_size and key_cache.shape[3] == head_size, (
        f"head size mismatch: query {head_size}, key {key.shape[2]}, kv cache {key_cache.shape[3]}")
    assert head_size >= 16 and head_size & (head_size - 1) == 0, (
        f"head size must be a power of two >= 16, got {head_size}")
    assert key_cache.shape[2] == num_kv_heads, (
        f"kv heads mismatch: key {num_kv_heads}, kv cache {key_cache.shape[2]}")
    assert num_heads % num_kv_heads == 0, (
        f"GQA needs num_heads ({num_heads}) divisible by num_kv_heads ({num_kv_heads})")
    assert query.dtype in _FLOAT_DTYPES, f"query dtype must be bf16/fp16/fp32, got {query.dtype}"
    for name, t in (("key", key), ("value", value), ("key_cache", key_cache), ("value_cache", value_cache)):
        assert t.dtype == query.dtype, f"{name} dtype {t.dtype} != query dtype {query.dtype}"
    assert out.dtype in _FLOAT_DTYPES, f"out dtype must be bf16/fp16/fp32, got {out.dtype}"
    num_rows = row_index.shape[0]
    assert block_table.dim() == 2, f"block_table must be [num_reqs, max_blocks], got {tuple(block_table.shape)}"
    assert row_path.dim() == 2 and row_path.shape[0] == num_rows, (
        f"row_path must be [M={num_rows}, P], got {tuple(row_path.shape)}")
    for name, t in (("row_index", row_index), ("row_req", row_req), ("row_context_len", row_context_len)):
        assert t.shape == (num_rows,), f"{name} must be [M={num_rows}], got {tuple(t.shape)}"
    tensors = {"query": query, "key": key, "value": value, "key_cache": key_cache,
               "value_cache": value_cache, "block_table": block_table, "row_index": row_index,
               "row_req": row_req, "row_context_len": row_context_len, "row_path": row_path, "out": out}
    for name in ("block_table", "row_index", "row_req", "row_context_len", "row_path"):
        assert tensors[name].dtype in _INDEX_DTYPES, f"{name} must be int32/int64, got {tensors[name].dtype}"
    for name, t in tensors.items():
        assert t.device == query.device, f"{name} is on {t.device}, query on {query.device}"
        assert t.numel() == 0 or t.dim() == 0 or t.stride(-1) == 1, (
            f"{name} must have a unit last-dim stride, got strides {t.stride()}")
    if num_rows == 0:
        return out
    if triton is None:
        raise RuntimeError("tree_attention needs Triton, which is not installed "
                           "(use triton_ops.reference.tree_attention_reference on CPU)")
    if query.device.type == "cpu" and not _interpreting():
        raise RuntimeError("tree_attention on CPU tensors needs the Triton interpreter: set "
                           "TRITON_INTERPRET=1 before triton is first imported")

    meta = launch_meta(num_heads // num_kv_heads, head_size, key_cache.shape[1], query.dtype,
                       context_given=context_given, path_width=row_path.shape[1])
    tiles = triton.cdiv(num_rows, meta["ROWS"])
    if num_splits is None:
        sms = _INTERPRETER_SMS if query.device.type == "cpu" else _sm_count(query.device)
        num_splits = auto_num_splits(tiles * num_kv_heads, sms)
    assert 1 <= num_splits <= MAX_SPLITS, f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}"
    if context_given:
        ctx_out, ctx_lse = context_out, context_lse
    else:  # unused by the kernel (its CONTEXT_GIVEN branch is compiled out)
        ctx_out, ctx_lse = out, torch.empty((1, 1), dtype=torch.float32, device=query.device)

    def kernel_args(splits: int, rows: int) -> tuple[tuple, tuple]:
        """The main and the combine launch's arguments at ``splits`` context splits for ``rows`` entries."""
        if splits > 1:  # fresh each call: inside a CUDA-graph capture they come from the graph's pool
            part_acc = torch.empty((splits, rows, num_heads, head_size), dtype=torch.float32, device=query.device)
            part_ml = torch.empty((splits, rows, num_heads, 2), dtype=torch.float32, device=query.device)
        else:  # unused by the kernel (its NUM_SPLITS == 1 branch writes out)
            part_acc = part_ml = torch.empty((1, 1, 1, 2), dtype=torch.float32, device=query.device)
        partials = (part_acc, part_acc.stride(0), part_acc.stride(1), part_acc.stride(2),
                    part_ml, part_ml.stride(0), part_ml.stride(1), part_ml.stride(2))
        main = (
            # Outputs
            out, out.stride(0), out.stride(1),  # mutable
            # Inputs
            query, query.stride(0), query.stride(1),
            key, key.stride(0), key.stride(1),
            value, value.stride(0), value.stride(1),
            key_cache, key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
            value_cache, value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
            block_table, block_table.stride(0),
            row_index, row_req, row_context_len,
            row_path, row_path.stride(0),
            *partials,
            ctx_out, ctx_out.stride(0), ctx_out.stride(1), ctx_lse, ctx_lse.stride(0), ctx_lse.stride(1),
            # Scalars
            scale * _LOG2E, rows, row_path.shape[1])
        return main, (out, out.stride(0), out.stride(1), row_index, *partials)

    if not context_given and not _interpreting():
        key_ = (tuple(sorted(meta.items())), query.device,
                tuple(t.dtype for t in (query, out, block_table, row_index, row_req, row_context_len, row_path)))
        if key_ not in _PRECOMPILED:
            _PRECOMPILED.add(key_)
            try:
                precompile_split_variants(kernel_args, meta, head_size)
            except Exception as error:  # an optimisation only: the launches below still compile what they need
                _LOG.warning("tree_attention: precompiling the split variants failed (%s: %s); a new split count "
                             "will compile when it is first launched", type(error).__name__, error)
    main_args, combine_args = kernel_args(num_splits, num_rows)
    _tree_attention_kernel[(tiles, num_kv_heads, num_splits)](*main_args, **{**meta, "NUM_SPLITS": num_splits})
    if num_splits > 1:
        _tree_attention_combine_kernel[(num_rows, num_heads)](*combine_args, **combine_meta(head_size, num_splits))
    return out


# Launch configurations whose split variants are compiled (precompile_split_variants), per process.
_PRECOMPILED: set[tuple] = set()


def combine_meta(head_size: int, num_splits: int) -> dict[str, int]:
    """The combine kernel's compile-time parameters."""
    return {"HEAD_SIZE": head_size, "NUM_SPLITS": num_splits, "SPLITS_PAD": 1 << (num_splits - 1).bit_length()}


def precompile_split_variants(kernel_args: Callable[[int, int], tuple[tuple, tuple]], meta: dict[str, object],
                              head_size: int) -> None:
    """Compile (``JITFunction.warmup``: no launch, so also safe inside a CUDA-graph capture) the kernel at every
    split count of SPLIT_CHOICES, and the combine kernel for each count > 1, with the argument types and value
    classes of the launch ``kernel_args(splits, rows)`` builds. The automatic split count follows the step's row
    count, which varies from step to step in the steps CUDA graphs do not cover (a prefill beside tree rows);
    without this each new count compiled in the middle of serving (seconds on the H200)."""
    for splits in SPLIT_CHOICES:
        main_args, combine_args = kernel_args(splits, 1)
        _tree_attention_kernel.warmup(*main_args, grid=(1, 1, splits), **{**meta, "NUM_SPLITS": splits})
        if splits > 1:
            _tree_attention_combine_kernel.warmup(*combine_args, grid=(1, 1), **combine_meta(head_size, splits))
