"""Tree acceptance walk, one program per request (the fused form of ``verify.accept.accept_tree``).

Request r's tree is ``parents[r, :n]`` (parents-first: ``parents[j] < j``; -1 at the root,
any negative value at a padding node, which is never accepted) with ``tokens[r, :n]`` the
token at each node and ``draws[r, :n]`` the target's draw at each node. The walk starts at
the root; while the current node has a child whose token equals the current node's draw it
moves there (siblings carry distinct tokens, so there is at most one), for at most
``max_depth`` steps. Outputs, as ``accept_tree``'s ``AcceptResult``:

* ``accepted_path [N, max_depth + 1]`` node index at each depth, root first, -1 padded;
* ``num_accepted [N]`` accepted draft nodes (root excluded);
* ``output_tokens [N, max_depth + 1]`` accepted draft tokens, then the draw at the last
  accepted node (the bonus token), -1 padded;
* ``last_node [N]`` the last accepted node (0 = root only).

The program keeps the tree's parents and tokens in registers and loops over depths with
scalar loads only; one launch replaces accept_tree's ~40 kernels. The launcher reads no
device value. Test oracle: :func:`ubtree_vllm.verify.accept.accept_tree`.
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    @triton.jit
    def _walk(parents, tokens, offs, candidate, draws_base, tokens_base, path_base, out_base,
              MAX_DEPTH: tl.constexpr, NODES_PAD: tl.constexpr):
        """One tree's walk (parents/tokens/candidate ``[NODES_PAD]`` in registers; draws and tokens of node j at
        ``draws_base + j`` / ``tokens_base + j``); writes path and output tokens, returns (num_accepted, last)."""
        cur = tl.zeros([], dtype=tl.int64)  # the root
        num_accepted = tl.zeros([], dtype=tl.int64)
        alive = tl.full([], 1, tl.int32)
        tl.store(path_base, cur)
        for d in range(1, MAX_DEPTH + 1):
            want = tl.load(draws_base + cur).to(tl.int64)
            match = candidate & (parents == cur) & (tokens == want) & (alive > 0)
            nxt = tl.min(tl.where(match, offs, NODES_PAD), axis=0).to(tl.int64)
            hit = nxt < NODES_PAD
            alive = tl.where(hit, alive, 0)
            token = tl.load(tokens_base + tl.where(hit, nxt, 0)).to(tl.int64)
            tl.store(path_base + d, tl.where(hit, nxt, -1))
            tl.store(out_base + d - 1, tl.where(hit, token, -1))
            cur = tl.where(hit, nxt, cur)
            num_accepted += hit.to(tl.int64)
        tl.store(out_base + MAX_DEPTH, -1)
        # the bonus: the draw at the last accepted node, right after the accepted tokens
        tl.store(out_base + num_accepted, tl.load(draws_base + cur).to(tl.int64))
        return num_accepted, cur

    @triton.jit
    def _tree_accept_kernel(
            parents_ptr, tokens_ptr, draws_ptr, stride_parents, stride_tokens, stride_draws, num_nodes,
            path_ptr, out_ptr, num_accepted_ptr, last_ptr, stride_path, stride_out,
            MAX_DEPTH: tl.constexpr, NODES_PAD: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, NODES_PAD)
        in_tree = offs < num_nodes
        parents = tl.load(parents_ptr + r * stride_parents + offs, mask=in_tree, other=-1).to(tl.int64)
        tokens = tl.load(tokens_ptr + r * stride_tokens + offs, mask=in_tree, other=-1).to(tl.int64)
        candidate = in_tree & (offs >= 1) & (parents >= 0)  # [NODES_PAD] nodes that can be accepted
        num_accepted, last = _walk(parents, tokens, offs, candidate, draws_ptr + r * stride_draws,
                                   tokens_ptr + r * stride_tokens, path_ptr + r * stride_path,
                                   out_ptr + r * stride_out, MAX_DEPTH, NODES_PAD)
        tl.store(num_accepted_ptr + r, num_accepted)
        tl.store(last_ptr + r, last)

    @triton.jit
    def _tree_accept_rows_kernel(
            tokens_ptr, draws_ptr, cu_ptr, idx_mapping_ptr, parents_ptr, stride_parents, num_nodes,
            seq_lens_ptr, prefill_len_ptr,
            path_ptr, out_ptr, num_accepted_ptr, last_ptr, stride_path, stride_out, num_sampled_ptr,
            num_rejected_ptr,
            MAX_DEPTH: tl.constexpr, NODES_PAD: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        start = tl.load(cu_ptr + r).to(tl.int64)
        count = tl.load(cu_ptr + r + 1).to(tl.int64) - start
        slot = tl.load(idx_mapping_ptr + r).to(tl.int64)
        offs = tl.arange(0, NODES_PAD)
        present = (offs < count) & (offs < num_nodes)
        tokens = tl.load(tokens_ptr + start + offs, mask=present, other=-1).to(tl.int64)
        parents = tl.load(parents_ptr + slot * stride_parents + offs, mask=present, other=-2).to(tl.int64)
        # placeholder (-1) tokens are never accepted; nodes past the request's rows do not exist
        candidate = present & (offs >= 1) & (parents >= 0) & (tokens >= 0)
        num_accepted, last = _walk(parents, tokens, offs, candidate, draws_ptr + start, tokens_ptr + start,
                                   path_ptr + r * stride_path, out_ptr + r * stride_out, MAX_DEPTH, NODES_PAD)
        tl.store(num_accepted_ptr + r, num_accepted)
        tl.store(last_ptr + r, last)
        # MRV2's counts: nothing sampled or rejected for a chunked-prefill row
        chunked = tl.load(seq_lens_ptr + r).to(tl.int64) < tl.load(prefill_len_ptr + slot).to(tl.int64)
        num_sampled = tl.where(chunked, 0, num_accepted + 1)
        tl.store(num_sampled_ptr + r, num_sampled.to(tl.int32))
        tl.store(num_rejected_ptr + r, tl.where(chunked, 0, count - num_sampled).to(tl.int32))


def launch_meta(max_depth: int, num_nodes: int) -> dict[str, int]:
    """The kernel's compile-time parameters for trees of ``num_nodes`` nodes and depth <= ``max_depth``."""
    return {"MAX_DEPTH": max_depth, "NODES_PAD": triton.next_power_of_2(num_nodes)}


