"""Commit the accepted path's KV: node at depth d moves to the slot of position root_pos + d.

vLLM's invariant is that after a step the accepted tokens' KV sits at contiguous
positions ``num_computed .. num_computed + accepted`` (the scheduler then rolls
``num_computed`` back over the rejected slots, which are overwritten later). A chain
satisfies this for free; a tree verified node j of a request in row/slot
``root_row + j``, so the accepted node ``a_d`` at depth d must be copied to the slot
of row ``root_row + d``.

The copy replays the fresh K/V stashed by the attention layers during the forward
(:class:`ubtree_vllm.vllm.attention.state.StashedLayer`) through each layer's own
``impl.do_kv_cache_update`` -- the only layout-agnostic writer (CPU_ATTN tiles keys per
ISA). Reading from the stash, not the cache, makes the order of the copies irrelevant.
Pairs that need no copy (the node already sits at its depth, or the depth is beyond the
accepted length) get slot -1, which vLLM's cache writers skip, so the whole commit is a
fixed-shape gather and one write per layer, without host syncs.
"""
from __future__ import annotations

import torch

from ubtree_vllm.vllm.attention.state import TreeForwardState
from ubtree_vllm.vllm.tree_plan import TreeStepPlan


def commit_accepted_paths(state: TreeForwardState, plan: TreeStepPlan, accepted_path: torch.Tensor,
                          num_accepted: torch.Tensor) -> None:
    """Write every tree request's accepted nodes into the slots of depths 1..k.

    accepted_path: [num_reqs, max_depth + 1] int64 node index at each depth, -1 padded;
    num_accepted:  [num_reqs] int64 accepted draft nodes (root excluded).
    """
    if not state.stash:
        return
    device = accepted_path.device
    tree_req = torch.from_numpy(plan.is_tree.nonzero()[0]).to(device)  # [Q]
    offset = torch.from_numpy(plan.stash_offset).to(device)[tree_req]  # [Q]
    num_stash = len(plan.stash_rows)
    depth = torch.arange(1, accepted_path.shape[1], device=device)  # [D]
    path = accepted_path[tree_req, 1:]  # [Q, D]
    moves = (depth[None, :] <= num_accepted[tree_req, None]) & (path != depth[None, :])
    src = (offset[:, None] + path.clamp(min=0)).flatten()  # stash index of the accepted node
    dst = (offset[:, None] + depth[None, :]).clamp(max=num_stash - 1).flatten()  # stash index of its depth
    moves = moves.flatten()
    for entry in state.stash.values():
        slots = torch.where(moves, entry.slots[dst], -1)
        layer = entry.layer
        layer.impl.do_kv_cache_update(layer, entry.key[src], entry.value[src], layer.kv_cache, slots)
