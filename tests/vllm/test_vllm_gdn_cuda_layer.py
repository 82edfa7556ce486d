"""The CUDA Gated DeltaNet tree form (patch cuda_gdn_tree_forward) with vLLM's own CUDA kernels.

vLLM's ``_forward_core`` runs a tree step's speculative rows with the patch installed; every node's output and state
equal, bit for bit, what vLLM's decode of one token per request computes along the node's root path, in both of
vLLM's decode paths: the packed kernel of ``_forward_core_decode_non_spec`` (``enable_packed_recurrent_decode``,
vLLM's default) and ``fused_sigmoid_gating_delta_rule_update`` (the decode part of mixed batches); after the commit of
accepted paths off their depth, a next step resumes from them.

On CUDA these are vLLM's Triton kernels. On the CPU (CI) both recurrence kernels are vLLM's CUDA kernels run by the
Triton interpreter, so their calling conventions are checked (state layout [HV, V, K], one state index per sequence,
index 0 skipped, in place, the packed q | k | v rows); the conv is vLLM's CPU conv given the CUDA conv's contract (its
output written over its input): the interpreter cannot run vLLM's conv kernel ("mask has unsupported dtype"). The
engine-level tests are in test_vllm_gpu.py.
"""
from __future__ import annotations

import importlib
import random
import types

import numpy as np
import pytest
import torch

from hybrid_checks import commit_paths_to_last_nodes, layer_step, path_to, spec_step
from ubtree_vllm.patches._patching import original_attr_name, restore_attr

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BF16, WIDTH, HEADS, HEAD_DIM, SPEC = torch.bfloat16, 4, 2, 128, 8
DIM = 3 * HEADS * HEAD_DIM


@pytest.fixture
def gdn(monkeypatch):
    """vLLM's GDN module with the patch installed (restored afterwards); on the CPU its two calls as described
    above."""
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as module

    importlib.import_module("ubtree_vllm.patches.worker.patch_cuda_gdn_tree_forward").install()
    if not CUDA:
        import vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating as fused_sigmoid_gating

        from vllm_triton_kernels import give_cpu_conv_the_cuda_contract, interpreted, interpreted_fused_recurrent

        give_cpu_conv_the_cuda_contract(module, original_attr_name("causal_conv1d_update"), monkeypatch)
        monkeypatch.setattr(module, original_attr_name("fused_sigmoid_gating_delta_rule_update"),
                            interpreted(fused_sigmoid_gating).fused_sigmoid_gating_delta_rule_update)
        monkeypatch.setattr(module, "fused_recurrent_gated_delta_rule_packed_decode",
                            interpreted_fused_recurrent().fused_recurrent_gated_delta_rule_packed_decode)
    yield module
    monkeypatch.undo()  # the originals first, then the patched names back to them
    cls = module.QwenGatedDeltaNetAttention
    for owner, name in ((cls, "__init__"), (cls, "_forward_core"), (module, "causal_conv1d_update"),
                        (module, "fused_sigmoid_gating_delta_rule_update")):
        restore_attr(owner, name)


