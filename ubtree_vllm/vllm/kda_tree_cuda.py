"""Kimi Delta Attention under tree verification on CUDA: the tree form of the speculative calls of Ling-3.0's KDA.

``BailingMoeV3KimiDeltaAttention._forward`` (``vllm/model_executor/models/bailing_moe_v3.py``) runs a KDA layer's
speculative rows through the module-level ``causal_conv1d_update`` (three short convs, q, k and v, each on its own
third of the layer's conv buffer) and ``fused_recurrent_kda_fwd`` (the recurrence), the only calls there passing
``num_accepted_tokens``, all treating a request's ``1 + S`` step tokens as a chain. During a UBTree step (patch
``cuda_kda_tree_forward``) the layer's speculative sequence i is the tree of plan request ``req[i]``
(:func:`~ubtree_vllm.vllm.gdn_tree_cuda.spec_sequences`), and:

* **convs**: each of the three is :func:`~ubtree_vllm.vllm.gdn_tree_cuda.tree_conv`, the Gated DeltaNet form (node
  j's window from its root path through vLLM's one-token conv; the buffer third rolled before the conv, which on
  CUDA writes its output over its input);
* **recurrence** (:func:`tree_recurrence`): per depth, each node's state slot j gets a copy of its parent's state
  (the root's: slot ``num_accepted - 1``) and ``fused_recurrent_kda`` -- the call plain decoding makes for its
  one-token decode rows -- advances it in place, one single-token sequence per node.

So every node computes what plain decoding computes for that token after its root path, with the same kernels. The
accepted path is committed by :func:`~ubtree_vllm.vllm.hybrid_state.commit_accepted_states` on the whole conv
buffer (the three thirds share its columns) and the recurrent states.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ubtree_vllm.vllm.gdn_tree_cuda import SpecSequences
from ubtree_vllm.vllm.hybrid_state import LinearStepLayer
from ubtree_vllm.vllm.linear_tree import fork_states_by_depth

# The three conv calls of a KDA layer's speculative rows (q, k, v), before its recurrence.
CONV_CALLS = 3


def tree_recurrence(seqs: SpecSequences, decode: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                    conv_buf: torch.Tensor, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, initial_state: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """[1, T, H, V] output of every node; node j's state ends in slot j, and ``seqs.record`` is the layer's commit
    record.

    q / k [1, T, H, K], v [1, T, H, V], g [1, T, H, K], beta [1, T, H]; initial_state [num_slots, H, V, K] (vLLM's
    view of the layer's recurrent states, mutated); conv_buf [num_slots, 3 * dim, state_len] the layer's whole conv
    buffer (for the commit); decode: vLLM's ``fused_recurrent_kda``, called as plain decoding calls it for a step of
    one-token decodes (``cu_seqlens = arange``, one state index per sequence, in place); kwargs: the speculative
    call's other arguments (``scale``, ``use_qk_l2norm_in_kernel`` kept; the chain's dropped)."""
    if seqs.conv_calls != CONV_CALLS:
        raise RuntimeError(f"ubtree: a KDA recurrence after {seqs.conv_calls} of its layer's {CONV_CALLS} conv calls "
                           "in a tree step")
    for chain_only in ("num_accepted_tokens", "cu_seqlens", "ssm_state_indices", "inplace_final_state"):
        kwargs.pop(chain_only, None)
    out = v.new_empty(v.shape)  # [1, T, H, V]
    for rows, dst in fork_states_by_depth(initial_state, seqs.slots, seqs.num_accepted, seqs.index):  # [n] each
        node_out, _ = decode(q=q[:, rows], k=k[:, rows], v=v[:, rows], g=g[:, rows], beta=beta[:, rows],
                             initial_state=initial_state, inplace_final_state=True,
                             cu_seqlens=torch.arange(len(rows) + 1, dtype=torch.int32, device=v.device),
                             ssm_state_indices=dst.to(torch.int32), **kwargs)
        out[:, rows] = node_out.to(out.dtype)
    seqs.record = LinearStepLayer(conv_buf=conv_buf, ssm_state=initial_state,
                                  req=torch.from_numpy(seqs.req).long().to(initial_state.device),
                                  slots=seqs.slots.clone(), node0_col=seqs.index.width - 2)
    return out
