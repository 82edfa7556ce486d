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


def walk_reference(tree: DraftTree, target: torch.Tensor) -> tuple[list[list[int]], list[list[int]]]:
    """The acceptance walk itself, one request at a time on the host (oracle of accept_tree)."""
    paths, outs = [], []
    for tokens, parents, draws in zip(tree.tokens.tolist(), tree.parents.tolist(), target.tolist()):
        cur, path, out = 0, [0], []
        while True:
            child = next((j for j, (p, t) in enumerate(zip(parents, tokens)) if p == cur and j > 0 and t == draws[cur]),
                         None)
            if child is None:
                break
            out.append(draws[cur])
            path.append(child)
            cur = child
        paths.append(path)
        outs.append(out + [draws[cur]])
    return paths, outs


def test_accept_matches_the_walk_on_random_trees():
    """Random parents-first trees with distinct sibling tokens (and padding nodes) vs the walk."""
    depths: list[int] = []
    for seed in range(20):
        check_random_trees(seed, depths)
    # The comparison exercised deep accepted paths, not only the root.
    assert max(depths) >= 4 and sum(d >= 2 for d in depths) >= len(depths) // 4, depths


def check_random_trees(seed: int, depths: list[int]) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_reqs, n, vocab, max_depth = 4, 24, 5, 9
    parents = torch.full((num_reqs, n), -2, dtype=torch.long)
    depth = torch.zeros((num_reqs, n), dtype=torch.long)
    tokens = torch.full((num_reqs, n), -1, dtype=torch.long)
    for r in range(num_reqs):
        real = int(torch.randint(1, n + 1, (1,), generator=gen))
        parents[r, 0], tokens[r, 0] = -1, 0
        used: dict[int, set[int]] = {}
        for j in range(1, real):
            candidates = [p for p in range(j) if depth[r, p] < max_depth and len(used.get(p, ())) < vocab]
            p = candidates[int(torch.randint(len(candidates), (1,), generator=gen))]
            free = [t for t in range(vocab) if t not in used.get(p, set())]
            t = free[int(torch.randint(len(free), (1,), generator=gen))]
            used.setdefault(p, set()).add(t)
            parents[r, j], depth[r, j], tokens[r, j] = p, depth[r, p] + 1, t
    tree = DraftTree(tokens=tokens, parents=parents, depth=depth, scores=torch.zeros(num_reqs, n))
    # Draws: mostly the token of one of the node's children, so that deep branches get accepted.
    draws = torch.randint(vocab, (num_reqs, n), generator=gen)
    for r in range(num_reqs):
        for j in range(n):
            kids = (parents[r] == j).nonzero().flatten().tolist()
            if kids and float(torch.rand(1, generator=gen)) < 0.8:
                draws[r, j] = tokens[r, kids[int(torch.randint(len(kids), (1,), generator=gen))]]
    res = accept_tree(tree, draws, max_depth=max_depth)
    paths, outs = walk_reference(tree, draws)
    depths.extend(len(path) - 1 for path in paths)
    for r in range(num_reqs):
        k = len(paths[r]) - 1
        assert res.accepted_path[r].tolist() == paths[r] + [-1] * (max_depth - k)
        assert res.output_tokens[r].tolist() == outs[r] + [-1] * (max_depth - k)
        assert int(res.num_accepted[r]) == k and int(res.last_node[r]) == paths[r][-1]
