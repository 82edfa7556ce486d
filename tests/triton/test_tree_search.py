"""triton_ops.tree_search against tree.search.build_tree (its oracle): identical trees, ties included.

Without CUDA the kernel runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
import torch

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.tree.search import build_tree
from ubtree_vllm.triton_ops.tree_search import tree_search

# the interpreter (CPU tensors) only where there is no GPU: with CUDA, Triton launches real kernels
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def random_lattice(num_reqs: int, gamma: int, top_k: int, gen: torch.Generator, ties: bool):
    anchor = torch.randint(0, 1000, (num_reqs,), generator=gen)
    cand = torch.stack([torch.stack([torch.randperm(1000, generator=gen)[:top_k] for _ in range(gamma)])
                        for _ in range(num_reqs)])  # distinct within a depth
    root = -torch.rand(num_reqs, top_k, generator=gen) * 4
    trans = -torch.rand(num_reqs, gamma - 1, top_k, top_k, generator=gen) * 4
    if ties:  # coarse values: many equal scores, so the tie-breaking rule decides
        root, trans = (root * 2).round() / 2, (trans * 2).round() / 2
    trans[..., 0] = 0.5  # positive log-probs are clamped to 0 by both
    return anchor, cand, root, trans


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_reqs,gamma,top_k,beam_width,budget,ties", [
    (2, 4, 8, 3, 6, False), (3, 5, 6, 4, 12, True), (1, 16, 64, 12, 64, False), (2, 16, 64, 12, 64, True),
    (1, 3, 2, 4, 5, False), (2, 1, 5, 2, 2, True), (2, 4, 8, 1, 4, True)])
def test_matches_build_tree(device, num_reqs, gamma, top_k, beam_width, budget, ties):
    gen = torch.Generator().manual_seed(gamma * 100 + top_k + ties)
    anchor, cand, root, trans = random_lattice(num_reqs, gamma, top_k, gen, ties)
    cfg = UBTreeConfig(tree_budget=budget, beam_width=beam_width, top_k=top_k, block_size=gamma)
    want = build_tree(anchor, cand, root, trans, cfg)
    tokens, parents, depth, scores = tree_search(anchor.to(device), cand.to(device), root.to(device),
                                                 trans.to(device), beam_width, budget)
    assert torch.equal(tokens.cpu(), want.tokens)
    assert torch.equal(parents.cpu(), want.parents)
    assert torch.equal(depth.cpu(), want.depth)
    assert torch.equal(scores.cpu(), want.scores)
    assert int(want.depth.max()) > 1 or gamma == 1


def test_budget_beyond_the_beam_is_refused():
    anchor, cand, root, trans = random_lattice(1, 2, 2, torch.Generator().manual_seed(0), False)
    with pytest.raises(AssertionError, match=r"tree_budget must be in \[1, 4\]"):
        tree_search(anchor, cand, root, trans, beam_width=2, tree_budget=5)
