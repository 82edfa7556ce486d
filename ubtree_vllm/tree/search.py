"""Tree construction: depth-wise beam over the candidate lattice, then global pruning to B nodes.

No neural compute; batched over requests; a static number of steps (gamma), so nothing
syncs with the host.

Scores. A node's score is its path log-prob: the sum of normalized edge log-probs from the
root. Edge log-probs are <= 0, so a child never outscores its parent.

Beam. Depth 1 keeps the best min(W, K) root edges. Depth d keeps the best W of all K
extensions of the depth d-1 beam. Every beam entry at every depth is a tree node.

Pruning. The B best nodes overall are kept. Ties are broken by a fixed rule, lower
(depth, beam rank) first, implemented as a stable sort over a depth-major node list; since
a parent is never worse than its child and always comes earlier in that list, the kept
set is closed under ancestors, i.e. a tree. Identical inputs give identical trees on every
tensor-parallel rank.

Order. Nodes 1..B are numbered by that rank, best first (a parents-first order for the same
reason), so every prefix of the list is the best smaller tree: a load-adaptive step that
verifies only the first B' nodes (vLLM's scheduler truncates the drafts) gets the B'-node tree
of the same beam, not the B' shallowest nodes. On the reference decoder (CPU, fp32 SmolLM2,
shipped drafter, T = 0, lookup branch on, 4 prompts per set, 2026-12-03) the first 8 nodes of a
64-node tree accepted more in this order than in depth-major order on all three sets.
"""
from __future__ import annotations

import torch

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.tree.topology import DraftTree


def topk_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim; among equal values the lower index wins."""
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return values[..., :k], indices[..., :k]


def beam_widths(cfg: UBTreeConfig, top_k: int) -> list[int]:
    """Nodes per depth: min(W, K * previous width), starting from the single root."""
    widths, width = [], 1
    for _ in range(cfg.block_size):
        width = min(width * top_k, cfg.beam_width)
        widths.append(width)
    return widths


def build_tree(anchor: torch.Tensor, cand_tokens: torch.Tensor, root_logp: torch.Tensor,
               trans_logp: torch.Tensor, cfg: UBTreeConfig) -> DraftTree:
    """Build one draft tree per request.

    anchor:      [N] int64 root token
    cand_tokens: [N, gamma, K] int64 candidates per depth (distinct within a depth)
    root_logp:   [N, K] float edge log-probs root -> depth-1 candidate
    trans_logp:  [N, gamma - 1, K, K] float; [:, d, a, b] = log q(depth d+2 cand b | depth d+1 cand a)
    Returns a DraftTree with B + 1 nodes (node 0 = root) in depth-major order.
    """
    num_reqs, gamma, top_k = cand_tokens.shape
    if gamma != cfg.block_size:
        raise ValueError(f"candidates have {gamma} depths but block_size is {cfg.block_size}")
    device = cand_tokens.device
    widths = beam_widths(cfg, top_k)
    if sum(widths) < cfg.tree_budget:
        raise ValueError(f"tree_budget {cfg.tree_budget} exceeds the {sum(widths)} nodes the beam yields")

    # Depth 1.
    score, cand = topk_stable(root_logp.float().clamp(max=0.0), widths[0])  # [N, w1]
    scores, cands, parents = [score], [cand], [torch.full_like(cand, -1)]
    offset = 0  # global (depth-major) index of the first node of the previous depth
    for d in range(1, gamma):
        prev_width = widths[d - 1]
        # [N, w_{d-1}, K]: each beam entry extended by every depth-(d+1) candidate.
        edge = trans_logp[:, d - 1].float().clamp(max=0.0).gather(1, cand[:, :, None].expand(-1, -1, top_k))
        ext = (score[:, :, None] + edge).flatten(1)
        score, flat = topk_stable(ext, widths[d])
        parents.append(offset + torch.div(flat, top_k, rounding_mode="floor"))
        cand = flat % top_k
        scores.append(score)
        cands.append(cand)
        offset += prev_width

    node_score = torch.cat(scores, dim=1)  # [N, M]
    node_cand = torch.cat(cands, dim=1)
    node_parent = torch.cat(parents, dim=1)  # global index, -1 for depth 1
    node_depth = torch.cat([torch.full((num_reqs, w), d + 1, dtype=torch.long, device=device)
                            for d, w in enumerate(widths)], dim=1)
    node_token = _tokens_of(cand_tokens, node_depth, node_cand)

    # Global pruning to the best B nodes, numbered by rank (a parents-first order, see the module docstring).
    _, keep = topk_stable(node_score, cfg.tree_budget)  # [N, B] global indices, best first
    # Node index in the pruned tree (1..B); the root is 0.
    new_index = torch.full_like(node_score, -1, dtype=torch.long)
    new_index.scatter_(1, keep, torch.arange(1, cfg.tree_budget + 1, device=device).expand(num_reqs, -1))
    kept_parent = node_parent.gather(1, keep)
    parent = torch.where(kept_parent >= 0, new_index.gather(1, kept_parent.clamp(min=0)), 0)

    root_col = torch.zeros((num_reqs, 1), dtype=torch.long, device=device)
    return DraftTree(
        tokens=torch.cat([anchor[:, None].long(), node_token.gather(1, keep)], dim=1),
        parents=torch.cat([root_col - 1, parent], dim=1),
        depth=torch.cat([root_col, node_depth.gather(1, keep)], dim=1),
        scores=torch.cat([root_col.float(), node_score.gather(1, keep)], dim=1),
    )


def construct_tree(anchor: torch.Tensor, cand_tokens: torch.Tensor, root_logp: torch.Tensor,
                   trans_logp: torch.Tensor, cfg: UBTreeConfig) -> DraftTree:
    """:func:`build_tree`'s tree; on CUDA from one Triton launch (``triton_ops/tree_search.py``, identical
    trees, tie-breaking included) instead of ~5 kernels per depth. Arguments as :func:`build_tree`."""
    if not cand_tokens.is_cuda:
        return build_tree(anchor, cand_tokens, root_logp, trans_logp, cfg)
    from ubtree_vllm.triton_ops.tree_search import tree_search

    if cand_tokens.shape[1] != cfg.block_size:
        raise ValueError(f"candidates have {cand_tokens.shape[1]} depths but block_size is {cfg.block_size}")
    tokens, parents, depth, scores = tree_search(anchor, cand_tokens, root_logp.float().contiguous(),
                                                 trans_logp.float().contiguous(), cfg.beam_width, cfg.tree_budget)
    return DraftTree(tokens=tokens, parents=parents, depth=depth, scores=scores)


def _tokens_of(cand_tokens: torch.Tensor, node_depth: torch.Tensor, node_cand: torch.Tensor) -> torch.Tensor:
    """Token of each global node: cand_tokens[n, depth - 1, cand]. -> [N, M]"""
    top_k = cand_tokens.shape[2]
    return cand_tokens.flatten(1).gather(1, (node_depth - 1) * top_k + node_cand)
