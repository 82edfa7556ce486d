"""Where the accepted path of each tree request moves, one launch (the fused forms of
``vllm.mrv2.tree_layout.commit_pairs`` and ``linearise_rows``, ~30 small kernels each).

Request r's logits rows are ``logits_indices[cu[r]:cu[r + 1]]``, its root at row
``root = logits_indices[cu[r]]`` and node j at row ``root + j``. After the acceptance walk,
``accepted_path[r, d]`` is the accepted node at depth d for d <= ``num_accepted[r]``. Pair
(r, d), d = 1..max_depth, is *accepted* when d <= num_accepted[r] and the node is one of the
request's logits rows (then so is row root + d: nodes are parents-first, node >= d).

* :func:`accepted_commit_pairs` -> (src_slot, dst_slot, moves) ``[R * max_depth]``, depth-major
  per request: the node's KV moves from the slot of row ``root + node`` to the slot of row
  ``root + d``; ``moves`` is False where the pair is not accepted or the node is already there
  (both slots are then the root's, or row root + d's), ready for ``kv_path_commit``.
* :func:`accepted_row_permutation` -> ``perm [num_tokens]``: identity except
  ``perm[root + d] = root + node`` for accepted pairs (``hidden[perm]`` lays the accepted path
  out as a chain); given ``positions``, the same launch also restores the linear positions
  ``positions[root + j] = positions[root] + j`` of every logits row (the oracle:
  ``vllm.mrv2.speculator.linear_logits_positions_``).

One program per request, lanes over depths. The launchers read no device value. Test
oracles: ``commit_pairs`` / ``linearise_rows`` (torch, tests/unit/test_mrv2_tree_layout.py).
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

NODE_BLOCK = 64  # logits rows per step of the positions loop

if triton is not None:
    @triton.jit
    def _accepted_rows_kernel(
            slot_mapping_ptr, logits_indices_ptr, cu_ptr, path_ptr, stride_path, num_accepted_ptr,
            src_ptr, dst_ptr, moves_ptr, perm_ptr, positions_ptr,
            MAX_DEPTH: tl.constexpr, DEPTH_PAD: tl.constexpr, WRITE_PAIRS: tl.constexpr,
            WRITE_PERM: tl.constexpr, WRITE_POS: tl.constexpr, NODE_BLOCK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        d = 1 + tl.arange(0, DEPTH_PAD).to(tl.int64)  # [DEPTH_PAD] depths 1..
        in_depth = d <= MAX_DEPTH
        start = tl.load(cu_ptr + r).to(tl.int64)
        num_nodes = tl.load(cu_ptr + r + 1).to(tl.int64) - start
        root = tl.load(logits_indices_ptr + start).to(tl.int64)
        accepted_count = tl.load(num_accepted_ptr + r).to(tl.int64)
        node = tl.load(path_ptr + r * stride_path + d, mask=in_depth, other=0).to(tl.int64)
        accepted = in_depth & (d <= accepted_count) & (node < num_nodes)
        if WRITE_PAIRS:
            src = tl.load(slot_mapping_ptr + root + tl.where(accepted, node, 0), mask=in_depth, other=0)
            dst = tl.load(slot_mapping_ptr + root + tl.where(accepted, d, 0), mask=in_depth, other=0)
            out = r * MAX_DEPTH + d - 1
            tl.store(src_ptr + out, src.to(tl.int64), mask=in_depth)
            tl.store(dst_ptr + out, dst.to(tl.int64), mask=in_depth)
            tl.store(moves_ptr + out, accepted & (node != d), mask=in_depth)
        if WRITE_PERM:
            tl.store(perm_ptr + root + d, root + node, mask=accepted)
        if WRITE_POS:  # linear positions of the request's logits rows (the root's is read, never written)
            root_pos = tl.load(positions_ptr + root).to(tl.int64)
            for j0 in range(1, num_nodes, NODE_BLOCK):
                j = j0 + tl.arange(0, NODE_BLOCK).to(tl.int64)
                tl.store(positions_ptr + root + j, root_pos + j, mask=j < num_nodes)


def _check(logits_indices: torch.Tensor, cu_num_logits: torch.Tensor, accepted_path: torch.Tensor,
           num_accepted: torch.Tensor, max_depth: int) -> int:
    """Shared contract of both launchers; returns R."""
    if triton is None:
        raise RuntimeError("accepted_rows needs triton (pip install triton); use vllm.mrv2.tree_layout")
    num_reqs = cu_num_logits.shape[0] - 1
    for name, t in (("logits_indices", logits_indices), ("cu_num_logits", cu_num_logits),
                    ("num_accepted", num_accepted)):
        assert t.dim() == 1 and t.is_contiguous() and not t.is_floating_point(), \
            f"{name} must be a contiguous 1-D integer tensor, got {t.dtype} {tuple(t.shape)}"
    assert num_accepted.shape == (num_reqs,), f"num_accepted must be [R = {num_reqs}], got {tuple(num_accepted.shape)}"
    assert accepted_path.dim() == 2 and accepted_path.shape[0] == num_reqs and accepted_path.stride(1) == 1 \
        and accepted_path.shape[1] >= max_depth + 1 and not accepted_path.is_floating_point(), \
        f"accepted_path must be [R, >= max_depth + 1] integer with contiguous rows, got {tuple(accepted_path.shape)}"
    assert max_depth >= 1, f"max_depth must be >= 1, got {max_depth}"
    assert all(t.device == logits_indices.device for t in (cu_num_logits, accepted_path, num_accepted)), \
        "all tensors must be on one device"
    return num_reqs


def _meta(max_depth: int) -> dict[str, int]:
    return {"MAX_DEPTH": max_depth, "DEPTH_PAD": triton.next_power_of_2(max_depth), "NODE_BLOCK": NODE_BLOCK}


def accepted_commit_pairs(
        # [T_pad] int KV slot of each token row (one KV cache group)
        slot_mapping: torch.Tensor,
        # [L] int, [R + 1] int: the step's logits rows
        logits_indices: torch.Tensor, cu_num_logits: torch.Tensor,
        # [R, >= max_depth + 1] int accepted node per depth; [R] int accepted drafts
        accepted_path: torch.Tensor, num_accepted: torch.Tensor,
        max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src_slot int64, dst_slot int64, moves bool), each ``[R * max_depth]`` (see the module docstring)."""
    num_reqs = _check(logits_indices, cu_num_logits, accepted_path, num_accepted, max_depth)
    assert slot_mapping.dim() == 1 and slot_mapping.is_contiguous() and slot_mapping.device == logits_indices.device, \
        f"slot_mapping must be a contiguous [T_pad] tensor on {logits_indices.device}"
    device = logits_indices.device
    src = torch.empty(num_reqs * max_depth, dtype=torch.int64, device=device)
    dst = torch.empty_like(src)
    moves = torch.empty(num_reqs * max_depth, dtype=torch.bool, device=device)
    if num_reqs:
        _accepted_rows_kernel[(num_reqs,)](
            slot_mapping, logits_indices, cu_num_logits, accepted_path, accepted_path.stride(0), num_accepted,
            src, dst, moves, src, src, WRITE_PAIRS=True, WRITE_PERM=False, WRITE_POS=False, **_meta(max_depth))
    return src, dst, moves


