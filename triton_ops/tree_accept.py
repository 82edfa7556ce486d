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
        cur = tl.zeros([], dtype=tl.int64)  # the root
        num_accepted = tl.zeros([], dtype=tl.int64)
        alive = tl.full([], 1, tl.int32)
        tl.store(path_ptr + r * stride_path, cur)
        for d in range(1, MAX_DEPTH + 1):
            want = tl.load(draws_ptr + r * stride_draws + cur).to(tl.int64)
            match = candidate & (parents == cur) & (tokens == want) & (alive > 0)
            nxt = tl.min(tl.where(match, offs, NODES_PAD), axis=0).to(tl.int64)
            hit = nxt < NODES_PAD
            alive = tl.where(hit, alive, 0)
            token = tl.load(tokens_ptr + r * stride_tokens + tl.where(hit, nxt, 0)).to(tl.int64)
            tl.store(path_ptr + r * stride_path + d, tl.where(hit, nxt, -1))
            tl.store(out_ptr + r * stride_out + d - 1, tl.where(hit, token, -1))
            cur = tl.where(hit, nxt, cur)
            num_accepted += hit.to(tl.int64)
        tl.store(out_ptr + r * stride_out + MAX_DEPTH, -1)
        # the bonus: the draw at the last accepted node, right after the accepted tokens
        tl.store(out_ptr + r * stride_out + num_accepted, tl.load(draws_ptr + r * stride_draws + cur).to(tl.int64))
        tl.store(num_accepted_ptr + r, num_accepted)
        tl.store(last_ptr + r, cur)


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