def make_layer(gdn, gen, num_slots, packed):
    """What _forward_core reads of a layer, with caches [num_slots] in vLLM's CUDA layouts; ``packed``: its decode
    takes the packed kernel."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(BF16).to(DEVICE)

    dim_first = is_conv_state_dim_first()
    raw_conv = rand(num_slots, DIM, WIDTH - 1 + SPEC) if dim_first else rand(num_slots, WIDTH - 1 + SPEC, DIM)
    layer = types.SimpleNamespace(
        conv1d=types.SimpleNamespace(weight=rand(DIM, 1, WIDTH, scale=0.5), bias=rand(DIM, scale=0.1)),
        activation="silu", A_log=rand(HEADS), dt_bias=rand(HEADS), key_dim=HEADS * HEAD_DIM,
        value_dim=HEADS * HEAD_DIM, tp_size=1, head_k_dim=HEAD_DIM, head_v_dim=HEAD_DIM,
        prefix="model.layers.0.linear_attn", enable_packed_recurrent_decode=packed,
        kv_cache=(raw_conv, rand(num_slots, HEADS, HEAD_DIM, HEAD_DIM, scale=0.1)))
    layer.rearrange_mixed_qkv = types.MethodType(gdn.QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    layer.conv_state = raw_conv if dim_first else raw_conv.transpose(-1, -2)  # [slots, dim, state_len]
    return layer


def tree_step(gdn, monkeypatch, layer, trees, num_accepted, slots, gen):
    """Run one step whose requests verify ``trees``; returns (inputs x / b / a, [T, H, Dv] output, commit record)."""
    from ubtree_vllm.vllm.attention.state import tree_forward_state

    plan, metadata = spec_step(trees, num_accepted, slots, DEVICE)
    total = int(plan.num_nodes.sum())
    x = torch.randn(total, DIM, generator=gen).to(BF16).to(DEVICE)
    b, a = (torch.randn(total, HEADS, generator=gen).to(BF16).to(DEVICE) for _ in range(2))
    state = tree_forward_state()
    monkeypatch.setattr(gdn, "get_forward_context",
                        lambda: types.SimpleNamespace(attn_metadata={layer.prefix: metadata}))
    monkeypatch.setattr(state, "step_plan", plan)
    monkeypatch.setattr(state, "linear_stash", {})
    out = torch.zeros(total, HEADS, HEAD_DIM, dtype=BF16, device=DEVICE)
    gdn.QwenGatedDeltaNetAttention._forward_core(layer, x.clone(), b, a, out)  # the conv overwrites its input
    monkeypatch.setattr(state, "step_plan", None)
    return (x, b, a), out, state.linear_stash[layer.prefix]


def plain_decode(gdn, layer, window, state, tokens):
    """vLLM's decode of one token per request over ``tokens`` [(x, b, a)] from ``window`` [dim, width - 1] and
    ``state`` [H, V, K], the calls of ``_forward_core_decode_non_spec`` (packed layers) or of the decode part of
    ``_forward_core`` (the others); returns ([n, H, Dv] outputs, final state)."""
    conv = getattr(gdn, original_attr_name("causal_conv1d_update"))
    recurrence = getattr(gdn, original_attr_name("fused_sigmoid_gating_delta_rule_update"))
    conv_state = window[None].expand(2, -1, -1).clone()  # slot 1 (0 is vLLM's null block)
    ssm = state[None].expand(2, -1, -1, -1).clone()
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    weight = layer.conv1d.weight.view(DIM, WIDTH)
    outs = []
    for x, b, a in tokens:
        mixed = conv(x[None].clone(), conv_state, weight, layer.conv1d.bias, "silu", conv_state_indices=one,
                     validate_data=True)
        if layer.enable_packed_recurrent_decode:
            o = torch.empty(1, 1, HEADS, HEAD_DIM, dtype=BF16, device=DEVICE)
            gdn.fused_recurrent_gated_delta_rule_packed_decode(
                mixed_qkv=mixed, a=a[None], b=b[None], A_log=layer.A_log, dt_bias=layer.dt_bias,
                scale=HEAD_DIM ** -0.5, initial_state=ssm, out=o, ssm_state_indices=one, use_qk_l2norm_in_kernel=True)
            outs.append(o.reshape(HEADS, HEAD_DIM))
            continue
        q, k, v = layer.rearrange_mixed_qkv(mixed)
        o, _ = recurrence(A_log=layer.A_log, a=a[None], b=b[None], dt_bias=layer.dt_bias, q=q, k=k, v=v,
                          initial_state=ssm, inplace_final_state=True,
                          cu_seqlens=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), ssm_state_indices=one,
                          use_qk_l2norm_in_kernel=True)
        outs.append(o.reshape(HEADS, HEAD_DIM))
    return torch.stack(outs), ssm[1]


@pytest.mark.parametrize("packed", [True, False], ids=["packed_decode", "fused_sigmoid"])
def test_tree_nodes_equal_plain_decoding_of_their_paths_and_the_commit_resumes_them(gdn, monkeypatch, packed):
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    layer = make_layer(gdn, gen, 3 * (SPEC + 1) + 1, packed)
    slots, trees, num_accepted, resumed = layer_step(SPEC, rng, WIDTH, layer.conv_state, layer.kv_cache[1])
    (x, b, a), out, record = tree_step(gdn, monkeypatch, layer, trees, num_accepted, slots, gen)
    start = 0
    for i, (parents, _) in enumerate(trees):
        for node in range(len(parents)):
            path = [start + j for j in path_to(parents, node)]
            outs, final = plain_decode(gdn, layer, *resumed[i], [(x[t], b[t], a[t]) for t in path])
            assert torch.equal(out[start + node], outs[-1]), (i, node)
            assert torch.equal(layer.kv_cache[1][slots[i, node]], final), (i, node)
        start += len(parents)

    accepted = commit_paths_to_last_nodes(record, trees, SPEC, DEVICE)
    chain = (np.arange(3) - 1, np.arange(3))
    (x2, b2, a2), out2, _ = tree_step(gdn, monkeypatch, layer, [chain] * 3, [len(p) for p in accepted], slots, gen)
    for i, path in enumerate(accepted):
        first = sum(len(p) for p, _ in trees[:i])
        tokens = [(x[first + j], b[first + j], a[first + j]) for j in path]
        tokens += [(x2[3 * i + t], b2[3 * i + t], a2[3 * i + t]) for t in range(3)]
        outs, final = plain_decode(gdn, layer, *resumed[i], tokens)
        assert torch.equal(out2[3 * i:3 * i + 3], outs[-3:]), i
        assert torch.equal(layer.kv_cache[1][slots[i, 2]], final), i
