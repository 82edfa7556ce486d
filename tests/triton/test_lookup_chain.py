"""triton_ops.lookup_chain against ``tree.lookup.lookup_continuation`` (itself checked against a brute-force search
in tests/unit/test_tree_lookup.py) over the gathered history rows, as the MRV2 speculator gathered them, and its
injection kernel against ``tree.lookup.inject_chain``.

Without CUDA the kernels run under the Triton interpreter on CPU tensors."""
from __future__ import annotations

import pytest
import torch

from ubtree_vllm.tree.lookup import inject_chain, lookup_continuation
from ubtree_vllm.triton_ops.lookup_chain import BLOCK_L, inject_chain_lattice, lookup_chain_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(token_ids: torch.Tensor, total_len: torch.Tensor, slots: torch.Tensor, gamma: int, min_n: int,
              max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    history = token_ids[slots].long()
    return lookup_continuation(history, total_len[slots].long().clamp(0, history.shape[1]), gamma, min_n, max_n)


def random_histories(num_slots: int, width: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 histories with repeats planted (copied spans, a constant row), lengths from 0 to past the width."""
    token_ids = torch.randint(vocab, (num_slots, width), generator=gen, dtype=torch.int32)
    token_ids[0] = 7  # every n matches at the latest possible place
    for slot in range(1, num_slots):  # a copied span: a long match far back
        span = int(torch.randint(4, 12, (1,), generator=gen))
        src = int(torch.randint(0, width // 2, (1,), generator=gen))
        dst = int(torch.randint(width // 2, width - span, (1,), generator=gen))
        token_ids[slot, dst:dst + span] = token_ids[slot, src:src + span].clone()
    total_len = torch.randint(0, width + 1, (num_slots,), generator=gen, dtype=torch.int32)
    total_len[1] = width + 5  # longer than the buffer: clamped to it
    total_len[2] = 1
    return token_ids, total_len


@pytest.mark.parametrize("width", [40, BLOCK_L + 300, 2 * BLOCK_L])
@pytest.mark.parametrize("gamma,min_n,max_n,vocab", [(16, 2, 4, 3), (3, 1, 1, 5), (5, 3, 5, 2)])
def test_matches_lookup_continuation(width, gamma, min_n, max_n, vocab):
    gen = torch.Generator().manual_seed(width + 10 * gamma + min_n)
    token_ids, total_len = random_histories(6, width, vocab, gen)
    slots = torch.tensor([3, 0, 5, 1, 2, 3, 4], dtype=torch.long)  # any order, a slot twice
    want_chain, want_len = reference(token_ids, total_len, slots, gamma, min_n, max_n)
    chain, chain_len = lookup_chain_rows(token_ids.to(DEVICE), total_len.to(DEVICE), slots.to(DEVICE), gamma,
                                         min_n, max_n)
    assert torch.equal(chain_len.cpu(), want_len)
    assert torch.equal(chain.cpu(), want_chain)
    assert want_len.max() > 0 and (want_len == 0).any()  # both cases exercised


def test_match_in_a_later_block_beats_earlier_blocks():
    """The latest match of the longest n wins across scan blocks: a 3-gram in block 0 and a later one in block 1."""
    width = 2 * BLOCK_L
    token_ids = torch.zeros((1, width), dtype=torch.int32)
    token_ids[0] = torch.arange(width, dtype=torch.int32) % 1000 + 10  # no repeats within 1000 tokens
    suffix = [1, 2, 3]
    length = width - 5
    token_ids[0, length - 3:length] = torch.tensor(suffix)
    token_ids[0, 100:103] = torch.tensor(suffix)
    token_ids[0, BLOCK_L + 50:BLOCK_L + 53] = torch.tensor(suffix)
    total_len = torch.tensor([length], dtype=torch.int32)
    slots = torch.tensor([0])
    chain, chain_len = lookup_chain_rows(token_ids.to(DEVICE), total_len.to(DEVICE), slots.to(DEVICE), 4, 2, 4)
    assert chain_len.tolist() == [4]
    assert chain.cpu().tolist() == [token_ids[0, BLOCK_L + 53:BLOCK_L + 57].tolist()]


def test_no_rows_and_bad_lengths():
    token_ids = torch.zeros((2, 8), dtype=torch.int32, device=DEVICE)
    total_len = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    chain, chain_len = lookup_chain_rows(token_ids, total_len, torch.zeros(0, dtype=torch.long, device=DEVICE),
                                         4, 2, 3)
    assert chain.shape == (0, 4) and chain_len.shape == (0,)
    with pytest.raises(ValueError, match="min_n"):
        lookup_chain_rows(token_ids, total_len, torch.zeros(1, dtype=torch.long, device=DEVICE), 4, 3, 2)


@pytest.mark.parametrize("gamma,top_k,edge_logprob", [(5, 6, 0.0), (16, 64, -0.3), (1, 4, 0.0), (3, 5, -1.0)])
def test_injection_matches_inject_chain(gamma, top_k, edge_logprob):
    gen = torch.Generator().manual_seed(gamma * 7 + top_k)
    num_reqs, vocab = 6, max(3 * top_k, 12)
    cand = torch.stack([torch.stack([torch.randperm(vocab, generator=gen)[:top_k] for _ in range(gamma)])
                        for _ in range(num_reqs)])
    # the edges as the selector hands them over: views of one [N, gamma, K, K] tensor
    logp = torch.log_softmax(torch.randn(num_reqs, gamma, top_k, top_k, generator=gen), -1)
    root, trans = logp[:, 0, 0], logp[:, 1:]
    chain = torch.randint(vocab, (num_reqs, gamma), generator=gen)
    chain[0] = vocab + torch.arange(gamma)  # proposed at no depth: the last slot replaced at every depth, whose
    logp[0, :, :, top_k - 1] = -0.01  # selector scores (above edge_logprob) must not survive into the chain's edges
    chain[1] = cand[1, :, top_k // 2]  # proposed at every depth
    chain[2, 1:] = cand[2, 1:, 0]  # replaced at depth 1 only
    chain_len = torch.tensor([gamma, gamma, gamma, 0, max(gamma - 1, 0), 1])[:num_reqs]
    want = inject_chain(cand, root, trans, chain, chain_len, edge_logprob)
    got = inject_chain_lattice(cand.to(DEVICE), root.to(DEVICE), trans.to(DEVICE), chain.to(DEVICE),
                               chain_len.to(DEVICE), edge_logprob)
    for name, w, g in zip(("tokens", "root_logp", "trans_logp"), want, got):
        assert torch.equal(g.cpu(), w), name
    assert not torch.equal(want[0], cand) and not torch.equal(want[1], root)  # the chains changed the lattice
