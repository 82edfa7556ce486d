"""Bigram selector: serving tables and the training path agree; edge rows are log-distributions."""
from __future__ import annotations

import torch

from ubtree_vllm.selector.bigram import BigramSelector


def make_selector():
    torch.manual_seed(0)
    sel = BigramSelector(hidden_size=16, inner=24, rank=8, block_size=4)
    embed = torch.randn(50, 16)
    pred = torch.randint(50, (3, 4, 5))
    cand = torch.randint(50, (3, 4, 6))
    cand_logp = torch.log_softmax(torch.randn(3, 4, 6), -1)
    hidden = torch.randn(3, 4, 16)
    return sel, embed, (pred, cand, cand_logp, hidden)


def test_precomputed_tables_match_training_path():
    sel, embed, args = make_selector()
    trained = sel.train().edge_logprobs(*args, embed)
    sel.eval()
    sel.precompute_tables(embed)
    served = sel.edge_logprobs(*args, embed)
    torch.testing.assert_close(served, trained)
    assert served.shape == (3, 4, 5, 6)
    torch.testing.assert_close(served.exp().sum(-1), torch.ones(3, 4, 5))


def test_training_path_gradients_reach_both_codebooks():
    sel, embed, args = make_selector()
    sel.train().edge_logprobs(*args, embed)[..., 0].sum().backward()
    for module in (sel.pred_codebook, sel.succ_codebook, sel.hidden_proj):
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())
