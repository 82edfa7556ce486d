"""The proposer's objective through the target's LM head, in row chunks.

Per labelled row i (one block depth of one anchor) with drafter hidden h_i, the target's
teacher-forced final hidden t_i at the previous position, the label y_i and a row weight w_i:

    q_i = softmax(W h_i)           the proposer's distribution   (W: the frozen LM head [V, H])
    p_i = softmax(softcap(W t_i))  the target's distribution at that position
    loss = sum_i w_i * (kl_weight * KL(p_i || q_i) + ce_weight * -log q_i[y_i])

`[rows, V]` logits are never held whole: rows go through the head in chunks, and since W is
frozen the gradient w.r.t. h is formed chunk by chunk in the forward pass,
    dloss/dh_i = w_i * (kl_weight * (q_i - p_i) + ce_weight * (q_i - onehot(y_i))) @ W,
so the backward is one multiply ([rows, H] kept, not [rows, V]). The same pass returns
the per-row KL and CE, the proposer's top-1 and its top-K candidates with their
log-probabilities (inputs of the selector), all without gradient. With `lse_grad` it also
returns a differentiable log-sum-exp of W h (for a caller that differentiates log q at a few
tokens through the normalizer, e.g. the joint recipe's selector).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ubtree_vllm.triton_ops.head_loss_rows import head_loss_rows
from ubtree_vllm.triton_ops.head_loss_rows import triton as _triton

DEFAULT_CHUNK_ROWS = 4096


def triton_available() -> bool:
    return _triton is not None


@dataclass
class HeadLossOutput:
    loss: torch.Tensor  # scalar, differentiable w.r.t. hidden
    kl_rows: torch.Tensor  # [M] float32, no grad
    ce_rows: torch.Tensor  # [M] float32, no grad
    top1: torch.Tensor  # [M] int64 proposer argmax
    cand: torch.Tensor  # [M, K] int64 proposer top-K (descending)
    cand_logp: torch.Tensor  # [M, K] float32 their log q, no grad
    lse: torch.Tensor  # [M] float32 log-sum-exp of W h; differentiable when lse_grad


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, head_weight, teacher_hidden, labels, row_weight, kl_weight, ce_weight, top_k,
                softcap, chunk_rows, lse_grad, fused):
        rows = hidden.shape[0]
        dev = hidden.device
        w = head_weight
        grad_hidden = torch.empty((rows, hidden.shape[1]), dtype=torch.float32, device=dev)
        lse_hidden = torch.empty_like(grad_hidden) if lse_grad else None
        kl_rows = torch.empty(rows, dtype=torch.float32, device=dev)
        ce_rows = torch.empty_like(kl_rows)
        lse = torch.empty_like(kl_rows)
        top1 = torch.empty(rows, dtype=torch.long, device=dev)
        cand = torch.empty((rows, top_k), dtype=torch.long, device=dev)
        cand_logp = torch.empty((rows, top_k), dtype=torch.float32, device=dev)
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        with torch.autocast(device_type=dev.type, enabled=False):
            for start in range(0, rows, chunk_rows):
                sl = slice(start, min(rows, start + chunk_rows))
                if fused:  # one two-pass kernel over the matmuls' logits (triton_ops/head_loss_rows.py)
                    logits = hidden[sl].to(w.dtype) @ w.t()  # [c, V] in the head's dtype
                    t_logits = teacher_hidden[sl].to(w.dtype) @ w.t()
                    g, stats, top1[sl] = head_loss_rows(logits, t_logits, labels[sl], row_weight[sl], kl_weight,
                                                        ce_weight, softcap)
                    chunk_lse, kl, ce = stats[:, 0], stats[:, 1], stats[:, 2]
                    loss += (row_weight[sl] * (kl_weight * kl + ce_weight * ce)).sum()
                    grad_hidden[sl] = (g @ w).float()
                    kl_rows[sl], ce_rows[sl], lse[sl] = kl, ce, chunk_lse
                    top_logits, cand[sl] = logits.topk(top_k, dim=-1)
                    cand_logp[sl] = top_logits.float() - chunk_lse[:, None]
                    continue
                logits = (hidden[sl].to(w.dtype) @ w.t()).float()  # [c, V]
                chunk_lse = torch.logsumexp(logits, dim=-1)
                log_q = logits - chunk_lse[:, None]
                t_logits = (teacher_hidden[sl].to(w.dtype) @ w.t()).float()
                if softcap:
                    t_logits = softcap * torch.tanh(t_logits / softcap)
                log_p = torch.log_softmax(t_logits, dim=-1)
                p = log_p.exp()
                q = log_q.exp()
                y = labels[sl]
                kl = (p * (log_p - log_q)).sum(-1)
                ce = -log_q.gather(1, y[:, None]).squeeze(1)
                rw = row_weight[sl]
                loss += (rw * (kl_weight * kl + ce_weight * ce)).sum()
                # d loss / d logits, then through the frozen head.
                g = (kl_weight + ce_weight) * q - kl_weight * p
                g.scatter_add_(1, y[:, None], torch.full_like(y[:, None], -ce_weight, dtype=g.dtype))
                g *= rw[:, None]
                grad_hidden[sl] = (g.to(w.dtype) @ w).float()
                if lse_hidden is not None:
                    lse_hidden[sl] = (q.to(w.dtype) @ w).float()
                kl_rows[sl], ce_rows[sl], lse[sl] = kl, ce, chunk_lse
                top1[sl] = logits.argmax(-1)
                cand_logp[sl], cand[sl] = log_q.topk(top_k, dim=-1)
        ctx.save_for_backward(grad_hidden, lse_hidden if lse_hidden is not None else grad_hidden[:0])
        ctx.lse_grad = lse_grad
        ctx.hidden_dtype = hidden.dtype
        ctx.mark_non_differentiable(kl_rows, ce_rows, top1, cand, cand_logp)
        if not lse_grad:
            ctx.mark_non_differentiable(lse)
        return loss, kl_rows, ce_rows, top1, cand, cand_logp, lse

    @staticmethod
    def backward(ctx, grad_loss, _kl, _ce, _top1, _cand, _cand_logp, grad_lse):
        grad_hidden, lse_hidden = ctx.saved_tensors
        grad = grad_hidden * grad_loss
        if ctx.lse_grad and grad_lse is not None:
            grad = grad + lse_hidden * grad_lse[:, None]
        return grad.to(ctx.hidden_dtype), None, None, None, None, None, None, None, None, None, None, None


def head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, teacher_hidden: torch.Tensor, labels: torch.Tensor,
              row_weight: torch.Tensor, kl_weight: float, ce_weight: float, top_k: int,
              softcap: float | None = None, chunk_rows: int = DEFAULT_CHUNK_ROWS,
              lse_grad: bool = False, fused: bool | None = None) -> HeadLossOutput:
    """See the module docstring. hidden/teacher_hidden [M, H]; head_weight [V, H] (frozen);
    labels [M] int64; row_weight [M] float32. `fused` (default: on CUDA, without lse_grad) runs
    each chunk's softmax work in the Triton kernel of triton_ops/head_loss_rows.py; the torch
    path stays for the CPU and for lse_grad, which needs q itself."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if fused is None:
        fused = hidden.is_cuda and not lse_grad and triton_available()
    if fused and lse_grad:
        raise ValueError("fused=True does not support lse_grad (the fused kernel never forms q)")
    out = _HeadLoss.apply(hidden, head_weight.detach(), teacher_hidden.detach(), labels, row_weight.float(),
                          float(kl_weight), float(ce_weight), int(top_k), softcap, int(chunk_rows), bool(lse_grad),
                          bool(fused))
    return HeadLossOutput(*out)


def head_loss_reference(hidden: torch.Tensor, head_weight: torch.Tensor, teacher_hidden: torch.Tensor,
                        labels: torch.Tensor, row_weight: torch.Tensor, kl_weight: float, ce_weight: float,
                        softcap: float | None = None) -> torch.Tensor:
    """The same loss with full [M, V] logits and autograd (the test oracle)."""
    log_q = torch.log_softmax((hidden @ head_weight.t()).float(), dim=-1)
    t_logits = (teacher_hidden @ head_weight.t()).float()
    if softcap:
        t_logits = softcap * torch.tanh(t_logits / softcap)
    log_p = torch.log_softmax(t_logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    ce = -log_q.gather(1, labels[:, None]).squeeze(1)
    return (row_weight * (kl_weight * kl + ce_weight * ce)).sum()