def accepted_row_permutation(
        num_tokens: int,
        # [L] int, [R + 1] int, [R, >= max_depth + 1] int, [R] int: as in accepted_commit_pairs
        logits_indices: torch.Tensor, cu_num_logits: torch.Tensor, accepted_path: torch.Tensor,
        num_accepted: torch.Tensor, max_depth: int,
        # [T_pad] int64, mutated: the logits rows' linear positions restored (module docstring); None: untouched
        positions: torch.Tensor | None = None) -> torch.Tensor:
    """``perm [num_tokens]`` int64 (see the module docstring); rows past num_tokens are never written."""
    num_reqs = _check(logits_indices, cu_num_logits, accepted_path, num_accepted, max_depth)
    if positions is not None:
        assert positions.dim() == 1 and positions.is_contiguous() and positions.dtype == torch.int64 \
            and positions.device == logits_indices.device, \
            f"positions must be a contiguous int64 [T_pad] tensor on {logits_indices.device}"
    # [num_tokens + 1]: accepted rows are logits rows, all < num_tokens; the spare entry keeps the
    # allocation non-empty for a step without tokens
    perm = torch.arange(num_tokens + 1, dtype=torch.int64, device=logits_indices.device)
    if num_reqs:
        _accepted_rows_kernel[(num_reqs,)](
            perm, logits_indices, cu_num_logits, accepted_path, accepted_path.stride(0), num_accepted,
            perm, perm, perm, perm, perm if positions is None else positions, WRITE_PAIRS=False, WRITE_PERM=True,
            WRITE_POS=positions is not None, **_meta(max_depth))
    return perm[:num_tokens]
