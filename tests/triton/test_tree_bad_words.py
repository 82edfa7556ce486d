"""triton_ops.tree_bad_words against its torch twin on random trees, and the twin on a hand case.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1).
"""
from __future__ import annotations

import random

import pytest
import torch
from kernel_device import DEVICE

from ubtree_vllm.triton_ops.reference import tree_bad_words_reference
from ubtree_vllm.triton_ops.tree_bad_words import tree_bad_words

V, MAX_REQS, NODES, MAX_WORDS, SEQ = 24, 3, 8, 4, 40


def topology(trees: dict[int, list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    parents = torch.full((MAX_REQS + 1, NODES), -2, dtype=torch.int32)
    depth = torch.zeros_like(parents)
    for state, par in trees.items():
        for j, p in enumerate(par):
            parents[state, j], depth[state, j] = p, 0 if p < 0 else depth[state, p] + 1
    return parents, depth


def words_state(words: dict[int, list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.zeros(MAX_REQS, 32, dtype=torch.int32)
    offsets = torch.zeros(MAX_REQS, MAX_WORDS + 1, dtype=torch.int32)
    counts = torch.zeros(MAX_REQS, dtype=torch.int32)
    for state, ws in words.items():
        flat = [t for w in ws for t in w]
        tokens[state, :len(flat)] = torch.tensor(flat, dtype=torch.int32)
        offsets[state, 1:len(ws) + 1] = torch.tensor([len(w) for w in ws]).cumsum(0)
        counts[state] = len(ws)
    return tokens, offsets, counts


def run_both(logits, state, local_pos, tokens, parents, depth, words, history, prompt_len, total_len):
    args = (state, local_pos, tokens, parents, depth, *words_state(words), history, prompt_len, total_len, MAX_WORDS)
    expected = logits.clone()
    tree_bad_words_reference(expected, *args)
    got = logits.clone().to(DEVICE)
    tree_bad_words(got, *(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
    return got.cpu(), expected


def path_nodes(par: list[int], node: int) -> list[int]:
    """Nodes root -> node, root excluded."""
    path = []
    while node > 0:
        path.append(node)
        node = par[node]
    return path[::-1]


@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_its_torch_twin_on_random_trees(seed):
    rng = random.Random(seed)
    trees, state, local_pos = {}, [], []
    for slot in rng.sample(range(MAX_REQS), rng.randint(1, MAX_REQS)):
        par, depth = [-1], [0]
        for j in range(1, rng.randint(3, NODES)):
            parent = rng.randrange(j)
            par.append(parent)
            depth.append(depth[parent] + 1)
        trees[slot] = par
        state += [slot] * len(par)
        local_pos += list(range(len(par)))
    parents, depth = topology(trees)
    tokens = torch.tensor([rng.randrange(4) for _ in state], dtype=torch.int32)  # few ids: words do match
    tokens[0] = -1 if rng.random() < 0.3 else tokens[0]
    history = torch.tensor([[rng.randrange(4) for _ in range(SEQ)] for _ in range(MAX_REQS)], dtype=torch.int32)
    prompt_len = torch.tensor([rng.randrange(1, 10) for _ in range(MAX_REQS)], dtype=torch.int32)
    total_len = prompt_len + torch.tensor([rng.randrange(1, 6) for _ in range(MAX_REQS)], dtype=torch.int32)
    words = {s: [[rng.randrange(4) for _ in range(rng.randint(1, 3))] + [10 + w] for w in range(rng.randint(1, 3))]
             for s in trees}
    for slot, par in trees.items():  # one word that ends a deep node's sequence: it crosses the path and outputs
        first, node = state.index(slot), len(par) - 1
        words[slot].append([int(history[slot, total_len[slot] - 1]), *[int(tokens[first + j]) for j in
                                                                       path_nodes(par, node)], 20])
    logits = torch.randn(len(state), V, generator=torch.Generator().manual_seed(seed))
    got, expected = run_both(logits, torch.tensor(state), torch.tensor(local_pos, dtype=torch.int32), tokens,
                             parents, depth, words, history, prompt_len, total_len)
    assert torch.equal(got, expected)
    assert torch.isinf(expected).any(), "no word matched: the case tests nothing"


def test_twin_bans_a_words_last_token_where_outputs_and_the_path_end_with_its_prefix():
    """Outputs [.., 3, 4] (prompt 2 tokens, then 5, 3, 4); tree 0 -> {1, 2}, 2 -> 3 with tokens [4, 6, 7, 8].
    Word [3, 4, 9]: the root's sequence ends with 3, 4, so 9 is banned at the root only. Word [4, 7, 8, 11]: node
    3's sequence ends ... 4, 7, 8 (root token 4 is the last output, then its path 7, 8): banned at node 3 only."""
    parents, depth = topology({0: [-1, 0, 0, 2]})
    history = torch.zeros(MAX_REQS, SEQ, dtype=torch.int32)
    history[0, :5] = torch.tensor([1, 2, 5, 3, 4])
    logits = torch.zeros(4, V)
    got, expected = run_both(logits, torch.zeros(4, dtype=torch.long), torch.arange(4, dtype=torch.int32),
                             torch.tensor([4, 6, 7, 8], dtype=torch.int32), parents, depth,
                             {0: [[3, 4, 9], [4, 7, 8, 11]]}, history, torch.tensor([2, 0, 0], dtype=torch.int32),
                             torch.tensor([5, 0, 0], dtype=torch.int32))
    banned = [(row, token) for row, token in torch.isinf(expected).nonzero().tolist()]
    assert banned == [(0, 9), (3, 11)]
    assert torch.equal(got, expected)
