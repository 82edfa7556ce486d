"""Tree construction in one launch: depth-wise beam, then global pruning (``tree.search.build_tree`` fused).

One program per request keeps the whole candidate lattice walk in registers: depth 1 takes
the best ``w_1 = min(W, K)`` root edges; depth d the best ``w_d = min(W, K * w_{d-1})`` of the
``w_{d-1} x K`` extensions (score = parent score + edge log-prob, edges clamped to <= 0); the
``M = sum w_d`` nodes are numbered depth-major, the best B of them are kept and renumbered
1..B in that order (node 0 is the root). Every selection picks the largest score and, among
equal scores, the lowest index -- the stable-sort rule of ``build_tree`` -- so the output is
identical to it, tie-breaking included, for finite scores.

Scratch: a ``[N, M_PAD]`` int64 buffer holds the nodes' ordering keys, from which each node's
rank among all nodes is counted (written, then read after a barrier); a ``[N, M_PAD]`` int32
buffer maps each kept node's depth-major index to its new index so children can look their
parent up (likewise). The launcher
reads no device value; the grid is ``(N,)``.
Test oracle: :func:`ubtree_vllm.tree.search.build_tree`.
"""
from __future__ import annotations

import torch

from ubtree_vllm.config import max_tree_nodes

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    _NO_KEY = tl.constexpr(-(1 << 63))  # the key of a taken entry: below every real one

    @triton.jit
    def _order_keys(values, index, taken):
        """One int64 key per entry that orders as (value, then -index); taken entries get ``_NO_KEY``, the smallest int64.

        The float's bits made sign-ordered (-0.0 as +0.0, which compares equal to it) in the high word, and
        2^31 - 1 - index in the low word (indices of untaken entries are distinct and in [0, 2^31))."""
        bits = values.to(tl.int32, bitcast=True)
        bits = tl.where(bits == -2147483648, 0, bits)  # -0.0
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # signed order = float order
        low = (2147483647 - index).to(tl.int64)
        return tl.where(taken, tl.full([], _NO_KEY, tl.int64), (ordered.to(tl.int64) << 32) | low)

    @triton.jit
    def _select_into(values, index, taken, count, out_scores, out_index, slot_offs, SLOTS: tl.constexpr):
        """Pick the ``count`` best untaken entries of ``values`` (ties: lowest ``index``) into slots 0..count-1, in
        order (count <= the untaken entries): one bitonic top-k over the entries' keys (:func:`_order_keys`, distinct
        for untaken entries) where there are at least as many entries as slots (and two slots or more), else one
        max-reduction per pick."""
        keys = _order_keys(values, index, taken)
        # (not at one slot: Triton 3.6's tl.topk cannot take k = 1)
        if values.shape[0] >= out_scores.shape[0] and out_scores.shape[0] > 1:
            best = tl.topk(keys, out_scores.shape[0])  # [SLOTS_PAD] keys, largest first
            live = slot_offs < count
            high = (best >> 32).to(tl.int32)
            score = tl.where(high >= 0, high, high ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
            pick = (2147483647 - (best & 0x7FFFFFFF)).to(tl.int32)
            out_scores = tl.where(live, score, out_scores)
            out_index = tl.where(live, pick, out_index)
        else:
            for j in range(SLOTS):
                live = j < count
                best = tl.max(keys, axis=0)
                keys = tl.where((keys == best) & live, tl.full([], _NO_KEY, tl.int64), keys)
                high = (best >> 32).to(tl.int32)
                score = tl.where(high >= 0, high, high ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
                pick = (2147483647 - (best & 0x7FFFFFFF)).to(tl.int32)
                out_scores = tl.where((slot_offs == j) & live, score, out_scores)
                out_index = tl.where((slot_offs == j) & live, pick, out_index)
        return out_scores, out_index

    @triton.jit
    def _tree_search_kernel(
            anchor_ptr, cand_ptr, root_ptr, trans_ptr,
            stride_anchor, stride_cand_n, stride_cand_d, stride_root_n,
            stride_trans_n, stride_trans_d, stride_trans_a,
            scratch_ptr, stride_scratch, key_scratch_ptr, stride_key_scratch,
            out_tokens_ptr, out_parents_ptr, out_depth_ptr, out_scores_ptr, stride_out,
            GAMMA: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, W: tl.constexpr, W_PAD: tl.constexpr,
            BUDGET: tl.constexpr, M_PAD: tl.constexpr, CHUNK: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        offs_k = tl.arange(0, K_PAD)
        offs_w = tl.arange(0, W_PAD)
        offs_m = tl.arange(0, M_PAD)
        offs_e = tl.arange(0, W_PAD * K_PAD)  # flattened (beam entry, candidate) extensions
        # Depth-major node arrays of the whole lattice walk.
        node_score = tl.full([M_PAD], float("-inf"), tl.float32)
        node_parent = tl.full([M_PAD], -1, tl.int32)
        node_depth = tl.zeros([M_PAD], tl.int32)
        node_cand = tl.zeros([M_PAD], tl.int32)
        node_valid = offs_m < 0
        # Depth 1: the best min(W, K) root edges.
        root = tl.load(root_ptr + n * stride_root_n + offs_k, mask=offs_k < K, other=float("-inf")).to(tl.float32)
        root = tl.minimum(root, 0.0)
        width = tl.zeros([], tl.int32) + min(W, K)
        score, cand = _select_into(root, offs_k, offs_k >= K, width, tl.full([W_PAD], float("-inf"), tl.float32),
                                   tl.zeros([W_PAD], tl.int32), offs_w, W)
        put = (offs_m[:, None] == offs_w[None, :]) & (offs_w[None, :] < width)  # [M_PAD, W_PAD]
        node_score = tl.where(tl.sum(put.to(tl.int32), axis=1) > 0, tl.sum(tl.where(put, score[None, :], 0.0), axis=1),
                              node_score)
        node_cand = tl.where(tl.sum(put.to(tl.int32), axis=1) > 0, tl.sum(tl.where(put, cand[None, :], 0), axis=1),
                             node_cand)
        node_depth = tl.where(offs_m < width, 1, node_depth)
        node_valid = node_valid | (offs_m < width)
        offset = tl.zeros([], tl.int32)  # depth-major index of the previous depth's first node
        base = offset + width  # ... and of this depth's first node
        for d in range(1, GAMMA):
            prev_width = width
            width = tl.minimum(W, K * prev_width)
            w_e = offs_e // K_PAD  # beam entry of each extension
            k_e = offs_e % K_PAD  # candidate of each extension
            live_e = (w_e < prev_width) & (k_e < K)
            cand_e = tl.sum(tl.where(offs_w[None, :] == w_e[:, None], cand[None, :], 0), axis=1)  # [E]
            score_e = tl.sum(tl.where(offs_w[None, :] == w_e[:, None], score[None, :], 0.0), axis=1)
            edge = tl.load(trans_ptr + n * stride_trans_n + (d - 1) * stride_trans_d + cand_e * stride_trans_a + k_e,
                           mask=live_e, other=float("-inf")).to(tl.float32)
            ext = tl.where(live_e, score_e + tl.minimum(edge, 0.0), float("-inf"))
            flat = w_e * K + k_e  # build_tree's flattened index (ties: lowest first)
            new_score, pick = _select_into(ext, tl.where(live_e, flat, 1 << 30), ~live_e, width,
                                           tl.full([W_PAD], float("-inf"), tl.float32), tl.zeros([W_PAD], tl.int32),
                                           offs_w, W)
            parent = offset + pick // K
            cand = pick % K
            score = new_score
            put = (offs_m[:, None] == (base + offs_w)[None, :]) & (offs_w[None, :] < width)
            hit = tl.sum(put.to(tl.int32), axis=1) > 0
            node_score = tl.where(hit, tl.sum(tl.where(put, score[None, :], 0.0), axis=1), node_score)
            node_cand = tl.where(hit, tl.sum(tl.where(put, cand[None, :], 0), axis=1), node_cand)
            node_parent = tl.where(hit, tl.sum(tl.where(put, parent[None, :], 0), axis=1), node_parent)
            node_depth = tl.where(hit, d + 1, node_depth)
            node_valid = node_valid | hit
            offset = base
            base += width
        # Global pruning: the best BUDGET nodes (ties: lower depth-major index), renumbered 1..B by rank. A node's
        # rank is the number of valid nodes whose key is larger (keys of valid nodes are distinct), counted against
        # the keys in CHUNK-sized pieces read back from key_scratch: no sequential pick per kept node.
        keys = _order_keys(node_score, offs_m, ~node_valid)  # [M_PAD]
        tl.store(key_scratch_ptr + n * stride_key_scratch + offs_m, keys)
        tl.debug_barrier()
        offs_c = tl.arange(0, CHUNK)
        rank = tl.zeros([M_PAD], tl.int32)
        for c in range(0, M_PAD, CHUNK):
            other = tl.load(key_scratch_ptr + n * stride_key_scratch + c + offs_c)  # [CHUNK]
            rank += tl.sum((other[None, :] > keys[:, None]).to(tl.int32), axis=1)
        kept = node_valid & (rank < BUDGET)  # [M_PAD]
        new_index = tl.where(kept, rank + 1, 0)  # rank + 1 at the kept nodes
        tl.store(scratch_ptr + n * stride_scratch + offs_m, new_index)
        tl.debug_barrier()
        parent_new = tl.load(scratch_ptr + n * stride_scratch + tl.maximum(node_parent, 0), mask=kept, other=0)
        parent_new = tl.where(node_parent >= 0, parent_new, 0)
        token = tl.load(cand_ptr + n * stride_cand_n + (node_depth - 1).to(tl.int64) * stride_cand_d + node_cand,
                        mask=kept, other=0)
        out = n * stride_out + new_index
        tl.store(out_tokens_ptr + out, token, mask=kept)
        tl.store(out_parents_ptr + out, parent_new.to(tl.int64), mask=kept)
        tl.store(out_depth_ptr + out, node_depth.to(tl.int64), mask=kept)
        tl.store(out_scores_ptr + out, node_score, mask=kept)
        tl.store(out_tokens_ptr + n * stride_out, tl.load(anchor_ptr + n * stride_anchor).to(tl.int64))
        tl.store(out_parents_ptr + n * stride_out, -1)
        tl.store(out_depth_ptr + n * stride_out, 0)
        tl.store(out_scores_ptr + n * stride_out, 0.0)


def launch_meta(gamma: int, top_k: int, beam_width: int, tree_budget: int) -> dict[str, int]:
    """The kernel's compile-time parameters for one tree shape (gamma depths, K candidates, W, B)."""
    nodes = max_tree_nodes(beam_width, top_k, gamma)
    return {"GAMMA": gamma, "K": top_k, "K_PAD": triton.next_power_of_2(top_k), "W": beam_width,
            "W_PAD": triton.next_power_of_2(beam_width), "BUDGET": tree_budget,
            "M_PAD": triton.next_power_of_2(nodes), "CHUNK": min(32, triton.next_power_of_2(nodes))}


def tree_search(
        # [N] int root token
        anchor: torch.Tensor,
        # [N, gamma, K] int64 candidates per depth
        cand_tokens: torch.Tensor,
        # [N, K] float root -> depth-1 edge log-probs
        root_logp: torch.Tensor,
        # [N, gamma - 1, K, K] float; [:, d, a, b] = log q(depth d+2 cand b | depth d+1 cand a)
        trans_logp: torch.Tensor,
        beam_width: int, tree_budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, parents, depth [N, B+1] int64, scores [N, B+1] float32), as ``build_tree``'s DraftTree."""
    if triton is None:
        raise RuntimeError("tree_search needs triton (pip install triton); use tree.search.build_tree")
    num_reqs, gamma, top_k = cand_tokens.shape
    assert anchor.shape == (num_reqs,), f"anchor must be [N={num_reqs}], got {tuple(anchor.shape)}"
    assert root_logp.shape == (num_reqs, top_k), f"root_logp must be [N, K], got {tuple(root_logp.shape)}"
    assert trans_logp.shape == (num_reqs, max(gamma - 1, 0), top_k, top_k), (
        f"trans_logp must be [N, gamma - 1, K, K], got {tuple(trans_logp.shape)}")
    assert cand_tokens.dtype == torch.int64, f"cand_tokens must be int64, got {cand_tokens.dtype}"
    for name, t in (("cand_tokens", cand_tokens), ("root_logp", root_logp), ("trans_logp", trans_logp)):
        assert t.stride(-1) == 1, f"{name} needs a unit last-dim stride, got {t.stride()}"
        assert t.device == anchor.device, f"{name} on {t.device}, anchor on {anchor.device}"
    nodes = max_tree_nodes(beam_width, top_k, gamma)
    assert 1 <= tree_budget <= nodes, f"tree_budget must be in [1, {nodes}] (the beam's nodes), got {tree_budget}"
    device = anchor.device
    out = [torch.empty((num_reqs, tree_budget + 1), dtype=dtype, device=device)
           for dtype in (torch.int64, torch.int64, torch.int64, torch.float32)]
    if num_reqs == 0:
        return out[0], out[1], out[2], out[3]
    meta = launch_meta(gamma, top_k, beam_width, tree_budget)
    scratch = torch.empty((num_reqs, meta["M_PAD"]), dtype=torch.int32, device=device)
    key_scratch = torch.empty((num_reqs, meta["M_PAD"]), dtype=torch.int64, device=device)
    trans = trans_logp if gamma > 1 else root_logp.new_empty((num_reqs, 1, top_k, top_k))
    _tree_search_kernel[(num_reqs,)](
        anchor, cand_tokens, root_logp, trans,
        anchor.stride(0), cand_tokens.stride(0), cand_tokens.stride(1), root_logp.stride(0),
        trans.stride(0), trans.stride(1), trans.stride(2),
        scratch, scratch.stride(0), key_scratch, key_scratch.stride(0),
        out[0], out[1], out[2], out[3], out[0].stride(0), **meta)
    return out[0], out[1], out[2], out[3]
