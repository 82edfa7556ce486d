"""Mamba2 (vLLM's ``MambaMixer2``, e.g. NemotronH) under tree verification: the decode calls' tree form.

``MambaMixer2.forward_impl`` runs its decode requests through two module-level calls, ``causal_conv1d_update``
(the short conv) and ``selective_state_update`` (the SSM step), both treating a request's ``1 + S`` step tokens
as a chain (vLLM's CPU conv even ignores ``num_accepted_tokens``). During a UBTree step (patch
``mamba2_tree_decode``) decode request i is the tree of plan request i (vLLM puts decodes first, in batch
order; checked against the plan) and:

* **conv** (:func:`tree_conv_update`): node j's window is the ``width - 1`` inputs before it on its root path,
  reaching into the committed window for shallow nodes (:func:`~ubtree_vllm.vllm.recurrent.nodes.node_windows`),
  through the conv vLLM's plain decoding runs, one token per window; the buffer is then rolled as for Gated
  DeltaNet (:func:`~ubtree_vllm.vllm.recurrent.nodes.roll_conv_buffers`);
* **SSM** (:func:`tree_state_update`): per depth, each node's state slot j gets a copy of its parent's state (the
  root's: slot ``num_accepted - 1``) and vLLM's one-token ``selective_state_update`` advances it in place.

So every node computes what plain decoding computes for that token after its root path, with the same kernels
on the same inputs: vLLM's CPU ops on the CPU, its Triton conv and SSM update on CUDA (opt-in,
``UBTREE_CUDA_HYBRIDS=1``; the conv buffer is rolled before the conv, which on CUDA writes its output over its
input). The conv call leaves its half of the layer's commit record in :class:`PendingConv`; the SSM call, which
follows it in the same layer, completes it (:class:`~ubtree_vllm.vllm.recurrent.commit.LinearStepLayer`, committed
by the runner like a GDN layer's).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ubtree_vllm.vllm.recurrent.commit import LinearStepLayer
from ubtree_vllm.vllm.recurrent.nodes import (TreeIndex, fork_states_by_depth, node_windows, roll_conv_buffers,
                                              tree_index)
from ubtree_vllm.vllm.tree_plan import TreeStepPlan


@dataclass
class PendingConv:
    """What a layer's conv call leaves for its SSM call: the conv buffers and the step's tree bookkeeping."""

    conv_buf: torch.Tensor  # [num_slots, dim, state_len] (a view of the layer's conv cache)
    slots: torch.Tensor  # [Q, 1 + S] int64
    num_accepted: torch.Tensor  # [Q] int64
    index: TreeIndex


def tree_conv_update(plan: TreeStepPlan, conv_update: Callable[..., torch.Tensor], x: torch.Tensor,
                     conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: Any,
                     conv_state_indices: torch.Tensor, num_accepted_tokens: torch.Tensor,
                     query_start_loc: torch.Tensor, dim_first: bool) -> tuple[torch.Tensor, PendingConv]:
    """[T, dim] conv output of every node of the decode requests' trees, and the layer's pending record.

    x [T, dim] the decode tokens; conv_state [num_slots, dim, width - 1 + S] (mutated: the roll);
    weight [dim, width]; conv_state_indices [Q, 1 + S]; num_accepted_tokens [Q]; query_start_loc [Q + 1];
    conv_update: vLLM's conv as plain decoding calls it (one token per window)."""
    num_seqs = conv_state_indices.shape[0]
    slots = conv_state_indices.long()
    num_accepted = num_accepted_tokens[:num_seqs].long()
    # each sequence's tokens, checked against the plan's trees (tree_index) where reading them is free (the CPU);
    # on CUDA that would be a host read per layer, so there only their total is checked
    seq_lens = (query_start_loc[:num_seqs + 1].diff().numpy() if query_start_loc.is_cpu
                else plan.num_nodes[:num_seqs])
    if int(seq_lens.sum()) != x.shape[0]:
        raise RuntimeError(f"ubtree: the Mamba2 layer's {x.shape[0]} decode tokens are not the step's trees "
                           f"({seq_lens.tolist()} nodes)")
    index = tree_index(plan, np.arange(num_seqs), seq_lens, "Mamba2", weight.shape[-1], conv_state.device)
    windows = node_windows(x, conv_state, slots, num_accepted, index, dim_first)  # [1 + T, dim, width - 1]
    roll_conv_buffers(x, conv_state, slots, num_accepted, index)  # from the inputs, before any conv output
    indices = torch.arange(1, len(index.tokens.seq) + 1, dtype=conv_state_indices.dtype, device=x.device)  # [T]
    out = conv_update(x, windows, weight, bias, activation, conv_state_indices=indices)
    return out, PendingConv(conv_buf=conv_state, slots=slots, num_accepted=num_accepted, index=index)


def tree_state_update(pending: PendingConv, state_update: Callable[..., Any], state: torch.Tensor, x: torch.Tensor,
                      dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, out: torch.Tensor,
                      index_dtype: torch.dtype, **kwargs: Any) -> LinearStepLayer:
    """Advance every node's SSM state from its parent's and write its output; returns the layer's commit record.

    state [num_slots, H, head_dim, N] (mutated: node j's state in slot j); x / dt [T, H, head_dim];
    B / C [T, groups, N]; out [T, H, head_dim] (written); kwargs: the call's other arguments (D, z, dt_bias,
    dt_softplus, ...) for vLLM's ``selective_state_update`` (``state_update``), which each depth's nodes go
    through one token each, as plain decoding calls it."""
    slots = pending.slots
    z = kwargs.pop("z", None)
    # [n] tokens of a depth, their slots
    for rows, dst in fork_states_by_depth(state, slots, pending.num_accepted, pending.index):
        node_out = torch.empty_like(out[rows])  # [n, H, head_dim]
        indices = dst.to(index_dtype)[:, None]  # [n, 1]: one token per node, as in plain decoding
        state_update(state, x[rows], dt[rows], A, B[rows], C[rows], z=None if z is None else z[rows],
                     state_batch_indices=indices, dst_state_batch_indices=indices, out=node_out, **kwargs)
        out[rows] = node_out
    return LinearStepLayer(conv_buf=pending.conv_buf, ssm_state=state,
                           req=torch.arange(slots.shape[0], dtype=torch.int64, device=slots.device),
                           slots=slots.clone(),
                           node0_col=pending.index.width - 2)
