"""Commit each tree request's accepted path in one launch: its KV in every layer, its hidden-row
permutation and its linear positions (the fused form of ``vllm.mrv2.tree_layout.commit_pairs`` +
``kv_path_commit`` + ``linearise_rows``, which were three launches and four allocations a step).

Request r's logits rows are ``logits_indices[cu[r]:cu[r + 1]]``, its root at row
``root = logits_indices[cu[r]]`` and node j at row ``root + j``. After the acceptance walk,
``accepted_path[r, d]`` is the accepted node at depth d for d <= ``num_accepted[r]``. Depth d,
d = 1..max_depth, is *accepted* when d <= num_accepted[r] and the node is one of the request's
logits rows (then so is row root + d: nodes are parents-first, node >= d).

:func:`commit_accepted_paths` does, for every accepted depth d with node != d:

* **KV**: in every layer whose cache base address is in ``kv_cache_ptrs``, the ``[H_kv, E]``
  contents of the slot of row ``root + node`` are copied to the slot of row ``root + d``
  (``slot_mapping``), so vLLM finds the accepted node at depth d where a chain would have put it;
* **rows**: ``perm[root + d] = root + node`` (``perm`` is the identity elsewhere;
  ``hidden[perm]`` lays the accepted path out as a chain, for the drafter's context);
* **positions** (given): every logits row's linear position is restored,
  ``positions[root + j] = positions[root] + j`` (the tree layout had written root + depth).

Grid ``(L + 1, R, cdiv(H_kv * E, BLOCK))``. Program ``(l < L, r, c)`` moves feature chunk c of
request r in layer l, walking depths in ascending order with the same element offsets and thread
layout at every depth, so a row is read before it is overwritten: a destination may also be the
source of a shallower depth of the same request (path [0, 2, 5]: depth 1 reads row 2, which depth
2 overwrites), while a later depth never reads an overwritten row (the accepted node at depth d
has index >= d > every row written before). Program ``(L, r, 0)`` writes request r's ``perm`` and
positions; slots are read from ``slot_mapping``, never from positions, so the programs are
independent. The launcher reads no device value.
Test oracle: ``commit_pairs`` + ``reference.kv_path_commit_reference`` + ``linearise_rows``
(tests/triton/test_mrv2_rows.py).
"""
from __future__ import annotations

import torch

from ubtree_vllm.triton_ops.kv_path_commit import launch_meta as kv_launch_meta

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

NODE_BLOCK = 64  # logits rows per step of the positions loop

