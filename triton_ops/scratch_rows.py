"""Fill the scratch pages of ``tree_attention: "flash_exact"``'s virtual sequences: one layer, one launch.

Each tree row's virtual sequence ends in scratch pages that hold its request's committed tail (read from the
layer's paged cache) and then its root -> row path (the layer's fresh K/V of this forward)
(``ubtree_vllm/vllm/attention/exact_rows.py``, which computes the copy lists once per forward). Each program makes
``COPIES`` consecutive copies of one list as one ``[COPIES, H_kv, D]`` tile: the first ``cdiv(num_tail, COPIES)``
programs copy cache slots to cache slots (key and value), the rest fresh rows to cache slots. Copies of unused
entries all target one dump page; with ``skip_dst_page`` set to it they are not made at all (they would all write
the same slot; in an H100 profile the launch took far longer than its bytes warrant, ``docs/design/mrv2.md`` §7).
Sources and destinations never overlap: tails are read from the scheduler's pages,
everything is written to scratch pages.

Caches: one layer's key / value views ``[num_blocks, block_size, H_kv, D]`` of the same cache (equal strides, the
last one 1); fresh K/V ``[T, H_kv, D]`` (last stride 1). The launcher reads no device value; the grid is
``(cdiv(num_tail, COPIES) + cdiv(num_path, COPIES),)``. Test oracle:
:func:`ubtree_vllm.triton_ops.reference.scratch_rows_reference`.
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

# elements of one program's [COPIES, H_kv, D] tile (padded to powers of two) the launcher aims at
TILE_ELEMENTS = 2048
NO_PAGE = -1  # skip_dst_page when every copy is made

if triton is not None:

    @triton.jit
    def _scratch_rows_kernel(
            key_cache_ptr, value_cache_ptr, key_ptr, value_ptr,
            tail_src_page_ptr, tail_src_slot_ptr, tail_dst_page_ptr, tail_dst_slot_ptr,  # [num_tail]
            path_row_ptr, path_dst_page_ptr, path_dst_slot_ptr,  # [num_path]
            num_tail, num_path, skip_page,
            stride_page, stride_slot, stride_cache_head,
            stride_key_row, stride_key_head, stride_value_row, stride_value_head,
            HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
            COPIES: tl.constexpr):
        pid = tl.program_id(0)
        tail_programs = tl.cdiv(num_tail, COPIES)
        copy = tl.arange(0, COPIES)[:, None, None]  # [C, 1, 1]
        heads = tl.arange(0, BLOCK_H)[None, :, None]  # [1, BLOCK_H, 1]
        dims = tl.arange(0, BLOCK_D)[None, None, :]  # [1, 1, BLOCK_D]
        lanes = (heads < HEADS) & (dims < HEAD_SIZE)  # [1, BLOCK_H, BLOCK_D]
        in_cache = heads.to(tl.int64) * stride_cache_head + dims
        if pid < tail_programs:
            i = pid * COPIES + copy  # [C, 1, 1] this program's tail copies
            dst_page = tl.load(tail_dst_page_ptr + i, mask=i < num_tail, other=skip_page)
            live = (i < num_tail) & (dst_page != skip_page)  # past the list or onto the skipped page: not made
            src = (tl.load(tail_src_page_ptr + i, mask=live, other=0).to(tl.int64) * stride_page
                   + tl.load(tail_src_slot_ptr + i, mask=live, other=0).to(tl.int64) * stride_slot)
            dst = (dst_page.to(tl.int64) * stride_page
                   + tl.load(tail_dst_slot_ptr + i, mask=live, other=0).to(tl.int64) * stride_slot)
            mask = live & lanes  # [C, BLOCK_H, BLOCK_D]
            tl.store(key_cache_ptr + dst + in_cache, tl.load(key_cache_ptr + src + in_cache, mask=mask), mask=mask)
            tl.store(value_cache_ptr + dst + in_cache, tl.load(value_cache_ptr + src + in_cache, mask=mask),
                     mask=mask)
        else:
            j = (pid - tail_programs) * COPIES + copy  # [C, 1, 1] this program's path copies
            dst_page = tl.load(path_dst_page_ptr + j, mask=j < num_path, other=skip_page)
            live = (j < num_path) & (dst_page != skip_page)
            row = tl.load(path_row_ptr + j, mask=live, other=0).to(tl.int64)
            dst = (dst_page.to(tl.int64) * stride_page
                   + tl.load(path_dst_slot_ptr + j, mask=live, other=0).to(tl.int64) * stride_slot)
            mask = live & lanes
            key = tl.load(key_ptr + row * stride_key_row + heads.to(tl.int64) * stride_key_head + dims, mask=mask)
            value = tl.load(value_ptr + row * stride_value_row + heads.to(tl.int64) * stride_value_head + dims,
                            mask=mask)
            tl.store(key_cache_ptr + dst + in_cache, key, mask=mask)
            tl.store(value_cache_ptr + dst + in_cache, value, mask=mask)


def launch_meta(heads: int, head_size: int) -> dict[str, int]:
    """The kernel's compile-time parameters for ``heads`` KV heads of ``head_size``: the padded tile of one copy and
    how many copies a program makes (about :data:`TILE_ELEMENTS` elements per program, at most 16 copies)."""
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_size)
    copies = max(1, min(16, TILE_ELEMENTS // (block_h * block_d)))  # powers of two all: so is this
    return {"HEADS": heads, "HEAD_SIZE": head_size, "BLOCK_H": block_h, "BLOCK_D": block_d, "COPIES": copies}


def scratch_rows(
        # [num_blocks, block_size, H_kv, D] one layer's key / value cache views (same strides), mutated
        key_cache: torch.Tensor, value_cache: torch.Tensor,
        # [T, H_kv, D] the layer's fresh key / value rows
        key: torch.Tensor, value: torch.Tensor,
        # [num_tail] int64 page / slot read and page / slot written per tail copy
        tail_src_page: torch.Tensor, tail_src_slot: torch.Tensor, tail_dst_page: torch.Tensor,
        tail_dst_slot: torch.Tensor,
        # [num_path] int64 fresh row read and page / slot written per path copy
        path_row: torch.Tensor, path_dst_page: torch.Tensor, path_dst_slot: torch.Tensor,
        # copies written to this page are not made (flash_exact's dump page); NO_PAGE: every copy is made
        skip_dst_page: int = NO_PAGE) -> None:
    """Copy ``cache[tail_src] -> cache[tail_dst]`` and ``fresh[path_row] -> cache[path_dst]``, key and value, but
    none onto page ``skip_dst_page``."""
    if triton is None:
        raise RuntimeError("scratch_rows needs triton (pip install triton)")
    assert key_cache.dim() == 4 and key_cache.stride() == value_cache.stride() and key_cache.stride(3) == 1, (
        f"key/value caches must be [num_blocks, block_size, H_kv, D] views with equal strides, last 1: "
        f"{tuple(key_cache.shape)} {key_cache.stride()} {value_cache.stride()}")
    assert key.dim() == value.dim() == 3 and key.stride(2) == value.stride(2) == 1, "fresh K/V must be [T, H_kv, D]"
    _, _, heads, head_size = key_cache.shape
    assert key.shape[1:] == value.shape[1:] == (heads, head_size), f"fresh K/V {key.shape} vs cache {key_cache.shape}"
    num_tail, num_path = tail_src_page.shape[0], path_row.shape[0]
    for t in (tail_src_slot, tail_dst_page, tail_dst_slot):
        assert t.shape == (num_tail,), f"tail copy lists must be [{num_tail}], got {tuple(t.shape)}"
    for t in (path_dst_page, path_dst_slot):
        assert t.shape == (num_path,), f"path copy lists must be [{num_path}], got {tuple(t.shape)}"
    if num_tail + num_path == 0:
        return
    meta = launch_meta(heads, head_size)
    copies = meta["COPIES"]
    grid = (triton.cdiv(num_tail, copies) + triton.cdiv(num_path, copies),)
    _scratch_rows_kernel[grid](
        key_cache, value_cache, key, value, tail_src_page, tail_src_slot, tail_dst_page, tail_dst_slot,
        path_row, path_dst_page, path_dst_slot, num_tail, num_path, skip_dst_page,
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), **meta)
