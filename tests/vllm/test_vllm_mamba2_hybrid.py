"""Mamba2 (NemotronH) targets under tree verification on the CPU V1 runner.

Layer level (no engine): the tree forms of the Mamba2 mixer's decode calls compute, for every node, bit for
bit what vLLM's non-speculative decode computes for that token after the node's root path (conv window from
the ancestors, SSM state from the parent), with vLLM's own CPU kernels; after the commit of an accepted path
the next step resumes from it.

Engine level (greedy equality, T = 1 distribution): tests/vllm/test_vllm_cpu_families.py.
"""
from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

from ubtree_vllm.vllm.recurrent.commit import commit_accepted_states
from ubtree_vllm.vllm.recurrent.mamba2 import tree_conv_update, tree_state_update
from hybrid_checks import path_to, random_tree

BF16 = torch.bfloat16
WIDTH, HEADS, HEAD_DIM, STATE, SPEC = 4, 8, 64, 64, 8  # conv width, Mamba heads, head dim, SSM state, S
DIM = HEADS * HEAD_DIM + 2 * STATE  # conv channels: x, B, C (one group)


def ssu(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False, state_batch_indices=None,
        dst_state_batch_indices=None, null_block_id=0, out=None, num_accepted_tokens=None, cu_seqlens=None,
        is_blackwell=False):
    """vLLM's CPU selective_state_update backend (``CPUSSUBackend``), without its engine-wide initialisation."""
    torch.ops._C.selective_state_update_cpu(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, state_batch_indices,
                                            dst_state_batch_indices, null_block_id, out, num_accepted_tokens,
                                            cu_seqlens)


class Step:
    """One decode step of a Mamba2 layer over ``trees``, with the mixer's call arguments."""

    def __init__(self, trees, num_accepted, slots, weights, caches, gen):
        self.trees, self.num_accepted, self.slots = trees, num_accepted, slots
        self.weight, self.bias, self.A, self.D, self.dt_bias = weights
        self.conv_buf, self.ssm_state = caches
        num_nodes = np.array([len(p) for p, _ in trees])
        width = int(num_nodes.max())
        self.plan = types.SimpleNamespace(
            num_nodes=num_nodes,
            parents=np.stack([np.pad(p, (0, width - len(p)), constant_values=-2) for p, _ in trees]),
            depth=np.stack([np.pad(d, (0, width - len(d))) for _, d in trees]))
        self.qsl = torch.tensor(np.concatenate([[0], np.cumsum(num_nodes)]), dtype=torch.int32)
        total = int(num_nodes.sum())
        self.x = torch.randn(total, DIM, generator=gen).to(BF16)  # conv inputs
        self.xs = torch.randn(total, HEADS, HEAD_DIM, generator=gen).to(BF16)  # SSM inputs
        self.dt = torch.randn(total, HEADS, generator=gen).to(BF16)
        self.B = torch.randn(total, 1, STATE, generator=gen).to(BF16)
        self.C = torch.randn(total, 1, STATE, generator=gen).to(BF16)
        self.before = self.conv_buf.clone(), self.ssm_state.clone()

    def mixer_args(self):
        """A, dt, D, dt_bias expanded as MambaMixer2's decode path passes them."""
        A = self.A[:, None, None].expand(-1, HEAD_DIM, STATE).float()
        return (A, self.dt[:, :, None].expand(-1, -1, HEAD_DIM), self.D[:, None].expand(-1, HEAD_DIM),
                self.dt_bias[:, None].expand(-1, HEAD_DIM))

    def run(self):
        """(conv out [T, DIM], SSM out [T, H, P], the layer's commit record)."""
        def conv_over_its_input(x, *args, **kwargs):  # vLLM's CUDA conv writes its output over x: model that contract
            return x.copy_(causal_conv1d_update_cpu(x, *args, **kwargs))

        conv_out, pending = tree_conv_update(
            self.plan, conv_over_its_input, self.x.clone(), self.conv_buf, self.weight, self.bias, "silu",
            conv_state_indices=self.slots.to(torch.int32),
            num_accepted_tokens=torch.tensor(self.num_accepted, dtype=torch.int32), query_start_loc=self.qsl,
            dim_first=False)
        A, dt, D, dt_bias = self.mixer_args()
        out = torch.empty_like(self.xs)
        record = tree_state_update(pending, ssu, self.ssm_state, self.xs, dt, A, self.B, self.C, out, torch.int32,
                                   D=D, dt_bias=dt_bias, dt_softplus=True)
        return conv_out, out, record

    def committed(self, i):
        """(window [DIM, width - 1], state) request i resumes from, per vLLM's chain convention."""
        conv0, ssm0 = self.before
        offset = self.num_accepted[i] - 1
        return conv0[self.slots[i, 0], :, offset:offset + WIDTH - 1], ssm0[self.slots[i, offset]]

    def plain_decode(self, window, state, tokens):
        """vLLM's non-speculative decode of ``tokens`` (indices into this step's inputs, or (step, index)) one at
        a time, as MambaMixer2 calls its kernels without speculation: ([n, DIM] conv, [n, H, P] SSM outputs)."""
        conv = window.T.contiguous()[None].expand(2, -1, -1).transpose(1, 2).clone()  # slot 1 of [2, DIM, w - 1]
        ssm = state[None].expand(2, -1, -1, -1).clone()
        slot = torch.ones(1, 1, dtype=torch.int32)
        conv_outs, ssm_outs = [], []
        for step, t in tokens:
            conv_outs.append(causal_conv1d_update_cpu(step.x[t][None], conv, step.weight, step.bias, "silu",
                                                      conv_state_indices=slot)[0])
            A, dt, D, dt_bias = step.mixer_args()
            out = torch.empty_like(step.xs[t][None])
            ssu(ssm, step.xs[t][None], dt[t][None], A, step.B[t][None], step.C[t][None], D, dt_bias,
                dt_softplus=True, state_batch_indices=slot, dst_state_batch_indices=slot, out=out)
            ssm_outs.append(out[0])
        return torch.stack(conv_outs), torch.stack(ssm_outs), ssm[1]


