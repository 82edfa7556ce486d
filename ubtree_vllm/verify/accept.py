"""Tree acceptance: the longest branch the target agrees with, plus one bonus token.

Rule (lossless at every temperature). The target's token x_u is drawn at every node u,
independently, exactly as non-speculative decoding would draw it after the root->u path
(argmax at T=0). The walk starts at the root; while the current node has a child whose
token equals x_u, it moves there; at the first node without such a child it emits x_u.

Why it is exact: the tree does not depend on the target's draws, siblings are distinct, and
each draw x_u has the target's distribution given the root->u path. The emitted sequence
is x_root, x_child, ... i.e. each token drawn from the target given all tokens before it,
which is the definition of autoregressive sampling. At T=0 this is the longest path
matching the target's argmax at every node. For deterministic candidates the acceptance
probability at a node, sum over children c of p(c), is the best any lossless rule reaches.

Computation (no loop over depths, no host sync, a fixed ~40 kernels). A node j is
*accepted* iff every node on the root->j path (root excluded) carries the draw of its
parent. Because siblings are distinct, the accepted nodes form one root-anchored path,
which is exactly the walk above; its deepest node is where the walk stops. "Every
ancestor matches" is an AND along parent pointers, computed by pointer jumping in
ceil(log2(max_depth + 1)) rounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ubtree_vllm.tree.topology import DraftTree


@dataclass
class AcceptResult:
    # [N, max_depth + 1] int64 node indices root->last accepted node; -1 padded
    accepted_path: torch.Tensor
    # [N] int64 number of accepted draft nodes (root excluded)
    num_accepted: torch.Tensor
    # [N, max_depth + 1] int64 tokens to emit: accepted draft tokens then the bonus; -1 padded
    output_tokens: torch.Tensor
    # [N] int64 index of the last accepted node (0 = root only)
    last_node: torch.Tensor


def accept_tree(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int) -> AcceptResult:
    """Walk each tree along the target's draws.

    tree: N flattened trees with n nodes (parents < 0 except the root's -1 mark padding
    nodes, which are never accepted); target_tokens: [N, n] the target's draw at each node;
    max_depth: static bound on tree depth (the block size).
    """
    num_reqs, n = tree.tokens.shape
    device = tree.tokens.device
    node = torch.arange(n, device=device)
    is_root = node[None, :] == 0  # [1, n]
    has_parent = tree.parents >= 0  # [N, n]
    parent = torch.where(has_parent, tree.parents, 0)  # root and padding point at the root
    # bad[j]: node j's own edge fails (its token is not the draw at its parent).
    bad = ~is_root & (~has_parent | (tree.tokens != target_tokens.gather(1, parent)))
    # Pointer jumping: after round r, bad[j] covers the 2^r nearest nodes of the root->j path.
    jump = parent
    for _ in range(max(1, max_depth).bit_length()):
        bad = bad | bad.gather(1, jump)
        jump = jump.gather(1, jump)
    accepted = ~bad  # [N, n]; a single root-anchored path
    depth = torch.where(accepted, tree.depth, -1)
    num_accepted, last = depth.max(dim=1)  # deepest accepted node; root (depth 0) at least
    # Path: accepted node at each depth (scatter by depth; non-path nodes go to a spill column).
    path = torch.full((num_reqs, max_depth + 2), -1, dtype=torch.long, device=device)
    spill = torch.where(accepted, tree.depth.clamp(max=max_depth), max_depth + 1)
    path.scatter_(1, spill, node.expand(num_reqs, n).clone())
    path = path[:, : max_depth + 1]
    # Tokens: accepted draft tokens (depths 1..k), then the bonus draw at the last node.
    out = torch.where(path[:, 1:] >= 0, tree.tokens.gather(1, path[:, 1:].clamp(min=0)), -1)
    out = torch.cat([out, torch.full((num_reqs, 1), -1, dtype=torch.long, device=device)], dim=1)
    bonus = target_tokens.gather(1, last[:, None])
    out.scatter_(1, num_accepted[:, None], bonus)
    return AcceptResult(accepted_path=path, num_accepted=num_accepted, output_tokens=out, last_node=last)


def walk_trees(parents: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor, target_tokens: torch.Tensor,
               max_depth: int) -> AcceptResult:
    """:func:`accept_tree` over raw ``[N, n]`` parents / tokens / depth; on CUDA from one Triton launch
    (``triton_ops/tree_accept.py``, same result; compiled per ``max_depth``, so pass a static bound there)."""
    if not target_tokens.is_cuda:
        tree = DraftTree(tokens=tokens, parents=parents, depth=depth,
                         scores=torch.zeros_like(tokens, dtype=torch.float32))
        return accept_tree(tree, target_tokens, max_depth)
    from ubtree_vllm.triton_ops.tree_accept import tree_accept

    return AcceptResult(*tree_accept(parents.contiguous(), tokens.contiguous(), target_tokens, max_depth))
