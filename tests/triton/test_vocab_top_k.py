"""triton_ops.vocab_top_k: the one-pass top K (with the log-sum-exp and the coupled noise) against its torch twin,
a float32 log-softmax over the whole vocabulary, the coupled scores and a full-vocabulary torch.topk.

Without CUDA the kernel runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
import torch

from kernel_device import DEVICE
from ubtree_vllm.triton_ops.reference import vocab_top_k_reference
from ubtree_vllm.triton_ops.vocab_top_k import BLOCK, vocab_top_k, vocab_top_k_kernel


def batch(num_rows: int, vocab: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(num_rows, vocab, generator=gen) * 3).to(dtype)
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.5] * num_rows)[:num_rows]
    seeds = torch.randint(-(2 ** 62), 2 ** 62, (num_rows,), generator=gen)
    pos = torch.randint(0, 40000, (num_rows,), generator=gen)
    return [t.to(DEVICE) for t in (logits, temperature, seeds, pos)]


def check(got, want, logits: torch.Tensor):
    """The same scores rank by rank; the same tokens up to exact ties (bfloat16 logits tie often); each token's
    log-prob is the full-vocabulary log-softmax's."""
    (tokens, logp, scores), (want_tokens, _, want_scores) = [t.cpu() for t in got], [t.cpu() for t in want]
    assert tokens.dtype == torch.int64 and logp.dtype == scores.dtype == torch.float32
    assert tokens.shape == logp.shape == scores.shape == want_tokens.shape
    torch.testing.assert_close(scores, want_scores, atol=2e-5, rtol=1e-5)
    full_logp = torch.log_softmax(logits.cpu().float(), dim=-1)
    torch.testing.assert_close(logp, full_logp.gather(-1, tokens), atol=2e-5, rtol=1e-5)
    for row in range(tokens.shape[0]):
        assert len(set(tokens[row].tolist())) == tokens.shape[1], "no token twice"
        # every token scoring clearly above the reference's K-th is kept
        clear = want_tokens[row][want_scores[row] > want_scores[row, -1] + 1e-4]
        assert set(clear.tolist()) <= set(tokens[row].tolist())


# vocabularies below one block, of exactly two blocks, with a partial last block; K a power of two or not
SHAPES = [(1, 5, 3), (2, 1500, 1), (3, 1500, 64), (2, 2 * BLOCK, 16), (2, 2 * BLOCK + 905, 64), (2, BLOCK + 1, 5)]


@pytest.mark.parametrize("num_rows,vocab,top_k", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_top_k_matches_the_full_vocabulary_reference(num_rows, vocab, top_k, dtype):
    logits = batch(num_rows, vocab, seed=vocab + top_k, dtype=dtype)[0]
    got = vocab_top_k_kernel(logits, top_k)
    want = vocab_top_k_reference(logits.cpu(), top_k)
    check(got, want, logits)
    if dtype == torch.float32:  # no near ties: the same tokens in the same order
        assert torch.equal(got[0].cpu(), want[0])
    assert torch.equal(got[1], got[2]), "without noise the scores are the log-probs"


@pytest.mark.parametrize("use_fp64", [False, True])
@pytest.mark.parametrize("num_rows,vocab,top_k", [SHAPES[2], SHAPES[4]])
def test_coupled_top_k_matches_the_reference(use_fp64, num_rows, vocab, top_k):
    logits, temperature, seeds, pos = batch(num_rows, vocab, seed=vocab * 7 + top_k)
    got = vocab_top_k_kernel(logits, top_k, temperature, seeds, pos, use_fp64)
    want = vocab_top_k_reference(logits.cpu(), top_k, temperature.cpu(), seeds.cpu(), pos.cpu(), use_fp64)
    check(got, want, logits)
    assert torch.equal(got[0].cpu(), want[0])
    greedy = temperature == 0  # a greedy row of a coupled batch keeps its noise-free candidates, bit for bit
    plain = vocab_top_k_kernel(logits[greedy], top_k)
    for coupled, alone in zip(got, plain):
        assert torch.equal(coupled[greedy], alone)


def test_a_strided_row_view_is_read_in_place():
    """The drafter passes [N * gamma, V] views of the LM head's output; a row stride above V is honoured."""
    wide = batch(4, 3000, seed=5)[0]
    logits = wide[:, :2500]
    check(vocab_top_k_kernel(logits, 8), vocab_top_k_reference(logits.cpu().contiguous(), 8), logits)


def test_the_dispatcher_runs_the_kernel_on_cuda_and_the_twin_elsewhere():
    logits, temperature, seeds, pos = batch(4, 700, seed=9)
    got = vocab_top_k(logits, 6, temperature, seeds, pos)
    if logits.is_cuda:
        check(got, vocab_top_k_reference(logits.cpu(), 6, temperature.cpu(), seeds.cpu(), pos.cpu()), logits)
    else:  # the torch twin itself, bit for bit
        for a, b in zip(got, vocab_top_k_reference(logits, 6, temperature, seeds, pos)):
            assert torch.equal(a, b)


def test_a_block_of_minus_infinity_logits_weighs_nothing():
    """A vocabulary block whose logits are all -inf (masked tokens) adds nothing to the log-sum-exp."""
    logits = batch(2, BLOCK + 300, seed=4)[0]
    logits[:, :BLOCK] = float("-inf")
    got = vocab_top_k_kernel(logits, 4)
    want = vocab_top_k_reference(logits.cpu(), 4)
    assert torch.isfinite(got[1]).all()
    check(got, want, logits)
