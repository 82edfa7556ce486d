"""vLLM's GPU worker for 'ubtree' engines (selected through ``ParallelConfig.worker_cls``).

Applies the worker stage of the patch manifest (``FLASH_ATTN`` resolves to the tree-aware
backend) before vLLM's ``Worker`` builds anything, and builds the UBTree runner through
``Worker._make_model_runner`` -- the hook vLLM provides for this: ``UBTreeModelRunnerV2`` for
the engine's Model Runner V2 form (``"dflash"``), the V1 runner for the ``custom_class`` form,
which vLLM itself keeps off Model Runner V2. Before that it adds the CUDA-graph sizes of tree
steps (``decode_graphs.py``) unless the user chose capture sizes.
"""
from __future__ import annotations

from typing import Any

from vllm.logger import init_logger
from vllm.v1.worker.gpu_worker import Worker

from ubtree_vllm import compat, patches
from ubtree_vllm.vllm.config import TreeAttentionRPC, from_vllm_config
from ubtree_vllm.vllm.decode_graphs import check_tree_steps_fit, widen_decode_graph_sizes
from ubtree_vllm.vllm.recurrent.memory import HybridBudgetRPC
from ubtree_vllm.vllm.stage_clock import StageTimesRPC
from ubtree_vllm.vllm.tensor_parallel import TPDigestRPC

logger = init_logger(__name__)


class UBTreeGPUWorker(StageTimesRPC, TreeAttentionRPC, TPDigestRPC, HybridBudgetRPC, Worker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        compat.check_vllm_version()
        patches.apply("worker")
        super().__init__(*args, **kwargs)
        config = from_vllm_config(self.vllm_config)
        if config is not None:  # before any device memory: a tree step that cannot fit fails here, naming the field
            check_tree_steps_fit(self.vllm_config, graph_sizes_chosen=not config.wide_decode_graphs,
                                 default_schedule=config.default_schedule)

    def ubtree_decline_exact_rows(self) -> None:
        """RPC of the engine core (patch engine_core_kv_cache_configs, DECLINE_EXACT_ROWS_RPC): the scratch pages of
        the "flash_exact" that "auto" chose did not fit, so none are kept and the runner serves "triton"."""
        self.model_runner.decline_exact_rows()

    def _make_model_runner(self) -> Any:
        config = from_vllm_config(self.vllm_config)
        mrv2 = config is not None and config.runner == "mrv2"
        if self.use_v2_model_runner != mrv2:
            raise RuntimeError(f"speculative method 'ubtree' was configured for the {config.runner if config else 'v1'} "
                               f"runner but vLLM selected {'Model Runner V2' if self.use_v2_model_runner else 'V1'}; "
                               "set UBTREE_VLLM_RUNNER=v1, or unset VLLM_USE_V2_MODEL_RUNNER")
        draft_query_len = 1 + config.tree.block_size if mrv2 else None  # MRV2's draft graphs read the same sizes
        if config is not None and config.wide_decode_graphs and widen_decode_graph_sizes(self.vllm_config,
                                                                                           draft_query_len):
            logger.info("ubtree: CUDA graphs for tree steps of up to %d requests (capture sizes %s)",
                        self.vllm_config.compilation_config.max_cudagraph_capture_size
                        // self.vllm_config.uniform_decode_query_len,
                        self.vllm_config.compilation_config.cudagraph_capture_sizes)
        if mrv2:  # the default on CUDA (UBTREE_VLLM_RUNNER=auto), docs/design/mrv2.md
            from ubtree_vllm.vllm.mrv2.model_runner import UBTreeModelRunnerV2

            return UBTreeModelRunnerV2(self.vllm_config, self.device)
        from ubtree_vllm.vllm.runner import UBTreeGPUModelRunner

        return UBTreeGPUModelRunner(self.vllm_config, self.device)

