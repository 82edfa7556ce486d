"""Tree topology and construction: invariants (hypothesis) and brute-force beam checks."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ubtree_vllm.config import UBTreeConfig, max_tree_nodes
from ubtree_vllm.tree.search import beam_widths, build_tree, topk_stable
from ubtree_vllm.tree.topology import (ancestor_mask, check_topology, node_depth, path_to_root,
                                       root_to_leaf_paths)


def random_lattice(num_reqs: int, gamma: int, top_k: int, vocab: int, seed: int, quantize: bool = False):
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.stack([torch.randperm(vocab, generator=g)[:top_k] for _ in range(gamma)])
                        for _ in range(num_reqs)])
    root = torch.log_softmax(torch.randn(num_reqs, top_k, generator=g), -1)
    trans = torch.log_softmax(torch.randn(num_reqs, max(gamma - 1, 0), top_k, top_k, generator=g), -1)
    if quantize:  # coarse scores create ties, exercising the tie-break rule
        root, trans = (root * 2).round() / 2, (trans * 2).round() / 2
        root, trans = root.clamp(max=0), trans.clamp(max=0)
    anchor = torch.randint(vocab, (num_reqs,), generator=g)
    return anchor, cand, root, trans


def reference_tree(cand, root, trans, cfg):
    """Pure-Python beam + prune for one request: list of (depth, rank, score, path_of_cand_indices)."""
    gamma, top_k = cand.shape
    nodes = []
    beam = sorted(((float(root[c]), c, (c,)) for c in range(top_k)), key=lambda x: (-x[0], x[1]))
    beam = beam[: min(cfg.beam_width, top_k)]
    for rank, (s, _, path) in enumerate(beam):
        nodes.append((1, rank, s, path))
    for d in range(1, gamma):
        ext = []
        for prank, (s, c, path) in enumerate(beam):
            for b in range(top_k):
                ext.append((s + float(trans[d - 1, c, b]), prank * top_k + b, b, path + (b,)))
        ext.sort(key=lambda x: (-x[0], x[1]))
        beam = [(s, b, path) for s, _, b, path in ext[: cfg.beam_width]]
        for rank, (s, _, path) in enumerate(beam):
            nodes.append((d + 1, rank, s, path))
    # Best first; depth-major order is the tie-break order.
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][2], i))[: cfg.tree_budget]
    return [nodes[i] for i in order]


def tree_paths(tree, n):
    """Token path (root excluded) of every node of request n."""
    parents, tokens = tree.parents[n].tolist(), tree.tokens[n].tolist()
    paths = []
    for j in range(1, len(parents)):
        p, node = [], j
        while node > 0:
            p.append(tokens[node])
            node = parents[node]
        paths.append(tuple(reversed(p)))
    return paths


tree_shapes = st.tuples(st.integers(1, 5), st.integers(1, 6), st.integers(1, 8)).flatmap(
    lambda s: st.tuples(st.just(s), st.integers(1, max_tree_nodes(s[2], s[1], s[0]))))


@settings(max_examples=60, deadline=None)
@given(shape=tree_shapes, seed=st.integers(0, 10_000), quantize=st.booleans())
def test_build_tree_invariants(shape, seed, quantize):
    (gamma, top_k, width), budget = shape
    cfg = UBTreeConfig(tree_budget=budget, beam_width=width, top_k=top_k, block_size=gamma)
    anchor, cand, root, trans = random_lattice(3, gamma, top_k, 50, seed, quantize)
    tree = build_tree(anchor, cand, root, trans, cfg)
    assert tree.tokens.shape == (3, budget + 1)
    check_topology(tree)  # parents first, depth = parent depth + 1, distinct siblings
    assert (tree.tokens[:, 0] == anchor).all()
    assert (node_depth(tree.parents, gamma) == tree.depth).all()
    assert (tree.depth <= gamma).all()
    # Scores never increase along a path.
    assert (tree.scores[:, 1:] <= tree.scores.gather(1, tree.parents[:, 1:]) + 1e-6).all()


@settings(max_examples=60, deadline=None)
@given(shape=tree_shapes, seed=st.integers(0, 10_000), quantize=st.booleans())
def test_build_tree_matches_reference_beam(shape, seed, quantize):
    (gamma, top_k, width), budget = shape
    cfg = UBTreeConfig(tree_budget=budget, beam_width=width, top_k=top_k, block_size=gamma)
    anchor, cand, root, trans = random_lattice(2, gamma, top_k, 50, seed, quantize)
    tree = build_tree(anchor, cand, root, trans, cfg)
    for n in range(2):
        expected = reference_tree(cand[n], root[n], trans[n], cfg)
        exp_paths = [tuple(int(cand[n, d, c]) for d, c in enumerate(path)) for _, _, _, path in expected]
        assert tree_paths(tree, n) == exp_paths
        torch.testing.assert_close(tree.scores[n, 1:], torch.tensor([s for _, _, s, _ in expected]))


@pytest.mark.parametrize("gamma,top_k,budget", [(3, 3, 10), (4, 2, 12), (2, 5, 7)])
def test_unpruned_beam_keeps_globally_best_prefixes(gamma, top_k, budget):
    """With W >= K**gamma nothing is cut, so the tree is the brute-force top-B prefix set."""
    cfg = UBTreeConfig(tree_budget=budget, beam_width=top_k**gamma, top_k=top_k, block_size=gamma)
    anchor, cand, root, trans = random_lattice(1, gamma, top_k, 30, 7)
    scored = []
    for depth in range(1, gamma + 1):
        for path in itertools.product(range(top_k), repeat=depth):
            s = float(root[0, path[0]]) + sum(float(trans[0, d - 1, path[d - 1], path[d]]) for d in range(1, depth))
            scored.append((s, tuple(int(cand[0, d, c]) for d, c in enumerate(path))))
    best = sorted(scored, key=lambda x: -x[0])[:budget]
    tree = build_tree(anchor, cand, root, trans, cfg)
    assert sorted(tree_paths(tree, 0)) == sorted(p for _, p in best)


def test_single_path_is_top1_chain():
    cfg = UBTreeConfig(tree_budget=4, beam_width=1, top_k=1, block_size=4)
    cand = torch.tensor([[[5], [6], [7], [8]]])
    tree = build_tree(torch.tensor([1]), cand, torch.zeros(1, 1), torch.zeros(1, 3, 1, 1), cfg)
    assert tree.tokens.tolist() == [[1, 5, 6, 7, 8]]
    assert tree.parents.tolist() == [[-1, 0, 1, 2, 3]]


def test_topk_stable_breaks_ties_by_index():
    values, idx = topk_stable(torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]]), 3)
    assert idx.tolist() == [[1, 2, 4]]
    assert values.tolist() == [[3.0, 3.0, 3.0]]


def test_beam_widths_and_capacity():
    cfg = UBTreeConfig(tree_budget=64, beam_width=12, top_k=64, block_size=16)
    assert beam_widths(cfg, 64) == [12] * 16
    assert max_tree_nodes(12, 64, 16) == 192
    assert max_tree_nodes(10, 2, 4) == 2 + 4 + 8 + 10


def test_ancestor_mask_and_paths():
    # root -> 1 -> 3 -> 4 ; root -> 2
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    mask = ancestor_mask(parents, max_depth=3)[0]
    expected = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 1, 0, 1, 1]])
    assert (mask == expected.bool()).all()
    assert path_to_root(parents, torch.tensor([4]), 3).tolist() == [[0, 1, 3, 4]]
    assert path_to_root(parents, torch.tensor([2]), 3).tolist() == [[0, 2, -1, -1]]
    assert sorted(root_to_leaf_paths(parents[0].tolist())) == [[0, 1, 3, 4], [0, 2]]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000))
def test_ancestor_mask_matches_parent_walk(seed):
    cfg = UBTreeConfig(tree_budget=12, beam_width=3, top_k=4, block_size=5)
    tree = build_tree(*random_lattice(2, 5, 4, 40, seed), cfg)
    mask = ancestor_mask(tree.parents, 5)
    for n in range(2):
        parents = tree.parents[n].tolist()
        for i in range(len(parents)):
            anc, node = set(), i
            while node >= 0:
                anc.add(node)
                node = parents[node]
            assert set(torch.nonzero(mask[n, i]).flatten().tolist()) == anc


@settings(max_examples=60, deadline=None)
@given(shape=tree_shapes, seed=st.integers(0, 10_000), quantize=st.booleans())
def test_every_prefix_of_the_node_list_is_the_best_smaller_tree(shape, seed, quantize):
    """Nodes are numbered by rank, so the first B' nodes -- what a load-adaptive step of vLLM's scheduler
    verifies -- are exactly the tree of budget B' (same beam), not the B' shallowest nodes."""
    (gamma, top_k, width), budget = shape
    anchor, cand, root, trans = random_lattice(2, gamma, top_k, 50, seed, quantize)
    full = build_tree(anchor, cand, root, trans, UBTreeConfig(tree_budget=budget, beam_width=width, top_k=top_k,
                                                              block_size=gamma))
    for smaller in sorted({1, (budget + 1) // 2, budget}):
        small = build_tree(anchor, cand, root, trans, UBTreeConfig(tree_budget=smaller, beam_width=min(width, smaller),
                                                                   top_k=top_k, block_size=gamma))
        if min(width, smaller) != width:  # a narrower beam is another lattice walk; compare node sets only
            continue
        for name in ("tokens", "parents", "depth", "scores"):
            assert torch.equal(getattr(full, name)[:, :smaller + 1], getattr(small, name)), name
