"""training/ceiling.py: the expected acceptance of a tree, the best tree of B nodes, and the end-to-end ceiling."""
from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from ubtree_vllm.training.ceiling import accepted_under_noise, best_tree_accepted, expected_accepted

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
    scores = tree_ceiling(target, drafter, [prompt], 0.0, tree, every=3, max_new_tokens=7, eos=(), coupled_samples=2)
    assert scores.num_contexts == 3  # anchors at response tokens 0, 3, 6 of 8
    assert scores.best == pytest.approx(1 + 4)
    assert 1.0 <= scores.drafter <= scores.best
    assert scores.coupled is None  # T = 0: nothing to couple to


def test_accepted_under_noise_walks_the_targets_gumbel_max_draws():
    """root -> a (token 0) -> b (token 1); root -> c (token 2): the draw at the root picks the child, the draw at a
    continues or stops the walk."""
    tokens, parents, depth = [9, 0, 1, 2], [-1, 0, 1, 0], [0, 1, 2, 1]
    probs = torch.full((4, 3), 1 / 3)
    noise = torch.tensor([[5.0, 0.0, 0.0], [0.0, 5.0, 0.0], [0.0, 0.0, 0.0]])  # depth 1 draws 0, depth 2 draws 1
    assert accepted_under_noise(probs, tokens, parents, depth, noise) == 2
    noise[1] = torch.tensor([0.0, 0.0, 5.0])  # depth 2 draws 2: a has no such child
    assert accepted_under_noise(probs, tokens, parents, depth, noise) == 1
    noise[0] = torch.tensor([0.0, 0.0, 5.0])  # depth 1 draws 2: c, a leaf
    assert accepted_under_noise(probs, tokens, parents, depth, noise) == 1
    noise[0] = torch.tensor([0.0, 5.0, 0.0])  # depth 1 draws 1: no child of the root holds it
    assert accepted_under_noise(probs, tokens, parents, depth, noise) == 0


def test_coupled_tree_of_a_perfect_drafter_accepts_every_depth():
    """A drafter whose candidates and edges are the target's own: under coupling its top branch is the target's
    draw at every depth, so the walk runs the whole block (a drafter blind to the noise could not)."""
    from ubtree_vllm.training.ceiling import coupled_tree_accepted
    from ubtree_vllm.types import DraftContext

    gamma, vocab = 3, 5
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(2))

    class Scorer:
        temperature = 1.0

        def probs(self, cache, ctx_len, tokens, parents, depth):
            return torch.softmax(logits, -1).expand(len(tokens), -1)

    class Drafter:
        cfg = type("cfg", (), {"vocab_size": vocab})

        def draft_tree(self, ctx, tree, noise):
            from ubtree_vllm.drafter.coupling import coupled_candidates

            tokens = coupled_candidates(logits.expand(1, gamma, vocab), 1, noise)[0][0, :, 0].tolist()  # the coupled top 1 per depth
            return type("tree", (), {"tokens": torch.tensor([[7] + tokens]),
                                     "parents": torch.tensor([list(range(-1, gamma))]),
                                     "depth": torch.tensor([list(range(gamma + 1))])})

    from ubtree_vllm.config import UBTreeConfig

    ctx = DraftContext(anchor=torch.tensor([7]), anchor_pos=torch.tensor([4]), features=torch.zeros(1, 4, 1),
                       positions=torch.arange(4)[None], valid=torch.ones(1, 4, dtype=torch.bool),
                       tokens=torch.zeros(1, 4, dtype=torch.long))
    tree = UBTreeConfig(tree_budget=gamma, beam_width=1, top_k=1, block_size=gamma)
    mean = coupled_tree_accepted(Scorer(), None, 4, Drafter(), ctx, tree, samples=6,
                                 gen=torch.Generator().manual_seed(0))
    assert mean == {tree.coupled_edge_weight: gamma}


def test_coupled_weights_are_scored_under_the_same_noise_draws():
    """Each noise draw drafts one tree per coupled edge weight, with that weight and that draw's seed, so the weights
    compare pair by pair; the means come back per weight."""
    from ubtree_vllm.config import UBTreeConfig
    from ubtree_vllm.training.ceiling import coupled_tree_accepted
    from ubtree_vllm.types import DraftContext

    gamma, vocab = 2, 4
    calls = []

    class Scorer:
        temperature = 1.0

        def probs(self, cache, ctx_len, tokens, parents, depth):
            return torch.full((len(tokens), vocab), 1 / vocab)

    class Drafter:
        cfg = type("cfg", (), {"vocab_size": vocab})

        def draft_tree(self, ctx, tree, noise):
            calls.append((tree.coupled_edge_weight, int(noise.seeds[0])))
            return type("tree", (), {"tokens": torch.tensor([[7]]), "parents": torch.tensor([[-1]]),
                                     "depth": torch.tensor([[0]])})

    ctx = DraftContext(anchor=torch.tensor([7]), anchor_pos=torch.tensor([4]), features=torch.zeros(1, 4, 1),
                       positions=torch.arange(4)[None], valid=torch.ones(1, 4, dtype=torch.bool),
                       tokens=torch.zeros(1, 4, dtype=torch.long))
    tree = UBTreeConfig(tree_budget=gamma, beam_width=1, top_k=1, block_size=gamma)
    means = coupled_tree_accepted(Scorer(), None, 4, Drafter(), ctx, tree, samples=3,
                                  gen=torch.Generator().manual_seed(0), weights=[1.0, 2.5])
    assert means == {1.0: 0.0, 2.5: 0.0}  # root-only trees accept nothing
    assert [w for w, _ in calls] == [1.0, 2.5] * 3
    seeds = [seed for _, seed in calls]
    assert seeds[0::2] == seeds[1::2] and len(set(seeds[0::2])) == 3
