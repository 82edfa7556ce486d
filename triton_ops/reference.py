"""Pure-torch twins of the Triton launchers: the test oracles (one Python loop per row).

Each function takes exactly the arguments of its launcher in ``triton_ops/<op>.py`` and
writes the same outputs. They read device values on the host (``.tolist()``) and loop in
Python, so they are for tests and debugging only, never for the decode path.
"""
from __future__ import annotations

import torch


def tree_attention_reference(
        # [T, H, D] query rows of the forward
        query: torch.Tensor,
        # [T, H_kv, D] the layer's fresh key / value rows of the forward
        key: torch.Tensor, value: torch.Tensor,
        # [num_blocks, block_size, H_kv, D] paged cache views (may be non-contiguous)
        key_cache: torch.Tensor, value_cache: torch.Tensor,
        # [num_reqs, max_blocks] int32/int64 block ids per request
        block_table: torch.Tensor,
        # [M] int global row of each tree row to compute; -1 = skip the entry
        row_index: torch.Tensor,
        # [M] int request (row of block_table) of each tree row
        row_req: torch.Tensor,
        # [M] int committed context length of the row's request
        row_context_len: torch.Tensor,
        # [M, P] int global rows of the root->row path (ancestors-or-self), -1 padded
        row_path: torch.Tensor,
        scale: float,
        # [T, H, D] mutable: rows row_index are overwritten, the others untouched
        out: torch.Tensor) -> torch.Tensor:
    """Row r: ``out[row_index[r]] = softmax(q K^T * scale) V`` over context + path, fp32 math.

    K/V of row r = context tokens 0 .. row_context_len[r] - 1 of request row_req[r] (read
    through its block table) followed by ``key/value[row_path[r, j]]`` for every
    ``row_path[r, j] >= 0``. Query head h reads kv head ``h // (H // H_kv)``. A row with
    nothing to attend to gets zeros; entries with row_index -1 are skipped. Returns ``out``.
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    block_size = key_cache.shape[1]
    rows = zip(row_index.tolist(), row_req.tolist(), row_context_len.tolist(), row_path.tolist())
    for row, req, context_len, path in rows:
        if row < 0:
            continue
        pos = torch.arange(context_len, device=key_cache.device)  # [c]
        block_ids = block_table[req, pos // block_size].long()  # [c]
        path_rows = torch.tensor([p for p in path if p >= 0], dtype=torch.long, device=key.device)
        # [c + depth + 1, H, D] fp32, kv heads repeated over their query-head group
        k = torch.cat([key_cache[block_ids, pos % block_size], key[path_rows]]).float()
        v = torch.cat([value_cache[block_ids, pos % block_size], value[path_rows]]).float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if k.shape[0] == 0:
            out[row] = 0
            continue
        scores = torch.einsum("hd,nhd->hn", query[row].float(), k) * scale  # [H, n]
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(out.dtype)
    return out


def kv_path_commit_reference(
        # the layers' caches, each [num_blocks, H_kv, block_size, E] (mutated)
        kv_caches: list[torch.Tensor],
        # [Q * D] int64 source / destination slot per (request, depth), depth-major within a request
        src_slot: torch.Tensor, dst_slot: torch.Tensor,
        # [Q * D] bool: copy this pair
        moves: torch.Tensor,
        num_depths: int) -> None:
    """Twin of :func:`ubtree_vllm.triton_ops.kv_path_commit.kv_path_commit`: pairs one by one, depths ascending."""
    for cache in kv_caches:
        block_size = cache.shape[2]
        for src, dst, move in zip(src_slot.tolist(), dst_slot.tolist(), moves.tolist()):
            if move:
                cache[dst // block_size, :, dst % block_size] = cache[src // block_size, :, src % block_size].clone()
