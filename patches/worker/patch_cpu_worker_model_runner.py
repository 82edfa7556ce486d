"""Let ``CPUWorker`` build the UBTree V1 model runner when the engine uses method 'ubtree'.

``vllm.v1.worker.cpu_worker.CPUWorker.init_device`` constructs its V1 runner through the
module-level name ``CPUModelRunner`` (unlike the GPU ``Worker``, it has no
``_make_model_runner`` hook). The patch rebinds that name, where it is looked up, to a
factory that returns :class:`ubtree_vllm.vllm.runner.UBTreeCPUModelRunner` for a
'ubtree' engine and vLLM's own ``CPUModelRunner`` otherwise, so other engines in the same
process (in-process mode) are unaffected.

CPU platform only: importing ``vllm.v1.worker.cpu_worker`` runs ``vllm/v1/worker/cpu/shm.py``,
which replaces ``torch.Event``/``torch.cuda.Event`` process-wide with a placeholder; on a GPU
that breaks torch inductor's autotuning (``'_EventPlaceholder' object has no attribute
'elapsed_time'``), so on other platforms this patch does nothing.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import original_attr_name, replace_attr

NAME = "cpu_worker_model_runner"


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.v1.worker.cpu_worker as cpu_worker

    from ubtree_vllm.vllm.config import is_ubtree_speculative_config

    def make_cpu_model_runner(vllm_config: Any, device: Any) -> Any:
        if is_ubtree_speculative_config(vllm_config.speculative_config):
            from ubtree_vllm.vllm.runner import UBTreeCPUModelRunner

            return UBTreeCPUModelRunner(vllm_config, device)
        stock_runner = getattr(cpu_worker, original_attr_name("CPUModelRunner"))
        return stock_runner(vllm_config, device)

    replace_attr(cpu_worker, "CPUModelRunner", make_cpu_model_runner, NAME)
