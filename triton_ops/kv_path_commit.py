"""Move every tree request's accepted KV rows to the slots of their depths, all layers in one launch.

After a tree forward, node j of a request sits at the KV slot of its row ``root_row + j``;
vLLM expects the accepted node at depth d at the slot of row ``root_row + d``. For each
(request q, depth d) pair ``i = q * D + d`` the launcher copies the ``[H_kv, E]`` slot
contents at ``src_slot[i]`` to ``dst_slot[i]`` where ``moves[i]``, in every layer whose
cache base address is in ``kv_cache_ptrs``.

Ordering: a destination may also be the source of a shallower pair of the same request
(path = [0, 2, 5]: depth 1 reads row 2, which depth 2 overwrites). One program per
(layer, request, feature chunk) walks its request's depths in ascending order, and every
iteration touches the same element offsets with the same thread layout, so a row is read
before it is overwritten. A later depth never reads an overwritten row: nodes are listed
parents-first, so the accepted node at depth d has index >= d > every row written before.

Caches: ``[num_blocks, H_kv, block_size, E]`` with any strides, the same for every layer
(vLLM allocates the layers of one KV cache group alike). The launcher reads no device
value; the grid is ``(L, Q, cdiv(H_kv * E, BLOCK))``.
Test oracle: :func:`ubtree_vllm.triton_ops.reference.kv_path_commit_reference`.
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

_TL_DTYPES = {}
if triton is not None:
    _TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32,
                  torch.uint8: tl.uint8}

    @triton.jit
    def _kv_path_commit_kernel(
            kv_cache_ptrs,  # [L] int64 base addresses
            src_slot_ptr, dst_slot_ptr, moves_ptr,  # [Q * D]
            num_depths, block_size,
            stride_block, stride_head, stride_slot, stride_elem,
            ELEMS: tl.constexpr,  # E (last dim)
            NUM_ELEMS: tl.constexpr,  # H_kv * E
            BLOCK: tl.constexpr, DTYPE: tl.constexpr):
        layer = tl.program_id(0)
        q = tl.program_id(1)
        chunk = tl.program_id(2)
        base = tl.load(kv_cache_ptrs + layer).to(tl.pointer_type(DTYPE))
        offs = chunk * BLOCK + tl.arange(0, BLOCK)
        in_range = offs < NUM_ELEMS
        inner = (offs // ELEMS).to(tl.int64) * stride_head + (offs % ELEMS).to(tl.int64) * stride_elem  # [BLOCK]
        for d in range(0, num_depths):  # ascending: see the module docstring
            i = q * num_depths + d
            move = tl.load(moves_ptr + i).to(tl.int32)
            mask = in_range & (offs * 0 + move > 0)  # [BLOCK]
            src = tl.load(src_slot_ptr + i).to(tl.int64)
            dst = tl.load(dst_slot_ptr + i).to(tl.int64)
            src_off = (src // block_size) * stride_block + (src % block_size) * stride_slot
            dst_off = (dst // block_size) * stride_block + (dst % block_size) * stride_slot
            rows = tl.load(base + src_off + inner, mask=mask)
            tl.store(base + dst_off + inner, rows, mask=mask)


def launch_meta(dtype: torch.dtype, heads: int, elems: int) -> dict[str, object]:
    """The kernel's compile-time parameters for caches of ``dtype`` with ``heads x elems`` per slot."""
    return {"ELEMS": elems, "NUM_ELEMS": heads * elems, "BLOCK": min(1024, triton.next_power_of_2(heads * elems)),
            "DTYPE": _TL_DTYPES[dtype]}


def kv_cache_pointers(kv_caches: list[torch.Tensor]) -> torch.Tensor:
    """[L] int64 base addresses of the layers' caches, on their device (build once; the caches never move).

    Asserts the caches share dtype, shape, strides and device (the kernel reads one layout)."""
    first = kv_caches[0]
    for cache in kv_caches[1:]:
        assert (cache.dtype, cache.shape, cache.stride(), cache.device) == (
            first.dtype, first.shape, first.stride(), first.device), "KV caches of one group must share a layout"
    return torch.tensor([c.data_ptr() for c in kv_caches], dtype=torch.int64, device=first.device)


def kv_path_commit(
        # [L] int64 base addresses from kv_cache_pointers
        kv_cache_ptrs: torch.Tensor,
        # one of the caches: [num_blocks, H_kv, block_size, E], for dtype, shape and strides
        kv_cache_like: torch.Tensor,
        # [Q * D] int64 source / destination slot per (request, depth), depth-major within a request
        src_slot: torch.Tensor, dst_slot: torch.Tensor,
        # [Q * D] bool: copy this pair
        moves: torch.Tensor,
        num_depths: int) -> None:
    """Copy ``slot src_slot[i] -> dst_slot[i]`` where ``moves[i]``, in every layer, depths ascending."""
    if triton is None:
        raise RuntimeError("kv_path_commit needs triton (pip install triton)")
    assert kv_cache_like.dim() == 4, f"kv cache must be [num_blocks, H_kv, block_size, E], got {kv_cache_like.shape}"
    assert kv_cache_like.dtype in _TL_DTYPES, f"kv cache dtype {kv_cache_like.dtype} not in {list(_TL_DTYPES)}"
    assert kv_cache_ptrs.dtype == torch.int64 and kv_cache_ptrs.dim() == 1, "kv_cache_ptrs must be [L] int64"
    pairs = src_slot.shape[0]
    assert dst_slot.shape == moves.shape == (pairs,) and src_slot.dim() == 1, (
        f"src_slot/dst_slot/moves must be [Q * D]: {src_slot.shape}, {dst_slot.shape}, {moves.shape}")
    assert num_depths > 0 and pairs % num_depths == 0, f"{pairs} pairs are not Q x {num_depths} depths"
    for t, name in ((kv_cache_ptrs, "kv_cache_ptrs"), (src_slot, "src_slot"), (dst_slot, "dst_slot"),
                    (moves, "moves")):
        assert t.device == kv_cache_like.device, f"{name} on {t.device}, caches on {kv_cache_like.device}"
    num_layers, num_reqs = kv_cache_ptrs.shape[0], pairs // num_depths
    if num_layers == 0 or num_reqs == 0:
        return
    _, heads, block_size, elems = kv_cache_like.shape
    s_block, s_head, s_slot, s_elem = kv_cache_like.stride()
    meta = launch_meta(kv_cache_like.dtype, heads, elems)
    grid = (num_layers, num_reqs, triton.cdiv(heads * elems, meta["BLOCK"]))
    _kv_path_commit_kernel[grid](
        kv_cache_ptrs, src_slot, dst_slot, moves, num_depths, block_size, s_block, s_head, s_slot, s_elem, **meta)
