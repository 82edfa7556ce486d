"""One MRV2 verification step's trees over the token batch, on device (``docs/design/mrv2.md`` §3, §4, §6).

MRV2 puts a request's logits rows at the end of its query rows, contiguously: logits row
``i = cu_num_logits[b] + j`` (``expanded_local_pos[i] == j``) is node j of batch request b,
at global row ``root_row + j`` with ``root_row = logits_indices[cu_num_logits[b]]``. Node 0
is the root (the last sampled token), nodes 1.. are the scheduled drafts, a prefix of the
drafter's parents-first layout and so itself a tree. Each request has at least one logits row.

Per request state slot s (``expanded_idx_mapping``), ``tree_parents[s]`` / ``tree_depth[s]``
``[B + 1]`` give node j's parent (-1 at the root, -2 for padding, parents[j] < j) and depth.
Depths must agree with the parents (depth[parents[j]] + 1) for the nodes that are not padding.
A node is a *tree row* iff j >= 1, 1 <= depth <= max_depth and no node on its root path is
padding. Rows deeper than max_depth (a chain: parents j - 1) are left to the
stock causal attention at their linear positions, which is exact for a chain; the runner's trees are
never deeper than max_depth (gamma), and the acceptance walk never goes past it. With
``tree_attention: "triton_stock_roots"``, in a uniform decode step the runner lays out every draft row
(``cover_rows``): FlashAttention then computes the roots alone and the tree kernel every other row
(``vllm/attention/tree_rows.py``).

Every function uses fixed-shape torch ops only (no ``.item()``/``.cpu()``/``nonzero``/mask
indexing, no loop over requests): shapes depend on host-known sizes, never on device values.
On CUDA tensors :func:`lay_out_tree_rows` runs as one Triton launch (``triton_ops/tree_layout.py``;
the torch form is ~200 small kernels, whose launch cost dominated a batch-1 verification step of
a small target). After the acceptance walk the runner commits the accepted paths with one launch,
``triton_ops/accepted_rows.py:commit_accepted_paths``, whose oracle is :func:`commit_pairs` +
``kv_path_commit_reference`` + :func:`linearise_rows` (with positions).
"""
from __future__ import annotations

import torch

from ubtree_vllm.triton_ops.tree_layout import tree_layout


def lay_out_tree_rows(
        # [T_pad] int64 MRV2 positions (linear), mutated: tree rows get root position + depth
        positions: torch.Tensor,
        # [L] int64 global row of each logits row
        logits_indices: torch.Tensor,
        # [R + 1] int32 logits rows per batch request, cumulative
        cu_num_logits: torch.Tensor,
        # [L] int64 request state slot of each logits row
        expanded_idx_mapping: torch.Tensor,
        # [L] int32 node index of each logits row within its request (0 = root)
        expanded_local_pos: torch.Tensor,
        # [max_reqs, B + 1] int32 parent / depth of each node, per request state slot
        tree_parents: torch.Tensor, tree_depth: torch.Tensor,
        max_depth: int,
        # [M_cap] (M_cap >= L) tree attention entries, mutated; entry m = logits row m
        out_row_index: torch.Tensor, out_row_req: torch.Tensor, out_row_context_len: torch.Tensor,
        # [M_cap, max_depth + 1] mutated
        out_row_path: torch.Tensor,
        # an entry for every logits row (a step whose token rows are all logits rows skips the stock attention)
        cover_rows: bool = False) -> None:
    """Write the tree positions in place and fill the tree-attention row buffers.

    Entry m of a tree row: row_index = its global row, row_req = its batch index (row of the
    block tables), row_context_len = its root's position, row_path = global rows of its
    root->self path, root first, -1 padded (the contract of ``triton_ops/tree_attention``).
    Every other entry (roots, non-tree nodes, m >= L) gets row_index -1, row_path -1,
    row_req and row_context_len 0. With ``cover_rows`` every non-root logits row m < L gets an entry: a
    non-tree node (padding, never accepted) attends to its context, its root and itself (``[root, self]``,
    finite, unread). Roots never get one.
    """
    if positions.is_cuda:
        tree_layout(positions, logits_indices, cu_num_logits, expanded_idx_mapping, expanded_local_pos, tree_parents,
                    tree_depth, max_depth, out_row_index, out_row_req, out_row_context_len, out_row_path,
                    cover_rows=cover_rows)
        return
    num_logits = logits_indices.shape[0]  # L
    rows = logits_indices.long()  # [L]
    node = expanded_local_pos.long()  # [L]
    root_rows = root_rows_of(logits_indices, expanded_local_pos)  # [L]
    root_pos = positions[root_rows]  # [L]
    depth = tree_depth[expanded_idx_mapping, node].long()  # [L]
    path, is_tree = _root_paths(tree_parents, expanded_idx_mapping.long(), node, depth, max_depth)
    positions[rows] = torch.where(is_tree, root_pos + depth, positions[rows])
    batch = _batch_index(cu_num_logits, num_logits)  # [L]
    path_rows = torch.where(is_tree[:, None] & (path >= 0), root_rows[:, None] + path, -1)  # [L, D + 1]
    covered = (node >= 1) if cover_rows else is_tree  # [L]
    if cover_rows:  # [root, self] for a non-tree node
        other = torch.full_like(path_rows, -1)
        other[:, 0] = root_rows
        if other.shape[1] > 1:
            other[:, 1] = rows
        path_rows = torch.where(is_tree[:, None], path_rows, torch.where(covered[:, None], other, -1))
    _write_entries(out_row_index, torch.where(covered, rows, -1), -1)
    _write_entries(out_row_req, torch.where(covered, batch, 0), 0)
    _write_entries(out_row_context_len, torch.where(covered, root_pos, 0), 0)
    _write_entries(out_row_path, path_rows, -1)


