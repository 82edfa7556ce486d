"""FlashInfer's custom mask and page list for a uniform decode tree-verification step, filled on the device.

FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` with a custom mask computes every row of the step: ``R_pad``
requests of exactly ``q`` query rows each (row ``i`` of request ``r`` is global row ``g = r * q + i``; row 0 is the
root, rows ``1 .. q - 1`` the tree nodes), request ``r`` planned with ``kv_pages[r]`` pages of ``page_size`` keys,
so ``kv_len_r = kv_pages[r] * page_size`` keys. Two launches, neither reads a device value on the host:

* :func:`tree_prefill_mask` -- the packed mask. Request ``r``'s segment starts at byte ``mask_offsets[r]`` and holds
  ``q * kv_len_r`` bits, little bit order: bit ``n = i * kv_len_r + p`` (query row ``i``, key ``p``) is bit
  ``n % 8`` of byte ``mask_offsets[r] + n // 8``. With ``ctx = max(seq_lens[r] - q, 0)`` the committed keys, a root
  (``i == 0``) or a row without a path (``row_index[g] < 0``: roots, padding) sees keys ``p <= ctx`` (the context
  and its own key; a padding request, ``seq_lens[r] == 0``, key 0 only); a tree row sees ``p < ctx`` and
  ``ctx + j`` for each request-local node ``j = row_path[g, k] - r * q`` of its root -> row path (``0 <= j < q``).
  Keys ``p >= kv_len_r`` do not exist. ``page_size`` is a multiple of 8, so each query row starts on a byte: one
  program owns ``BLOCK_BYTES`` bytes of one row (grid ``(R_pad * q, cdiv(max_kv_len / 8, BLOCK_BYTES))``, programs
  past their row's bytes store nothing) and packs a ``[BLOCK_BYTES, 8]`` visibility tile.
* :func:`paged_kv_indices` -- the flat page list: ``out_indices[kv_indptr[r] + j] = block_table[r, j]`` for
  ``j < kv_pages[r]``; 0 for a padding request (``r >= R_rows``), past the table's width, or for a negative id.
  Grid ``(R_pad, cdiv(max_pages, BLOCK_PAGES))``.

The host ints ``max_kv_len`` / ``max_pages`` (the largest ``kv_len_r`` / ``kv_pages[r]``, known to the planner)
only size the grids. Test oracles: :func:`ubtree_vllm.triton_ops.reference.tree_prefill_mask_reference` and
:func:`ubtree_vllm.triton_ops.reference.paged_kv_indices_reference` (tests/triton/test_tree_prefill_mask.py).
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

BLOCK_BYTES = 128  # mask bytes (1024 keys) of one query row per program
BLOCK_PAGES = 128  # page ids per program

if triton is not None:

    @triton.jit
    def _tree_prefill_mask_kernel(
            seq_lens_ptr, kv_pages_ptr,  # [R_pad] int32
            row_index_ptr, row_path_ptr,  # [T] int64; [T, P] int64 (root-first global rows, -1 padded)
            mask_offsets_ptr,  # [R_pad + 1] int64 byte offsets of the requests' segments
            out_mask_ptr,  # [>= mask_offsets[-1]] uint8
            q, page_size, path_width, stride_path_row,
            BLOCK_BYTES: tl.constexpr):
        g = tl.program_id(0)
        chunk = tl.program_id(1)
        r = g // q
        i = g % q
        kv_len = tl.load(kv_pages_ptr + r) * page_size
        row_bytes = kv_len // 8
        ctx = tl.maximum(tl.load(seq_lens_ptr + r) - q, 0)
        tree = (i != 0) & (tl.load(row_index_ptr + g) >= 0)

        first = chunk * BLOCK_BYTES
        byte = first + tl.arange(0, BLOCK_BYTES)  # [BLOCK_BYTES]
        bits = tl.arange(0, 8)  # [8]
        key = byte[:, None] * 8 + bits[None, :]  # [BLOCK_BYTES, 8]
        fresh = key - ctx  # request-local node index of a fresh key
        on_path = key < 0  # [BLOCK_BYTES, 8] all False
        # only a tree row's chunks that overlap the fresh keys ctx .. ctx + q - 1 scan the path
        if tree & (first < row_bytes) & (ctx < (first + BLOCK_BYTES) * 8) & (ctx + q > first * 8):
            path_row = row_path_ptr + g.to(tl.int64) * stride_path_row
            for k in range(0, path_width):
                node = tl.load(path_row + k)
                # -1: no node (the interpreter widens a scalar bool & a tile bool to an integer array: one compare)
                on_path = on_path | (fresh == tl.where(node >= 0, node - r * q, -1))
        on_path = on_path & (fresh >= 0) & (fresh < q)
        visible = tl.where(tree, (key < ctx) | on_path, key <= ctx)
        packed = tl.sum(visible.to(tl.int32) << bits[None, :], axis=1)  # [BLOCK_BYTES], bit b = key 8 * byte + b
        row_start = tl.load(mask_offsets_ptr + r) + i.to(tl.int64) * row_bytes
        tl.store(out_mask_ptr + row_start + byte, packed.to(tl.uint8), mask=byte < row_bytes)

    @triton.jit
    def _paged_kv_indices_kernel(
            block_table_ptr,  # [R_rows, max_blocks] int32
            kv_pages_ptr, kv_indptr_ptr,  # [R_pad] / [R_pad + 1] int32
            out_indices_ptr,  # [>= kv_indptr[-1]] int32
            num_rows, max_blocks, stride_table_row,
            BLOCK_PAGES: tl.constexpr):
        r = tl.program_id(0)
        j = tl.program_id(1) * BLOCK_PAGES + tl.arange(0, BLOCK_PAGES)  # [BLOCK_PAGES]
        pages = tl.load(kv_pages_ptr + r)
        in_table = tl.where(r < num_rows, tl.minimum(pages, max_blocks), 0)  # ids read from the table
        # one compare per mask, as in the mask kernel
        page = tl.load(block_table_ptr + r.to(tl.int64) * stride_table_row + j, mask=j < in_table, other=0)
        tl.store(out_indices_ptr + tl.load(kv_indptr_ptr + r) + j, tl.maximum(page, 0), mask=j < pages)


def launch_meta(block_bytes: int = BLOCK_BYTES) -> dict[str, int]:
    """:func:`tree_prefill_mask`'s compile-time parameters: mask bytes per program (a power of two)."""
    return {"BLOCK_BYTES": block_bytes}


