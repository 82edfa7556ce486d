"""What a tree budget costs a hybrid target in recurrent-state memory, and the largest budget that fits.

Tree verification of a hybrid target (the tree forms of ``ubtree_vllm/vllm/recurrent/``) gives every node of a B-node
tree its own state slot: vLLM allocates ``1 + num_speculative_tokens`` slots per request and linear layer
(``MambaSpec.num_speculative_blocks``; the committed state plus one per node), each a whole recurrent state
(conv window and SSM / delta-rule state, ``MambaSpec.page_size_bytes``). That cost grows linearly in B and is
paid by every request, whatever its length. vLLM checks at start that one request of ``max_model_len`` fits
the KV cache memory and, when it does not, suggests a shorter ``max_model_len``; for a hybrid under UBTree the
budget is the other knob, so :func:`explain_budget_that_does_not_fit` names the largest one that fits.

The budget sizes more than the slot count: a linear layer's conv state holds ``conv_kernel - 1 + B`` columns, and
on a hybrid target vLLM aligns the attention block size and pads the state page to the larger of the two pages
(``Platform.update_block_size_for_backend``, run by the executor after the model loads). So the layer specs of a
smaller budget are rebuilt where the layers are, by :class:`HybridBudgetRPC` on each worker, not derived from the
configured budget's specs.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

MIB = 1 << 20


@dataclasses.dataclass(frozen=True)
class RecurrentStateCost:
    """Per request, on one worker: ``layers`` linear layers, ``slot_bytes`` for one slot of each, together."""

    layers: int
    slot_bytes: int  # one state slot of every linear layer, summed

    def per_request_bytes(self, budget: int) -> int:
        return (1 + budget) * self.slot_bytes

    def describe(self, budget: int) -> str:
        return (f"1 + B = {1 + budget} recurrent-state slots per request in each of {self.layers} linear layers: "
                f"{self.per_request_bytes(budget) / MIB:.1f} MiB per request at B = {budget} "
                f"({self.slot_bytes / MIB:.2f} MiB per slot of all layers)")


def recurrent_state_cost(kv_cache_spec: Mapping[str, Any]) -> RecurrentStateCost | None:
    """The cost of one worker's layer specs (vLLM's ``{layer name: KVCacheSpec}``); None without linear layers."""
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = [spec for spec in kv_cache_spec.values() if isinstance(spec, MambaSpec)]
    if not mamba:
        return None
    return RecurrentStateCost(layers=len(mamba), slot_bytes=sum(spec.page_size_bytes for spec in mamba))


class HybridBudgetRPC:
    """Worker mixin: ``collective_rpc("ubtree_kv_cache_spec_at_budget", args=(B',))`` returns this worker's layer
    specs as they would be had the engine been configured with ``num_speculative_tokens = B'``.

    It replays what vLLM does between loading the model and reading the specs, at B': the recurrent layers'
    ``num_spec`` (their state shapes), the block-size alignment from the cache settings as they were before it
    (kept by :meth:`load_model`), then the worker's own ``get_kv_cache_spec``. Everything it changes is restored
    before it returns. Start-up only (the engine core asks while it sizes the KV cache, before any cache exists).
    """

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        cache = self.vllm_config.cache_config  # type: ignore[attr-defined]
        # the executor aligns the block size after load_model returns (uniproc, multiproc and Ray executors)
        self._ubtree_cache_before_alignment = _cache_sizes(cache)
        return super().load_model(*args, **kwargs)  # type: ignore[misc]

    def ubtree_kv_cache_spec_at_budget(self, budget: int) -> dict[str, Any]:
        import logging

        from vllm.config.vllm import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
        from vllm.platforms import current_platform

        config = self.vllm_config  # type: ignore[attr-defined]
        cache, speculative = config.cache_config, config.speculative_config
        recurrent = [layer for layer in get_layers_from_vllm_config(config, AttentionLayerBase).values()
                     if hasattr(layer, "num_spec")]  # vLLM's linear layers size their conv window by num_spec
        configured = (_cache_sizes(cache), speculative.num_speculative_tokens, [layer.num_spec for layer in recurrent])
        platform_logger = logging.getLogger("vllm.platforms")  # the replayed alignment would log its choices again
        level = platform_logger.level
        try:
            platform_logger.setLevel(logging.WARNING)
            _set_cache_sizes(cache, self._ubtree_cache_before_alignment)
            speculative.num_speculative_tokens = budget
            for layer in recurrent:
                layer.num_spec = budget
            current_platform.update_block_size_for_backend(config)
            return self.get_kv_cache_spec()  # type: ignore[attr-defined]
        finally:
            sizes, tokens, num_specs = configured
            _set_cache_sizes(cache, sizes)
            speculative.num_speculative_tokens = tokens
            for layer, num_spec in zip(recurrent, num_specs):
                layer.num_spec = num_spec
            platform_logger.setLevel(level)


# what Platform.update_block_size_for_backend sets
_ALIGNED_CACHE_FIELDS = ("block_size", "mamba_page_size_padded", "mamba_block_size", "skip_page_size_padded")


def _cache_sizes(cache: Any) -> tuple[Any, ...]:
    return tuple(getattr(cache, name) for name in _ALIGNED_CACHE_FIELDS)


def _set_cache_sizes(cache: Any, sizes: tuple[Any, ...]) -> None:
    for name, value in zip(_ALIGNED_CACHE_FIELDS, sizes):
        setattr(cache, name, value)


def largest_budget(fits: Callable[[int], bool], budget: int) -> int:
    """The largest B' in [1, budget] with ``fits(B')`` (fits is monotone: fewer slots never need more memory);
    0 when not even B' = 1 fits."""
    low, high = 0, budget  # fits(low) holds or low == 0; the answer is in [low, high]
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


def explain_budget_that_does_not_fit(cost: RecurrentStateCost, budget: int, fitting: int, max_model_len: int,
                                     vllm_message: str) -> str:
    """The start-up error for a hybrid target whose tree budget does not fit, naming the largest that does."""
    head = (f"speculative_config.num_speculative_tokens = {budget} does not fit this hybrid target's KV cache "
            f"memory: tree verification holds {cost.describe(budget)}. ")
    if fitting >= 1:
        return (head + f"The largest budget that fits one request of max_model_len {max_model_len} is "
                f"num_speculative_tokens = {fitting}; or give the KV cache more memory. vLLM: {vllm_message}")
    return head + f"Not even num_speculative_tokens = 1 fits with max_model_len {max_model_len}. vLLM: {vllm_message}"
