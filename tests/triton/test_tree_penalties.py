"""triton_ops.tree_penalties against its torch twin on random trees, and the twin against plain decoding's rule.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1).
"""
from __future__ import annotations

import random

import pytest
import torch
from kernel_device import DEVICE

from ubtree_vllm.triton_ops.reference import tree_penalties_reference
from ubtree_vllm.triton_ops.tree_penalties import tree_penalties

V, MAX_REQS, NODES, MAX_DEPTH = 300, 4, 9, 4


def random_batch(seed: int):
    """Requests (slot, rows) laid out one after another, each a parents-first tree of <= NODES nodes."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    parents = torch.full((MAX_REQS + 1, NODES), -2, dtype=torch.int32)
    state, local_pos = [], []
    for slot in rng.sample(range(MAX_REQS), rng.randint(1, MAX_REQS)):
        n = rng.randint(1, NODES)
        depth = [0]
        parents[slot, 0] = -1
        for j in range(1, n):
            parent = rng.choice([p for p in range(j) if depth[p] < MAX_DEPTH])
            parents[slot, j] = parent
            depth.append(depth[parent] + 1)
        state += [slot] * n
        local_pos += list(range(n))
    rows = len(state)
    tokens = torch.randint(0, 40, (rows,), generator=gen, dtype=torch.int32)  # few ids: repeats on paths
    tokens[torch.rand(rows, generator=gen) < 0.1] = -1  # placeholders are never counted
    logits = torch.randn(rows, V, generator=gen) * 3
    repetition = torch.tensor([1.0, 1.3, 0.8, 1.0, 1.0])[:MAX_REQS]
    frequency = torch.tensor([0.0, 0.4, 0.0, -0.5, 0.0])[:MAX_REQS]
    presence = torch.tensor([0.0, 0.2, 0.7, 0.0, 0.0])[:MAX_REQS]
    repetition[rng.randrange(MAX_REQS)] = 1.0  # a request without penalties keeps its logits
    prompt_mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (MAX_REQS, (V + 31) // 32), generator=gen, dtype=torch.int32)
    counts = torch.randint(0, 3, (MAX_REQS, V), generator=gen, dtype=torch.int32) * (torch.rand(MAX_REQS, V,
                                                                                                 generator=gen) < 0.05)
    return (logits, torch.tensor(state), torch.tensor(local_pos, dtype=torch.int32), tokens, parents, repetition,
            frequency, presence, prompt_mask, counts.to(torch.int32))


@pytest.mark.parametrize("seed", range(6))
def test_kernel_matches_its_torch_twin_on_random_trees(seed):
    logits, *rest = random_batch(seed)
    expected = logits.clone()
    tree_penalties_reference(expected, *rest, MAX_DEPTH)
    got = logits.clone().to(DEVICE)
    tree_penalties(got, *(t.to(DEVICE) for t in rest), MAX_DEPTH)
    torch.testing.assert_close(got.cpu(), expected, atol=1e-5, rtol=1e-5)


def test_twin_is_plain_decodings_rule_on_each_nodes_path():
    """Tree 0 -> {1, 2}, 2 -> 3 with tokens [r, 7, 5, 5]: node 3 sees outputs + [5, 5] (its path, root excluded),
    node 1 sees outputs + [7]; vLLM's rule: repetition on prompt or seen tokens, then frequency and presence."""
    parents = torch.tensor([[-1, 0, 0, 2]], dtype=torch.int32)
    tokens = torch.tensor([9, 7, 5, 5], dtype=torch.int32)
    logits = torch.full((4, 12), 2.0)
    counts = torch.zeros(1, 12, dtype=torch.int32)
    counts[0, 9] = 1  # the root token, sampled last step
    prompt = torch.zeros(1, 1, dtype=torch.int32)
    prompt[0, 0] = 1 << 3  # token 3 is in the prompt
    args = (torch.zeros(4, dtype=torch.long), torch.arange(4, dtype=torch.int32), tokens, parents,
            torch.tensor([2.0]), torch.tensor([0.5]), torch.tensor([0.25]), prompt, counts, MAX_DEPTH)
    tree_penalties_reference(logits, *args)
    seen_once = 2.0 / 2.0 - 0.5 - 0.25
    assert logits[3, 5].item() == pytest.approx(2.0 / 2.0 - 0.5 * 2 - 0.25)  # 5 twice on node 3's path
    assert logits[3, 7].item() == 2.0  # 7 is on node 1's path, not node 3's
    assert logits[1, 7].item() == pytest.approx(seen_once) and logits[1, 5].item() == 2.0
    assert logits[0, 9].item() == pytest.approx(seen_once)  # outputs count at every node
    assert logits[2, 3].item() == pytest.approx(1.0) and logits[2, 0].item() == 2.0  # prompt: repetition only
    kernel = torch.full((4, 12), 2.0, device=DEVICE)
    tree_penalties(kernel, *(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
    torch.testing.assert_close(kernel.cpu(), logits)