def indices_launch_meta(block_pages: int = BLOCK_PAGES) -> dict[str, int]:
    """:func:`paged_kv_indices`'s compile-time parameters: page ids per program (a power of two)."""
    return {"BLOCK_PAGES": block_pages}


def tree_prefill_mask(
        # [R_pad] int32 each request's tokens including its q rows (0: a padding request)
        seq_lens: torch.Tensor,
        # [T] int64 g for a tree row with a path, else -1; [T, P] int64 root-first global rows, -1 padded
        row_index: torch.Tensor, row_path: torch.Tensor,
        q: int,
        # [R_pad] int32 pages FlashInfer was planned with; [R_pad + 1] int64 byte offsets of the mask segments
        kv_pages: torch.Tensor, mask_offsets: torch.Tensor,
        page_size: int,
        # [>= mask_offsets[-1]] uint8, mutated: the requests' segments (module docstring)
        out_mask: torch.Tensor,
        *, max_kv_len: int, block_bytes: int = BLOCK_BYTES) -> None:
    """Write FlashInfer's packed custom mask of the step's ``R_pad * q`` rows (module docstring); one launch.

    ``max_kv_len``: a host int >= every ``kv_pages[r] * page_size`` (sizes the grid; too small leaves bytes
    unwritten). ``block_bytes``: mask bytes per program (a power of two; tests shrink it)."""
    if triton is None:
        raise RuntimeError("tree_prefill_mask needs triton (pip install triton)")
    num_reqs = seq_lens.shape[0]
    assert q >= 1 and page_size % 8 == 0 and page_size > 0, f"need q >= 1 and page_size % 8 == 0: {q}, {page_size}"
    assert block_bytes > 0 and block_bytes & (block_bytes - 1) == 0, f"block_bytes must be a power of 2: {block_bytes}"
    for name, t in (("seq_lens", seq_lens), ("kv_pages", kv_pages)):
        assert t.shape == (num_reqs,) and t.dtype == torch.int32, f"{name} must be [{num_reqs}] int32"
    assert mask_offsets.shape == (num_reqs + 1,) and mask_offsets.dtype == torch.int64, (
        f"mask_offsets must be [{num_reqs + 1}] int64")
    assert row_index.dim() == 1 and row_index.dtype == torch.int64 and row_index.shape[0] >= num_reqs * q, (
        f"row_index must be [T >= {num_reqs * q}] int64, got {tuple(row_index.shape)} {row_index.dtype}")
    assert row_path.dim() == 2 and row_path.shape[0] == row_index.shape[0] and row_path.dtype == torch.int64 \
        and row_path.stride(1) == 1, f"row_path must be [T, P] int64, last stride 1: {tuple(row_path.shape)}"
    assert out_mask.dim() == 1 and out_mask.dtype == torch.uint8, "out_mask must be a flat uint8 buffer"
    if num_reqs == 0 or max_kv_len <= 0:
        return
    grid = (num_reqs * q, triton.cdiv(max_kv_len, 8 * block_bytes))
    _tree_prefill_mask_kernel[grid](
        seq_lens, kv_pages, row_index, row_path, mask_offsets, out_mask,
        q, page_size, row_path.shape[1], row_path.stride(0), **launch_meta(block_bytes))


