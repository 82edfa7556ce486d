"""Gated DeltaNet (Qwen3-Next) targets under tree verification.

Layer level (no engine), for both tree forms: the CPU one (vLLM's ``_spec_forward`` replaced,
``gdn_cpu``) and the CUDA one (vLLM's own ``_forward_core`` run through patch
``cuda_gdn_tree_forward``, ``gdn_cuda``; here on the CPU, its recurrence call served by vLLM's CPU
decode kernel behind the CUDA signature, which accepts only the calls plain decoding makes). Each computes,
for every node, bit for bit what vLLM's non-speculative decode computes for that token after the node's
root path (and what the torch references compute, to bf16 rounding); after the commit of an
accepted path the next step finds it where vLLM's chain convention looks.

Engine level (tests/vllm/test_vllm_cpu_families.py): greedy UBTree on a tiny random bf16 Qwen3-Next is
token-identical to the same engine without speculation; here, prefix caching is refused.
"""
from __future__ import annotations

import importlib
import random
import types

import numpy as np
import pytest
import torch
from vllm import _custom_ops as ops
import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu

from ubtree_vllm.patches._patching import original_attr_name, restore_attr
from ubtree_vllm.triton_ops.reference import tree_causal_conv1d_reference, tree_gated_delta_rule_reference
from ubtree_vllm.vllm.recurrent.gdn_cpu import tree_spec_forward
from ubtree_vllm.vllm.attention.state import tree_forward_state
from ubtree_vllm.vllm.recurrent.commit import commit_accepted_states
from hybrid_checks import path_to, random_tree
from vllm_engines import TINY_TREE
from vllm_models import save_tiny_qwen3_next, save_untrained_drafter

BF16 = torch.bfloat16
WIDTH, HEADS, HEAD_DIM, SPEC = 4, 2, 128, 8  # conv width, linear heads (k = v), head dim, num_speculative_tokens


def fake_gdn_layer(gen: torch.Generator) -> types.SimpleNamespace:
    """What the GDN forward reads of a QwenGatedDeltaNetAttention: conv weights, gates, the qkv split."""
    dim = 3 * HEADS * HEAD_DIM
    layer = types.SimpleNamespace(
        conv1d=types.SimpleNamespace(weight=(torch.randn(dim, 1, WIDTH, generator=gen) * 0.5).to(BF16),
                                     bias=(torch.randn(dim, generator=gen) * 0.1).to(BF16)),
        activation="silu", A_log=torch.randn(HEADS, generator=gen).to(BF16),
        dt_bias=torch.randn(HEADS, generator=gen).to(BF16), key_dim=HEADS * HEAD_DIM, value_dim=HEADS * HEAD_DIM,
        tp_size=1, head_k_dim=HEAD_DIM, head_v_dim=HEAD_DIM, prefix="model.layers.0.linear_attn")
    layer.rearrange_mixed_qkv = types.MethodType(QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    return layer


def layer_caches(num_slots: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv_buf [slots, dim, state_len], ssm_state [slots, H, Dk, Dv]): vLLM's CPU views of its SD-layout caches."""
    dim = 3 * HEADS * HEAD_DIM
    conv = torch.randn(num_slots, WIDTH - 1 + SPEC, dim, generator=gen).to(BF16)
    ssm = (torch.randn(num_slots, HEADS, HEAD_DIM, HEAD_DIM, generator=gen) * 0.1).to(BF16)
    return conv.transpose(-1, -2), ssm.view(num_slots, HEADS, HEAD_DIM, HEAD_DIM)


def step_inputs(layer, trees, num_accepted, slots, gen):
    """A step's plan, GDN metadata and token inputs for requests with ``trees`` [(parents, depth)]."""
    num_nodes = np.array([len(p) for p, _ in trees])
    width = int(num_nodes.max())
    plan = types.SimpleNamespace(
        num_nodes=num_nodes, parents=np.stack([np.pad(p, (0, width - len(p)), constant_values=-2) for p, _ in trees]),
        depth=np.stack([np.pad(d, (0, width - len(d))) for _, d in trees]))
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(num_nodes)]), dtype=torch.int32)
    metadata = types.SimpleNamespace(
        num_spec_decodes=len(trees), spec_state_indices_tensor=slots.to(torch.int32),
        num_accepted_tokens=torch.tensor(num_accepted, dtype=torch.int32), spec_query_start_loc=qsl,
        spec_sequence_masks_cpu=torch.ones(len(trees), dtype=torch.bool))
    total, dim = int(num_nodes.sum()), 3 * HEADS * HEAD_DIM
    x = torch.randn(total, dim, generator=gen).to(BF16)
    b, a = torch.randn(total, HEADS, generator=gen).to(BF16), torch.randn(total, HEADS, generator=gen).to(BF16)
    return plan, metadata, x, b, a