def root_rows_of(logits_indices: torch.Tensor, expanded_local_pos: torch.Tensor) -> torch.Tensor:
    """``[L]`` int64 global row of each logits row's root (its request's logits row with local pos 0)."""
    rows = logits_indices.long()  # [L]
    return rows[torch.arange(rows.shape[0], device=rows.device) - expanded_local_pos.long()]


def commit_pairs(
        # [T_pad] int64 KV slot of each token row (one KV cache group)
        slot_mapping: torch.Tensor,
        # [L] int64, [R + 1] int32: as in lay_out_tree_rows
        logits_indices: torch.Tensor, cu_num_logits: torch.Tensor,
        # [R, max_depth + 1] int64 accepted node at each depth (read up to num_accepted); [R] int64 accepted drafts
        accepted_path: torch.Tensor, num_accepted: torch.Tensor,
        max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src_slot, dst_slot, moves), each ``[R * max_depth]`` int64/int64/bool, depth-major per request.

    Pair (r, d), d = 1..max_depth: the accepted node at depth d moves from the slot of its row
    ``root + path[r, d]`` to the slot of row ``root + d``; ``moves`` is False past the accepted
    length, where the node is already there, and for rows outside the request (both slots are
    then the root's). Ready for ``kv_path_commit(..., num_depths=max_depth)``.
    """
    root, depth, node, accepted = _accepted_nodes(logits_indices, cu_num_logits, accepted_path, num_accepted,
                                                  max_depth)
    src = slot_mapping[root + torch.where(accepted, node, 0)].long()  # [R, D]
    dst = slot_mapping[root + torch.where(accepted, depth, 0)].long()  # [R, D]
    moves = accepted & (node != depth)  # [R, D]
    return src.flatten(), dst.flatten(), moves.flatten()


def linearise_rows(
        num_tokens: int,
        # [L] int64, [R + 1] int32, [R, max_depth + 1] int64, [R] int64: as in commit_pairs
        logits_indices: torch.Tensor, cu_num_logits: torch.Tensor,
        accepted_path: torch.Tensor, num_accepted: torch.Tensor,
        max_depth: int,
        # [T_pad] int64 positions, mutated (None: untouched) and [L] node index of each logits row
        positions: torch.Tensor | None = None, expanded_local_pos: torch.Tensor | None = None) -> torch.Tensor:
    """``perm [num_tokens]`` int64: identity, except ``perm[root + d] = root + path[r, d]`` for d = 1..accepted.

    ``hidden[perm]`` holds the accepted path's rows at ``root + 1 .. root + k``, as a chain would.
    Given ``positions``, every logits row's linear position is restored too
    (:func:`linear_logits_positions_`).
    """
    if positions is not None:
        assert expanded_local_pos is not None, "restoring the positions needs expanded_local_pos"
        linear_logits_positions_(positions, logits_indices, expanded_local_pos)
    root, depth, node, accepted = _accepted_nodes(logits_indices, cu_num_logits, accepted_path, num_accepted,
                                                  max_depth)
    # [T + 1]: entry T absorbs the pairs that write nothing, so no two writes share an index
    perm = torch.arange(num_tokens + 1, device=logits_indices.device)
    perm.scatter_(0, torch.where(accepted, root + depth, num_tokens).flatten(),
                  torch.where(accepted, root + node, num_tokens).flatten())
    return perm[:num_tokens]


def linear_logits_positions_(
        # [T_pad] int64, mutated
        positions: torch.Tensor,
        # [L] row of each logits row, [L] node index of each logits row within its request
        logits_indices: torch.Tensor, expanded_local_pos: torch.Tensor) -> None:
    """``positions[root + j] = positions[root] + j`` for every logits row (root = its request's row j = 0)."""
    root_rows = root_rows_of(logits_indices, expanded_local_pos)  # [L]
    positions[logits_indices.long()] = positions[root_rows] + expanded_local_pos.long()  # read before the write


def _root_paths(tree_parents: torch.Tensor, req_state: torch.Tensor, node: torch.Tensor, depth: torch.Tensor,
                max_depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(path [L, D + 1], is_tree [L]): node index of each row's ancestor at depths 0..max_depth, -1 past its depth.

    Walks parent pointers from the row's depth up (a static loop of max_depth steps).
    """
    cur = node  # [L] ancestor at the depth being filled
    is_tree = (node >= 1) & (depth >= 1) & (depth <= max_depth)  # [L]
    cols = []
    for d in range(max_depth, -1, -1):
        on_path = depth >= d  # [L]
        cols.append(torch.where(on_path, cur, -1))
        if d > 0:
            parent = tree_parents[req_state, cur].long()  # [L]
            is_tree &= ~on_path | (parent >= 0)
            cur = torch.where(on_path, parent.clamp(min=0), cur)
    return torch.stack(cols[::-1], dim=1), is_tree


def _batch_index(cu_num_logits: torch.Tensor, num_logits: int) -> torch.Tensor:
    """``[L]`` int64 batch request of each logits row: b with cu[b] <= i < cu[b + 1]."""
    rows = torch.arange(num_logits, dtype=cu_num_logits.dtype, device=cu_num_logits.device)
    return torch.searchsorted(cu_num_logits[1:], rows, right=True)


def _write_entries(out: torch.Tensor, head: torch.Tensor, fill: int) -> None:
    """``out[:L] = head`` (cast to out's dtype), ``out[L:] = fill``."""
    out[:head.shape[0]].copy_(head)
    out[head.shape[0]:].fill_(fill)


def _accepted_nodes(logits_indices: torch.Tensor, cu_num_logits: torch.Tensor, accepted_path: torch.Tensor,
                    num_accepted: torch.Tensor,
                    max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(root [R, 1], depth [1, D], node [R, D], accepted [R, D]) for depths 1..max_depth.

    accepted: d <= num_accepted[r] and the node is one of the request's logits rows (then so is d:
    nodes are parents-first, so the accepted node at depth d has index >= d).
    """
    cu = cu_num_logits.long()  # [R + 1]
    root = logits_indices[cu[:-1]].long()[:, None]  # [R, 1]
    num_nodes = (cu[1:] - cu[:-1])[:, None]  # [R, 1]
    depth = torch.arange(1, max_depth + 1, device=root.device)[None, :]  # [1, D]
    node = accepted_path[:, 1:max_depth + 1].long()  # [R, D]
    accepted = (depth <= num_accepted[:, None]) & (node < num_nodes)  # [R, D]
    return root, depth, node, accepted
