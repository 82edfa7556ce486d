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
:func:`ubtree_vllm.vllm.hybrid_state.commit_accepted_states`.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm import _custom_ops as ops
from vllm.model_executor.layers.mamba.ops.cpu.causal_conv1d import causal_conv1d_update_cpu
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _causal_conv1d_update_cpu, _unpacked_conv_weight

from ubtree_vllm.vllm.hybrid_state import LinearStepLayer
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
    if not np.array_equal(plan.num_nodes[req], seq_lens):
        raise RuntimeError(f"ubtree: the GDN speculative sequences ({seq_lens.tolist()} tokens) are not the step's "
                           f"trees ({plan.num_nodes[req].tolist()} nodes)")
    seq = np.repeat(np.arange(num_seqs), seq_lens)  # [T] sequence of each token
    start = np.cumsum(seq_lens) - seq_lens  # [Q] first token of each sequence
    node = np.arange(len(seq)) - start[seq]  # [T] node index within its tree
    parent = plan.parents[req[seq], node]  # [T] parent node, -1 at the root
    depth = plan.depth[req[seq], node]  # [T]

    conv_out = _tree_conv(layer, mixed_qkv_spec, conv_buf, slots, num_accepted, seq, start, parent, depth, width)
    for i in range(num_seqs):  # roll: the window's newest width - 2 inputs, then node j's input in column width - 2 + j
        buf = conv_buf[slots[i, 0]]  # [dim, state_len]
        offset, first, n = int(num_accepted[i]) - 1, int(start[i]), int(seq_lens[i])
        buf[:, :width - 2 + n] = torch.cat([buf[:, offset + 1:offset + width - 1],
                                            mixed_qkv_spec[first:first + n].T.to(buf.dtype)], dim=-1)
    query, key, value = layer.rearrange_mixed_qkv(conv_out)  # each [1, T, H, D]
    out = torch.empty(value.shape[1:], dtype=mixed_qkv_spec.dtype)  # [T, H, Dv]
    seq_t, node_t, parent_t = (torch.from_numpy(a).long() for a in (seq, node, parent))
    for d in range(int(depth.max()) + 1):
        rows = torch.from_numpy(np.nonzero(depth == d)[0])  # [n] tokens at depth d
        dst = slots[seq_t[rows], node_t[rows]]  # [n] each node's own slot
        src = torch.where(parent_t[rows] < 0, slots[seq_t[rows], num_accepted[seq_t[rows]] - 1],
                          slots[seq_t[rows], parent_t[rows].clamp(min=0)])  # [n] parent's (root: resumed) slot
        ssm_state.index_copy_(0, dst, ssm_state.index_select(0, src))
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
               seq: np.ndarray, start: np.ndarray, parent: np.ndarray, depth: np.ndarray, width: int) -> torch.Tensor:
    """[T, dim] conv output of every node: vLLM's one-token conv update on the node's own window.

    Window of token t (oldest first): for distance m = width - 1 .. 1 before t, its ancestor at
    distance m if m <= depth[t], else column ``width - 1 - (m - depth[t])`` of its sequence's
    committed window. x [T, dim]; seq / parent / depth [T] (host); start [Q] first token per sequence.
    """
    num_seqs, hist = slots.shape[0], width - 1
    # [Q * (width - 1) + T, dim]: the committed windows (read before the roll), then the step's inputs
    offsets = (num_accepted - 1)[:, None] + torch.arange(hist)  # [Q, width - 1]
    committed = conv_buf[slots[:, 0, None], :, offsets]  # [Q, width - 1, dim]
    source = torch.cat([committed.reshape(num_seqs * hist, -1), x.to(conv_buf.dtype)])
    index = np.empty((len(seq), hist), dtype=np.int64)  # [T, width - 1] rows of `source`
    parent_token = np.where(parent >= 0, start[seq] + parent, -1)  # [T]
    ancestor = parent_token  # [T] token at distance m before each token, -1 past the root
    for m in range(1, width):
        index[:, hist - m] = np.where(m <= depth, num_seqs * hist + ancestor, seq * hist + hist - (m - depth))
        ancestor = np.where(ancestor >= 0, parent_token[np.maximum(ancestor, 0)], -1)
    # [1 + T, dim, width - 1] in the layout of vLLM's conv cache (dim-contiguous, or width-contiguous under the
    # "DS" layout): window t in row 1 + t, because the kernels skip row 0 (vLLM's null block, NULL_BLOCK_ID)
    windows = source[torch.from_numpy(np.concatenate([index[:1], index]))].transpose(1, 2)
    indices = torch.arange(1, len(seq) + 1, dtype=torch.int32)
    if weights_packed(layer):  # the kernel plain decoding runs on this CPU (gdn_attention._cpu_gdn_attention_nonspec)
        if is_conv_state_dim_first():
            windows = windows.contiguous()
        return _causal_conv1d_update_cpu(x=x, conv_states=windows, weight=layer.conv1d.weight, bias=layer.conv1d.bias,
                                         silu_activation=layer.activation == "silu", conv_state_indices=indices,
                                         is_weight_packed=True)
    return causal_conv1d_update_cpu(x=x, conv_state=windows, weight=_unpacked_conv_weight(layer),
                                    bias=layer.conv1d.bias, activation=layer.activation, conv_state_indices=indices)


def weights_packed(layer: Any) -> bool:
    """Whether vLLM packed the layer's conv weights for its C++ conv (it keeps the plain copy beside them, and
    plain decoding then runs that kernel: ARM bf16 or AVX-512 BF16 CPUs)."""
    return getattr(layer.conv1d, "_cpu_unpacked_conv_weight", None) is not None
