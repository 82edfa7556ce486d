"""Tree-mask attention for multi-head latent attention (MLA) layers, in the absorbed (decode) form.

MLA layers (DeepSeek-V2/V3, Kimi, Ling-3.0's BailingMoeV3 full-attention layers) cache one
latent vector per token: ``kv_cache[block, slot] = [c (L = kv_lora_rank) | k_rope (R)]``, vLLM's
MLA cache layout. In the absorbed form every query head h attends with
``q_latent[h] (L) = W_UK^T q_nope[h]`` and its RoPE part ``q_rope[h] (R)``:

    s_j = scale * (q_latent[h] . c_j + q_rope[h] . k_rope_j),   o[h] = sum_j softmax(s)_j c_j   (L)

and the layer maps ``o`` back through ``W_UV`` itself. All heads share the single latent K/V
(multi-query attention with Dk = L + R, Dv = L).

Tree row r (a non-root node of a draft tree) attends to exactly what a non-speculative decode at
that node would see, the same row plan as :mod:`ubtree_vllm.triton_ops.tree_attention`:

* the committed context: positions 0 .. row_context_len[r] - 1 of request row_req[r], read from
  the paged cache through ``block_table[row_req[r]]``;
* its ancestors-or-self: this forward's fresh latent rows ``kv_latent / k_rope[row_path[r, j]]``
  (root first, -1 padded). The caller applies RoPE at the node's depth position before, as for
  every row of the forward.

One program per (entry, tile of BLOCK_H query heads): an online softmax (fp32, base 2) over the
context in BLOCK_N-token tiles, each tile loaded once for all heads of the program, then one tile
of the path's gathered rows. Entries with ``row_index == -1`` are skipped (fixed-size CUDA-graph
launches); rows of ``out`` not in ``row_index`` are never touched. The launcher reads no device
value. Test oracle: :func:`ubtree_vllm.triton_ops.reference.tree_mla_attention_reference`.
"""
from __future__ import annotations

import torch

