"""Tree acceptance walk and the target-side sampler."""
from __future__ import annotations

import pytest
import torch

from ubtree_vllm.config import SamplingConfig
from ubtree_vllm.tree.topology import DraftTree
from ubtree_vllm.verify.accept import accept_tree
from ubtree_vllm.verify.sampling import SamplingTensors, processed_probs, sample_tokens

# root(10) -> 1:a(11) -> 3:c(13) -> 4:d(14)
#          -> 2:b(12) -> 5:e(15)
TREE = DraftTree(
    tokens=torch.tensor([[10, 11, 12, 13, 14, 15]]),
    parents=torch.tensor([[-1, 0, 0, 1, 3, 2]]),
    depth=torch.tensor([[0, 1, 1, 2, 3, 2]]),
    scores=torch.zeros(1, 6),
)


@pytest.mark.parametrize("target,path,out", [
    # target draws per node: root, a, b, c, d, e
    ([11, 13, 0, 14, 7, 0], [0, 1, 3, 4], [11, 13, 14, 7]),  # full branch + bonus
    ([12, 0, 15, 0, 0, 9], [0, 2, 5, -1], [12, 15, 9, -1]),  # second branch
    ([99, 13, 15, 14, 7, 9], [0, -1, -1, -1], [99, -1, -1, -1]),  # nothing accepted
    ([11, 42, 0, 14, 7, 0], [0, 1, -1, -1], [11, 42, -1, -1]),  # miss at depth 2
])
def test_accept_walk(target, path, out):
    res = accept_tree(TREE, torch.tensor([target]), max_depth=3)
    assert res.accepted_path.tolist() == [path]
    assert res.output_tokens.tolist() == [out]
    assert res.num_accepted.tolist() == [sum(p > 0 for p in path)]
    assert res.last_node.tolist() == [max(path)]


def test_accept_batched_rows_are_independent():
    tree = DraftTree(*(torch.cat([t, t]) for t in (TREE.tokens, TREE.parents, TREE.depth, TREE.scores)))
    res = accept_tree(tree, torch.tensor([[11, 13, 0, 14, 7, 0], [12, 0, 15, 0, 0, 9]]), max_depth=3)
    assert res.output_tokens.tolist() == [[11, 13, 14, 7], [12, 15, 9, -1]]


def reference_probs(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """Straightforward per-row filter: temperature, top-k, then the smallest top-p set."""
    probs = torch.softmax(logits.double() / cfg.temperature, -1)
    order = torch.argsort(probs, descending=True, stable=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    k = cfg.top_k if cfg.top_k > 0 else len(probs)
    kept = probs[order[:k]] / probs[order[:k]].sum()
    mass = 0.0
    for rank, tok in enumerate(order[:k].tolist()):
        keep[tok] = True
        mass += float(kept[rank])
        if mass >= cfg.top_p:
            break
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()


@pytest.mark.parametrize("cfg", [SamplingConfig(1.0), SamplingConfig(0.7, top_k=3), SamplingConfig(1.3, top_p=0.6),
                                 SamplingConfig(1.0, top_k=4, top_p=0.8)])
def test_processed_probs_matches_reference(cfg):
    logits = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(0))
    got = processed_probs(logits, SamplingTensors.from_configs([cfg] * 3, "cpu"))
    for n in range(3):
        for j in range(5):
            torch.testing.assert_close(got[n, j].double(), reference_probs(logits[n, j], cfg), atol=1e-6, rtol=0)


def test_sample_tokens_greedy_and_frequencies():
    logits = torch.tensor([[[0.0, 1.0, 2.0, -1.0]]]).expand(2, 1, 4)
    params = SamplingTensors.from_configs([SamplingConfig(0.0), SamplingConfig(1.0)], "cpu")
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack([sample_tokens(logits, params, gen)[:, 0] for _ in range(4000)])
    assert (draws[:, 0] == 2).all()
    freq = torch.bincount(draws[:, 1], minlength=4).double() / 4000
    torch.testing.assert_close(freq, torch.softmax(logits[1, 0].double(), -1), atol=0.03, rtol=0)
