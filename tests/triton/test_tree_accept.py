"""triton_ops.tree_accept against verify.accept.accept_tree (its oracle) on random trees.

Without CUDA the kernel runs under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1)."""
from __future__ import annotations

import pytest
import torch

from ubtree_vllm.tree.topology import DraftTree
from ubtree_vllm.triton_ops.tree_accept import tree_accept
from ubtree_vllm.verify.accept import accept_tree

# the interpreter (CPU tensors) only where there is no GPU: with CUDA, Triton launches real kernels
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def random_trees(num_reqs: int, num_nodes: int, max_depth: int, vocab: int, gen: torch.Generator):
    """Parents-first trees of depth <= max_depth with distinct sibling tokens, some padding nodes, and
    draws that follow a random root-anchored path for a random number of steps."""
    parents = torch.full((num_reqs, num_nodes), -2, dtype=torch.int64)
    tokens = torch.randint(0, vocab, (num_reqs, num_nodes), generator=gen)
    depth = torch.zeros((num_reqs, num_nodes), dtype=torch.int64)
    draws = torch.randint(0, vocab, (num_reqs, num_nodes), generator=gen)
    for r in range(num_reqs):
        parents[r, 0] = -1
        used: dict[int, set[int]] = {}
        size = int(torch.randint(1, num_nodes + 1, (1,), generator=gen))  # the rest is padding
        for j in range(1, size):
            p = int(torch.randint(0, j, (1,), generator=gen))
            if depth[r, p] >= max_depth:
                p = 0
            siblings = used.setdefault(p, set())
            while int(tokens[r, j]) in siblings:
                tokens[r, j] = (tokens[r, j] + 1) % vocab
            siblings.add(int(tokens[r, j]))
            parents[r, j], depth[r, j] = p, depth[r, p] + 1
        node = 0  # make the draws follow a random branch for a while
        for _ in range(int(torch.randint(1, max_depth + 1, (1,), generator=gen))):
            children = [j for j in range(1, size) if parents[r, j] == node]
            if not children:
                break
            child = children[int(torch.randint(0, len(children), (1,), generator=gen))]
            draws[r, node] = tokens[r, child]
            node = child
    return parents, tokens, depth, draws


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_reqs,num_nodes,max_depth", [(1, 1, 1), (7, 17, 16), (5, 65, 16), (3, 9, 3)])
def test_matches_accept_tree(device, num_reqs, num_nodes, max_depth):
    gen = torch.Generator().manual_seed(num_nodes * 31 + max_depth)
    parents, tokens, depth, draws = random_trees(num_reqs, num_nodes, max_depth, vocab=97, gen=gen)
    want = accept_tree(DraftTree(tokens=tokens, parents=parents, depth=depth, scores=torch.zeros(parents.shape)),
                       draws, max_depth)
    path, num_accepted, out, last = tree_accept(parents.to(device), tokens.to(device), draws.to(device), max_depth)
    assert torch.equal(path.cpu(), want.accepted_path)
    assert torch.equal(num_accepted.cpu(), want.num_accepted)
    assert torch.equal(out.cpu(), want.output_tokens)
    assert torch.equal(last.cpu(), want.last_node)
    if num_nodes > 1:
        assert int(want.num_accepted.max()) > 0, "no case walks: the comparison would not test the walk"


@pytest.mark.parametrize("device", DEVICES)
def test_int32_inputs_and_contract_errors(device):
    parents = torch.tensor([[-1, 0, 1]], dtype=torch.int32, device=device)
    tokens = torch.tensor([[5, 6, 7]], dtype=torch.int32, device=device)
    draws = torch.tensor([[6, 7, 9]], dtype=torch.int32, device=device)
    path, num_accepted, out, last = tree_accept(parents, tokens, draws, max_depth=4)
    assert path.tolist() == [[0, 1, 2, -1, -1]] and num_accepted.tolist() == [2]
    assert out.tolist() == [[6, 7, 9, -1, -1]] and last.tolist() == [2]
    with pytest.raises(AssertionError, match="all be"):
        tree_accept(parents, tokens[:, :2], draws, max_depth=4)
    with pytest.raises(AssertionError, match="max_depth"):
        tree_accept(parents, tokens, draws, max_depth=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_nodes,max_depth", [(9, 3), (65, 16)])
def test_rows_form_matches_the_torch_steps(device, num_nodes, max_depth):
    """tree_accept_rows (MRV2's flat logits rows) against the sampler's torch form: requests in a shuffled
    order of state slots, drafts truncated by the scheduler, placeholder (-1) drafts, chunked prefills."""
    from ubtree_vllm.triton_ops.tree_accept import tree_accept_rows
    from ubtree_vllm.vllm.mrv2.rejection_sampler import accept_rows_torch

    max_reqs = 12
    walked = 0
    for seed in range(6):
        gen = torch.Generator().manual_seed(seed * 7 + num_nodes)
        parents, tokens, depth, draws = random_trees(max_reqs, num_nodes, max_depth, vocab=97, gen=gen)
        num_reqs = int(torch.randint(1, max_reqs + 1, (1,), generator=gen))
        slots = torch.randperm(max_reqs, generator=gen)[:num_reqs]
        flat_tokens, flat_draws, cu = [], [], [0]
        for slot in slots.tolist():
            count = int(torch.randint(1, num_nodes + 1, (1,), generator=gen))  # a scheduled prefix of the tree
            row_tokens = tokens[slot, :count].clone()
            if float(torch.rand(1, generator=gen)) < 0.2:
                row_tokens[1:] = -1  # a request still inside its prompt: draft rows are placeholders
            flat_tokens += row_tokens.tolist()
            flat_draws += draws[slot, :count].tolist()
            cu.append(cu[-1] + count)
        prefill_len = torch.randint(0, 50, (max_reqs,), generator=gen)
        seq_lens = torch.randint(30, 80, (num_reqs,), generator=gen).int()  # some < prefill_len: chunks
        args = [torch.tensor(flat_tokens, dtype=torch.int32), torch.tensor(flat_draws), torch.tensor(cu).int(),
                slots.int(), parents.int()]
        want_walk, want_sampled, want_rejected = accept_rows_torch(*args, depth.int(), seq_lens, prefill_len,
                                                                   max_depth)
        got_walk, got_sampled, got_rejected = tree_accept_rows(*(a.to(device) for a in args), seq_lens.to(device),
                                                               prefill_len.to(device), max_depth)
        for name, got, want in zip(("path", "num_accepted", "output_tokens", "last"), got_walk, want_walk):
            assert got.dtype == torch.int64 and torch.equal(got.cpu(), want), (seed, name)
        assert got_sampled.dtype == got_rejected.dtype == torch.int32
        assert torch.equal(got_sampled.cpu(), want_sampled) and torch.equal(got_rejected.cpu(), want_rejected), seed
        walked += int(want_walk[1].sum())
    assert walked > 5, "no case walks: the comparison would not test the walk"
