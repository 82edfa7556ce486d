"""Gated delta rule over a draft tree without per-node states: each node recomputes its root path.

The cheaper state form of :mod:`ubtree_vllm.triton_ops.tree_delta_rule` (same recurrence, same
arguments). That kernel walks a tree's nodes in order and keeps every node's state
``[T, H, Dk, Dv]`` float32 in memory, so its children can start from it: at Qwen3-Next's shapes
(32 heads of 128 x 128) 2 MiB per node and layer, 130 MiB for a 65-node tree. Here one program
per (node, head, Dv tile) starts from the committed state and applies the updates of the node's
root path (at most ``MAX_DEPTH + 1`` tokens, the root included), so no state is written at all:
the per-step memory is the outputs. The work grows from T to the sum of path lengths (about
T x mean depth) updates, spread over T times more programs. After acceptance,
:func:`commit_tree_state_by_path` recomputes the accepted node's path once more and writes only
its state into the layer's state cache.

A path deeper than ``max_depth + 1`` tokens (a layout the caller promised not to send) gives NaN
outputs and a NaN state, never a silently truncated recurrence. The launchers read no device
value. Torch twins: ``reference.tree_gated_delta_rule_reference`` (the outputs) and
``reference.gated_delta_rule_chain_reference`` along the accepted path (the commit).
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

from ubtree_vllm.triton_ops.tree_delta_rule import check_tree_delta_shapes, launch_meta

if triton is not None:
    from ubtree_vllm.triton_ops.tree_delta_rule import delta_rule_step

if triton is not None:
    @triton.jit
    def _tree_delta_rule_paths_kernel(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, parents_ptr, h0_ptr, node_ptr, out_ptr, slot_ptr, scale,
            T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            PER_CHANNEL_GATE: tl.constexpr, DELTA: tl.constexpr, MAX_PATH: tl.constexpr, COMMIT: tl.constexpr):
        # COMMIT=False: program row r = n * T + t, node t of request n, writes o[n, t] (out [N, T, H, Dv]).
        # COMMIT=True: program row r = n, node node_ptr[n], writes its state to out[slot_ptr[n]] ([S, H, Dk, Dv]).
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        iv = tl.program_id(2).to(tl.int64)
        if COMMIT:
            n = r
            last = tl.load(node_ptr + n).to(tl.int64)
        else:
            n = r // T
            last = r % T
        ok = tl.arange(0, BK)
        ov = iv * BV + tl.arange(0, BV)
        mk, mv = ok < DK, ov < DV
        mkv = mk[:, None] & mv[None, :]
        state_off = ok[:, None] * DV + ov[None, :]  # [BK, BV] inside one [DK, DV] state
        state = tl.load(h0_ptr + (n * H + h) * DK * DV + state_off, mask=mkv, other=0.0).to(tl.float32)
        for i in tl.static_range(MAX_PATH):  # the ancestor at distance MAX_PATH - 1 - i, oldest first
            node = last
            for _ in tl.static_range(MAX_PATH - 1 - i):
                up = tl.load(parents_ptr + n * T + tl.maximum(node, 0)).to(tl.int64)
                node = tl.where(node >= 0, up, -1)
            # off the path (a shallower node): node 0's row is read and its update discarded
            tok = (n * T + tl.maximum(node, 0)) * H + h
            after = delta_rule_step(state, k_ptr, v_ptr, g_ptr, beta_ptr, tok, ok, ov, mk, mv, DK, DV,
                                    PER_CHANNEL_GATE, DELTA)
            state = tl.where(node >= 0, after, state)
        # a path longer than MAX_PATH: the root's parent is not the committed state -> NaN, never truncated
        node = last
        for _ in tl.static_range(MAX_PATH):
            up = tl.load(parents_ptr + n * T + tl.maximum(node, 0)).to(tl.int64)
            node = tl.where(node >= 0, up, -1)
        state = tl.where(node >= 0, float("nan"), state)
        if COMMIT:
            slot = tl.load(slot_ptr + n).to(tl.int64)
            tl.store(out_ptr + (slot * H + h) * DK * DV + state_off, state.to(out_ptr.dtype.element_ty), mask=mkv)
        else:
            tok = (n * T + last) * H + h
            q = tl.load(q_ptr + tok * DK + ok, mask=mk, other=0.0).to(tl.float32)
            o = tl.sum(state * q[:, None], axis=0) * scale
            tl.store(out_ptr + tok * DV + ov, o.to(out_ptr.dtype.element_ty), mask=mv)


def paths_launch_meta(dk: int, dv: int, num_heads: int, per_channel: bool, delta: bool, max_depth: int,
                      commit: bool) -> dict[str, object]:
    """Compile-time parameters (shared with compile_check): the tree kernel's tiles, the path bound."""
    return {**launch_meta(dk, dv, num_heads, per_channel, delta), "MAX_PATH": max_depth + 1, "COMMIT": commit}


