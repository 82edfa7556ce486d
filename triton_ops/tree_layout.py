"""One MRV2 verification step's tree rows, laid out in one launch (the fused form of
``vllm.mrv2.tree_layout.lay_out_tree_rows``, which takes ~200 small kernels for gamma = 16).

Logits row ``m < L`` is node ``j = expanded_local_pos[m]`` of its request, at global row
``logits_indices[m]``; its root is logits row ``m - j``. With ``s = expanded_idx_mapping[m]``
the node's parent / depth are ``tree_parents[s, j]`` / ``tree_depth[s, j]`` (-1 parent at the
root, -2 at padding). A *tree row* has j >= 1, 1 <= depth <= max_depth and no padding on its
root path. For each tree row the launch writes, at entry m of the row buffers:

* ``row_index`` its global row, ``row_req`` its batch index (b with ``cu[b] <= m < cu[b + 1]``),
  ``row_context_len`` its root's position;
* ``row_path [M_cap, max_depth + 1]`` the global rows of its root->self path, root first, -1 padded;

and ``positions[row] = positions[root] + depth``. Every other entry m < M_cap gets row_index
-1, row_path -1, row_req 0, row_context_len 0; other positions are untouched. Roots are never
written, so reading the roots' positions races with nothing.

``cover_rows`` (``tree_attention: "triton_stock_roots"`` in a uniform decode step: FlashAttention then
computes only the roots and the tree kernel every other row, ``vllm/attention/tree_rows.py``): every
non-root logits row m < L gets an entry; a node that is not a tree row (padding, never accepted) gets
``[root, self]``, a finite output nothing reads. Roots never get an entry.

One program per ``BLOCK`` entries; each lane walks its node's parent pointers for max_depth
steps (a static loop) and finds its batch index by binary search over ``cu_num_logits``. The
launcher reads no device value. Test oracle: ``lay_out_tree_rows`` (torch, itself checked
against a Python loop in ``tests/unit/test_mrv2_tree_layout.py``).
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

BLOCK = 32
# Binary-search steps for the batch index: enough for any batch below 2 ** SEARCH_STEPS requests. Fixed, like
# the scalar arguments below (not specialised), so a serving engine compiles this kernel once.
SEARCH_STEPS = 16

if triton is not None:
    @triton.jit(do_not_specialize=["num_logits", "num_reqs", "num_entries"])
    def _tree_layout_kernel(
            positions_ptr, logits_indices_ptr, cu_ptr, state_ptr, local_pos_ptr,
            parents_ptr, depth_ptr, stride_parents, stride_depth,
            row_index_ptr, row_req_ptr, row_context_len_ptr, row_path_ptr, stride_path,
            num_logits, num_reqs, num_entries,
            MAX_DEPTH: tl.constexpr, PATH_PAD: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
            COVER_ROWS: tl.constexpr):
        m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] entries
        entry = m < num_entries
        valid = m < num_logits
        node = tl.load(local_pos_ptr + m, mask=valid, other=0).to(tl.int64)
        row = tl.load(logits_indices_ptr + m, mask=valid, other=0).to(tl.int64)
        root_row = tl.load(logits_indices_ptr + (m - node), mask=valid, other=0).to(tl.int64)
        state = tl.load(state_ptr + m, mask=valid, other=0).to(tl.int64)
        root_pos = tl.load(positions_ptr + root_row, mask=valid, other=0).to(tl.int64)
        depth = tl.load(depth_ptr + state * stride_depth + node, mask=valid, other=0).to(tl.int64)
        is_tree = valid & (node >= 1) & (depth >= 1) & (depth <= MAX_DEPTH)
        # root->self path, node indices: column d = the ancestor at depth d (-1 past the node's depth)
        cols = tl.arange(0, PATH_PAD)
        path = tl.full([BLOCK, PATH_PAD], -1, tl.int64)
        cur = node
        for i in tl.static_range(MAX_DEPTH + 1):
            d = MAX_DEPTH - i
            on_path = depth >= d
            path = tl.where((cols[None, :] == d) & on_path[:, None], cur[:, None], path)
            if d > 0:
                parent = tl.load(parents_ptr + state * stride_parents + cur, mask=valid, other=-1).to(tl.int64)
                is_tree = is_tree & ((~on_path) | (parent >= 0))
                cur = tl.where(on_path, tl.maximum(parent, 0), cur)
        # batch index: the number of requests b with cu[b + 1] <= m
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = tl.zeros([BLOCK], dtype=tl.int32) + num_reqs
        for _ in tl.static_range(SEARCH_STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(cu_ptr + mid + 1, mask=valid & active, other=0)
            right = active & (end <= m)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & (~right), mid, hi)
        tl.store(positions_ptr + row, root_pos + depth, mask=is_tree)
        if COVER_ROWS:
            covered = valid & (node >= 1)  # every draft row; the ones that are not tree rows attend to [root, self]
        else:
            covered = is_tree
        tl.store(row_index_ptr + m, tl.where(covered, row, -1), mask=entry)
        tl.store(row_req_ptr + m, tl.where(covered, lo.to(tl.int64), 0), mask=entry)
        tl.store(row_context_len_ptr + m, tl.where(covered, root_pos, 0), mask=entry)
        path_rows = tl.where(is_tree[:, None] & (path >= 0), root_row[:, None] + path, -1)
        if COVER_ROWS:
            other = tl.where(cols[None, :] == 0, root_row[:, None], tl.where(cols[None, :] == 1, row[:, None], -1))
            path_rows = tl.where((covered & ~is_tree)[:, None], other, path_rows)
        path_mask = entry[:, None] & (cols[None, :] <= MAX_DEPTH)
        tl.store(row_path_ptr + m.to(tl.int64)[:, None] * stride_path + cols[None, :], path_rows, mask=path_mask)


def launch_meta(max_depth: int, cover_rows: bool = False) -> dict[str, int]:
    """Compile-time parameters for trees of depth <= ``max_depth``, with or without ``cover_rows``."""
    return {"MAX_DEPTH": max_depth, "PATH_PAD": triton.next_power_of_2(max_depth + 1), "SEARCH_STEPS": SEARCH_STEPS,
            "BLOCK": BLOCK, "COVER_ROWS": cover_rows}


def tree_layout(
        # [T_pad] int64 positions (linear), mutated: tree rows get root position + depth
        positions: torch.Tensor,
        # [L] int global row of each logits row; [R + 1] int cumulative logits rows per request
        logits_indices: torch.Tensor, cu_num_logits: torch.Tensor,
        # [L] int request state slot of each logits row; [L] int node index within its request (0 = root)
        expanded_idx_mapping: torch.Tensor, expanded_local_pos: torch.Tensor,
        # [max_reqs, B + 1] int parent / depth of each node, per request state slot
        tree_parents: torch.Tensor, tree_depth: torch.Tensor,
        max_depth: int,
        # [M_cap] int64 (M_cap >= L), mutated
        out_row_index: torch.Tensor, out_row_req: torch.Tensor, out_row_context_len: torch.Tensor,
        # [M_cap, max_depth + 1] int64, mutated
        out_row_path: torch.Tensor,
        # an entry for every logits row, not only tree rows (module docstring)
        cover_rows: bool = False) -> None:
    """Tree positions and the row buffers of one step (see the module docstring); no host sync."""
    if triton is None:
        raise RuntimeError("tree_layout needs triton (pip install triton); use vllm.mrv2.tree_layout")
    num_logits, num_entries = logits_indices.shape[0], out_row_index.shape[0]
    num_reqs = cu_num_logits.shape[0] - 1
    assert positions.dtype == torch.int64 and positions.dim() == 1 and positions.is_contiguous(), \
        f"positions must be contiguous [T_pad] int64, got {positions.dtype} {tuple(positions.shape)}"
    for name, t in (("logits_indices", logits_indices), ("cu_num_logits", cu_num_logits),
                    ("expanded_idx_mapping", expanded_idx_mapping), ("expanded_local_pos", expanded_local_pos)):
        assert t.dim() == 1 and t.is_contiguous() and not t.is_floating_point(), \
            f"{name} must be a contiguous 1-D integer tensor, got {t.dtype} {tuple(t.shape)}"
    assert expanded_idx_mapping.shape[0] == expanded_local_pos.shape[0] == num_logits, \
        "logits_indices, expanded_idx_mapping and expanded_local_pos must all be [L]"
    assert 0 <= num_reqs < 2 ** SEARCH_STEPS, f"{num_reqs} requests: the kernel searches up to {2 ** SEARCH_STEPS - 1}"
    assert tree_parents.shape == tree_depth.shape and tree_parents.dim() == 2, \
        f"tree_parents/tree_depth must be [max_reqs, B + 1]: {tuple(tree_parents.shape)}, {tuple(tree_depth.shape)}"
    assert tree_parents.stride(1) == 1 and tree_depth.stride(1) == 1, "tree rows must be contiguous"
    assert num_entries >= num_logits, f"row buffers hold {num_entries} entries, the step has {num_logits} rows"
    for name, t in (("out_row_index", out_row_index), ("out_row_req", out_row_req),
                    ("out_row_context_len", out_row_context_len)):
        assert t.shape == (num_entries,) and t.dtype == torch.int64 and t.is_contiguous(), \
            f"{name} must be contiguous [{num_entries}] int64, got {t.dtype} {tuple(t.shape)}"
    assert out_row_path.shape == (num_entries, max_depth + 1) and out_row_path.dtype == torch.int64 \
        and out_row_path.stride(1) == 1, f"out_row_path must be [{num_entries}, {max_depth + 1}] int64 with " \
                                         f"contiguous rows, got {out_row_path.dtype} {tuple(out_row_path.shape)}"
    tensors = (logits_indices, cu_num_logits, expanded_idx_mapping, expanded_local_pos, tree_parents, tree_depth,
               out_row_index, out_row_req, out_row_context_len, out_row_path)
    assert all(t.device == positions.device for t in tensors), "all tensors must be on the positions' device"
    if num_entries == 0:
        return
    grid = (triton.cdiv(num_entries, BLOCK),)
    _tree_layout_kernel[grid](
        positions, logits_indices, cu_num_logits, expanded_idx_mapping, expanded_local_pos,
        tree_parents, tree_depth, tree_parents.stride(0), tree_depth.stride(0),
        out_row_index, out_row_req, out_row_context_len, out_row_path, out_row_path.stride(0),
        num_logits, num_reqs, num_entries, **launch_meta(max_depth, cover_rows))
