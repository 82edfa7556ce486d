"""Serve the speculative tokens of vLLM's CPU Gated DeltaNet as the UBTree step's trees.

``vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._cpu_gdn_attention_spec_aware`` runs the
speculative rows of a GDN layer through the module-level ``_spec_forward``, which treats each
request's tokens as a chain. The patch rebinds that name, where it is looked up, to a wrapper that
runs :func:`ubtree_vllm.vllm.recurrent.gdn_cpu.tree_spec_forward` while a UBTree step's target forward is in
flight (:attr:`ubtree_vllm.vllm.attention.state.TreeForwardState.step_plan`) and records the layer
for the runner's commit; every other call (other engines, dummy and profile runs) gets vLLM's
function unchanged.

CPU platform only: the GPU GDN path (``qwen_gdn_linear_attn._forward_core``, Triton) is not wired,
and Qwen3-Next is refused on CUDA at engine configuration.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import original_attr_name, replace_attr

NAME = "cpu_gdn_tree_forward"


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn_attention

    from ubtree_vllm.vllm.attention.state import tree_forward_state

    def _spec_forward(layer: Any, attn_metadata: Any, *args: Any) -> Any:
        state = tree_forward_state()
        if state.step_plan is None:
            return getattr(gdn_attention, original_attr_name("_spec_forward"))(layer, attn_metadata, *args)
        from ubtree_vllm.vllm.recurrent.gdn_cpu import tree_spec_forward

        out, record = tree_spec_forward(state.step_plan, layer, attn_metadata, *args)
        state.linear_stash[layer.prefix] = record
        return out

    replace_attr(gdn_attention, "_spec_forward", _spec_forward, NAME)
