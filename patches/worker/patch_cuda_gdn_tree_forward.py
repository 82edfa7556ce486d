"""Serve the speculative tokens of vLLM's CUDA Gated DeltaNet as the UBTree step's trees.

``QwenGatedDeltaNetAttention._forward_core`` (``vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn``) runs a
layer's speculative rows through the module-level ``causal_conv1d_update`` and
``fused_sigmoid_gating_delta_rule_update``, the only calls there that pass ``num_accepted_tokens``, treating each
request's tokens as a chain. The patch:

* wraps ``_forward_core``: during a UBTree step's target forward
  (:attr:`ubtree_vllm.vllm.attention.state.TreeForwardState.step_plan`) it builds the layer's trees
  (:func:`ubtree_vllm.vllm.recurrent.gdn_cuda.spec_sequences`) before vLLM's code runs, and after it records the
  layer for the runner's commit; RuntimeError if the speculative rows did not reach the tree form;
* rebinds the two names, where ``_forward_core`` looks them up, to wrappers that run the tree forms of
  :mod:`ubtree_vllm.vllm.recurrent.gdn_cuda` for the speculative calls of such a layer and vLLM's functions for every
  other call (prefill and plain decode rows, other engines, dummy and profile runs), so vLLM still splits mixed
  batches;
* turns off ``enable_fused_gdn_spec_decode`` on every layer it builds (vLLM's fused CUDA spec kernel never reaches
  ``_forward_core``; vLLM already leaves it off for Qwen3-Next's interleaved layout).

The GDN op must run outside CUDA graphs (its bookkeeping is host work per step): engines with a GDN target on
CUDA run PIECEWISE graphs, where ``qwen_gdn_attention_core`` is one of vLLM's splitting ops. CUDA only.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import original_attr_name, replace_attr

NAME = "cuda_gdn_tree_forward"


def apply() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        install()


def install() -> None:
    """The replacements, on any platform (the CPU tests run vLLM's CUDA ``_forward_core`` through them)."""
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from ubtree_vllm.vllm.recurrent import gdn_cuda
    from ubtree_vllm.vllm.attention.state import tree_forward_state

    layer_cls = gdn.QwenGatedDeltaNetAttention
    # The layer whose _forward_core is running, with its speculative sequences (at most one: layers run in turn).
    current: list[tuple[Any, gdn_cuda.SpecSequences]] = []

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        getattr(layer_cls, original_attr_name("__init__"))(self, *args, **kwargs)
        self.enable_fused_gdn_spec_decode = False

    def _forward_core(self: Any, mixed_qkv: Any, b: Any, a: Any, core_attn_out: Any) -> Any:
        original = getattr(layer_cls, original_attr_name("_forward_core"))
        state = tree_forward_state()
        metadata = gdn.get_forward_context().attn_metadata
        seqs = None
        if state.step_plan is not None and isinstance(metadata, dict):
            seqs = gdn_cuda.spec_sequences(state.step_plan, metadata.get(self.prefix), self.conv1d.weight.shape[-1])
        if seqs is None:
            return original(self, mixed_qkv, b, a, core_attn_out)
        if self.enable_packed_recurrent_decode:  # plain decoding's kernel for one-token decodes on this layer
            seqs.packed_decode = gdn.fused_recurrent_gated_delta_rule_packed_decode
        return gdn_cuda.forward_as_trees(lambda: original(self, mixed_qkv, b, a, core_attn_out), current, self, seqs,
                                         "GDN")

    def causal_conv1d_update(x: Any, conv_state: Any, weight: Any, bias: Any = None, activation: Any = None,
                             **kwargs: Any) -> Any:
        original = getattr(gdn, original_attr_name("causal_conv1d_update"))
        if not current or kwargs.get("num_accepted_tokens") is None:
            return original(x, conv_state, weight, bias, activation, **kwargs)
        return gdn_cuda.tree_conv(current[0][1], original, x, conv_state, weight, bias, activation,
                                  dim_first=is_conv_state_dim_first())

    def fused_sigmoid_gating_delta_rule_update(*args: Any, **kwargs: Any) -> Any:
        original = getattr(gdn, original_attr_name("fused_sigmoid_gating_delta_rule_update"))
        if args or not current or kwargs.get("num_accepted_tokens") is None:
            return original(*args, **kwargs)  # _forward_core's speculative call passes keywords only
        return gdn_cuda.tree_recurrence(current[0][1], original, **kwargs), kwargs["initial_state"]

    replace_attr(layer_cls, "__init__", __init__, NAME)
    replace_attr(layer_cls, "_forward_core", _forward_core, NAME)
    replace_attr(gdn, "causal_conv1d_update", causal_conv1d_update, NAME)
    replace_attr(gdn, "fused_sigmoid_gating_delta_rule_update", fused_sigmoid_gating_delta_rule_update, NAME)
