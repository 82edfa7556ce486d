"""Prompt-lookup branch: a copy of the context joins the candidate lattice before the tree search.

Copying from the context (summaries, RAG answers, code edits, rewrites) is what n-gram
speculation catches and a learned drafter misses. A round's lookup:

1. :func:`lookup_continuation` -- match the last n tokens of the request's history (prompt +
   output, ending at the anchor) against every earlier position, for n = max_n down to min_n;
   the most recent match of the longest n gives the chain: the up to gamma tokens that
   followed it.
2. :func:`inject_chain` -- chain token c_d becomes a candidate at depth d (its own slot if the
   proposer already proposed it, else the proposer's last, K-th, slot), and the chain's edges
   (root -> c_1, c_d -> c_{d+1}) score max(the selector's log-prob, ``edge_logprob``).
   A replaced slot has no selector scores of its own: every other edge into or out of it is
   -inf. The tree search then ranks the chain against the drafter's branches like any path
   under the same budget; with ``edge_logprob = 0`` (the maximum) the chain is always kept.

Both are batched over requests, static in shape (no host sync) and run on CPU or GPU tensors.
The tree they feed is verified like any other, so the output stays lossless.
"""
from __future__ import annotations

import torch


def lookup_continuation(history: torch.Tensor, length: torch.Tensor, gamma: int, min_n: int, max_n: int
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The context's continuation after the latest earlier occurrence of its last n tokens.

    history: [N, T] int64 token ids, row r valid in [0, length[r]) and ending at the anchor;
    length: [N] int64. Returns chain [N, gamma] int64 (0 past the chain) and chain_len [N]
    int64 in [0, gamma] (0: no n in [min_n, max_n] matched).
    """
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    num_reqs, width = history.shape
    device = history.device
    length = length.long()
    best_end = torch.full((num_reqs,), -1, dtype=torch.long, device=device)  # index after the match
    for n in range(max_n, min_n - 1, -1):
        if n >= width:
            continue
        suffix_pos = (length[:, None] - n + torch.arange(n, device=device)).clamp(min=0)  # [N, n]
        suffix = history.gather(1, suffix_pos)
        windows = history.unfold(1, n, 1)  # [N, T - n + 1, n]: windows[:, p] = history[:, p:p + n]
        start = torch.arange(windows.shape[1], device=device)
        # a match ends before the suffix's last token, so at least one token follows it
        match = (windows == suffix[:, None, :]).all(-1) & (start[None, :] + n < length[:, None])
        match &= (length >= n + 1)[:, None]
        latest = torch.where(match, start[None, :], -1).max(dim=1).values  # [N]
        found = (latest >= 0) & (best_end < 0)
        best_end = torch.where(found, latest + n, best_end)
    offsets = torch.arange(gamma, device=device)
    idx = best_end[:, None] + offsets  # [N, gamma]
    valid = (best_end >= 0)[:, None] & (idx < length[:, None])
    chain = torch.where(valid, history.gather(1, idx.clamp(0, width - 1)), 0)
    return chain, valid.sum(1)


def inject_chain(cand_tokens: torch.Tensor, root_logp: torch.Tensor, trans_logp: torch.Tensor, chain: torch.Tensor,
                 chain_len: torch.Tensor, edge_logprob: float = 0.0
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The candidate lattice with the chain in it (module docstring); inputs are not modified.

    cand_tokens [N, gamma, K] int64 (distinct within a depth); root_logp [N, K];
    trans_logp [N, gamma - 1, K, K] ([:, d, a, b]: depth d+1 slot a -> depth d+2 slot b);
    chain [N, gamma] int64 with chain_len [N] valid entries. Returns (cand_tokens, root_logp,
    trans_logp) of the same shapes; candidates stay distinct within each depth.
    """
    num_reqs, gamma, top_k = cand_tokens.shape
    if edge_logprob > 0.0:
        raise ValueError(f"edge_logprob must be <= 0 (a log-probability), got {edge_logprob}")
    device = cand_tokens.device
    depth = torch.arange(gamma, device=device)
    on = depth[None, :] < chain_len[:, None]  # [N, gamma] chain token at this depth
    hit = cand_tokens == chain[:, :, None]  # [N, gamma, K]
    present = hit.any(-1)
    slot = torch.where(present, hit.long().argmax(-1), top_k - 1)  # [N, gamma]
    replaced = on & ~present
    tokens = cand_tokens.clone()
    tokens.scatter_(2, slot[:, :, None], torch.where(on, chain, cand_tokens.gather(2, slot[:, :, None])[..., 0])
                    [:, :, None])
    neg_inf = torch.finfo(root_logp.dtype).min
    slot_one_hot = torch.nn.functional.one_hot(slot, top_k).bool()  # [N, gamma, K]

    def chain_score(score: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
        """A chain edge: max(selector score, edge_logprob), or edge_logprob alone into/out of a replaced slot."""
        return torch.where(fresh, torch.full_like(score, edge_logprob), score.clamp(min=edge_logprob))

    root = root_logp.clone()
    first = slot_one_hot[:, 0] & on[:, :1]  # [N, K]
    root = torch.where(first, chain_score(root_logp, replaced[:, :1]), root)

    trans = trans_logp.clone()
    if gamma > 1:
        src, dst = slot_one_hot[:, :-1], slot_one_hot[:, 1:]  # [N, gamma - 1, K]
        chain_edge = src[:, :, :, None] & dst[:, :, None, :] & on[:, 1:, None, None]  # [N, gamma - 1, K, K]
        # a replaced slot's only edges are the chain's: none into it from another slot, none out of it
        into_replaced = dst[:, :, None, :] & replaced[:, 1:, None, None]
        out_of_replaced = src[:, :, :, None] & replaced[:, :-1, None, None]
        trans = torch.where(into_replaced | out_of_replaced, neg_inf, trans)
        fresh = (replaced[:, :-1] | replaced[:, 1:])[:, :, None, None]
        trans = torch.where(chain_edge, chain_score(trans_logp, fresh), trans)
    return tokens, root, trans


def inject_lookup_chain(cand_tokens: torch.Tensor, root_logp: torch.Tensor, trans_logp: torch.Tensor,
                        chain: torch.Tensor, chain_len: torch.Tensor, edge_logprob: float = 0.0
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`inject_chain`'s lattice; on CUDA from one Triton launch (``triton_ops/lookup_chain.py``, identical
    outputs) instead of ~35 small kernels. Arguments as :func:`inject_chain`."""
    if not cand_tokens.is_cuda:
        return inject_chain(cand_tokens, root_logp, trans_logp, chain, chain_len, edge_logprob)
    from ubtree_vllm.triton_ops.lookup_chain import inject_chain_lattice

    return inject_chain_lattice(cand_tokens, root_logp.float(), trans_logp.float(), chain.long(), chain_len.long(),
                                edge_logprob)