@pytest.fixture
def mamba2_step():
    """Three requests (a random tree, a bushy tree, a lone root) resuming from different slots."""
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    weights = ((torch.randn(DIM, WIDTH, generator=gen) * 0.5).to(BF16), (torch.randn(DIM, generator=gen) * 0.1).to(BF16),
               -torch.rand(HEADS, generator=gen) - 0.5, torch.randn(HEADS, generator=gen).to(BF16),
               torch.randn(HEADS, generator=gen).to(BF16))
    num_slots = 3 * (SPEC + 1) + 1
    caches = (torch.randn(num_slots, WIDTH - 1 + SPEC, DIM, generator=gen).to(BF16).transpose(-1, -2),
              torch.randn(num_slots, HEADS, HEAD_DIM, STATE, generator=gen) * 0.1)
    slots = torch.arange(1, num_slots).view(3, SPEC + 1)
    trees = [random_tree(SPEC + 1, rng), (np.array([-1, 0, 0, 0, 1, 1, 2]), np.array([0, 1, 1, 1, 2, 2, 2])),
             (np.array([-1]), np.array([0]))]
    return Step(trees, [3, 1, 6], slots, weights, caches, gen)


def test_every_node_computes_what_plain_decoding_of_its_path_computes(mamba2_step):
    s = mamba2_step
    conv_out, ssm_out, _ = s.run()
    start = 0
    for i, (parents, _) in enumerate(s.trees):
        window, state = s.committed(i)
        for node in range(len(parents)):
            path = [(s, start + j) for j in path_to(parents, node)]
            conv_ref, ssm_ref, final = s.plain_decode(window, state, path)
            assert torch.equal(conv_out[start + node], conv_ref[-1]), (i, node)
            assert torch.equal(ssm_out[start + node], ssm_ref[-1]), (i, node)
            assert torch.equal(s.ssm_state[s.slots[i, node]], final), (i, node)
        start += len(parents)


def test_after_the_commit_the_next_step_resumes_from_the_accepted_path(mamba2_step):
    """Accept the path to each tree's last node (nodes off their depth move), commit, then run a 3-node chain
    (vLLM's num_accepted = k + 1): it equals plain decoding of the accepted path followed by the new tokens."""
    s = mamba2_step
    _, _, record = s.run()
    accepted = [path_to(p, len(p) - 1) for p, _ in s.trees]
    accepted_path = torch.tensor([a + [-1] * (SPEC + 1 - len(a)) for a in accepted])
    num_accepted = (accepted_path >= 0).sum(1) - 1
    commit_accepted_states([record], accepted_path, num_accepted)

    chain = (np.arange(3) - 1, np.arange(3))
    weights = (s.weight, s.bias, s.A, s.D, s.dt_bias)
    nxt = Step([chain] * 3, (num_accepted + 1).tolist(), s.slots, weights, (s.conv_buf, s.ssm_state),
               torch.Generator().manual_seed(1))
    conv_out, ssm_out, _ = nxt.run()
    for i in range(len(s.trees)):
        window, state = s.committed(i)
        first = sum(len(p) for p, _ in s.trees[:i])
        tokens = [(s, first + j) for j in accepted[i]] + [(nxt, 3 * i + t) for t in range(3)]
        conv_ref, ssm_ref, final = s.plain_decode(window, state, tokens)
        assert torch.equal(conv_out[3 * i:3 * i + 3], conv_ref[-3:]), i
        assert torch.equal(ssm_out[3 * i:3 * i + 3], ssm_ref[-3:]), i
        assert torch.equal(s.ssm_state[s.slots[i, 2]], final), i


def test_sequences_that_are_not_the_steps_trees_are_refused(mamba2_step):
    s = mamba2_step
    s.qsl = torch.tensor([0, 9, 15, 17], dtype=torch.int32)  # 9 + 6 + 2 tokens for trees of 9, 7 and 1 nodes
    with pytest.raises(RuntimeError, match="Mamba2 speculative sequences .* are not the step's trees"):
        s.run()
    s.qsl = torch.tensor([0, 9, 16, 17], dtype=torch.int32)
    s.x = s.x[:-1]  # 16 decode tokens for trees of 9, 7 and 1 nodes
    with pytest.raises(RuntimeError, match=r"the Mamba2 layer's 16 decode tokens are not the step's trees "
                                           r"\(\[9, 7, 1\] nodes\)"):
        s.run()
