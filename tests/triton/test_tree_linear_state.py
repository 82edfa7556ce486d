"""Hybrid-layer state over a draft tree: the tree delta rule and the tree conv against their torch
twins, and both against the chain recurrence run on each root->node path (per-node state equals
running that path as a chain), on random trees with budgets above any fixed slot count.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (tests/conftest.py)."""
from __future__ import annotations

import pytest
import torch

from ubtree_vllm.triton_ops.reference import (gated_delta_rule_chain_reference, tree_causal_conv1d_reference,
                                              tree_gated_delta_rule_reference)
from ubtree_vllm.triton_ops.tree_conv import tree_causal_conv1d, tree_conv_window
from ubtree_vllm.triton_ops.tree_delta_rule import tree_gated_delta_rule

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def random_parents(num_reqs: int, num_nodes: int, gen: torch.Generator) -> torch.Tensor:
    """[N, T] parents-first trees: node 0 hangs off the committed state (-1), node t > 0 off any earlier node."""
    rows = [[-1] + [int(torch.randint(0, t, (1,), generator=gen)) for t in range(1, num_nodes)]
            for _ in range(num_reqs)]
    return torch.tensor(rows)


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def delta_inputs(num_reqs, num_nodes, heads, dk, dv, per_channel, gen, device):
    q = torch.nn.functional.normalize(torch.randn(num_reqs, num_nodes, heads, dk, generator=gen), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(num_reqs, num_nodes, heads, dk, generator=gen), dim=-1)
    v = torch.randn(num_reqs, num_nodes, heads, dv, generator=gen)
    g_shape = (num_reqs, num_nodes, heads, dk) if per_channel else (num_reqs, num_nodes, heads)
    g = -torch.rand(g_shape, generator=gen) * 0.5
    beta = torch.rand(num_reqs, num_nodes, heads, generator=gen)
    h0 = torch.randn(num_reqs, heads, dk, dv, generator=gen)
    return [t.to(device) for t in (q, k, v, g, beta, h0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_channel,delta", [(False, True), (True, True), (False, False)],
                         ids=["gdn", "kda", "mamba2"])
@pytest.mark.parametrize("num_nodes,dk,dv", [(7, 16, 16), (65, 32, 24)])
def test_tree_delta_rule_node_state_equals_its_path_as_a_chain(device, per_channel, delta, num_nodes, dk, dv):
    gen = torch.Generator().manual_seed(num_nodes + dk)
    parents = random_parents(2, num_nodes, gen).to(device)
    q, k, v, g, beta, h0 = delta_inputs(2, num_nodes, 2, dk, dv, per_channel, gen, device)
    o, states = tree_gated_delta_rule(q, k, v, g, beta, parents, h0, scale=dk ** -0.5, delta=delta)
    o_ref, states_ref = tree_gated_delta_rule_reference(q, k, v, g, beta, parents, h0, dk ** -0.5, delta)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states, states_ref, rtol=1e-4, atol=1e-4)
    for n in range(2):
        par = parents[n].tolist()
        for node in (num_nodes - 1, num_nodes // 2, 0):
            path = path_to(par, node)
            chain_o, chain_states = gated_delta_rule_chain_reference(q[n, path], k[n, path], v[n, path],
                                                                     g[n, path], beta[n, path], h0[n], dk ** -0.5,
                                                                     delta)
            torch.testing.assert_close(states[n, node], chain_states[-1], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(o[n, node], chain_o[-1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("width,bias,activation", [(4, True, "silu"), (2, False, None)])
@pytest.mark.parametrize("num_nodes", [5, 65])
def test_tree_conv_node_window_is_built_from_its_ancestors(device, width, bias, activation, num_nodes):
    gen = torch.Generator().manual_seed(width * num_nodes)
    channels = 40
    parents = random_parents(3, num_nodes, gen).to(device)
    x = torch.randn(3, num_nodes, channels, generator=gen).to(device)
    state = torch.randn(3, channels, width - 1, generator=gen).to(device)
    weight = torch.randn(channels, width, generator=gen).to(device)
    b = torch.randn(channels, generator=gen).to(device) if bias else None
    out = tree_causal_conv1d(x, parents, state, weight, b, activation)
    torch.testing.assert_close(out, tree_causal_conv1d_reference(x, parents, state, weight, b, activation),
                               rtol=1e-5, atol=1e-5)
    for n in range(3):
        par = parents[n].tolist()
        for node in (num_nodes - 1, 1, 0):
            path = path_to(par, node)
            # The chain: the committed window then the path's inputs, convolved at the last position.
            seq = torch.cat([state[n].t(), x[n, path]])[-width:]  # [W, C]
            y = (seq.t() * weight).sum(1) + (b if bias else 0.0)
            y = torch.nn.functional.silu(y) if activation else y
            torch.testing.assert_close(out[n, node], y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_state_commit_writes_only_the_accepted_nodes_state(device):
    from ubtree_vllm.triton_ops.tree_delta_rule import commit_tree_state

    gen = torch.Generator().manual_seed(5)
    parents = random_parents(3, 9, gen).to(device)
    q, k, v, g, beta, h0 = delta_inputs(3, 9, 2, 8, 8, False, gen, device)
    _, states = tree_gated_delta_rule(q, k, v, g, beta, parents, h0, scale=1.0)
    cache = torch.zeros(6, 2, 8, 8, device=device)
    accepted, slots = torch.tensor([8, 0, 4], device=device), torch.tensor([5, 1, 2], device=device)
    commit_tree_state(states, accepted, cache, slots)
    for n, (node, slot) in enumerate(zip(accepted.tolist(), slots.tolist())):
        path = path_to(parents[n].tolist(), node)
        _, chain = gated_delta_rule_chain_reference(q[n, path], k[n, path], v[n, path], g[n, path], beta[n, path],
                                                    h0[n], 1.0)
        torch.testing.assert_close(cache[slot], chain[-1], rtol=1e-4, atol=1e-4)
    assert cache[[0, 3, 4]].abs().sum() == 0  # other slots untouched


@pytest.mark.parametrize("device", DEVICES)
def test_conv_window_commit_is_the_accepted_paths_last_inputs(device):
    gen = torch.Generator().manual_seed(3)
    width, channels, num_nodes = 4, 8, 12
    parents = random_parents(4, num_nodes, gen).to(device)
    x = torch.randn(4, num_nodes, channels, generator=gen).to(device)
    state = torch.randn(4, channels, width - 1, generator=gen).to(device)
    node = torch.tensor([num_nodes - 1, 0, 5, -1], device=device)  # -1: nothing accepted, the window stays
    got = tree_conv_window(x, parents, state, node)
    for n, last in enumerate(node.tolist()):
        path = path_to(parents[n].tolist(), last) if last >= 0 else []
        want = torch.cat([state[n].t(), x[n, path]])[-(width - 1):].t()  # [C, W - 1] oldest first
        torch.testing.assert_close(got[n], want)


def test_bad_shapes_name_the_arguments():
    q = torch.zeros(1, 3, 2, 4)
    with pytest.raises(ValueError, match="g must be"):
        tree_gated_delta_rule(q, q, q, torch.zeros(1, 3), torch.zeros(1, 3, 2), torch.zeros(1, 3), torch.zeros(1, 2, 4, 4),
                              1.0)
    with pytest.raises(ValueError, match="activation"):
        tree_causal_conv1d(torch.zeros(1, 3, 4), torch.zeros(1, 3), torch.zeros(1, 4, 3), torch.zeros(4, 4),
                           activation="gelu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_channel,delta", [(False, True), (True, True), (False, False)],
                         ids=["gdn", "kda", "mamba2"])
@pytest.mark.parametrize("num_nodes,dk,dv,max_depth", [(7, 16, 16, 6), (65, 32, 24, 16)])
def test_path_recompute_form_equals_the_node_state_form_and_commits_the_accepted_path(
        device, per_channel, delta, num_nodes, dk, dv, max_depth):
    """The cheaper state form (no per-node states): outputs equal the node-state kernel's, its reference's and
    the chain's on each root path; the commit writes the accepted node's chain state into its slot only."""
    from ubtree_vllm.triton_ops.tree_delta_rule_paths import commit_tree_state_by_path, tree_gated_delta_rule_paths

    gen = torch.Generator().manual_seed(7 * num_nodes + dk)
    parents = bounded_depth_parents(2, num_nodes, max_depth, gen).to(device)
    q, k, v, g, beta, h0 = delta_inputs(2, num_nodes, 2, dk, dv, per_channel, gen, device)
    o = tree_gated_delta_rule_paths(q, k, v, g, beta, parents, h0, dk ** -0.5, max_depth, delta)
    o_nodes, _ = tree_gated_delta_rule(q, k, v, g, beta, parents, h0, scale=dk ** -0.5, delta=delta)
    o_ref, _ = tree_gated_delta_rule_reference(q, k, v, g, beta, parents, h0, dk ** -0.5, delta)
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o, o_nodes, rtol=1e-4, atol=1e-4)
    deepest = [max(range(num_nodes), key=lambda t: len(path_to(parents[n].tolist(), t))) for n in range(2)]
    assert max(len(path_to(parents[n].tolist(), deepest[n])) for n in range(2)) == max_depth + 1  # the bound, met
    cache = torch.zeros(5, 2, dk, dv, device=device)
    accepted, slots = torch.tensor(deepest, device=device), torch.tensor([3, 1], device=device)
    commit_tree_state_by_path(q, k, v, g, beta, parents, h0, max_depth, accepted, slots, cache, delta)
    for n, (node, slot) in enumerate(zip(deepest, slots.tolist())):
        path = path_to(parents[n].tolist(), node)
        chain_o, chain = gated_delta_rule_chain_reference(q[n, path], k[n, path], v[n, path], g[n, path],
                                                          beta[n, path], h0[n], dk ** -0.5, delta)
        torch.testing.assert_close(cache[slot], chain[-1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(o[n, node], chain_o[-1], rtol=1e-4, atol=1e-4)
    assert cache[[0, 2, 4]].abs().sum() == 0  # other slots untouched


@pytest.mark.parametrize("device", DEVICES)
def test_path_recompute_form_poisons_paths_deeper_than_its_bound(device):
    """A root path longer than max_depth + 1 nodes gives NaN (output and committed state), never a truncated
    recurrence; nodes within the bound are exact."""
    from ubtree_vllm.triton_ops.tree_delta_rule_paths import commit_tree_state_by_path, tree_gated_delta_rule_paths

    gen = torch.Generator().manual_seed(11)
    parents = torch.tensor([[-1, 0, 1, 2, 3, 0]], device=device)  # a chain of 5 nodes and a leaf under the root
    q, k, v, g, beta, h0 = delta_inputs(1, 6, 2, 8, 8, False, gen, device)
    o = tree_gated_delta_rule_paths(q, k, v, g, beta, parents, h0, 1.0, max_depth=3)
    o_ref, _ = tree_gated_delta_rule_reference(q, k, v, g, beta, parents, h0, 1.0)
    assert torch.isnan(o[0, 4]).all() and not torch.isnan(o[0, [0, 1, 2, 3, 5]]).any()
    torch.testing.assert_close(o[0, [0, 1, 2, 3, 5]], o_ref[0, [0, 1, 2, 3, 5]], rtol=1e-4, atol=1e-4)
    cache = torch.zeros(1, 2, 8, 8, device=device)
    commit_tree_state_by_path(q, k, v, g, beta, parents, h0, 3, torch.tensor([4], device=device),
                              torch.tensor([0], device=device), cache)
    assert torch.isnan(cache).all()


def bounded_depth_parents(num_reqs: int, num_nodes: int, max_depth: int, gen: torch.Generator) -> torch.Tensor:
    """[N, T] random parents-first trees whose root paths hold at most max_depth + 1 nodes, one of them exactly."""
    rows = []
    for _ in range(num_reqs):
        parents, depth = [-1], [0]
        for t in range(1, num_nodes):
            if t <= max_depth:  # a spine to the bound first
                parent = t - 1
            else:
                parent = int(torch.randint(0, t, (1,), generator=gen))
                while depth[parent] == max_depth:
                    parent = int(torch.randint(0, t, (1,), generator=gen))
            parents.append(parent)
            depth.append(depth[parent] + 1)
        rows.append(parents)
    return torch.tensor(rows)