def plain_decode(layer, window, state, tokens):
    """vLLM's non-speculative CPU decode of ``tokens`` one at a time (its _cpu_gdn_attention_nonspec ops).

    window [dim, width - 1] and state [H, Dk, Dv] (copied); tokens: (x [dim], b [H], a [H]) each.
    Returns ([n, H, Dv] outputs, final window, final state)."""
    # slot 1 of two: the kernels skip slot 0 (vLLM's null block)
    conv = window.T.contiguous()[None].expand(2, -1, -1).transpose(1, 2).clone()  # [2, dim, width - 1]
    ssm = state[None].expand(2, -1, -1, -1).clone()  # [2, H, Dk, Dv]
    slot = torch.ones(1, dtype=torch.int32)
    weight = layer.conv1d.weight.view(layer.conv1d.weight.shape[0], WIDTH)
    outs = []
    for x, b, a in tokens:
        mixed = causal_conv1d_update_cpu(x=x[None], conv_state=conv, weight=weight, bias=layer.conv1d.bias,
                                         activation="silu", conv_state_indices=slot)
        q, k, v = layer.rearrange_mixed_qkv(mixed)
        o = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=layer.A_log, dt_bias=layer.dt_bias, q=q, k=k, v=v, a=a[None], b=b[None], initial_state_source=ssm,
            initial_state_indices=slot, cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
            use_qk_l2norm_in_kernel=True)
        outs.append(o.reshape(HEADS, HEAD_DIM))
    return torch.stack(outs), conv[1], ssm[1]


def cpu_decode_recurrence(*, A_log, a, b, dt_bias, q, k, v, initial_state, inplace_final_state=True, cu_seqlens=None,
                          ssm_state_indices=None, num_accepted_tokens=None, use_qk_l2norm_in_kernel=False, **_):
    """vLLM's ``fused_sigmoid_gating_delta_rule_update`` (the CUDA path's signature) for the calls plain decoding
    makes -- one token per sequence, one state index each, in place -- by vLLM's CPU decode kernel; anything else
    (the chain form with num_accepted_tokens) fails."""
    assert num_accepted_tokens is None and inplace_final_state and ssm_state_indices.ndim == 1
    assert torch.equal(cu_seqlens, torch.arange(len(ssm_state_indices) + 1, dtype=cu_seqlens.dtype))
    o = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=A_log, dt_bias=dt_bias, q=q, k=k, v=v, a=a, b=b, initial_state_source=initial_state,
        initial_state_indices=ssm_state_indices, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o.reshape(v.shape), initial_state


@pytest.fixture
def cuda_forward_core(monkeypatch):
    """vLLM's CUDA ``_forward_core`` with patch cuda_gdn_tree_forward installed, runnable on the CPU: the conv is the
    module's (vLLM's CPU conv on this platform) with the CUDA conv's output contract, the recurrence
    :func:`cpu_decode_recurrence`."""
    patch = importlib.import_module("ubtree_vllm.patches.worker.patch_cuda_gdn_tree_forward")
    patch.install()
    cpu_conv = getattr(gdn, original_attr_name("causal_conv1d_update"))

    def conv_over_its_input(x, *args, **kwargs):  # vLLM's CUDA conv writes its output over x (no `out` given)
        return x.copy_(cpu_conv(x, *args, **kwargs))

    monkeypatch.setattr(gdn, original_attr_name("causal_conv1d_update"), conv_over_its_input)
    monkeypatch.setattr(gdn, original_attr_name("fused_sigmoid_gating_delta_rule_update"), cpu_decode_recurrence)
    yield
    monkeypatch.undo()  # the originals first, then the patched names back to them
    for owner, name in ((QwenGatedDeltaNetAttention, "__init__"), (QwenGatedDeltaNetAttention, "_forward_core"),
                        (gdn, "causal_conv1d_update"), (gdn, "fused_sigmoid_gating_delta_rule_update")):
        restore_attr(owner, name)


