"""The proposer loss's per-row softmax work in one launch (training/head_loss.py's fused path).

Per row i of a chunk, with the drafter's logits s_i = W h_i and the target's t_i = W t'_i (both
[V], straight out of the LM-head matmul, bf16 on the GPU; t optionally soft-capped here):

    lse_q = logsumexp(s),  lse_p = logsumexp(t)
    KL(p || q) = sum_v p_v (t_v - s_v) - lse_p + lse_q       (p = softmax(t), q = softmax(s))
    CE = lse_q - s[y]
    g  = w * ((kl_w + ce_w) * q - kl_w * p - ce_w * onehot(y))   d loss / d s, stored in g's dtype

Pass 1 streams s and t once with running maxima (the sum for KL is rescaled with p's maximum);
pass 2 streams them again and writes g. So a row reads 2 x 2 x V values and writes V, where the
unfused torch form materialises about seven [rows, V] float32 tensors. One program per row.

Torch twin: ``head_loss_rows_reference`` (triton_ops/reference.py); test:
tests/triton/test_head_loss_rows.py. The launcher reads no device value.
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

# stats columns of the launcher's output
STATS = ("lse_q", "kl", "ce", "lse_p")

if triton is not None:
    @triton.jit
    def _capped(t, softcap, HAS_SOFTCAP: tl.constexpr):
        if HAS_SOFTCAP:  # softcap * tanh(t / softcap), tanh(x) = 2 sigmoid(2x) - 1
            t = softcap * (2.0 * tl.sigmoid(2.0 * t / softcap) - 1.0)
        return t

    @triton.jit
    def _head_loss_rows_kernel(
            s_ptr, t_ptr, stride_s, stride_t, labels_ptr, row_weight_ptr, g_ptr, stride_g, stats_ptr, top1_ptr,
            vocab, kl_weight, ce_weight, softcap,
            HAS_SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        s_row = s_ptr + row * stride_s
        t_row = t_ptr + row * stride_t
        cols = tl.arange(0, BLOCK_V)
        neg_inf = float("-inf")
        # Pass 1: running max / sum of exp for s and t, sum of e^(t - m_p) (t - s), argmax of s.
        m_q = tl.full((), neg_inf, tl.float32)
        z_q = tl.zeros((), tl.float32)
        m_p = tl.full((), neg_inf, tl.float32)
        z_p = tl.zeros((), tl.float32)
        a_p = tl.zeros((), tl.float32)
        best = tl.full((), neg_inf, tl.float32)
        best_idx = tl.zeros((), tl.int64)
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            inside = idx < vocab
            s = tl.load(s_row + idx, mask=inside, other=neg_inf).to(tl.float32)
            t = _capped(tl.load(t_row + idx, mask=inside, other=0.0).to(tl.float32), softcap, HAS_SOFTCAP)
            t = tl.where(inside, t, neg_inf)
            blk_max_s = tl.max(s, 0)
            blk_arg = tl.argmax(s, 0)
            better = blk_max_s > best
            best_idx = tl.where(better, start + blk_arg.to(tl.int64), best_idx)
            best = tl.maximum(best, blk_max_s)
            new_m_q = tl.maximum(m_q, blk_max_s)
            z_q = z_q * tl.exp(m_q - new_m_q) + tl.sum(tl.exp(s - new_m_q), 0)
            m_q = new_m_q
            new_m_p = tl.maximum(m_p, tl.max(t, 0))
            e_t = tl.exp(t - new_m_p)
            rescale = tl.exp(m_p - new_m_p)
            z_p = z_p * rescale + tl.sum(e_t, 0)
            a_p = a_p * rescale + tl.sum(tl.where(inside, e_t * (t - s), 0.0), 0)
            m_p = new_m_p
        lse_q = m_q + tl.log(z_q)
        lse_p = m_p + tl.log(z_p)
        label = tl.load(labels_ptr + row).to(tl.int64)
        s_label = tl.load(s_row + label).to(tl.float32)
        kl = a_p / z_p - lse_p + lse_q
        ce = lse_q - s_label
        tl.store(stats_ptr + row * 4 + 0, lse_q)
        tl.store(stats_ptr + row * 4 + 1, kl)
        tl.store(stats_ptr + row * 4 + 2, ce)
        tl.store(stats_ptr + row * 4 + 3, lse_p)
        tl.store(top1_ptr + row, best_idx)
        # Pass 2: d loss / d s.
        w = tl.load(row_weight_ptr + row).to(tl.float32)
        g_row = g_ptr + row * stride_g
        for start in range(0, vocab, BLOCK_V):
            idx = start + cols
            inside = idx < vocab
            s = tl.load(s_row + idx, mask=inside, other=0.0).to(tl.float32)
            t = _capped(tl.load(t_row + idx, mask=inside, other=0.0).to(tl.float32), softcap, HAS_SOFTCAP)
            q = tl.exp(s - lse_q)
            p = tl.exp(t - lse_p)
            g = (kl_weight + ce_weight) * q - kl_weight * p - tl.where(idx == label, ce_weight, 0.0)
            tl.store(g_row + idx, (w * g).to(g_ptr.dtype.element_ty), mask=inside)


def launch_meta(vocab: int, softcap: float | None) -> dict[str, object]:
    """Compile-time parameters of one launch."""
    return {"HAS_SOFTCAP": bool(softcap), "BLOCK_V": min(2048, triton.next_power_of_2(vocab))}


def head_loss_rows(logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                   row_weight: torch.Tensor, kl_weight: float, ce_weight: float, softcap: float | None = None,
                   grad_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Module docstring. logits/teacher_logits [c, V] (rows contiguous); labels [c] int64;
    row_weight [c] float32. Returns (g [c, V] in grad_dtype (default: the logits' dtype),
    stats [c, 4] float32 with columns STATS, top1 [c] int64 argmax of logits)."""
    if triton is None:
        raise RuntimeError("head_loss_rows needs triton (pip install triton); training/head_loss.py has a torch path")
    rows, vocab = logits.shape
    assert teacher_logits.shape == (rows, vocab), \
        f"teacher_logits must be [{rows}, {vocab}] like logits, got {tuple(teacher_logits.shape)}"
    assert logits.stride(1) == 1 and teacher_logits.stride(1) == 1, "logit rows must be contiguous"
    assert labels.shape == (rows,) and not labels.is_floating_point(), f"labels must be [{rows}] integer"
    assert row_weight.shape == (rows,) and row_weight.dtype == torch.float32, f"row_weight must be [{rows}] float32"
    assert all(t.device == logits.device for t in (teacher_logits, labels, row_weight)), "one device for all inputs"
    g = torch.empty((rows, vocab), dtype=grad_dtype or logits.dtype, device=logits.device)
    stats = torch.empty((rows, 4), dtype=torch.float32, device=logits.device)
    top1 = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _head_loss_rows_kernel[(rows,)](
            logits, teacher_logits, logits.stride(0), teacher_logits.stride(0), labels, row_weight, g, g.stride(0),
            stats, top1, vocab, float(kl_weight), float(ce_weight), float(softcap or 1.0),
            **launch_meta(vocab, softcap))
    return g, stats, top1
