"""The fused per-row head-loss kernel against its torch twin, and the chunked head loss's fused
path against the full-logits oracle (value and gradient).

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from ubtree_vllm.training.head_loss import head_loss, head_loss_reference
from ubtree_vllm.triton_ops.head_loss_rows import head_loss_rows
from ubtree_vllm.triton_ops.reference import head_loss_rows_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def row_inputs(rows: int, vocab: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    s = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    t = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    labels = torch.randint(vocab, (rows,), generator=gen)
    weights = torch.rand(rows, generator=gen)
    return [x.to(DEVICE) for x in (s, t, labels, weights)]


@pytest.mark.parametrize("vocab", [1000, 4096, 5003], ids=["partial-block", "one-block", "blocks+tail"])
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_head_loss_rows_matches_torch(vocab, softcap):
    s, t, labels, weights = row_inputs(5, vocab, torch.float32, vocab)
    g, stats, top1 = head_loss_rows(s, t, labels, weights, 1.0, 0.1, softcap)
    g_ref, stats_ref, top1_ref = head_loss_rows_reference(s, t, labels, weights, 1.0, 0.1, softcap)
    torch.testing.assert_close(stats, stats_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    assert torch.equal(top1, top1_ref)
    assert (stats[:, 1] >= -1e-4).all(), "KL must be non-negative"


def test_head_loss_rows_bf16_logits_strided_rows():
    """bf16 logits (the GPU's matmul output) in a wider buffer: gradient stored as bf16."""
    s, t, labels, weights = row_inputs(4, 3000, torch.bfloat16, 7)
    wide = torch.zeros(4, 3100, dtype=torch.bfloat16, device=DEVICE)
    wide[:, :3000] = s
    g, stats, top1 = head_loss_rows(wide[:, :3000], t, labels, weights, 0.5, 0.2)
    g_ref, stats_ref, top1_ref = head_loss_rows_reference(s, t, labels, weights, 0.5, 0.2)
    assert g.dtype == torch.bfloat16
    torch.testing.assert_close(stats, stats_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(g.float(), g_ref.float(), rtol=2e-2, atol=1e-5)
    assert torch.equal(top1, top1_ref)


def test_fused_head_loss_value_and_gradient_match_the_oracle():
    gen = torch.Generator().manual_seed(3)
    rows, hidden, vocab = 37, 24, 700
    h = torch.randn(rows, hidden, generator=gen).to(DEVICE).requires_grad_()
    w = torch.randn(vocab, hidden, generator=gen).to(DEVICE)
    th = torch.randn(rows, hidden, generator=gen).to(DEVICE)
    labels = torch.randint(vocab, (rows,), generator=gen).to(DEVICE)
    weights = torch.rand(rows, generator=gen).to(DEVICE)
    out = head_loss(h, w, th, labels, weights, 1.0, 0.1, top_k=5, chunk_rows=16, fused=True)
    out.loss.backward()
    grad = h.grad.clone()
    h.grad = None
    ref = head_loss_reference(h, w, th, labels, weights, 1.0, 0.1)
    ref.backward()
    torch.testing.assert_close(out.loss, ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(grad, h.grad, rtol=1e-4, atol=1e-5)
    unfused = head_loss(h.detach(), w, th, labels, weights, 1.0, 0.1, top_k=5, chunk_rows=16, fused=False)
    for name in ("kl_rows", "ce_rows", "lse", "cand_logp"):
        torch.testing.assert_close(getattr(out, name), getattr(unfused, name), rtol=1e-5, atol=1e-4)
    assert torch.equal(out.top1, unfused.top1) and torch.equal(out.cand, unfused.cand)
