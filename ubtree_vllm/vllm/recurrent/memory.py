"""What a tree budget costs a hybrid target in recurrent-state memory, and the largest budget that fits.

Tree verification of a hybrid target (the tree forms of ``ubtree_vllm/vllm/recurrent/``) gives every node of a B-node
tree its own state slot: vLLM allocates ``1 + num_speculative_tokens`` slots per request and linear layer
(``MambaSpec.num_speculative_blocks``; the committed state plus one per node), each a whole recurrent state
(conv window and SSM / delta-rule state, ``MambaSpec.page_size_bytes``). That cost grows linearly in B and is
paid by every request, whatever its length. vLLM checks at start that one request of ``max_model_len`` fits
the KV cache memory and, when it does not, suggests a shorter ``max_model_len``; for a hybrid under UBTree the
budget is the other knob, so :func:`explain_budget_that_does_not_fit` names the largest one that fits.
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


def with_budget(kv_cache_spec: Mapping[str, Any], budget: int) -> dict[str, Any]:
    """The specs with every linear layer holding ``1 + budget`` slots per request (the others unchanged)."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return {name: dataclasses.replace(spec, num_speculative_blocks=budget) if isinstance(spec, MambaSpec) else spec
            for name, spec in kv_cache_spec.items()}


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
