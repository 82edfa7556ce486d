"""Gated DeltaNet under tree verification on the CPU: the tree form of vLLM's speculative GDN forward.

Replaces ``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._spec_forward`` for the steps of
the UBTree V1 runner (patch ``cpu_gdn_tree_forward``). vLLM's version treats a request's
``1 + s`` step tokens as a chain; here they are the step's tree (node 0 the root, parents first,
:mod:`ubtree_vllm.vllm.tree_plan`). Per GDN layer and speculative sequence:

* **conv**: node j's window is the ``width - 1`` inputs before it on its root path, reaching
  into the committed window (the ``width - 1`` buffer columns at offset ``num_accepted - 1``) for
  nodes shallower than ``width - 1``; the buffer then holds that window's newest ``width - 2``
  inputs followed by the step's (node j's in column ``width - 2 + j``). vLLM's roll keeps
  ``state_len - q`` columns instead, which is the same for ``q = 1 + S`` step tokens only: with
  fewer (a short tree, a zero-draft row) it misplaces the next window, and fails with a size
  mismatch when the previous step accepted more tokens than this one has;
* **recurrence**: node j starts from its parent's state (the root from slot ``num_accepted - 1``)
  and its state is written to slot j.

Both run through the kernels vLLM's *non-speculative* CPU decode uses for one token
(the conv update on a per-node window -- vLLM's C++ kernel on its packed weights where vLLM packed them,
ARM bf16 or AVX-512 BF16, else ``causal_conv1d_update_cpu`` -- and ``fused_sigmoid_gating_delta_rule_update_cpu``
on the nodes of one depth at a time, each in its own slot after a copy of its parent's state), so
every node computes what plain decoding computes for that token after its root path, to the bit,
given the same layer inputs (vLLM's chain kernel keeps the state unrounded between tokens and
does not). The pure-torch twins (``triton_ops/reference.py``) are the test oracle.
Chains are trees, so every UBTree step takes this path; the commit of the accepted path is
:func:`ubtree_vllm.vllm.recurrent.commit.commit_accepted_states`.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _causal_conv1d_update_cpu, _unpacked_conv_weight

from ubtree_vllm.vllm.recurrent.commit import LinearStepLayer
from ubtree_vllm.vllm.recurrent.nodes import (TreeIndex, fork_states_by_depth, node_windows, roll_conv_buffers,
                                              tree_index)
from ubtree_vllm.vllm.tree_plan import TreeStepPlan


def tree_spec_forward(plan: TreeStepPlan, layer: Any, attn_metadata: Any, mixed_qkv_spec: torch.Tensor,
                      b_spec: torch.Tensor, a_spec: torch.Tensor, conv_buf: torch.Tensor, ssm_state: torch.Tensor,
                      width: int, state_len: int) -> tuple[torch.Tensor, LinearStepLayer]:
    """Core GDN output of the step's speculative tokens, and where their states went (for the commit).

    Same arguments as vLLM's ``_spec_forward``: mixed_qkv_spec [T, dim], b_spec / a_spec [T, H] the
    speculative sequences' tokens in ``spec_query_start_loc`` order; conv_buf [num_slots, dim,
    state_len] and ssm_state [num_slots, H, Dk, Dv] views of the layer's cache (mutated).
    Returns ([T, H, Dv] output, the layer's :class:`LinearStepLayer`).
    """
    num_seqs = attn_metadata.num_spec_decodes
    slots = attn_metadata.spec_state_indices_tensor[:num_seqs].long()  # [Q, 1 + S]
    num_accepted = attn_metadata.num_accepted_tokens[:num_seqs].long()  # [Q]
    seq_lens = attn_metadata.spec_query_start_loc[:num_seqs + 1].diff().numpy()  # [Q]
    req = attn_metadata.spec_sequence_masks_cpu.nonzero()[:num_seqs, 0].numpy()  # [Q] plan request index
    index = tree_index(plan, req, seq_lens, "GDN", width, conv_buf.device)

    conv_out = _tree_conv(layer, mixed_qkv_spec, conv_buf, slots, num_accepted, index)
    roll_conv_buffers(mixed_qkv_spec, conv_buf, slots, num_accepted, index)
    query, key, value = layer.rearrange_mixed_qkv(conv_out)  # each [1, T, H, D]
    out = torch.empty(value.shape[1:], dtype=mixed_qkv_spec.dtype)  # [T, H, Dv]
    for rows, dst in fork_states_by_depth(ssm_state, slots, num_accepted, index):  # [n] tokens of a depth, slots
        o = ops.fused_sigmoid_gating_delta_rule_update_cpu(
            A_log=layer.A_log, dt_bias=layer.dt_bias, q=query[:, rows], k=key[:, rows], v=value[:, rows],
            a=a_spec[rows].contiguous(), b=b_spec[rows].contiguous(), initial_state_source=ssm_state,
            initial_state_indices=dst.to(torch.int32), cu_seqlens=torch.arange(len(rows) + 1, dtype=torch.int32),
            use_qk_l2norm_in_kernel=True)
        out[rows] = o.reshape(len(rows), *out.shape[1:])
    record = LinearStepLayer(conv_buf=conv_buf, ssm_state=ssm_state, req=torch.from_numpy(req).long(),
                             slots=slots.clone(), node0_col=width - 2)
    return out, record


def _tree_conv(layer: Any, x: torch.Tensor, conv_buf: torch.Tensor, slots: torch.Tensor, num_accepted: torch.Tensor,
               index: TreeIndex) -> torch.Tensor:
    """[T, dim] conv output of every node: vLLM's one-token conv update on the node's own window
    (:func:`~ubtree_vllm.vllm.recurrent.nodes.node_windows`)."""
    packed = weights_packed(layer)  # the kernel plain decoding runs on this CPU (_cpu_gdn_attention_nonspec)
    windows = node_windows(x, conv_buf, slots, num_accepted, index, dim_first=packed and is_conv_state_dim_first())
    indices = torch.arange(1, len(index.tokens.seq) + 1, dtype=torch.int32)
    if packed:
        return _causal_conv1d_update_cpu(x=x, conv_states=windows, weight=layer.conv1d.weight, bias=layer.conv1d.bias,
                                         silu_activation=layer.activation == "silu", conv_state_indices=indices,
                                         is_weight_packed=True)
    return causal_conv1d_update_cpu(x=x, conv_state=windows, weight=_unpacked_conv_weight(layer),
                                    bias=layer.conv1d.bias, activation=layer.activation, conv_state_indices=indices)


def weights_packed(layer: Any) -> bool:
    """Whether vLLM packed the layer's conv weights for its C++ conv (it keeps the plain copy beside them, and
    plain decoding then runs that kernel: ARM bf16 or AVX-512 BF16 CPUs)."""
    return getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None) is not None
