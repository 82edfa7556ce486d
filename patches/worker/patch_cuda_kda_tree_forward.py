"""Serve the speculative tokens of vLLM's CUDA Kimi Delta Attention (Ling-3.0, BailingMoeV3) as the UBTree step's trees.

``BailingMoeV3KimiDeltaAttention._forward`` (``vllm.model_executor.models.bailing_moe_v3``) runs a layer's speculative
rows through the module-level ``causal_conv1d_update`` (q, k and v in turn) and ``fused_recurrent_kda_fwd``, the only
calls there that pass ``num_accepted_tokens``, treating each request's tokens as a chain. The patch:

* wraps ``_forward``: during a UBTree step's target forward
  (:attr:`ubtree_vllm.vllm.attention.state.TreeForwardState.step_plan`) it builds the layer's trees
  (:func:`ubtree_vllm.vllm.recurrent.gdn_cuda.spec_sequences`) before vLLM's code runs, and after it records the
  layer for the runner's commit; RuntimeError if the speculative rows did not reach the tree form;
* rebinds the two names, where ``_forward`` looks them up, to wrappers that run the tree forms
  (:func:`ubtree_vllm.vllm.recurrent.gdn_cuda.tree_conv`, :func:`ubtree_vllm.vllm.recurrent.kda_cuda.tree_recurrence`;
  the latter through the module's ``fused_recurrent_kda``, plain decoding's call, and vLLM's chain call) for the
  speculative calls of such a layer, and vLLM's functions for every other call (prefill and plain decode rows, other
  engines, dummy and profile runs), so vLLM still splits mixed batches.

The KDA op ``bailing_v3_kda_attention`` is one of vLLM's splitting ops, so under PIECEWISE graphs its host
bookkeeping runs eagerly between graph pieces. CUDA only.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import original_attr_name, replace_attr

NAME = "cuda_kda_tree_forward"


def apply() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        install()


def conv_buffer(layer: Any, dim_first: bool) -> Any:
    """[num_slots, 3 * dim, state_len] the layer's whole conv buffer, as ``_forward`` views it before its chunks."""
    conv_state = layer.kv_cache[0]
    return conv_state if dim_first else conv_state.transpose(-1, -2)


def install() -> None:
    """The replacements, on any platform (the CPU tests run vLLM's CUDA ``_forward`` through them)."""
    import vllm.model_executor.models.bailing_moe_v3 as bailing
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    from ubtree_vllm.vllm.recurrent import gdn_cuda, kda_cuda
    from ubtree_vllm.vllm.attention.state import tree_forward_state

    layer_cls = bailing.BailingMoeV3KimiDeltaAttention
    # The layer whose _forward is running, with its speculative sequences (at most one: layers run in turn).
    current: list[tuple[Any, gdn_cuda.SpecSequences]] = []

    def _forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        original = getattr(layer_cls, original_attr_name("_forward"))
        state = tree_forward_state()
        metadata = bailing.get_forward_context().attn_metadata
        seqs = None
        if state.step_plan is not None and isinstance(metadata, dict):
            seqs = gdn_cuda.spec_sequences(state.step_plan, metadata.get(self.prefix), self.conv_size, "KDA")
        if seqs is None:
            return original(self, *args, **kwargs)
        return gdn_cuda.forward_as_trees(lambda: original(self, *args, **kwargs), current, self, seqs, "KDA")

    def causal_conv1d_update(x: Any, conv_state: Any, weight: Any, bias: Any = None, activation: Any = None,
                             **kwargs: Any) -> Any:
        original = getattr(bailing, original_attr_name("causal_conv1d_update"))
        if not current or kwargs.get("num_accepted_tokens") is None:
            return original(x, conv_state, weight, bias, activation, **kwargs)
        return gdn_cuda.tree_conv(current[0][1], original, x, conv_state, weight, bias, activation,
                                  dim_first=is_conv_state_dim_first())

    def fused_recurrent_kda_fwd(*args: Any, **kwargs: Any) -> Any:
        original = getattr(bailing, original_attr_name("fused_recurrent_kda_fwd"))
        if args or not current or kwargs.get("num_accepted_tokens") is None:
            return original(*args, **kwargs)  # _forward's speculative call passes keywords only
        layer, seqs = current[0]
        out = kda_cuda.tree_recurrence(seqs, bailing.fused_recurrent_kda, original,
                                       conv_buffer(layer, is_conv_state_dim_first()), **kwargs)
        return out, kwargs["initial_state"]

    replace_attr(layer_cls, "_forward", _forward, NAME)
    replace_attr(bailing, "causal_conv1d_update", causal_conv1d_update, NAME)
    replace_attr(bailing, "fused_recurrent_kda_fwd", fused_recurrent_kda_fwd, NAME)
