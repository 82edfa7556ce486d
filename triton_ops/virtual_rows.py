"""The virtual sequences of ``tree_attention: "flash_exact"`` and their FA3 split counts: one launch per forward.

``ubtree_vllm/vllm/attention/exact_rows.py`` gives every row of a covered uniform decode step a one-query-row
sequence of its own (a root over its request's pages; a tree row over its request's full pages, then scratch pages
holding its committed tail and its root -> row path) and pins each sequence's split count to plain decoding's. Its
torch form, :func:`~ubtree_vllm.vllm.attention.exact_rows.virtual_rows` with
:func:`~ubtree_vllm.vllm.attention.exact_rows.plain_split_counts`, is about 80 small kernels per forward inside the
FULL graph; this kernel computes the same tensors in one launch and is tested against that form.

One program per row m of the forward (grid ``(T,)``). Each program scans the step's requests in chunks of
``BLOCK_R`` (the root whose first row is m; the key blocks of every root, for the split counts) and the block-table
columns in chunks of ``BLOCK_W``, so no shape but the row count depends on the batch (no recompilation across batch
sizes). Outputs, with the torch form's names and meaning:

* ``tree`` / ``root`` [T] bool; ``cu_seqlens_q`` [T + 1] int32 0..T; ``seq_lens`` [T] int32 keys per sequence;
* ``block_table`` [T, W + PAGES] int32; ``request`` [T] int64;
* tail copies [T * (BLOCK_SIZE - 1)] int64: page / slot read, page / slot written (unused: the dump page);
* path copies [T * PATH] int64: the forward row read, page / slot written;
* ``split_counts`` [T] int32: FA3's scheduler rule (``exact_rows.splits_for``) over a batch of the step's requests
  at their roots' key blocks, the row's own request at the row's.

The launcher reads no device value. Test oracle: the torch form (tests/triton/test_virtual_rows.py).
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

BLOCK_R = 64  # requests per scan chunk
BLOCK_W = 128  # block-table columns per chunk

if triton is not None:

    @triton.jit
    def _root_of(r, mask, row_index_ptr, query_start_loc_ptr, seq_lens_ptr, num_rows, max_entries,
                 KEY_BLOCK: tl.constexpr):
        """Request(s) ``r``'s root: (first row, clamped to num_rows; its keys; its FA3 key blocks where it counts in
        the batch's split rule: its first row exists, is no tree row, and has keys; else 0)."""
        q0 = tl.load(query_start_loc_ptr + r, mask=mask, other=0).to(tl.int64)
        q1 = tl.load(query_start_loc_ptr + r + 1, mask=mask, other=0).to(tl.int64)
        sl = tl.load(seq_lens_ptr + r, mask=mask, other=0).to(tl.int64)
        first = tl.minimum(q0, num_rows)
        keys = tl.where(sl > 0, tl.maximum(sl - (q1 - q0) + 1, 0), 0)
        on_row = mask & (first < num_rows)
        first_entry = tl.load(row_index_ptr + first, mask=on_row, other=-1)
        counted = on_row & (keys > 0) & ~((first_entry >= 0) & (first < max_entries))
        return first, keys, tl.where(counted, (keys + KEY_BLOCK - 1) // KEY_BLOCK, 0)

    @triton.jit
    def _virtual_rows_kernel(
            # [T] int64 row buffers; [T, PATH] int64 paths (root-first, -1 padded)
            row_index_ptr, row_req_ptr, row_context_len_ptr, row_path_ptr,
            # [R, W] int32 pages; [R + 1] int32 first rows; [R] int32 keys (FlashAttention's metadata)
            block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
            # outputs (module docstring)
            tree_ptr, root_ptr, cu_seqlens_q_ptr, keys_ptr, table_ptr, request_ptr,
            tail_src_page_ptr, tail_src_slot_ptr, tail_dst_page_ptr, tail_dst_slot_ptr,
            path_rows_ptr, path_dst_page_ptr, path_dst_slot_ptr, splits_ptr,
            num_rows, num_reqs, width, first_page, dump_page, max_entries,
            stride_path_row, stride_table_req, stride_out_table,
            num_kv_heads, num_sms, max_splits,
            BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr, PATH: tl.constexpr, KEY_BLOCK: tl.constexpr,
            BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_P: tl.constexpr):
        m = tl.program_id(0)
        is_tree = (tl.load(row_index_ptr + m) >= 0) & (m < max_entries)

        # the request whose root is row m (the last one listing m as its first row, as index_copy_ leaves it), and
        # every root's key blocks: a request's root is its first row when that row exists, is no tree row and has keys
        root_len = tl.zeros((), dtype=tl.int64)
        root_req = tl.full((), -1, dtype=tl.int64)
        all_root_blocks = tl.zeros((), dtype=tl.int64)
        for start in range(0, num_reqs, BLOCK_R):
            r = start + tl.arange(0, BLOCK_R)  # [BLOCK_R]
            ok = r < num_reqs
            first, keys, root_blocks = _root_of(r, ok, row_index_ptr, query_start_loc_ptr, seq_lens_ptr, num_rows,
                                                max_entries, KEY_BLOCK)
            hit = ok & (first == m)
            root_len = tl.maximum(root_len, tl.max(tl.where(hit, keys, 0), axis=0))
            root_req = tl.maximum(root_req, tl.max(tl.where(hit, r.to(tl.int64), -1), axis=0))
            all_root_blocks += tl.sum(root_blocks, axis=0)
        is_root = (root_len > 0) & ~is_tree
        request = tl.where(is_tree, tl.maximum(tl.load(row_req_ptr + m), 0), tl.maximum(root_req, 0))

        context = tl.maximum(tl.load(row_context_len_ptr + m), 0)
        steps = tl.arange(0, BLOCK_P)  # [BLOCK_P]
        path = tl.load(row_path_ptr + m * stride_path_row + steps, mask=steps < PATH, other=-1)
        path_len = tl.sum((path >= 0).to(tl.int64), axis=0)
        full = context // BLOCK_SIZE
        tail = context % BLOCK_SIZE
        first_scratch = first_page + m.to(tl.int64) * PAGES
        keys_m = tl.where(is_tree, context + path_len, tl.where(is_root, root_len, 0))
        tl.store(keys_ptr + m, keys_m.to(tl.int32))
        tl.store(tree_ptr + m, is_tree)
        tl.store(root_ptr + m, is_root)
        tl.store(request_ptr + m, request)
        tl.store(cu_seqlens_q_ptr + m, m)
        if m == 0:
            tl.store(cu_seqlens_q_ptr + num_rows, num_rows)

        # the sequence's pages: its request's (full pages only for a tree row), then a tree row's scratch pages
        own_row = block_table_ptr + request * stride_table_req
        for start in range(0, width + PAGES, BLOCK_W):
            c = start + tl.arange(0, BLOCK_W)  # [BLOCK_W]
            in_table = c < width + PAGES
            own = tl.load(own_row + c, mask=in_table & (c < width), other=0).to(tl.int64)
            tree_table = tl.where(c < full, own, tl.where(c < full + PAGES, first_scratch + (c - full), 0))
            page = tl.where(is_tree, tree_table, tl.where(is_root, own, 0))
            tl.store(table_ptr + m * stride_out_table + c, page.to(tl.int32), mask=in_table)

        # a tree row's committed tail: the request's page after its full ones -> its first scratch page
        dump = dump_page * BLOCK_SIZE
        offset = tl.arange(0, BLOCK_TAIL)  # [BLOCK_TAIL]
        in_tail = offset < BLOCK_SIZE - 1
        tail_ok = is_tree & (offset < tail)
        tail_page = tl.load(own_row + tl.minimum(full, width - 1)).to(tl.int64)
        src = tl.where(tail_ok, tail_page * BLOCK_SIZE + offset, 0)
        dst = tl.where(tail_ok, first_scratch * BLOCK_SIZE + offset, dump)
        at = m * (BLOCK_SIZE - 1) + offset
        tl.store(tail_src_page_ptr + at, src // BLOCK_SIZE, mask=in_tail)
        tl.store(tail_src_slot_ptr + at, src % BLOCK_SIZE, mask=in_tail)
        tl.store(tail_dst_page_ptr + at, dst // BLOCK_SIZE, mask=in_tail)
        tl.store(tail_dst_slot_ptr + at, dst % BLOCK_SIZE, mask=in_tail)

        # its root -> row path: fresh rows -> right after the tail
        path_ok = is_tree & (path >= 0)
        path_dst = tl.where(path_ok, first_scratch * BLOCK_SIZE + tail + steps, dump)
        at = m * PATH + steps
        in_path = steps < PATH
        tl.store(path_rows_ptr + at, tl.where(path_ok, path, 0), mask=in_path)
        tl.store(path_dst_page_ptr + at, path_dst // BLOCK_SIZE, mask=in_path)
        tl.store(path_dst_slot_ptr + at, path_dst % BLOCK_SIZE, mask=in_path)

        # plain decoding's split count at this row's position: the batch's root blocks, the own request's at the row's
        blocks = (keys_m + KEY_BLOCK - 1) // KEY_BLOCK
        _, _, own_blocks = _root_of(request, True, row_index_ptr, query_start_loc_ptr, seq_lens_ptr,
                                    num_rows, max_entries, KEY_BLOCK)
        total = all_root_blocks - own_blocks + blocks
        # num_kv_heads / num_sms come as fp32 scalars: an int argument equal to 1 is specialized to a constant on a GPU
        work = tl.math.div_rn(total.to(tl.float32) * 1.1 * num_kv_heads, num_sms)
        per_sm = tl.maximum(tl.math.ceil(work).to(tl.int64), 1)
        splits = tl.minimum(tl.maximum((blocks + per_sm - 1) // per_sm, 1), max_splits)
        tl.store(splits_ptr + m, splits.to(tl.int32))


def launch_meta(block_size: int, pages_per_row: int, path_width: int, key_block: int) -> dict[str, int]:
    """The kernel's compile-time parameters: KV cache page size, scratch pages per row, path width (gamma + 1) and
    FA3's decode key block (``exact_rows.FA3_DECODE_BLOCK_N``)."""
    return {"BLOCK_SIZE": block_size, "PAGES": pages_per_row, "PATH": path_width, "KEY_BLOCK": key_block,
            "BLOCK_R": BLOCK_R, "BLOCK_W": BLOCK_W, "BLOCK_TAIL": triton.next_power_of_2(max(block_size - 1, 1)),
            "BLOCK_P": triton.next_power_of_2(path_width)}


def virtual_rows_kernel(
        # [T] int64 the row buffers' entries of a covered forward; [T, P] int64 root-first paths
        row_index: torch.Tensor, row_req: torch.Tensor, row_context_len: torch.Tensor, row_path: torch.Tensor,
        # [R, W] int32 pages; [R + 1] int32 first rows; [R] int32 keys
        block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
        first_page: int, pages_per_row: int, max_entries: int, dump_page: int, block_size: int,
        key_block: int, num_kv_heads: int, num_sms: int, max_splits: int) -> dict[str, torch.Tensor]:
    """The torch form's tensors (module docstring) by name, plus ``split_counts``; one launch."""
    if triton is None:
        raise RuntimeError("virtual_rows_kernel needs triton (pip install triton)")
    num_rows, path_width = row_path.shape
    num_reqs, width = block_table.shape
    for name, t in (("row_index", row_index), ("row_req", row_req), ("row_context_len", row_context_len)):
        assert t.shape == (num_rows,) and t.dtype == torch.int64, f"{name} must be [{num_rows}] int64"
    assert row_path.dtype == torch.int64 and row_path.stride(1) == 1, "row_path must be [T, P] int64, last stride 1"
    assert block_table.stride(1) == 1 and query_start_loc.shape == (num_reqs + 1,) and seq_lens.shape == (num_reqs,)
    device = row_index.device

    def empty(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    tail = num_rows * (block_size - 1)
    out = {"tree": empty(num_rows, dtype=torch.bool), "root": empty(num_rows, dtype=torch.bool),
           "cu_seqlens_q": empty(num_rows + 1, dtype=torch.int32), "seq_lens": empty(num_rows, dtype=torch.int32),
           "block_table": empty(num_rows, width + pages_per_row, dtype=torch.int32), "request": empty(num_rows),
           "tail_src_page": empty(tail), "tail_src_slot": empty(tail), "tail_dst_page": empty(tail),
           "tail_dst_slot": empty(tail), "path_rows": empty(num_rows * path_width),
           "path_dst_page": empty(num_rows * path_width), "path_dst_slot": empty(num_rows * path_width),
           "split_counts": empty(num_rows, dtype=torch.int32)}
    if num_rows == 0:
        out["cu_seqlens_q"].zero_()
        return out
    _virtual_rows_kernel[(num_rows,)](
        row_index, row_req, row_context_len, row_path, block_table, query_start_loc, seq_lens,
        out["tree"], out["root"], out["cu_seqlens_q"], out["seq_lens"], out["block_table"], out["request"],
        out["tail_src_page"], out["tail_src_slot"], out["tail_dst_page"], out["tail_dst_slot"],
        out["path_rows"], out["path_dst_page"], out["path_dst_slot"], out["split_counts"],
        num_rows, num_reqs, width, first_page, dump_page, max_entries,
        row_path.stride(0), block_table.stride(0), out["block_table"].stride(0),
        float(num_kv_heads), float(num_sms), max_splits, **launch_meta(block_size, pages_per_row, path_width, key_block))
    return out
