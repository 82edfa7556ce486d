"""Gated DeltaNet under tree verification on CUDA: the tree form of the speculative calls in vLLM's ``_forward_core``.

``QwenGatedDeltaNetAttention._forward_core`` (``vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py``)
runs a GDN layer's speculative rows through two module-level calls, the only ones passing
``num_accepted_tokens``: ``causal_conv1d_update`` (the short conv) and ``fused_sigmoid_gating_delta_rule_update``
(the recurrence), both treating a request's ``1 + S`` step tokens as a chain. During a UBTree step (patch
``cuda_gdn_tree_forward``) the layer's speculative sequence i is the tree of plan request ``req[i]`` (node 0 the
root, parents first; :func:`spec_sequences`), and:

* **conv** (:func:`tree_conv`): node j's window is the ``width - 1`` inputs before it on its root path, reaching
  into the committed window for shallow nodes (:func:`~ubtree_vllm.vllm.recurrent.nodes.node_windows`), through the
  conv vLLM's plain decoding calls (``causal_conv1d_update``, one token per window); the conv buffer is
  rolled as on the CPU (:func:`~ubtree_vllm.vllm.recurrent.nodes.roll_conv_buffers`), before the conv, which on CUDA
  writes its output over its input;
* **recurrence** (:func:`tree_recurrence`): per depth, each node's state slot j gets a copy of its parent's state
  (the root's: slot ``num_accepted - 1``) and the kernel plain decoding runs for a step of one-token decodes
  advances it in place: ``fused_recurrent_gated_delta_rule_packed_decode`` on the packed conv output where the
  layer takes vLLM's packed decode path (``enable_packed_recurrent_decode``, vLLM's default,
  ``_forward_core_decode_non_spec``), else ``fused_sigmoid_gating_delta_rule_update`` with ``cu_seqlens = arange``
  and one state index per sequence (the decode part of vLLM's mixed batches).

So every node computes what plain decoding computes for that token after its root path, with the same kernels.
The trees' index tensors are built once per step and shared by its GDN layers
(:func:`~ubtree_vllm.vllm.recurrent.nodes.tree_index`). The conv and state moves are index operations on the
device; the bookkeeping is host numpy from the step plan and the metadata's host mask. The accepted path is
committed by :func:`~ubtree_vllm.vllm.recurrent.commit.commit_accepted_states`, as on the CPU.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ubtree_vllm.vllm.attention.state import tree_forward_state
from ubtree_vllm.vllm.recurrent.commit import LinearStepLayer
from ubtree_vllm.vllm.recurrent.nodes import (TreeIndex, fork_states_by_depth, node_windows, roll_conv_buffers,
                                              tree_index)
from ubtree_vllm.vllm.tree_plan import TreeStepPlan


@dataclass
class SpecSequences:
    """One GDN layer's speculative sequences in this step, as trees (built before its forward core runs)."""

    index: TreeIndex  # the trees' bookkeeping on the device (shared by the step's GDN layers)
    req: np.ndarray  # [Q] plan request index of each speculative sequence
    slots: torch.Tensor  # [Q, 1 + S] int64 state slot of node j (column 0 also holds the conv buffer), device
    num_accepted: torch.Tensor  # [Q] int64 the previous step's accepted count (drafts + 1), device
    # vLLM's fused_recurrent_gated_delta_rule_packed_decode where the layer decodes with it (else None)
    packed_decode: Callable[..., Any] | None = None
    conv_buf: torch.Tensor | None = None  # [num_slots, dim, state_len], set by the conv call for the commit record
    conv_calls: int = 0  # conv calls served so far (one per GDN layer; q, k and v for a KDA layer)
    record: LinearStepLayer | None = None  # the layer's commit record, set by the recurrence call

    def record_states(self, ssm_state: torch.Tensor, conv_buf: torch.Tensor) -> None:
        """Set :attr:`record`: node j's state in ``ssm_state`` slot j, its conv input in ``conv_buf`` column
        ``width - 2 + j`` (the recurrence call, after the step's nodes have run)."""
        self.record = LinearStepLayer(conv_buf=conv_buf, ssm_state=ssm_state,
                                      req=torch.from_numpy(self.req).long().to(ssm_state.device),
                                      slots=self.slots.clone(), node0_col=self.index.width - 2)


# The speculative recurrence call's arguments that describe the chain; a tree form passes its own.
CHAIN_ONLY_KWARGS = ("num_accepted_tokens", "cu_seqlens", "ssm_state_indices", "inplace_final_state")


def spec_sequences(plan: TreeStepPlan, attn_metadata: Any, width: int, family: str = "GDN") -> SpecSequences | None:
    """The layer's speculative sequences as the step's trees; None when the step has none.

    attn_metadata: the layer's ``GDNAttentionMetadata`` (Gated DeltaNet, and Kimi Delta Attention: ``family`` "KDA");
    width: the layer's conv width. Sequence i is the i-th request of the batch whose ``spec_sequence_masks_cpu`` entry
    is set (vLLM selects the speculative tokens in that order); RuntimeError when the metadata's token count is not
    the plan's (never computes on a wrong layout)."""
    if attn_metadata is None or attn_metadata.spec_sequence_masks is None:
        return None
    num_seqs = attn_metadata.num_spec_decodes
    req = attn_metadata.spec_sequence_masks_cpu.nonzero()[:num_seqs, 0].numpy()  # [Q]
    seq_lens = plan.num_nodes[req]  # [Q]
    if int(seq_lens.sum()) != attn_metadata.num_spec_decode_tokens:
        raise RuntimeError(f"ubtree: the {family} layer's {attn_metadata.num_spec_decode_tokens} speculative tokens "
                           f"are not the step's trees ({seq_lens.tolist()} nodes)")
    slots = attn_metadata.spec_state_indices_tensor[:num_seqs].long()  # [Q, 1 + S]
    num_accepted = attn_metadata.num_accepted_tokens[:num_seqs].long()  # [Q]
    return SpecSequences(index=tree_index(plan, req, seq_lens, family, width, slots.device), req=req, slots=slots,
                         num_accepted=num_accepted)


