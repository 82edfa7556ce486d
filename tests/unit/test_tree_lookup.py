"""The prompt-lookup branch: the n-gram continuation against a brute-force search, its injection
into the candidate lattice (the chain becomes a root path of the tree, candidates stay distinct,
replaced slots get no borrowed scores), the CUDA tree search on injected lattices, and the
decoding tests with the branch on are in test_reference_decoder.py."""
from __future__ import annotations

import pytest
import torch

from test_tree import tree_paths
from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.tree.lookup import inject_chain, lookup_continuation
from ubtree_vllm.tree.search import build_tree
from ubtree_vllm.tree.topology import check_topology


def brute_force(history: list[int], gamma: int, min_n: int, max_n: int) -> list[int]:
    length = len(history)
    for n in range(max_n, min_n - 1, -1):
        if length < n + 1:
            continue
        suffix = history[length - n:]
        for start in range(length - n - 1, -1, -1):  # latest match first; a token must follow it
            if history[start:start + n] == suffix:
                return history[start + n:start + n + gamma]
    return []


@pytest.mark.parametrize("seed", range(6))
def test_lookup_continuation_matches_brute_force(seed):
    gen = torch.Generator().manual_seed(seed)
    num_reqs, width, gamma = 7, 40, 5
    vocab = 3 + seed  # small vocabularies repeat n-grams often
    lengths = torch.randint(1, width + 1, (num_reqs,), generator=gen)
    history = torch.randint(vocab, (num_reqs, width), generator=gen)
    history[0, :] = 9  # one constant row: every n matches at the latest possible place
    padded = history.masked_fill(torch.arange(width)[None, :] >= lengths[:, None], 99)  # padding is ignored
    chain, chain_len = lookup_continuation(padded, lengths, gamma, min_n=2, max_n=4)
    for r in range(num_reqs):
        expected = brute_force(history[r, :lengths[r]].tolist(), gamma, 2, 4)
        assert chain_len[r] == len(expected)
        assert chain[r, :len(expected)].tolist() == expected and (chain[r, len(expected):] == 0).all()
    assert chain_len.max() > 0


def test_lookup_prefers_the_longest_then_the_latest_match():
    #        0  1  2  3  4  5  6  7  8  9 10 11
    row = [5, 1, 2, 7, 8, 3, 1, 2, 6, 4, 1, 2]  # suffix [1, 2]: latest match at 6 -> continuation [6, 4, 1]
    chain, n = lookup_continuation(torch.tensor([row]), torch.tensor([12]), 3, 2, 4)
    assert chain.tolist() == [[6, 4, 1]] and n.tolist() == [3]
    row = [9, 1, 2, 7, 8, 9, 1, 2, 6, 9, 1, 2]  # [9, 1, 2] matches at 5 first (n = 3 beats n = 2's later match)
    chain, n = lookup_continuation(torch.tensor([row]), torch.tensor([12]), 3, 2, 4)
    assert chain.tolist() == [[6, 9, 1]] and n.tolist() == [3]
    chain, n = lookup_continuation(torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([5]), 3, 2, 4)
    assert n.tolist() == [0] and chain.tolist() == [[0, 0, 0]]  # no n-gram repeats
    with pytest.raises(ValueError, match="min_n"):
        lookup_continuation(torch.tensor([row]), torch.tensor([12]), 3, 3, 2)


def random_lattice(num_reqs: int, gamma: int, top_k: int, vocab: int, gen: torch.Generator):
    cand = torch.stack([torch.stack([torch.randperm(vocab, generator=gen)[:top_k] for _ in range(gamma)])
                        for _ in range(num_reqs)])
    root = torch.log_softmax(torch.randn(num_reqs, top_k, generator=gen), -1)
    trans = torch.log_softmax(torch.randn(num_reqs, gamma - 1, top_k, top_k, generator=gen), -1)
    return cand, root, trans


@pytest.mark.parametrize("edge_logprob", [0.0, -0.3])
def test_injected_chain_is_a_root_path_of_the_tree(edge_logprob):
    gen = torch.Generator().manual_seed(1)
    num_reqs, gamma, top_k, vocab = 4, 5, 6, 12
    cand, root, trans = random_lattice(num_reqs, gamma, top_k, vocab, gen)
    chain = torch.randint(vocab, (num_reqs, gamma), generator=gen)
    chain[1, :3] = cand[1, :3, 2]  # a chain the proposer already proposed at depths 1-3
    chain_len = torch.tensor([5, 3, 0, 2])
    tokens, root2, trans2 = inject_chain(cand, root, trans, chain, chain_len, edge_logprob)
    cfg = UBTreeConfig(tree_budget=10, beam_width=3, top_k=top_k, block_size=gamma)
    tree = build_tree(torch.zeros(num_reqs, dtype=torch.long), tokens, root2, trans2, cfg)
    check_topology(tree)  # siblings distinct: the chain reuses a proposed slot or replaces one
    for r in range(num_reqs):
        assert len(set(tokens[r, 0].tolist())) == top_k
        n = int(chain_len[r])
        if n:
            assert tuple(chain[r, :n].tolist()) in tree_paths(tree, r)
    assert torch.equal(tokens[2], cand[2]) and torch.equal(root2[2], root[2]) and torch.equal(trans2[2], trans[2])
    # request 1's chain was proposed: its slots and the selector's scores stay, raised to edge_logprob at most
    assert torch.equal(tokens[1], cand[1])
    assert root2[1, 2] == max(root[1, 2].item(), edge_logprob)
    # a replaced slot (request 0, depth 2) has no edge in or out but the chain's
    slot = (tokens[0, 1] == chain[0, 1]).nonzero().item()
    if not (cand[0, 1] == chain[0, 1]).any():
        others = [a for a in range(top_k) if a != (tokens[0, 0] == chain[0, 0]).nonzero().item()]
        assert (trans2[0, 0, others, slot] == torch.finfo(trans.dtype).min).all()


def test_tree_search_kernel_on_injected_lattices():
    """The Triton tree search (interpreter on CPU) builds the same trees from an injected lattice."""
    from ubtree_vllm.triton_ops.tree_search import tree_search

    gen = torch.Generator().manual_seed(2)
    num_reqs, gamma, top_k, vocab = 3, 4, 5, 10
    cand, root, trans = random_lattice(num_reqs, gamma, top_k, vocab, gen)
    chain = torch.randint(vocab, (num_reqs, gamma), generator=gen)
    tokens, root2, trans2 = inject_chain(cand, root, trans, chain, torch.tensor([4, 2, 1]))
    cfg = UBTreeConfig(tree_budget=8, beam_width=3, top_k=top_k, block_size=gamma)
    anchor = torch.zeros(num_reqs, dtype=torch.long)
    ref = build_tree(anchor, tokens, root2, trans2, cfg)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    got = tree_search(anchor.to(device), tokens.to(device), root2.float().contiguous().to(device),
                      trans2.float().contiguous().to(device), cfg.beam_width, cfg.tree_budget)
    for name, value in zip(("tokens", "parents", "depth"), got[:3]):
        assert torch.equal(value.cpu(), getattr(ref, name)), name


def test_lookup_settings_name_the_field():
    with pytest.raises(ValueError, match="lookup_min_n must be in \\[1, 3\\]"):
        UBTreeConfig(prompt_lookup=True, lookup_min_n=4, lookup_max_n=3)
    with pytest.raises(ValueError, match="lookup_edge_logprob"):
        UBTreeConfig(lookup_edge_logprob=0.5)
    with pytest.raises(ValueError, match="prompt_lookup must be true or false"):
        UBTreeConfig(prompt_lookup="yes")