def _launch(q, k, v, g, beta, parents, initial_state, node, out, slot, scale, delta, max_depth, commit, rows):
    num_heads, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    meta = paths_launch_meta(dk, dv, num_heads, g.dim() == 4, delta, max_depth, commit)
    grid = (rows, num_heads, triton.cdiv(dv, meta["BV"]))
    _tree_delta_rule_paths_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        parents.to(torch.int64).contiguous(), initial_state.float().contiguous(), node, out, slot, float(scale),
        q.shape[1], **meta)


def tree_gated_delta_rule_paths(
        # [N, T, H, Dk] queries and keys, [N, T, H, Dv] values, [N, T, H] or [N, T, H, Dk] log-decays, [N, T, H] betas
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
        # [N, T] parent of each node, -1 = the committed state; parents[n, t] < t; root paths <= max_depth + 1 nodes
        parents: torch.Tensor,
        # [N, H, Dk, Dv] committed states
        initial_state: torch.Tensor, scale: float, max_depth: int, delta: bool = True) -> torch.Tensor:
    """o [N, T, H, Dv] in v's dtype, equal to :func:`tree_gated_delta_rule`'s (module docstring); one launch."""
    check_tree_delta_shapes(q, k, v, g, beta, parents, initial_state)
    o = torch.empty_like(v)
    if q.shape[0] * q.shape[1] == 0:
        return o
    _launch(q, k, v, g, beta, parents, initial_state, parents, o, parents, scale, delta, max_depth, False,
            q.shape[0] * q.shape[1])
    return o


def commit_tree_state_by_path(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, parents: torch.Tensor,
        initial_state: torch.Tensor, max_depth: int,
        # [N] deepest accepted node (>= 0: the root is always accepted), [N] the request's state-cache slot
        accepted_node: torch.Tensor, cache_slot: torch.Tensor,
        # [S, H, Dk, Dv] the layer's state cache (mutated: only the requests' slots)
        state_cache: torch.Tensor, delta: bool = True) -> None:
    """Write each request's accepted state, recomputed along its root path, into ``state_cache``; one launch."""
    check_tree_delta_shapes(q, k, v, g, beta, parents, initial_state)
    if accepted_node.shape != (q.shape[0],) or cache_slot.shape != (q.shape[0],):
        raise ValueError(f"accepted_node {tuple(accepted_node.shape)} and cache_slot {tuple(cache_slot.shape)} must "
                         f"be [N={q.shape[0]}]")
    if state_cache.shape[1:] != initial_state.shape[1:] or not state_cache.is_contiguous():
        heads, dk, dv = initial_state.shape[1:]
        raise ValueError(f"state_cache must be a contiguous [S, H, Dk, Dv] = [S, {heads}, {dk}, {dv}], "
                         f"got {tuple(state_cache.shape)}")
    if q.shape[0] == 0:
        return
    _launch(q, k, v, g, beta, parents, initial_state, accepted_node.to(torch.int64).contiguous(), state_cache,
            cache_slot.to(torch.int64).contiguous(), 1.0, delta, max_depth, True, q.shape[0])
