"""training/ceiling.py: the expected acceptance of a tree, the best tree of B nodes, and the end-to-end ceiling."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ubtree_vllm.training.ceiling import best_tree_accepted, expected_accepted

VOCAB = 3


def path_probs(path: tuple[int, ...]) -> torch.Tensor:
    """A fixed distribution over VOCAB tokens after each path (deterministic, uneven)."""
    g = torch.Generator().manual_seed(hash(path) % (2**31))
    return torch.softmax(torch.randn(VOCAB, generator=g) * 2, dim=0)


class FakeScorer:
    """TreeScorer's interface over :func:`path_probs` (no model)."""

    calls = 0

    def probs(self, cache, ctx_len, tokens, parents, depth):
        FakeScorer.calls += 1
        rows = []
        for j in range(len(tokens)):
            path, node = [], j
            while node > 0:
                path.append(tokens[node])
                node = parents[node]
            rows.append(path_probs(tuple(reversed(path))))
        return torch.stack(rows)


def test_expected_accepted_multiplies_along_each_path():
    # root -> a (0.5) -> b (0.4); root -> c (0.25)
    tokens, parents = [9, 0, 1, 2], [-1, 0, 1, 0]
    probs = torch.zeros(4, 3)
    probs[0, 0], probs[0, 2], probs[1, 1] = 0.5, 0.25, 0.4
    assert expected_accepted(probs, tokens, parents) == pytest.approx(0.5 + 0.5 * 0.4 + 0.25)


@pytest.mark.parametrize("budget,max_depth", [(1, 3), (4, 2), (7, 3), (20, 3)])
def test_best_tree_is_the_top_budget_paths(budget, max_depth):
    """Brute force: every path of depth <= max_depth, its probability; the best tree takes the largest B."""
    scored = []
    for depth in range(1, max_depth + 1):
        for path in itertools.product(range(VOCAB), repeat=depth):
            p = 1.0
            for d in range(depth):
                p *= float(path_probs(path[:d])[path[d]])
            scored.append(p)
    want = sum(sorted(scored, reverse=True)[:budget])
    assert best_tree_accepted(FakeScorer(), None, 0, 7, budget, max_depth) == pytest.approx(want, rel=1e-5)


def test_smollm2_ceiling_at_t0_is_the_greedy_chain_and_bounds_the_drafter(default_target_dir):
    """T = 0: the target's distribution is one-hot, so the best tree is its greedy chain, 1 + min(B, gamma) tokens per
    round wherever the rollout continues that far; the drafter's tree can only accept less or as much."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ubtree_vllm.training.data import chat_prompt_ids

    from ubtree_vllm.config import UBTreeConfig
    from ubtree_vllm.drafter.io import load_drafter
    from ubtree_vllm.training.ceiling import tree_ceiling

    shipped = Path(__file__).resolve().parents[2] / "checkpoints" / "smollm2-135m-instruct-ubtree"
    target = AutoModelForCausalLM.from_pretrained(default_target_dir, dtype=torch.float32).eval()
    drafter = load_drafter(shipped, device=torch.device("cpu"), dtype=torch.float32)
    drafter.bind_hf_target(target)
    drafter.eval()
    tokenizer = AutoTokenizer.from_pretrained(default_target_dir)
    prompt = chat_prompt_ids(tokenizer, "Name three colors.")
    tree = UBTreeConfig(tree_budget=4, beam_width=2, top_k=8, block_size=drafter.cfg.block_size)
    drafted, best, count = tree_ceiling(target, drafter, [prompt], 0.0, tree, every=3, max_new_tokens=7, eos=())
    assert count == 3  # anchors at response tokens 0, 3, 6 of 8
    assert best == pytest.approx(1 + 4)
    assert 1.0 <= drafted <= best
