"""Log what a hybrid target's tree budget costs in recurrent-state memory, and name the largest budget that fits.

``EngineCore._initialize_kv_caches`` turns each worker's layer specs and profiled memory into KV cache configs
through ``get_kv_cache_configs``, which raises a ValueError when one request of ``max_model_len`` does not fit
(before any cache is allocated). For a ``ubtree`` engine on a hybrid target the wrapper logs the per-request
cost of the 1 + B state slots per linear layer (vllm/recurrent/memory.py) and, when vLLM's check fails while a
smaller budget would fit, re-raises naming ``speculative_config.num_speculative_tokens`` and the largest budget
that fits (a binary search over the same call with fewer slots). Other engines and targets are untouched.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import replace_attr

NAME = "engine_core_hybrid_budget"


def apply() -> None:
    import vllm.v1.engine.core as core
    from vllm.logger import init_logger

    from ubtree_vllm.vllm.config import from_vllm_config
    from ubtree_vllm.vllm.recurrent.memory import (explain_budget_that_does_not_fit, largest_budget,
                                                 recurrent_state_cost, with_budget)

    logger = init_logger(f"vllm.{__name__}")  # under "vllm": the logger vLLM configures with its handlers
    original = core.get_kv_cache_configs

    def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: list[dict[str, Any]],
                             available_memory: list[int]) -> Any:
        costs = [] if from_vllm_config(vllm_config) is None else [recurrent_state_cost(s) for s in kv_cache_specs]
        if not any(costs):  # not a ubtree engine, or no linear layers
            return original(vllm_config, kv_cache_specs, available_memory)
        budget = vllm_config.speculative_config.num_speculative_tokens
        cost = next(c for c in costs if c is not None)
        logger.info("ubtree: hybrid target, per worker: %s", cost.describe(budget))
        try:
            return original(vllm_config, kv_cache_specs, available_memory)
        except ValueError as error:
            def fits(smaller: int) -> bool:
                try:
                    original(vllm_config, [with_budget(spec, smaller) for spec in kv_cache_specs], available_memory)
                except ValueError:
                    return False
                return True

            fitting = largest_budget(fits, budget - 1)
            raise ValueError(explain_budget_that_does_not_fit(cost, budget, fitting,
                                                              vllm_config.model_config.max_model_len,
                                                              str(error))) from error

    replace_attr(core, "get_kv_cache_configs", get_kv_cache_configs, NAME)
