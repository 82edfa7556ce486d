"""Draft-tree topology: the flattened node list and the views derived from it.

A request's tree is a node list of length n = B + 1 in which node 0 is the root (the last
committed token, not yet seen by the target) and every parent precedes its children. So
the list is a valid "flattened" draft: slot j of the verification batch holds node j.

Contract shared by all stages (tensors are batched over N requests):
    tokens  [N, n] int64   token at each node (tokens[:, 0] = root token)
    parents [N, n] int64   parent node index, -1 for the root; parents[:, j] < j
    depth   [N, n] int64   0 for the root, depth[parent] + 1 otherwise
Positions for verification are root_position + depth.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """A batch of draft trees in flattened (parents-first) order."""

    # [N, n] int64
    tokens: torch.Tensor
    # [N, n] int64, -1 at the root
    parents: torch.Tensor
    # [N, n] int64
    depth: torch.Tensor
    # [N, n] float32 path log-prob of each node under the drafter (0 at the root)
    scores: torch.Tensor

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    def to(self, device: torch.device | str) -> "DraftTree":
        return DraftTree(*(t.to(device) for t in (self.tokens, self.parents, self.depth, self.scores)))


def ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Ancestor-or-self mask: mask[b, i, j] is True iff node j lies on the root->i path.

    parents: [N, n] int64 with -1 at the root; max_depth bounds the tree depth (the block
    size), so the loop count is static and the function never syncs with the host.
    Returns [N, n, n] bool.
    """
    num_reqs, n = parents.shape
    device = parents.device
    mask = torch.eye(n, dtype=torch.bool, device=device).expand(num_reqs, n, n).clone()
    rows = torch.arange(n, device=device).expand(num_reqs, n)
    batch = torch.arange(num_reqs, device=device)[:, None].expand(num_reqs, n)
    cur = parents.clone()
    for _ in range(max_depth):
        valid = cur >= 0
        # Non-root ancestors set their bit; the root-parent (-1) rows write the diagonal again.
        mask[batch, rows, torch.where(valid, cur, rows)] = True
        cur = torch.where(valid, parents.gather(1, cur.clamp(min=0)), cur)
    return mask


def path_to_root(parents: torch.Tensor, nodes: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Node indices on the root->node path, root first, padded with -1 at the end.

    parents: [N, n] int64; nodes: [N] int64. Returns [N, max_depth + 1] int64 where entry d
    is the ancestor at depth d (entry 0 is always the root, node 0).
    """
    num_reqs = parents.shape[0]
    depth = node_depth(parents, max_depth)
    cur = nodes.clone()
    cur_depth = depth.gather(1, nodes[:, None]).squeeze(1)  # [N]
    # One spare column (index max_depth + 1) absorbs the writes of finished rows.
    path = torch.full((num_reqs, max_depth + 2), -1, dtype=torch.long, device=parents.device)
    for _ in range(max_depth + 1):
        valid = cur >= 0
        path.scatter_(1, torch.where(valid, cur_depth, max_depth + 1)[:, None], cur[:, None])
        cur = torch.where(valid, parents.gather(1, cur.clamp(min=0)[:, None]).squeeze(1), cur)
        cur_depth = cur_depth - 1
    return path[:, : max_depth + 1]


def node_depth(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """Depth of every node from the parent pointers. [N, n] int64 -> [N, n] int64."""
    depth = torch.zeros_like(parents)
    cur = parents.clone()
    for _ in range(max_depth):
        valid = cur >= 0
        depth += valid.long()
        cur = torch.where(valid, parents.gather(1, cur.clamp(min=0)), cur)
    return depth


def check_topology(tree: DraftTree) -> None:
    """Raise ValueError if the batch violates the flattened-tree contract (tests, debugging).

    Checks: root at 0 with parent -1 and depth 0; parents precede children; depth is
    parent depth + 1; siblings carry distinct tokens.
    """
    parents, depth, tokens = tree.parents, tree.depth, tree.tokens
    n = parents.shape[1]
    if not (parents[:, 0] == -1).all() or not (depth[:, 0] == 0).all():
        raise ValueError("node 0 must be the root (parent -1, depth 0)")
    idx = torch.arange(n, device=parents.device)
    child = parents[:, 1:]
    if not ((child >= 0) & (child < idx[1:])).all():
        raise ValueError("every non-root node's parent must precede it")
    if not (depth[:, 1:] == depth.gather(1, child) + 1).all():
        raise ValueError("depth must equal parent depth + 1")
    same_parent = parents[:, :, None] == parents[:, None, :]
    same_token = tokens[:, :, None] == tokens[:, None, :]
    off_diag = ~torch.eye(n, dtype=torch.bool, device=parents.device)
    if (same_parent & same_token & off_diag).any():
        raise ValueError("siblings must carry distinct tokens")


def root_to_leaf_paths(parents: list[int]) -> list[list[int]]:
    """All root->leaf node paths of one tree (host-side helper for tests and tooling)."""
    children: dict[int, list[int]] = {i: [] for i in range(len(parents))}
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    paths, stack = [], [[0]]
    while stack:
        path = stack.pop()
        kids = children[path[-1]]
        if not kids:
            paths.append(path)
        stack.extend(path + [k] for k in reversed(kids))
    return paths