def tree_accept(
        # [N, n] int parent of each node (-1 root, negative = padding), parents-first
        parents: torch.Tensor,
        # [N, n] int token at each node
        tokens: torch.Tensor,
        # [N, n] int the target's draw at each node
        draws: torch.Tensor,
        max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(accepted_path [N, D+1], num_accepted [N], output_tokens [N, D+1], last_node [N]), all int64."""
    if triton is None:
        raise RuntimeError("tree_accept needs triton (pip install triton); use verify.accept.accept_tree")
    assert parents.dim() == 2 and tokens.shape == parents.shape == draws.shape, (
        f"parents/tokens/draws must all be [N, n], got {tuple(parents.shape)}, {tuple(tokens.shape)}, "
        f"{tuple(draws.shape)}")
    assert max_depth >= 1, f"max_depth must be >= 1, got {max_depth}"
    for name, t in (("parents", parents), ("tokens", tokens), ("draws", draws)):
        assert t.dtype in (torch.int32, torch.int64), f"{name} must be int32/int64, got {t.dtype}"
        assert t.device == parents.device, f"{name} on {t.device}, parents on {parents.device}"
        assert t.shape[1] == 0 or t.stride(1) == 1, f"{name} needs a unit last-dim stride, got {t.stride()}"
    num_reqs, num_nodes = parents.shape
    device = parents.device
    path = torch.empty((num_reqs, max_depth + 1), dtype=torch.int64, device=device)
    out = torch.empty((num_reqs, max_depth + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=device)
    last = torch.empty(num_reqs, dtype=torch.int64, device=device)
    if num_reqs == 0:
        return path, num_accepted, out, last
    assert num_nodes >= 1, "every tree has a root"
    _tree_accept_kernel[(num_reqs,)](
        parents, tokens, draws, parents.stride(0), tokens.stride(0), draws.stride(0), num_nodes,
        path, out, num_accepted, last, path.stride(0), out.stride(0), **launch_meta(max_depth, num_nodes))
    return path, num_accepted, out, last


def tree_accept_rows(
        # [L] int token of each logits row (-1: a placeholder, never accepted); [L] int the target's draw there
        tokens: torch.Tensor, draws: torch.Tensor,
        # [R + 1] int cumulative logits rows per request; [R] int request state slot of each request
        cu_num_logits: torch.Tensor, idx_mapping: torch.Tensor,
        # [max_reqs, n] int parent of each node per state slot (-1 root, negative = padding), parents-first
        parents: torch.Tensor,
        # [>= R] int tokens in the sequence after this step; [max_reqs] int prompt length per state slot
        seq_lens: torch.Tensor, prefill_len: torch.Tensor,
        max_depth: int) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor,
                                 torch.Tensor]:
    """The walk over Model Runner V2's flat logits rows, one launch: request r's node j is logits row
    ``cu[r] + j`` (j < cu[r + 1] - cu[r]; later nodes were not scheduled), its topology row is
    ``parents[idx_mapping[r]]``.

    Returns ``((accepted_path, num_accepted, output_tokens, last_node), num_sampled, num_rejected)``: the
    first four as :func:`tree_accept` (int64), then MRV2's counts, int32 ``[R]``: ``num_accepted + 1`` and
    ``rows - num_sampled``, both 0 for a chunked-prefill request (``seq_lens[r] < prefill_len[slot]``).
    Test oracle: the torch steps of ``vllm.mrv2.rejection_sampler`` (per_request_nodes, accept_tree,
    sampled_and_rejected).
    """
    if triton is None:
        raise RuntimeError("tree_accept_rows needs triton (pip install triton)")
    num_reqs = cu_num_logits.shape[0] - 1
    assert max_depth >= 1, f"max_depth must be >= 1, got {max_depth}"
    assert tokens.shape == draws.shape and tokens.dim() == 1, \
        f"tokens/draws must both be [L], got {tuple(tokens.shape)}, {tuple(draws.shape)}"
    assert idx_mapping.shape[0] >= num_reqs and seq_lens.shape[0] >= num_reqs and parents.dim() == 2, \
        f"idx_mapping/seq_lens must hold >= {num_reqs} requests and parents be [max_reqs, n]"
    for name, t in (("tokens", tokens), ("draws", draws), ("cu_num_logits", cu_num_logits),
                    ("idx_mapping", idx_mapping), ("parents", parents), ("seq_lens", seq_lens),
                    ("prefill_len", prefill_len)):
        assert not t.is_floating_point() and t.device == tokens.device, f"{name} must be an integer tensor on " \
                                                                        f"{tokens.device}, got {t.dtype} {t.device}"
        assert t.shape[-1] == 0 or t.stride(-1) == 1, f"{name} needs a unit last-dim stride, got {t.stride()}"
    num_nodes = parents.shape[1]
    device = tokens.device
    path = torch.empty((num_reqs, max_depth + 1), dtype=torch.int64, device=device)
    out = torch.empty((num_reqs, max_depth + 1), dtype=torch.int64, device=device)
    num_accepted = torch.empty(num_reqs, dtype=torch.int64, device=device)
    last = torch.empty(num_reqs, dtype=torch.int64, device=device)
    num_sampled = torch.empty(num_reqs, dtype=torch.int32, device=device)
    num_rejected = torch.empty(num_reqs, dtype=torch.int32, device=device)
    if num_reqs:
        assert num_nodes >= 1, "every tree has a root"
        _tree_accept_rows_kernel[(num_reqs,)](
            tokens, draws, cu_num_logits, idx_mapping, parents, parents.stride(0), num_nodes, seq_lens, prefill_len,
            path, out, num_accepted, last, path.stride(0), out.stride(0), num_sampled, num_rejected,
            **launch_meta(max_depth, num_nodes))
    return (path, num_accepted, out, last), num_sampled, num_rejected