if triton is not None:
    @triton.jit
    def _commit_accepted_kernel(
            kv_cache_ptrs,  # [L] int64 base addresses
            slot_mapping_ptr, logits_indices_ptr, cu_ptr, path_ptr, stride_path, num_accepted_ptr,
            perm_ptr, positions_ptr,
            num_layers, block_size, stride_block, stride_head, stride_slot, stride_elem,
            MAX_DEPTH: tl.constexpr, DEPTH_PAD: tl.constexpr, NODE_BLOCK: tl.constexpr, WRITE_POS: tl.constexpr,
            ELEMS: tl.constexpr, NUM_ELEMS: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
        layer = tl.program_id(0)
        r = tl.program_id(1).to(tl.int64)
        chunk = tl.program_id(2)
        start = tl.load(cu_ptr + r).to(tl.int64)
        num_nodes = tl.load(cu_ptr + r + 1).to(tl.int64) - start
        root = tl.load(logits_indices_ptr + start).to(tl.int64)
        accepted_count = tl.load(num_accepted_ptr + r).to(tl.int64)
        if layer < num_layers:  # the KV of one layer, one feature chunk, depths ascending (module docstring)
            base = tl.load(kv_cache_ptrs + layer).to(tl.pointer_type(DTYPE))
            offs = chunk * BLOCK + tl.arange(0, BLOCK)
            in_range = offs < NUM_ELEMS
            inner = (offs // ELEMS).to(tl.int64) * stride_head + (offs % ELEMS).to(tl.int64) * stride_elem  # [BLOCK]
            for d in range(1, MAX_DEPTH + 1):
                node = tl.load(path_ptr + r * stride_path + d).to(tl.int64)
                move = (d <= accepted_count) & (node < num_nodes) & (node != d)
                src = tl.load(slot_mapping_ptr + root + tl.where(move, node, 0)).to(tl.int64)
                dst = tl.load(slot_mapping_ptr + root + tl.where(move, d, 0)).to(tl.int64)
                src_off = (src // block_size) * stride_block + (src % block_size) * stride_slot
                dst_off = (dst // block_size) * stride_block + (dst % block_size) * stride_slot
                mask = in_range & (offs * 0 + move.to(tl.int32) > 0)  # [BLOCK] (a scalar mask, broadcast)
                rows = tl.load(base + src_off + inner, mask=mask)
                tl.store(base + dst_off + inner, rows, mask=mask)
        elif chunk == 0:  # the request's hidden-row permutation and linear positions
            d = 1 + tl.arange(0, DEPTH_PAD).to(tl.int64)  # [DEPTH_PAD] depths 1..
            in_depth = d <= MAX_DEPTH
            node = tl.load(path_ptr + r * stride_path + d, mask=in_depth, other=0).to(tl.int64)
            accepted = in_depth & (d <= accepted_count) & (node < num_nodes)
            tl.store(perm_ptr + root + d, root + node, mask=accepted)
            if WRITE_POS:  # the root's position is read, never written
                root_pos = tl.load(positions_ptr + root).to(tl.int64)
                for j0 in range(1, num_nodes, NODE_BLOCK):
                    j = j0 + tl.arange(0, NODE_BLOCK).to(tl.int64)
                    tl.store(positions_ptr + root + j, root_pos + j, mask=j < num_nodes)


def launch_meta(max_depth: int, dtype: torch.dtype, heads: int, elems: int, write_pos: bool) -> dict[str, object]:
    """The kernel's compile-time parameters: depths, and the cache layout's (``kv_path_commit.launch_meta``)."""
    return {"MAX_DEPTH": max_depth, "DEPTH_PAD": triton.next_power_of_2(max_depth), "NODE_BLOCK": NODE_BLOCK,
            "WRITE_POS": write_pos, **kv_launch_meta(dtype, heads, elems)}


def commit_accepted_paths(
        # [L] int64 base addresses (kv_path_commit.kv_cache_pointers) and one of the caches,
        # [num_blocks, H_kv, block_size, E], for dtype, shape and strides
        kv_cache_ptrs: torch.Tensor, kv_cache_like: torch.Tensor,
        # [T_pad] int KV slot of each token row (the caches' KV cache group)
        slot_mapping: torch.Tensor,
        num_tokens: int,
        # [L] int, [R + 1] int: the step's logits rows
        logits_indices: torch.Tensor, cu_num_logits: torch.Tensor,
        # [R, >= max_depth + 1] int accepted node per depth (contiguous rows); [R] int accepted drafts
        accepted_path: torch.Tensor, num_accepted: torch.Tensor,
        max_depth: int,
        # [T_pad] int64, mutated: the logits rows' linear positions restored; None: untouched
        positions: torch.Tensor | None = None) -> torch.Tensor:
    """Move the accepted KV, restore the positions; returns ``perm [num_tokens]`` int64 (module docstring)."""
    if triton is None:
        raise RuntimeError("accepted_rows needs triton (pip install triton); use vllm.mrv2.tree_layout")
    num_reqs = cu_num_logits.shape[0] - 1
    device = logits_indices.device
    for name, t in (("slot_mapping", slot_mapping), ("logits_indices", logits_indices),
                    ("cu_num_logits", cu_num_logits), ("num_accepted", num_accepted)):
        assert t.dim() == 1 and t.is_contiguous() and not t.is_floating_point() and t.device == device, \
            f"{name} must be a contiguous 1-D integer tensor on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
    assert num_accepted.shape == (num_reqs,), f"num_accepted must be [R = {num_reqs}], got {tuple(num_accepted.shape)}"
    assert accepted_path.dim() == 2 and accepted_path.shape[0] == num_reqs and accepted_path.stride(1) == 1 \
        and accepted_path.shape[1] >= max_depth + 1 and not accepted_path.is_floating_point() \
        and accepted_path.device == device, \
        f"accepted_path must be [R, >= max_depth + 1] integer with contiguous rows, got {tuple(accepted_path.shape)}"
    assert max_depth >= 1, f"max_depth must be >= 1, got {max_depth}"
    if positions is not None:
        assert positions.dim() == 1 and positions.is_contiguous() and positions.dtype == torch.int64 \
            and positions.device == device, f"positions must be a contiguous int64 [T_pad] tensor on {device}"
    assert kv_cache_like.dim() == 4, f"kv cache must be [num_blocks, H_kv, block_size, E], got {kv_cache_like.shape}"
    assert kv_cache_ptrs.dtype == torch.int64 and kv_cache_ptrs.dim() == 1 and kv_cache_ptrs.device == device, \
        f"kv_cache_ptrs must be [L] int64 on {device}"
    # [num_tokens + 1]: accepted rows are logits rows, all < num_tokens; the spare entry keeps the
    # allocation non-empty for a step without tokens
    perm = torch.arange(num_tokens + 1, dtype=torch.int64, device=device)
    if num_reqs:
        _, heads, block_size, elems = kv_cache_like.shape
        s_block, s_head, s_slot, s_elem = kv_cache_like.stride()
        meta = launch_meta(max_depth, kv_cache_like.dtype, heads, elems, positions is not None)
        num_layers = kv_cache_ptrs.shape[0]
        grid = (num_layers + 1, num_reqs, triton.cdiv(heads * elems, meta["BLOCK"]))
        _commit_accepted_kernel[grid](
            kv_cache_ptrs, slot_mapping, logits_indices, cu_num_logits, accepted_path, accepted_path.stride(0),
            num_accepted, perm, perm if positions is None else positions, num_layers, block_size, s_block, s_head,
            s_slot, s_elem, **meta)
    return perm[:num_tokens]
