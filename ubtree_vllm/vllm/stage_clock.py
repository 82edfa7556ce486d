"""Wall time per stage of the UBTree runner's steps: a diagnosis mode, off by default.

``UBTREE_STAGE_TIMING=1`` (read when the runner is built) turns it on. Then every
``with clock.stage(name):`` block synchronizes the device when it starts and when it ends
(``# SYNC:`` diagnosis only), so a stage's time is the host plus device work issued inside
it, and adds that time to the stage's total (not while a CUDA graph is being captured). Stages nest: ``execute_model`` contains
``prepare_inputs``, ``forward``. Off, ``stage`` returns one shared no-op context: no sync, no
clock read. ``ubtree bench e2e --stage-timing`` reads the totals through the workers'
``ubtree_stage_times`` (vLLM's ``collective_rpc``) and records the mean per step.

``UBTREE_STAGE_TIMING=ranges`` instead makes every stage a ``torch.profiler`` range named
``ubtree:<stage>`` (no sync, no totals): ``ubtree bench e2e --profile`` reads the host and
device time of each stage from the profile of an untimed step (bench/profile.py).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import torch

from ubtree_vllm import envs

_OFF = contextlib.nullcontext()
RANGE_PREFIX = "ubtree:"  # profiler range names of the stages in ranges mode


class StageClock:
    """Per-stage (calls, total seconds); see the module docstring."""

    def __init__(self, device: torch.device, enabled: bool, ranges: bool = False) -> None:
        self.device = device
        self.enabled = enabled
        self.ranges = ranges and not enabled
        self._totals: dict[str, list[float]] = {}  # name -> [calls, seconds]

    @classmethod
    def from_env(cls, device: torch.device) -> StageClock:
        """The clock ``UBTREE_STAGE_TIMING`` asks for (read when a runner is built): 1 timed, ranges, 0 off."""
        mode = envs.UBTREE_STAGE_TIMING
        return cls(device, enabled=mode == "1", ranges=mode == "ranges")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # SYNC: stage timing (diagnosis mode only)

    @contextlib.contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            entry = self._totals.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    def stage(self, name: str) -> contextlib.AbstractContextManager[None]:
        if self.ranges:
            return torch.profiler.record_function(RANGE_PREFIX + name)
        # Never during CUDA-graph capture (vLLM's warm-up): a device sync would break the capture.
        if not self.enabled or (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            return _OFF
        return self._timed(name)

    def snapshot(self, reset: bool = False) -> dict[str, tuple[int, float]]:
        """{stage: (calls, total seconds)} so far; `reset` starts the totals again."""
        totals = {name: (int(calls), seconds) for name, (calls, seconds) in self._totals.items()}
        if reset:
            self._totals.clear()
        return totals


class StageTimesRPC:
    """Worker mixin: the runner's stage totals for ``LLM.collective_rpc("ubtree_stage_times")``."""

    def ubtree_stage_times(self, reset: bool = False) -> dict[str, tuple[int, float]]:
        return self.model_runner.ubtree_stage_clock.snapshot(reset)  # type: ignore[attr-defined]
