"""Recurrent (Gated DeltaNet) state of a tree step: per-node state slots, and the commit of the accepted path.

vLLM gives every request of a speculative engine ``1 + S`` recurrent state slots per GDN layer
(``S = num_speculative_tokens``, ``MambaSpec.num_speculative_blocks``) and, per layer, one rolling
conv-input buffer ``[dim, width - 1 + S]`` in the first slot. What the next step reads, vLLM's chain
convention, is kept unchanged:

* it resumes the recurrence from slot ``num_accepted - 1`` (``num_accepted`` = accepted drafts + 1,
  set by vLLM's ``_update_states_after_model_execute`` from the sampler output);
* its conv window is the ``width - 1`` buffer columns from offset ``num_accepted - 1``.

So after a step, token ``t``'s state must be in slot ``t`` and its conv input in column
``width - 2 + t`` (behind the previous window's newest ``width - 2`` inputs). The tree forward
(:mod:`ubtree_vllm.vllm.recurrent.gdn_cpu`) puts node ``j``'s state in slot ``j`` and its input in column
``width - 2 + j``; :func:`commit_accepted_states` then moves the accepted path
``[0, j_1, ..., j_k]`` into chain order: slot ``j_d`` -> slot ``d`` and column ``width - 2 + j_d`` ->
``width - 2 + d`` for ``d = 1..k``. Each move reads its source before any write (one gather, then one
scatter), and needs no ordering anyway: path nodes strictly increase (parents first), so the source
of depth ``d' > d`` is ``j_d' > j_d >= d``, never a destination written before it. Rejected nodes'
slots are overwritten by later steps, as vLLM does with rejected chain tokens.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass
class LinearStepLayer:
    """Where one GDN layer left this step's per-node state (recorded by the tree forward)."""

    # [num_slots, dim, state_len] the layer's rolling conv-input buffers (a view of its kv_cache[0])
    conv_buf: torch.Tensor
    # [num_slots, ...] the layer's recurrent states, one per slot (a view of its kv_cache[1]; [H, Dk, Dv] on the CPU,
    # [HV, V, K] on CUDA)
    ssm_state: torch.Tensor
    # [Q] int64 request index (row of the step plan / AcceptResult) of each speculative sequence
    req: torch.Tensor
    # [Q, 1 + S] int64 state slot of node j of each sequence (column 0 also holds the conv buffer)
    slots: torch.Tensor
    # conv-buffer column of node 0's input after the step (width - 2)
    node0_col: int


def commit_accepted_states(layers: Iterable[LinearStepLayer], accepted_path: torch.Tensor,
                           num_accepted: torch.Tensor) -> None:
    """Move every sequence's accepted nodes to the state slots / conv columns of depths 1..k.

    accepted_path: [num_reqs, max_depth + 1] int64 node at each depth, -1 padded (AcceptResult);
    num_accepted:  [num_reqs] int64 accepted draft nodes (root excluded).
    """
    for layer in layers:
        path = accepted_path[layer.req, 1:]  # [Q, D]
        depth = torch.arange(1, path.shape[1] + 1, device=path.device).expand_as(path)  # [Q, D]
        moves = (depth <= num_accepted[layer.req, None]) & (path != depth)  # [Q, D]
        # SYNC: the moves are few and data-dependent; the V1 runner has synchronised on the step's output already
        if not bool(moves.any()):
            continue
        seq = torch.arange(path.shape[0], device=path.device)[:, None].expand_as(path)[moves]  # [M]
        src, dst = path[moves], depth[moves]  # [M] node indices
        states = layer.ssm_state.index_select(0, layer.slots[seq, src])  # [M, H, Dk, Dv], read before writing
        layer.ssm_state.index_copy_(0, layer.slots[seq, dst], states)
        buf_slot = layer.slots[seq, 0]  # [M]
        inputs = layer.conv_buf[buf_slot, :, layer.node0_col + src]  # [M, dim]
        layer.conv_buf[buf_slot, :, layer.node0_col + dst] = inputs
