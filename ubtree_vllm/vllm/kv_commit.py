"""Commit the accepted path's KV: node at depth d moves to the slot of position root_pos + d.

vLLM's invariant is that after a step the accepted tokens' KV sits at contiguous
positions ``num_computed .. num_computed + accepted`` (the scheduler then rolls
``num_computed`` back over the rejected slots, which are overwritten later). A chain
satisfies this for free; a tree verified node j of a request in row/slot
``root_row + j``, so the accepted node ``a_d`` at depth d must be copied to the slot
of row ``root_row + d``.

Two writers, chosen by the attention backend:

* :func:`commit_accepted_paths` (stash; CPU_ATTN, whose cache layout is tiled per ISA, and CPU_MLA):
  replays the fresh K/V stashed by the attention layers during the forward
  (:class:`ubtree_vllm.vllm.attention.state.StashedLayer`) through each layer's own
  ``impl.do_kv_cache_update`` (MLA: ``impl.ubtree_write_kv``, the latent rows). Pairs that need
  no copy get slot -1, which vLLM's cache writers skip.
* :func:`commit_accepted_paths_in_cache` (FLASH_ATTN's ``[num_blocks, H_kv, block_size,
  2 * head_size]`` cache): the stock forward already wrote every node's K/V at its linear
  slot, so the commit copies slot to slot inside the caches of all layers in one Triton
  launch (:mod:`ubtree_vllm.triton_ops.kv_path_commit`, which orders the copies so a
  destination that is also a source is read first), and nothing is stashed.

Both are fixed-shape and free of host syncs.
"""
from __future__ import annotations

import torch

from ubtree_vllm.triton_ops.kv_path_commit import kv_path_commit
from ubtree_vllm.vllm.attention.state import TreeForwardState
from ubtree_vllm.vllm.tree_plan import TreeStepPlan


def _commit_pairs(plan: TreeStepPlan, accepted_path: torch.Tensor,
                  num_accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, moves), each [Q * D] over the plan's stash rows (Q tree requests, D depths).

    src: stash index of the accepted node at each depth (the root's for depths past the
    accepted length); dst: stash index of that depth's own row; moves: the pair needs a copy.
    """
    device = accepted_path.device
    tree_req = torch.from_numpy(plan.is_tree.nonzero()[0]).to(device)  # [Q]
    offset = torch.from_numpy(plan.stash_offset).to(device)[tree_req]  # [Q]
    num_stash = len(plan.stash_rows)
    depth = torch.arange(1, accepted_path.shape[1], device=device)  # [D]
    path = accepted_path[tree_req, 1:]  # [Q, D]
    moves = (depth[None, :] <= num_accepted[tree_req, None]) & (path != depth[None, :])
    src = (offset[:, None] + path.clamp(min=0)).flatten()
    dst = (offset[:, None] + depth[None, :]).clamp(max=num_stash - 1).flatten()
    return src, dst, moves.flatten()


def commit_accepted_paths(state: TreeForwardState, plan: TreeStepPlan, accepted_path: torch.Tensor,
                          num_accepted: torch.Tensor) -> None:
    """Write every tree request's accepted nodes into the slots of depths 1..k (stash writer).

    accepted_path: [num_reqs, max_depth + 1] int64 node index at each depth, -1 padded;
    num_accepted:  [num_reqs] int64 accepted draft nodes (root excluded).
    """
    if not state.stash:
        return
    src, dst, moves = _commit_pairs(plan, accepted_path, num_accepted)
    for entry in state.stash.values():
        slots = torch.where(moves, entry.slots[dst], -1)
        layer = entry.layer
        write_mla = getattr(layer.impl, "ubtree_write_kv", None)  # MLA: vLLM's latent writer has its own signature
        if write_mla is not None:
            write_mla(layer, entry.key[src], entry.value[src], slots)
        else:
            layer.impl.do_kv_cache_update(layer, entry.key[src], entry.value[src], layer.kv_cache, slots)


def commit_accepted_paths_in_cache(kv_cache_ptrs: torch.Tensor, kv_cache_like: torch.Tensor,
                                   stash_slots: torch.Tensor, plan: TreeStepPlan, accepted_path: torch.Tensor,
                                   num_accepted: torch.Tensor) -> None:
    """In-cache writer for ``[num_blocks, H_kv, block_size, 2 * head_size]`` caches (FLASH_ATTN): one launch.

    kv_cache_ptrs: [L] int64 base addresses of the layers' caches
    (:func:`ubtree_vllm.triton_ops.kv_path_commit.kv_cache_pointers`), kv_cache_like: one of them;
    stash_slots: [num_stash] int64 KV slot each of the plan's stash rows was written to this step;
    accepted_path / num_accepted as in :func:`commit_accepted_paths`.
    """
    if len(plan.stash_rows) == 0:
        return
    src, dst, moves = _commit_pairs(plan, accepted_path, num_accepted)
    kv_path_commit(kv_cache_ptrs, kv_cache_like, stash_slots[src], stash_slots[dst], moves,
                   num_depths=accepted_path.shape[1] - 1)
