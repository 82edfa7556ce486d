"""vLLM's CPU worker for 'ubtree' engines (selected through ``ParallelConfig.worker_cls``).

Before vLLM's ``CPUWorker`` builds anything, the worker stage of the patch manifest is
applied in this process: ``CPU_ATTN`` resolves to the tree-aware backend and
``CPUWorker.init_device`` builds :class:`ubtree_vllm.vllm.runner.UBTreeCPUModelRunner`.
"""
from __future__ import annotations

from typing import Any

from vllm.v1.worker.cpu_worker import CPUWorker

from ubtree_vllm import compat, patches
from ubtree_vllm.vllm.config import TreeAttentionRPC, from_vllm_config
from ubtree_vllm.vllm.decode_graphs import check_tree_steps_fit
from ubtree_vllm.vllm.recurrent.memory import HybridBudgetRPC
from ubtree_vllm.vllm.stage_clock import StageTimesRPC
from ubtree_vllm.vllm.tensor_parallel import TPDigestRPC


class UBTreeCPUWorker(StageTimesRPC, TreeAttentionRPC, TPDigestRPC, HybridBudgetRPC, CPUWorker):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        compat.check_vllm_version()
        patches.apply("worker")
        super().__init__(*args, **kwargs)
        config = from_vllm_config(self.vllm_config)
        if config is not None:  # before any device memory: a tree step that cannot fit fails here, naming the field
            check_tree_steps_fit(self.vllm_config, graph_sizes_chosen=not config.wide_decode_graphs,
                                 default_schedule=config.default_schedule)
