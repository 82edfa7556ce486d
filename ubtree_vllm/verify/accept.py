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

    tree: N flattened trees with n nodes; target_tokens: [N, n] the target's draw at each node;
    max_depth: static bound on tree depth (the block size), so the loop never syncs.
    """
    num_reqs = tree.tokens.shape[0]
    device = tree.tokens.device
    cur = torch.zeros(num_reqs, dtype=torch.long, device=device)
    alive = torch.ones(num_reqs, dtype=torch.bool, device=device)
    path = torch.full((num_reqs, max_depth + 1), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    out = torch.full((num_reqs, max_depth + 1), -1, dtype=torch.long, device=device)
    num_accepted = torch.zeros(num_reqs, dtype=torch.long, device=device)
    for d in range(1, max_depth + 1):
        want = target_tokens.gather(1, cur[:, None])  # [N, 1]
        match = (tree.parents == cur[:, None]) & (tree.tokens == want) & alive[:, None]
        found = match.any(dim=1)
        child = match.long().argmax(dim=1)  # siblings are distinct: at most one match
        out[:, d - 1] = torch.where(found, want.squeeze(1), out[:, d - 1])
        path[:, d] = torch.where(found, child, path[:, d])
        cur = torch.where(found, child, cur)
        num_accepted += found.long()
        alive &= found
    bonus = target_tokens.gather(1, cur[:, None]).squeeze(1)
    out.scatter_(1, num_accepted[:, None], bonus[:, None])
    return AcceptResult(accepted_path=path, num_accepted=num_accepted, output_tokens=out, last_node=cur)