def paged_kv_indices(
        # [R_rows, max_blocks] int32 the scheduler's pages (R_rows <= R_pad: later requests are padding)
        block_table: torch.Tensor,
        # [R_pad] int32 pages per request; [R_pad + 1] int32 their cumulative sum
        kv_pages: torch.Tensor, kv_indptr: torch.Tensor,
        # [>= kv_indptr[-1]] int32, mutated
        out_indices: torch.Tensor,
        max_pages: int, *, block_pages: int = BLOCK_PAGES) -> None:
    """Write FlashInfer's flat ``paged_kv_indices`` (module docstring); one launch. ``max_pages``: a host int >=
    every ``kv_pages[r]`` (sizes the grid). ``block_pages``: page ids per program (a power of two; tests shrink it)."""
    if triton is None:
        raise RuntimeError("paged_kv_indices needs triton (pip install triton)")
    num_reqs = kv_pages.shape[0]
    assert block_pages > 0 and block_pages & (block_pages - 1) == 0, f"block_pages must be a power of 2: {block_pages}"
    assert block_table.dim() == 2 and block_table.dtype == torch.int32 and block_table.stride(1) == 1, (
        f"block_table must be [R_rows, max_blocks] int32, last stride 1: {tuple(block_table.shape)}")
    assert kv_pages.dtype == torch.int32 and kv_indptr.shape == (num_reqs + 1,) and kv_indptr.dtype == torch.int32, (
        f"kv_pages / kv_indptr must be [{num_reqs}] / [{num_reqs + 1}] int32")
    assert out_indices.dim() == 1 and out_indices.dtype == torch.int32, "out_indices must be a flat int32 buffer"
    if num_reqs == 0 or max_pages <= 0:
        return
    _paged_kv_indices_kernel[(num_reqs, triton.cdiv(max_pages, block_pages))](
        block_table, kv_pages, kv_indptr, out_indices, block_table.shape[0], block_table.shape[1],
        block_table.stride(0), **indices_launch_meta(block_pages))
