"""Serve the decode tokens of vLLM's Mamba2 mixer as the UBTree step's trees (CPU, and CUDA for opted-in targets).

``vllm.model_executor.layers.mamba.mamba_mixer2`` runs the decode requests of every ``MambaMixer2`` layer
through its module-level ``causal_conv1d_update`` and ``selective_state_update``, which treat each request's
tokens as a chain. The patch rebinds both names, where the mixer looks them up, to wrappers that run the tree
forms of :mod:`ubtree_vllm.vllm.recurrent.mamba2` while a UBTree step's target forward is in flight
(:attr:`ubtree_vllm.vllm.attention.state.TreeForwardState.step_plan`): the conv call leaves the layer's pending
record, the SSM call that follows it completes the record for the runner's commit. Every other call (other
engines, dummy and profile runs) gets vLLM's functions unchanged.

On CUDA the same two names are vLLM's Triton conv and SSM update (the tree forms index on the device and read no
device tensor back); Mamba2 targets run there only with ``UBTREE_CUDA_HYBRIDS=1``, PIECEWISE graphs (the mixer op is
one of vLLM's splitting ops) and without ReplaySSM, whose decode calls are others (engine configuration).
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import original_attr_name, replace_attr

NAME = "mamba2_tree_decode"


def apply() -> None:
    from vllm.platforms import current_platform

    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        return
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from ubtree_vllm.vllm.attention.state import tree_forward_state

    # The conv call of a layer, waiting for that layer's SSM call (the mixer makes them in this order).
    pending: list[Any] = []

    def causal_conv1d_update(x: Any, conv_state: Any, weight: Any, bias: Any = None, activation: Any = None,
                             **kwargs: Any) -> Any:
        original = getattr(mixer, original_attr_name("causal_conv1d_update"))
        state = tree_forward_state()
        if state.step_plan is None:
            return original(x, conv_state, weight, bias, activation, **kwargs)
        from ubtree_vllm.vllm.recurrent.mamba2 import tree_conv_update

        out, record = tree_conv_update(
            state.step_plan, original, x, conv_state, weight, bias, activation,
            conv_state_indices=kwargs["conv_state_indices"], num_accepted_tokens=kwargs["num_accepted_tokens"],
            query_start_loc=kwargs["query_start_loc"], dim_first=is_conv_state_dim_first())
        pending[:] = [record]
        return out

    def selective_state_update(ssm_state: Any, x: Any, dt: Any, A: Any, B: Any, C: Any, D: Any, dt_bias: Any,
                               **kwargs: Any) -> Any:
        original = getattr(mixer, original_attr_name("selective_state_update"))
        state = tree_forward_state()
        if state.step_plan is None:
            return original(ssm_state, x, dt, A, B, C, D, dt_bias, **kwargs)
        if not pending:
            raise RuntimeError("ubtree: a Mamba2 state update without its layer's conv call in a tree step")
        from ubtree_vllm.vllm.recurrent.mamba2 import tree_state_update

        indices = kwargs.pop("state_batch_indices")
        for chain_only in ("dst_state_batch_indices", "num_accepted_tokens", "cu_seqlens"):
            kwargs.pop(chain_only, None)
        record = tree_state_update(pending.pop(), original, ssm_state, x, dt, A, B, C, kwargs.pop("out"),
                                   indices.dtype, D=D, dt_bias=dt_bias, **kwargs)
        state.linear_stash[f"mamba2:{ssm_state.data_ptr()}"] = record

    replace_attr(mixer, "causal_conv1d_update", causal_conv1d_update, NAME)
    replace_attr(mixer, "selective_state_update", selective_state_update, NAME)
