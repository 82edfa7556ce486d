"""Kimi Delta Attention under tree verification on CUDA: the tree form of the speculative calls of Ling-3.0's KDA.

``BailingMoeV3KimiDeltaAttention._forward`` (``vllm/model_executor/models/bailing_moe_v3.py``) runs a KDA layer's
speculative rows through the module-level ``causal_conv1d_update`` (three short convs, q, k and v, each on its own
third of the layer's conv buffer) and ``fused_recurrent_kda_fwd`` (the recurrence), the only calls there passing
``num_accepted_tokens``, all treating a request's ``1 + S`` step tokens as a chain. During a UBTree step (patch
``cuda_kda_tree_forward``) the layer's speculative sequence i is the tree of plan request ``req[i]``
(:func:`~ubtree_vllm.vllm.recurrent.gdn_cuda.spec_sequences`), and:

* **convs**: each of the three is :func:`~ubtree_vllm.vllm.recurrent.gdn_cuda.tree_conv`, the Gated DeltaNet form (node
  j's window from its root path through vLLM's one-token conv; the buffer third rolled before the conv, which on
  CUDA writes its output over its input);
* **recurrence** (:func:`tree_recurrence`): each root's slot gets the state its sequence resumes from (slot
  ``num_accepted - 1``) and ``fused_recurrent_kda`` -- the call plain decoding makes for its one-token decode rows --
  advances the roots in place; then every root -> leaf path runs as one sequence of a single launch of the same
  kernel over chains (bit for bit plain decoding's per-token store and reload of the fp32 state), writing each node's
  state to its slot (:func:`chain_below_roots`); two launches per layer instead of two per depth.

So every node computes what plain decoding computes for that token after its root path, with the same kernels. The
accepted path is committed by :func:`~ubtree_vllm.vllm.recurrent.commit.commit_accepted_states` on the whole conv
buffer (the three thirds share its columns) and the recurrent states.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ubtree_vllm.vllm.recurrent.gdn_cuda import CHAIN_ONLY_KWARGS, SpecSequences
from ubtree_vllm.vllm.recurrent.nodes import fork_states_by_depth

# The three conv calls of a KDA layer's speculative rows (q, k, v), before its recurrence.
CONV_CALLS = 3


def tree_recurrence(seqs: SpecSequences, decode: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                    chain: Callable[..., tuple[torch.Tensor, torch.Tensor]], conv_buf: torch.Tensor, *,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    initial_state: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """[1, T, H, V] output of every node; node j's state ends in slot j, and ``seqs.record`` is the layer's commit
    record.

    q / k [1, T, H, K], v [1, T, H, V], g [1, T, H, K], beta [1, T, H]; initial_state [num_slots, H, V, K] (vLLM's
    view of the layer's recurrent states, mutated); conv_buf [num_slots, 3 * dim, state_len] the layer's whole conv
    buffer (for the commit); decode: vLLM's ``fused_recurrent_kda``, called as plain decoding calls it for a step of
    one-token decodes (``cu_seqlens = arange``, one state index per sequence, in place); chain: vLLM's
    ``fused_recurrent_kda_fwd``, the same kernel over chains (what vLLM's speculative call runs); kwargs: the
    speculative call's other arguments (``scale``, ``use_qk_l2norm_in_kernel`` kept; the chain's dropped).

    Roots: each root's slot gets the state its sequence resumes from, and ``decode`` advances them in place. Below
    them, with fp32 states (vLLM's default for KDA), every root -> leaf path is one sequence of a single ``chain``
    launch: the kernel keeps a chain's state in fp32 registers between tokens, which is plain decoding's
    store-and-reload of an fp32 state to the bit, so each node computes what plain decoding computes after its root
    path; each path starts from its root's slot (read before the launch writes anything: no path writes a root) and
    writes its nodes' slots (shared ancestors are written by every path through them, with the same bits). Other
    state dtypes go depth by depth with ``decode`` (a chain would skip the rounding between tokens)."""
    if seqs.conv_calls != CONV_CALLS:
        raise RuntimeError(f"ubtree: a KDA recurrence after {seqs.conv_calls} of its layer's {CONV_CALLS} conv calls "
                           "in a tree step")
    for chain_only in CHAIN_ONLY_KWARGS:
        kwargs.pop(chain_only, None)
    out = v.new_empty(v.shape)  # [1, T, H, V]
    by_depth = fork_states_by_depth(initial_state, seqs.slots, seqs.num_accepted, seqs.index)
    for depth, (rows, dst) in enumerate(by_depth):  # [n] each
        node_out, _ = decode(q=q[:, rows], k=k[:, rows], v=v[:, rows], g=g[:, rows], beta=beta[:, rows],
                             initial_state=initial_state, inplace_final_state=True,
                             cu_seqlens=torch.arange(len(rows) + 1, dtype=torch.int32, device=v.device),
                             ssm_state_indices=dst.to(torch.int32), **kwargs)
        out[:, rows] = node_out.to(out.dtype)
        if depth == 0 and initial_state.dtype == torch.float32:
            chain_below_roots(seqs, chain, q, k, v, g, beta, initial_state, out, kwargs)
            break
    seqs.record_states(initial_state, conv_buf)
    return out


def chain_below_roots(seqs: SpecSequences, chain: Callable[..., tuple[torch.Tensor, torch.Tensor]], q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor, out: torch.Tensor, kwargs: dict[str, Any]) -> None:
    """Every node below the roots, one ``chain`` launch over the root -> leaf paths (:class:`TreePaths`): path i's
    state index row holds its nodes' slots, then its root's slot in the last column, where the chain reads its
    initial state (``num_accepted_tokens`` = the row width); ``out`` [1, T, H, V] gets each node's output."""
    paths = seqs.index.paths
    if len(paths.rows) == 0:
        return
    slots = seqs.slots[paths.seq[:, None], paths.nodes.clamp(min=0)]  # [P, W]
    indices = torch.where(paths.nodes >= 0, slots, 0).to(torch.int32)  # unused columns: vLLM's null block
    num_accepted = torch.full((indices.shape[0],), indices.shape[1], dtype=torch.int32, device=indices.device)
    rows = paths.rows
    path_out, _ = chain(q=q[:, rows], k=k[:, rows], v=v[:, rows], g=g[:, rows], beta=beta[:, rows],
                        initial_state=initial_state, inplace_final_state=True, cu_seqlens=paths.cu_seqlens,
                        ssm_state_indices=indices, num_accepted_tokens=num_accepted, **kwargs)
    out[:, paths.below] = path_out[:, paths.below_at].to(out.dtype)