def forward_as_trees(run: Callable[[], Any], current: list[tuple[Any, SpecSequences]], layer: Any,
                     seqs: SpecSequences, family: str) -> Any:
    """``run()`` (vLLM's forward of ``layer``) with ``(layer, seqs)`` as the ``current`` entry, through which the
    patch's rebound names serve the layer's speculative calls as ``seqs``' trees; then the layer's commit record into
    the step's linear stash under ``layer.prefix``. RuntimeError when the speculative rows did not reach the tree form
    (the record is missing)."""
    current[:] = [(layer, seqs)]
    try:
        result = run()
    finally:
        current.clear()
    if seqs.record is None:
        raise RuntimeError(f"ubtree: the speculative rows of {family} layer {layer.prefix} did not reach the tree form")
    tree_forward_state().linear_stash[layer.prefix] = seqs.record
    return result


def tree_conv(seqs: SpecSequences, conv_update: Callable[..., torch.Tensor], x: torch.Tensor,
              conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: Any,
              dim_first: bool) -> torch.Tensor:
    """[T, dim] conv output of every node; rolls the conv buffers (mutated) and records them in ``seqs``.

    x [T, dim] the speculative tokens (vLLM's CUDA conv overwrites them with the output); conv_state [num_slots, dim,
    width - 1 + S] (vLLM's view of the layer's conv cache); weight [dim, width], the width ``seqs.index`` was built
    for; conv_update: vLLM's ``causal_conv1d_update``, called as plain decoding
    calls it (one single-token sequence per node, each on its own window in a scratch buffer whose row 0 is
    never read: index 0 is vLLM's null block)."""
    windows = node_windows(x, conv_state, seqs.slots, seqs.num_accepted, seqs.index, dim_first)
    # the roll reads the inputs before the conv: vLLM's CUDA conv writes its output over x
    roll_conv_buffers(x, conv_state, seqs.slots, seqs.num_accepted, seqs.index)
    seqs.conv_buf = conv_state
    seqs.conv_calls += 1
    indices = torch.arange(1, len(seqs.index.tokens.seq) + 1, dtype=torch.int32, device=x.device)  # [T]
    return conv_update(x, windows, weight, bias, activation, conv_state_indices=indices, validate_data=False)


def tree_recurrence(seqs: SpecSequences, recurrence: Callable[..., Any], *, A_log: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor, dt_bias: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    initial_state: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """[1, T, HV, V] output of every node; node j's state ends in slot j, and ``seqs.record`` is the layer's
    commit record.

    q / k [1, T, H, K], v [1, T, HV, V], a / b [T, HV]; initial_state [num_slots, HV, V, K] (mutated);
    recurrence: vLLM's ``fused_sigmoid_gating_delta_rule_update``; kwargs: the call's other arguments (chain-only
    ones dropped). Each depth's nodes advance one token each, in place, as plain decoding calls it."""
    if seqs.conv_buf is None:
        raise RuntimeError("ubtree: a GDN recurrence without its layer's conv call in a tree step")
    for chain_only in CHAIN_ONLY_KWARGS:
        kwargs.pop(chain_only, None)
    out = torch.empty_like(v)  # [1, T, HV, V]
    for rows, dst in fork_states_by_depth(initial_state, seqs.slots, seqs.num_accepted, seqs.index):  # [n] each
        if seqs.packed_decode is not None:  # the conv output packed again: [n, q | k | v], as rearrange split it
            mixed = torch.cat([t[0, rows].flatten(1) for t in (q, k, v)], dim=-1)
            node_out = out.new_empty(len(rows), 1, *out.shape[2:])  # [n, 1, HV, V]
            seqs.packed_decode(mixed_qkv=mixed, a=a[rows], b=b[rows], A_log=A_log, dt_bias=dt_bias,
                               scale=k.shape[-1] ** -0.5, initial_state=initial_state, out=node_out,
                               ssm_state_indices=dst.to(torch.int32), use_qk_l2norm_in_kernel=True)
            out[0, rows] = node_out[:, 0]
            continue
        node_out, _ = recurrence(
            A_log=A_log, a=a[rows], b=b[rows], dt_bias=dt_bias, q=q[:, rows], k=k[:, rows], v=v[:, rows],
            initial_state=initial_state, inplace_final_state=True,
            cu_seqlens=torch.arange(len(rows) + 1, dtype=torch.int32, device=v.device),
            ssm_state_indices=dst.to(torch.int32), **kwargs)
        out[:, rows] = node_out.to(out.dtype)
    seqs.record_states(initial_state, seqs.conv_buf)
    return out