@pytest.fixture(params=["cpu_spec_forward", "cuda_forward_core"])
def gdn_step(request):
    """Three requests (a deep tree, a bushy tree, a lone root) resuming from different slots, run by one tree
    form."""
    if request.param == "cuda_forward_core":
        request.getfixturevalue("cuda_forward_core")
    gen, rng = torch.Generator().manual_seed(0), random.Random(0)
    layer = fake_gdn_layer(gen)
    conv_buf, ssm_state = layer_caches(3 * (SPEC + 1) + 1, gen)
    slots = torch.arange(1, 3 * (SPEC + 1) + 1).view(3, SPEC + 1)
    trees = [random_tree(SPEC + 1, rng), (np.array([-1, 0, 0, 0, 1, 1, 2]), np.array([0, 1, 1, 1, 2, 2, 2])),
             (np.array([-1]), np.array([0]))]
    num_accepted = [3, 1, 6]  # the previous step's accepted tokens (bonus included)
    plan, metadata, x, b, a = step_inputs(layer, trees, num_accepted, slots, gen)
    before = conv_buf.clone(), ssm_state.clone()
    return types.SimpleNamespace(layer=layer, conv_buf=conv_buf, ssm_state=ssm_state, slots=slots, trees=trees,
                                 num_accepted=num_accepted, plan=plan, metadata=metadata, x=x, b=b, a=a, before=before,
                                 gen=gen, form=request.param, monkeypatch=request.getfixturevalue("monkeypatch"))


def run_tree_step(s):
    """([T, H, Dv] output, the layer's commit record) of the step's tree form."""
    if s.form == "cpu_spec_forward":
        return tree_spec_forward(s.plan, s.layer, s.metadata, s.x, s.b, s.a, s.conv_buf, s.ssm_state, WIDTH,
                                 WIDTH - 1 + SPEC)
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    md, total = s.metadata, len(s.x)
    metadata = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=md.num_spec_decodes,
        num_spec_decode_tokens=total, num_actual_tokens=total, spec_query_start_loc=md.spec_query_start_loc,
        spec_state_indices_tensor=md.spec_state_indices_tensor, spec_sequence_masks=md.spec_sequence_masks_cpu,
        spec_sequence_masks_cpu=md.spec_sequence_masks_cpu, num_accepted_tokens=md.num_accepted_tokens)
    layer = types.SimpleNamespace(**vars(s.layer), enable_packed_recurrent_decode=False,
                                  kv_cache=(s.conv_buf if is_conv_state_dim_first() else s.conv_buf.transpose(-1, -2),
                                            s.ssm_state))
    layer.rearrange_mixed_qkv = types.MethodType(QwenGatedDeltaNetAttention.rearrange_mixed_qkv, layer)
    state = tree_forward_state()
    s.monkeypatch.setattr(gdn, "get_forward_context",
                          lambda: types.SimpleNamespace(attn_metadata={layer.prefix: metadata}))
    s.monkeypatch.setattr(state, "step_plan", s.plan)
    s.monkeypatch.setattr(state, "linear_stash", {})
    out = torch.zeros(total, HEADS, HEAD_DIM, dtype=BF16)
    QwenGatedDeltaNetAttention._forward_core(layer, s.x.clone(), s.b, s.a, out)  # the CUDA conv overwrites its input
    return out, state.linear_stash[layer.prefix]


def committed(s, i):
    """(window [dim, width - 1], state) request i resumes from, per vLLM's chain convention."""
    conv0, ssm0 = s.before
    offset = s.num_accepted[i] - 1
    return conv0[s.slots[i, 0], :, offset:offset + WIDTH - 1], ssm0[s.slots[i, offset]]


