"""Per-stage wall times of a repeated GPU/CPU computation, for the microbenchmarks.

`time_stages` runs `warmup` untimed iterations, then `iters` timed ones. Each iteration
calls the stages in order, feeding each stage's return value to the next, and marks
the clock before the first stage and after every stage:
  CUDA  `torch.cuda.Event(enable_timing=True)` recorded on the current stream; one
        synchronize after the last iteration, so the launches of consecutive stages and
        iterations overlap exactly as in serving.
  CPU   `time.perf_counter()` (CPU ops are synchronous).
Each stage's time is the gap between its two marks, the total is first to last mark;
`summarize` reduces the iterations to their median (robust to scheduler noise).

`time_launches` times one kernel launch (a function of no argument) on the device alone,
without the host's launch overhead, for kernel-against-kernel comparisons:
  CUDA  after `warmup` eager calls (compilation, autotuning), `GRAPH_CALLS` calls are
        captured in one CUDA graph; each of the `iters` samples is one replay between two
        CUDA events, divided by `GRAPH_CALLS`. If capture fails (a kernel that is not
        capturable), each sample is one eager call between two events instead (the host
        launch overhead is then included); the returned label says which.
  CPU   `time.perf_counter()` around each call.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

Stage = tuple[str, Callable[[Any], Any]]
TOTAL = "total"
GRAPH_CALLS = 10
GRAPH_CLOCK = f"CUDA graph of {GRAPH_CALLS} launches per sample, CUDA events"
EAGER_CLOCK = "eager launches, CUDA events (host launch overhead included)"
CPU_CLOCK = "time.perf_counter"


def time_stages(stages: Sequence[Stage], first_input: Any, device: torch.device, iters: int,
                warmup: int) -> dict[str, list[float]]:
    """{stage name: [ms per timed iteration]} plus TOTAL; see the module docstring."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    on_cuda = device.type == "cuda"
    marks_per_iter: list[list[Any]] = []
    for i in range(warmup + iters):
        value = first_input
        marks = [_mark(on_cuda)]
        for _, fn in stages:
            value = fn(value)
            marks.append(_mark(on_cuda))
        if i >= warmup:
            marks_per_iter.append(marks)
    if on_cuda:
        torch.cuda.synchronize(device)
    times: dict[str, list[float]] = {name: [] for name, _ in stages}
    times[TOTAL] = []
    for marks in marks_per_iter:
        for (name, _), start, end in zip(stages, marks, marks[1:]):
            times[name].append(_elapsed_ms(start, end, on_cuda))
        times[TOTAL].append(_elapsed_ms(marks[0], marks[-1], on_cuda))
    return times


def time_launches(fn: Callable[[], Any], device: torch.device, iters: int, warmup: int) -> tuple[list[float], str]:
    """([ms per call for each of `iters` samples], clock label); see the module docstring."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(1000.0 * (time.perf_counter() - start))
        return times, CPU_CLOCK
    for _ in range(max(warmup, 1)):  # at least one call compiles before any capture
        fn()
    torch.cuda.synchronize(device)
    graph = _capture(fn, device)
    if graph is None:
        run, calls, clock = fn, 1, EAGER_CLOCK
    else:
        run, calls, clock = graph.replay, GRAPH_CALLS, GRAPH_CLOCK
        for _ in range(warmup):
            run()
    marks = []
    for _ in range(iters):
        start = _mark(True)
        run()
        marks.append((start, _mark(True)))
    torch.cuda.synchronize(device)
    return [_elapsed_ms(start, end, True) / calls for start, end in marks], clock


def _capture(fn: Callable[[], Any], device: torch.device) -> Any:
    """A CUDA graph of GRAPH_CALLS calls of `fn`, or None when `fn` cannot be captured."""
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
    except Exception:  # any capture error (e.g. a host sync inside fn): fall back to eager launches
        torch.cuda.synchronize(device)
        return None
    return graph


def summarize(times: dict[str, list[float]]) -> dict[str, float]:
    """Median ms per stage."""
    return {name: statistics.median(values) for name, values in times.items()}


def _mark(on_cuda: bool) -> Any:
    if on_cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(start: Any, end: Any, on_cuda: bool) -> float:
    return float(start.elapsed_time(end)) if on_cuda else 1000.0 * (end - start)
