"""Settling GPU memory between in-process engines (test-only).

vLLM's memory profiling at an engine's start fails ("Error in memory profiling ... other processes sharing the
same container release GPU memory") when free memory grows while it profiles, as it does while a previous
engine's memory is still being released.
"""
from __future__ import annotations

import gc
from time import sleep


def settle_gpu_memory(interval_s: float = 0.5, tolerance_bytes: int = 1 << 20, max_reads: int = 20) -> None:
    """Where CUDA is available: collect garbage, return cached blocks, then read the device's free memory every
    ``interval_s`` until two consecutive reads agree within ``tolerance_bytes`` (at most ``max_reads`` waits, ~10 s;
    still moving then, it returns anyway). Does nothing without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    for _ in range(max_reads):
        sleep(interval_s)
        previous, free = free, torch.cuda.mem_get_info()[0]
        if abs(free - previous) <= tolerance_bytes:
            return
