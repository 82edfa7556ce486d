"""What a ``ubtree`` engine adds to vLLM's KV cache sizing: the hybrid budget that fits, and flash_exact's scratch.

``EngineCore._initialize_kv_caches`` turns each worker's layer specs and profiled memory into KV cache configs
through ``get_kv_cache_configs``, which raises a ValueError when one request of ``max_model_len`` does not fit
(before any cache is allocated). For ``ubtree`` engines the wrapper adds two things; other engines are untouched.

* **Hybrid targets**: it logs the per-request cost of the 1 + B state slots per linear layer
  (vllm/recurrent/memory.py) and, when vLLM's check fails while a smaller budget would fit, re-raises naming
  ``speculative_config.num_speculative_tokens`` and the largest budget that fits: a binary search over the same call
  with the specs each worker rebuilds for the smaller budget (``HybridBudgetRPC``: state shapes, block size and page
  padding all follow the budget). The workers are reached through the executor of the engine core whose
  ``_initialize_kv_caches`` is running (the second, thin wrapper).
* **tree_attention "flash_exact"**: the scheduler is given fewer blocks than the configs hold, by the scratch pages
  the tree rows' virtual sequences use (vllm/attention/exact_rows.py), so it never hands them out; the workers'
  runner (``UBTreeModelRunnerV2.initialize_kv_cache``) adds them back to its views and uses them. When they would
  leave less than one request of ``max_model_len``: a ValueError naming the setting where the user chose
  "flash_exact"; where "auto" chose it, the workers are told to serve "triton" (``DECLINE_EXACT_ROWS_RPC``) and no page
  is kept.
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any

from ubtree_vllm.patches._patching import replace_attr

NAME = "engine_core_kv_cache_configs"
# RPC of ubtree_vllm.vllm.recurrent.memory.HybridBudgetRPC (UBTree's CPU and GPU workers)
SPEC_AT_BUDGET_RPC = "ubtree_kv_cache_spec_at_budget"
# RPC of UBTreeGPUWorker: "auto"'s flash_exact declined (its scratch pages did not fit), the runner serves "triton"
DECLINE_EXACT_ROWS_RPC = "ubtree_decline_exact_rows"
_EXECUTOR: contextvars.ContextVar[Any] = contextvars.ContextVar("ubtree_kv_cache_executor", default=None)


def apply() -> None:
    import vllm.v1.engine.core as core
    from vllm.logger import init_logger

    from ubtree_vllm.vllm.attention.exact_rows import engine_scratch_pages
    from ubtree_vllm.vllm.config import from_vllm_config
    from ubtree_vllm.vllm.recurrent.memory import (explain_budget_that_does_not_fit, largest_budget,
                                                 recurrent_state_cost)

    logger = init_logger(f"vllm.{__name__}")  # under "vllm": the logger vLLM configures with its handlers
    original = core.get_kv_cache_configs
    original_initialize = core.EngineCore._initialize_kv_caches

    def _initialize_kv_caches(self: Any, vllm_config: Any) -> Any:
        token = _EXECUTOR.set(self.model_executor)
        try:
            return original_initialize(self, vllm_config)
        finally:
            _EXECUTOR.reset(token)

    def hybrid_configs(vllm_config: Any, kv_cache_specs: list[dict[str, Any]], available_memory: list[int]) -> Any:
        """vLLM's configs; for a hybrid target its cost logged and a budget that does not fit refused by name."""
        costs = [recurrent_state_cost(s) for s in kv_cache_specs]
        if not any(costs):  # no linear layers
            return original(vllm_config, kv_cache_specs, available_memory)
        budget = vllm_config.speculative_config.num_speculative_tokens
        cost = next(c for c in costs if c is not None)
        logger.info("ubtree: hybrid target, per worker: %s", cost.describe(budget))
        try:
            return original(vllm_config, kv_cache_specs, available_memory)
        except ValueError as error:
            executor = _EXECUTOR.get()
            if executor is None:  # called outside EngineCore._initialize_kv_caches: no workers to ask
                raise

            def fits(smaller: int) -> bool:
                specs = executor.collective_rpc(SPEC_AT_BUDGET_RPC, args=(smaller,))
                try:
                    original(vllm_config, specs, available_memory)
                except ValueError:
                    return False
                return True

            fitting = largest_budget(fits, budget - 1)
            raise ValueError(explain_budget_that_does_not_fit(cost, budget, fitting,
                                                              vllm_config.model_config.max_model_len,
                                                              str(error))) from error

    def get_kv_cache_configs(vllm_config: Any, kv_cache_specs: list[dict[str, Any]],
                             available_memory: list[int]) -> Any:
        ubtree = from_vllm_config(vllm_config)
        if ubtree is None:
            return original(vllm_config, kv_cache_specs, available_memory)
        configs = hybrid_configs(vllm_config, kv_cache_specs, available_memory)
        if ubtree.tree_attention == "flash_exact":
            executor = _EXECUTOR.get()

            def decline(why: str) -> None:  # "auto" chose flash_exact: the runners serve "triton", add no pages
                executor.collective_rpc(DECLINE_EXACT_ROWS_RPC)
                logger.warning("ubtree: tree_attention 'auto' serves 'triton', not 'flash_exact': %s", why)

            scratch = engine_scratch_pages(vllm_config)
            if keep_scratch_pages(configs, scratch, vllm_config.cache_config.block_size,
                                  vllm_config.model_config.max_model_len,
                                  decline if ubtree.tree_attention_auto and executor is not None else None):
                logger.info("ubtree: tree_attention 'flash_exact' keeps %d KV cache pages for the tree rows' scratch; "
                            "the scheduler gets the other %d", scratch.num_pages, configs[0].num_blocks)
        return configs

    replace_attr(core.EngineCore, "_initialize_kv_caches", _initialize_kv_caches, NAME)
    replace_attr(core, "get_kv_cache_configs", get_kv_cache_configs, NAME)


def keep_scratch_pages(configs: list[Any], scratch: Any, block_size: int, max_model_len: int,
                       decline: Callable[[str], None] | None) -> bool:
    """Take ``scratch.num_pages`` blocks off the end of every config's pool: True. Where a pool would then no longer
    hold one request of ``max_model_len``: ``decline(why)`` and no config changed (False), or, without ``decline``
    (the user chose "flash_exact"), the ValueError naming the setting."""
    try:
        for config in configs:  # every worker's pool checked before any is changed
            check_scratch_pages_fit(config, scratch, block_size, max_model_len)
    except ValueError as error:
        if decline is None:
            raise
        decline(str(error))
        return False
    for config in configs:
        config.num_blocks -= scratch.num_pages
    return True


def check_scratch_pages_fit(config: Any, scratch: Any, block_size: int, max_model_len: int) -> None:
    """ValueError naming the setting when ``config``'s pool less ``scratch.num_pages`` blocks (taken off its end: the
    scheduler's view; the workers' runner adds them back) no longer holds one request of ``max_model_len``."""
    left = config.num_blocks - scratch.num_pages
    needed = -(-max_model_len // block_size)
    if left < needed:
        raise ValueError(f"speculative_config.tree_attention 'flash_exact' keeps {scratch.num_pages} KV cache pages "
                         f"({scratch.num_pages * block_size} tokens: {scratch.pages_per_row} per tree row of up to "
                         f"{scratch.max_entries} in a step) for the tree rows' virtual sequences, leaving "
                         f"{max(left, 0)} of {config.num_blocks}, fewer than one request of max_model_len "
                         f"{max_model_len} needs ({needed}); give the KV cache more memory, lower max_num_seqs or "
                         "num_speculative_tokens, or use another tree_attention")