try:  # Triton is optional at import time: CPU-only installs can import this module.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    @triton.jit
    def _fold_latent_tile(q_lat, q_rope, c, kr, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr):
        """Fold one tile of latent rows c [N, L] / RoPE keys kr [N, R] into the running (max, sum, acc) of
        q_lat [BLOCK_H, L] / q_rope [BLOCK_H, R]; valid broadcasts to [BLOCK_H, N]; statistics in base 2."""
        s = (tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)
             + tl.dot(q_rope, tl.trans(kr), input_precision=DOT_PRECISION)) * qk_scale  # [BLOCK_H, N]
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: m_i starts at -1e30
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=DOT_PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _tree_mla_attention_kernel(
            out_ptr, stride_out_t, stride_out_h,
            q_lat_ptr, stride_ql_t, stride_ql_h,
            q_rope_ptr, stride_qr_t, stride_qr_h,
            kv_lat_ptr, stride_kl_t,
            k_rope_ptr, stride_kr_t,
            cache_ptr, stride_c_block, stride_c_slot,
            block_table_ptr, stride_bt_req,
            row_index_ptr, row_req_ptr, row_context_len_ptr, row_path_ptr, stride_path_row,
            qk_scale, num_heads, path_len,
            LATENT: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
            PATH_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr):
        entry = tl.program_id(0)
        heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        row = tl.load(row_index_ptr + entry).to(tl.int64)
        if row >= 0:
            req = tl.load(row_req_ptr + entry).to(tl.int64)
            context_len = tl.load(row_context_len_ptr + entry).to(tl.int32)
            hm = heads < num_heads
            offs_l = tl.arange(0, LATENT)
            offs_r = tl.arange(0, ROPE)
            q_lat = tl.load(q_lat_ptr + row * stride_ql_t + heads[:, None] * stride_ql_h + offs_l[None, :],
                            mask=hm[:, None], other=0.0)  # [BLOCK_H, L]
            q_rope = tl.load(q_rope_ptr + row * stride_qr_t + heads[:, None] * stride_qr_h + offs_r[None, :],
                             mask=hm[:, None], other=0.0)  # [BLOCK_H, R]
            m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
            l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
            acc = tl.zeros([BLOCK_H, LATENT], dtype=tl.float32)
            offs_n = tl.arange(0, BLOCK_N)
            # (a) the committed context through the block table, BLOCK_N tokens at a time
            for start in range(0, context_len, BLOCK_N):
                pos = start + offs_n
                valid = pos < context_len
                block_id = tl.load(block_table_ptr + req * stride_bt_req + pos // BLOCK_SIZE, mask=valid,
                                   other=0).to(tl.int64)
                base = block_id * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot  # [BLOCK_N]
                c = tl.load(cache_ptr + base[:, None] + offs_l[None, :], mask=valid[:, None], other=0.0)
                kr = tl.load(cache_ptr + base[:, None] + LATENT + offs_r[None, :], mask=valid[:, None], other=0.0)
                m_i, l_i, acc = _fold_latent_tile(q_lat, q_rope, c, kr, valid[None, :], m_i, l_i, acc, qk_scale,
                                                  DOT_PRECISION)
            # (b) ancestors-or-self: the path's fresh rows gathered as one tile
            offs_p = tl.arange(0, PATH_PAD)
            path = tl.load(row_path_ptr + entry * stride_path_row + offs_p, mask=offs_p < path_len,
                           other=-1).to(tl.int64)
            on_path = path >= 0
            prow = tl.where(on_path, path, 0)
            c = tl.load(kv_lat_ptr + prow[:, None] * stride_kl_t + offs_l[None, :], mask=on_path[:, None], other=0.0)
            kr = tl.load(k_rope_ptr + prow[:, None] * stride_kr_t + offs_r[None, :], mask=on_path[:, None],
                         other=0.0)
            m_i, l_i, acc = _fold_latent_tile(q_lat, q_rope, c, kr, on_path[None, :], m_i, l_i, acc, qk_scale,
                                              DOT_PRECISION)
            l_i = tl.where(l_i > 0.0, l_i, 1.0)  # nothing to attend to -> zeros
            tl.store(out_ptr + row * stride_out_t + heads[:, None] * stride_out_h + offs_l[None, :],
                     (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=hm[:, None])


_LOG2E = 1.4426950408889634


def launch_meta(latent: int, rope: int, path_len: int, block_size: int, dtype: torch.dtype) -> dict[str, object]:
    """Compile-time parameters (shared with compile_check): head tile, context tile, padded path."""
    return {"LATENT": latent, "ROPE": rope, "BLOCK_H": 16, "BLOCK_N": 32 if latent <= 256 else 16,
            "PATH_PAD": max(16, triton.next_power_of_2(max(path_len, 1))), "BLOCK_SIZE": block_size,
            "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32"}


def _power_of_two(value: int) -> bool:
    return value >= 16 and value & (value - 1) == 0


def tree_mla_attention(
        # [T, H, L] absorbed latent queries, [T, H, R] RoPE queries (rotated at each row's position)
        q_latent: torch.Tensor, q_rope: torch.Tensor,
        # [T, L] latent and [T, R] rotated RoPE keys of this forward's rows (the kv_cache entries they write)
        kv_latent: torch.Tensor, k_rope: torch.Tensor,
        # [num_blocks, block_size, L + R] vLLM's MLA cache (latent, then RoPE key)
        kv_cache: torch.Tensor,
        # [num_reqs, max_blocks] block ids per request
        block_table: torch.Tensor,
        # [M] global row of each tree row (-1 = skip), its request, its committed context length
        row_index: torch.Tensor, row_req: torch.Tensor, row_context_len: torch.Tensor,
        # [M, P] global rows of the root->row path (ancestors-or-self), -1 padded
        row_path: torch.Tensor,
        scale: float,
        # [T, H, L] mutable: rows row_index are overwritten, the others untouched
        out: torch.Tensor) -> torch.Tensor:
    """Write the latent attention output of every tree row into ``out[row_index]``; returns ``out``.

    See the module docstring; asserts the contract (shapes, dtypes, unit last-dim strides)."""
    num_rows, num_heads, latent = q_latent.shape
    rope = q_rope.shape[-1]
    assert q_rope.shape[:2] == (num_rows, num_heads), f"q_rope {tuple(q_rope.shape)} vs q_latent {tuple(q_latent.shape)}"
    assert kv_latent.shape == (num_rows, latent) and k_rope.shape == (num_rows, rope), (
        f"kv_latent {tuple(kv_latent.shape)} / k_rope {tuple(k_rope.shape)} do not fit T={num_rows}, L={latent}, "
        f"R={rope}")
    assert kv_cache.dim() == 3 and kv_cache.shape[2] == latent + rope, (
        f"kv_cache must be [num_blocks, block_size, L + R = {latent + rope}], got {tuple(kv_cache.shape)}")
    assert out.shape == q_latent.shape, f"out {tuple(out.shape)} != q_latent {tuple(q_latent.shape)}"
    assert _power_of_two(latent) and _power_of_two(rope), f"L ({latent}) and R ({rope}) must be powers of two >= 16"
    dtypes = {t.dtype for t in (q_latent, q_rope, kv_latent, k_rope, kv_cache)}
    assert len(dtypes) == 1, f"q, fresh rows and cache must share a dtype, got {dtypes}"
    for name, t in (("q_latent", q_latent), ("q_rope", q_rope), ("kv_latent", kv_latent), ("k_rope", k_rope),
                    ("kv_cache", kv_cache), ("out", out)):
        assert t.stride(-1) == 1, f"{name} must have a unit last-dim stride"
    assert row_path.dim() == 2 and row_path.shape[0] == row_index.shape[0], (
        f"row_path {tuple(row_path.shape)} vs row_index {tuple(row_index.shape)}")
    num_entries, path_len = row_path.shape
    if num_entries == 0:
        return out
    meta = launch_meta(latent, rope, path_len, kv_cache.shape[1], kv_cache.dtype)
    row_path = row_path.contiguous()
    grid = (num_entries, triton.cdiv(num_heads, meta["BLOCK_H"]))
    _tree_mla_attention_kernel[grid](
        out, out.stride(0), out.stride(1),
        q_latent, q_latent.stride(0), q_latent.stride(1),
        q_rope, q_rope.stride(0), q_rope.stride(1),
        kv_latent, kv_latent.stride(0), k_rope, k_rope.stride(0),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        block_table, block_table.stride(0),
        row_index, row_req, row_context_len, row_path, row_path.stride(0),
        float(scale) * _LOG2E, num_heads, path_len, **meta)
    return out