def test_every_node_computes_what_plain_decoding_of_its_path_computes(gdn_step):
    s = gdn_step
    out, _ = run_tree_step(s)
    start = 0
    for i, (parents, _) in enumerate(s.trees):
        window, state = committed(s, i)
        for node in range(len(parents)):
            path = [start + j for j in path_to(parents, node)]
            outs, _, final = plain_decode(s.layer, window, state, [(s.x[t], s.b[t], s.a[t]) for t in path])
            assert torch.equal(out[start + node], outs[-1]), (i, node)
            assert torch.equal(s.ssm_state[s.slots[i, node]], final), (i, node)
        start += len(parents)


def test_tree_step_matches_the_torch_references(gdn_step):
    """The semantics, independently of vLLM's kernels: tree conv and tree delta rule twins (fp32 math)."""
    s = gdn_step
    out, _ = run_tree_step(s)
    weight = s.layer.conv1d.weight.view(-1, WIDTH)
    start = 0
    for i, (parents, _) in enumerate(s.trees):
        n = len(parents)
        window, state = committed(s, i)
        par = torch.from_numpy(parents)[None]
        conv = tree_causal_conv1d_reference(s.x[None, start:start + n].float(), par, window[None].float(),
                                            weight.float(), s.layer.conv1d.bias.float())  # [1, n, dim]
        q, k, v = (t.float() for t in s.layer.rearrange_mixed_qkv(conv[0]))  # [1, n, H, D]
        q, k = torch.nn.functional.normalize(q, dim=-1, eps=1e-6), torch.nn.functional.normalize(k, dim=-1, eps=1e-6)
        g = -s.layer.A_log.float().exp() * torch.nn.functional.softplus(s.a[start:start + n].float()
                                                                         + s.layer.dt_bias.float())
        beta = torch.sigmoid(s.b[start:start + n].float())
        o, states = tree_gated_delta_rule_reference(q, k, v, g[None], beta[None], par, state[None].float(),
                                                    HEAD_DIM ** -0.5)
        torch.testing.assert_close(out[start:start + n].float(), o[0], rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(s.ssm_state[s.slots[i, :n]].float(), states[0], rtol=2e-2, atol=2e-2)
        start += n


def test_after_the_commit_the_next_step_resumes_from_the_accepted_path(gdn_step):
    """Accept [0, j1, .., jk] per request, commit, then run a next step (a 3-node chain, vLLM's
    num_accepted = k + 1): it equals plain decoding of the accepted path followed by the new tokens."""
    s = gdn_step
    _, record = run_tree_step(s)
    accepted = []
    for parents, _ in s.trees:
        path = path_to(parents, len(parents) - 1)  # the path to the last node (moves nodes off their depth)
        accepted.append(path + [-1] * (SPEC + 1 - len(path)))
    accepted_path = torch.tensor(accepted)  # [Q, SPEC + 1]
    num_accepted = (accepted_path >= 0).sum(1) - 1  # drafts accepted
    commit_accepted_states([record], accepted_path, num_accepted)

    chain = (np.arange(3) - 1, np.arange(3))
    nxt = types.SimpleNamespace(**vars(s))  # the same tree form
    nxt.before = s.conv_buf.clone(), s.ssm_state.clone()
    nxt.num_accepted = (num_accepted + 1).tolist()
    nxt.plan, nxt.metadata, nxt.x, nxt.b, nxt.a = step_inputs(s.layer, [chain] * 3, nxt.num_accepted, s.slots, s.gen)
    out, _ = run_tree_step(nxt)
    for i in range(len(s.trees)):
        window, state = committed(s, i)
        first = sum(len(p) for p, _ in s.trees[:i])
        tokens = [(s.x[first + j], s.b[first + j], s.a[first + j]) for j in accepted[i] if j >= 0]
        tokens += [(nxt.x[3 * i + t], nxt.b[3 * i + t], nxt.a[3 * i + t]) for t in range(3)]
        outs, _, final = plain_decode(s.layer, window, state, tokens)
        assert torch.equal(out[3 * i:3 * i + 3], outs[-3:]), i
        assert torch.equal(s.ssm_state[s.slots[i, 2]], final), i


def test_a_steps_tree_index_is_built_once_and_shared_by_its_layers(monkeypatch):
    """Index tensors are built by the step's first linear layer and reused by the others (no per-layer
    host-to-device copies); another plan, conv width or set of sequences gets its own; a layout that is not the
    plan's is refused."""
    from ubtree_vllm.vllm.recurrent.nodes import tree_index

    monkeypatch.setattr(tree_forward_state(), "step_cache", {})
    plan = types.SimpleNamespace(num_nodes=np.array([3, 2]), parents=np.array([[-1, 0, 0], [-1, 0, -2]]),
                                 depth=np.array([[0, 1, 1], [0, 1, 0]]))
    req, lens, cpu = np.array([0, 1]), np.array([3, 2]), torch.device("cpu")
    index = tree_index(plan, req, lens, "GDN", WIDTH, cpu)
    assert tree_index(plan, req, lens, "GDN", WIDTH, cpu) is index
    assert index.window_rows.shape == (1 + 5, WIDTH - 1) and [len(d[0]) for d in index.depths] == [2, 3]
    assert tree_index(plan, req, lens, "GDN", 2, cpu) is not index
    assert tree_index(plan, req[1:], lens[1:], "GDN", WIDTH, cpu) is not index
    assert tree_index(types.SimpleNamespace(**vars(plan)), req, lens, "GDN", WIDTH, cpu) is not index
    with pytest.raises(RuntimeError, match=r"the GDN speculative sequences \(\[3, 1\] tokens\) are not the step's"):
        tree_index(plan, req, np.array([3, 1]), "GDN", WIDTH, cpu)


def test_tree_paths_are_the_root_to_leaf_chains_below_the_roots(monkeypatch):
    """KDA's chain launch (kda_cuda.chain_below_roots): one path per leaf, nodes from depth 1 down, the root in the
    last column of each node row; each token below a root read from its first occurrence; a root-only tree adds none."""
    from ubtree_vllm.vllm.recurrent.nodes import tree_index

    monkeypatch.setattr(tree_forward_state(), "step_cache", {})
    # tree 0: 0 -> {1, 2}, 1 -> {3, 4}, 3 -> 5 (leaves 2, 4, 5); tree 1: the root alone; tree 2: 0 -> 1
    parents = np.array([[-1, 0, 0, 1, 1, 3], [-1, -2, -2, -2, -2, -2], [-1, 0, -2, -2, -2, -2]])
    depth = np.array([[0, 1, 1, 2, 2, 3], [0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0]])
    plan = types.SimpleNamespace(num_nodes=np.array([6, 1, 2]), parents=parents, depth=depth)
    paths = tree_index(plan, np.arange(3), np.array([6, 1, 2]), "KDA", WIDTH, torch.device("cpu")).paths
    # token rows: tree 0 at 0..5, tree 1 at 6, tree 2 at 7..8
    assert paths.rows.tolist() == [2, 1, 4, 1, 3, 5, 8] and paths.cu_seqlens.tolist() == [0, 1, 3, 6, 7]
    assert paths.seq.tolist() == [0, 0, 0, 2]
    assert paths.nodes.tolist() == [[2, -1, -1, 0], [1, 4, -1, 0], [1, 3, 5, 0], [1, -1, -1, 0]]
    assert paths.below.tolist() == [1, 2, 3, 4, 5, 8] and paths.below_at.tolist() == [1, 0, 4, 2, 5, 6]


# --- engine settings: greedy equality runs in test_vllm_cpu_families.py --------------------------------


@pytest.fixture(scope="module")
def qwen3_next(vllm_models_dir):
    target = save_tiny_qwen3_next(vllm_models_dir / "tiny-qwen3-next")
    return target, save_untrained_drafter(target, vllm_models_dir / "tiny-qwen3-next-drafter")


def test_prefix_caching_is_refused_before_any_engine_exists(qwen3_next):
    """vLLM turns prefix caching on by default; for a GDN target it would commit chain state slots."""
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = qwen3_next
    args = EngineArgs(model=str(target), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
                      speculative_config={"method": "ubtree", "model": str(drafter), **TINY_TREE})
    with pytest.raises(ValueError, match=r"enable_prefix_caching must be False with method 'ubtree' for target "
                                         r"architecture 'Qwen3NextForCausalLM'"):
        args.create_engine_config()
