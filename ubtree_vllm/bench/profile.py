"""`ubtree bench e2e --profile DIR`: where the host and device time of an untimed step goes.

A diagnosis mode beside ``--stage-timing`` (whose device syncs change what they measure): every
engine is built with ``UBTREE_STAGE_TIMING=ranges`` (the UBTree runners' stages become
``torch.profiler`` ranges ``ubtree:<stage>``, see vllm/stage_clock.py; nothing syncs) and each
measured run goes under ``torch.profiler`` (CPU and CUDA activities; the engine runs in this
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or only the client side is seen). Per run it
writes ``DIR/<engine>_<dataset>_T<t>_c<c>.txt`` (:func:`summary_text`) and, for the first run of
each engine, the Chrome trace ``.trace.json.gz``. No records: the profiler adds a few
microseconds of host time per op, so these runs are slower than the e2e ones.

:func:`python_profiled` runs the same cell again under ``cProfile`` alone and writes
``DIR/<name>.py.txt``: the Python functions with the most own and cumulative time per engine
step. The torch profiler names the kernels and launches but not the Python that issues them;
this names the host code (vLLM's scheduler, output processing, the runner's bookkeeping) that
bounds a step whose device is idle most of the time. cProfile slows every call about alike,
so read the shares, not the absolute times.

The summary, all per engine step (``LLMEngine.step`` calls of the run):
  wall ms; device busy ms (sum of kernel and memcpy/memset durations: one stream at batch 1,
  so the gap to the wall time is the device's idle time, the host-bound share); kernels and
  host API calls (kernel launches, graph launches, copies, syncs); each ``ubtree:`` stage's host
  ms and its device span (the profiler's device-side copy of the range: first to last kernel it
  launched, graph replays included); the ops with the most device and host time.
"""
from __future__ import annotations

import contextlib
import cProfile
import gzip
import pstats
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ubtree_vllm.vllm.stage_clock import RANGE_PREFIX

STAGE_TIMING_MODE = "ranges"  # UBTREE_STAGE_TIMING of the profiled engines (bench/stage_timing.py:stage_timing_env)
# Host API calls counted per step (CUDA runtime and driver names as the profiler reports them).
API_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch",
             "cudaMemcpyAsync", "cudaMemsetAsync", "cudaStreamSynchronize", "cudaDeviceSynchronize",
             "cudaEventSynchronize", "cudaStreamWaitEvent")
TOP_OPS = 30
TOP_FUNCTIONS = 60


def run_name(label: str, dataset: str, temperature: float, concurrency: int, option: str | None = None) -> str:
    """File stem of one profiled run: the engine label ('ubtree-mrv2:64' -> 'ubtree-mrv2-B64',
    'ubtree-mrv2:64@flash_merge' -> 'ubtree-mrv2-B64-flash_merge'), cell, and the sampling option its requests
    carried (--sampling-options), if any."""
    from ubtree_vllm.bench.settings import TREE_ATTENTION_AUTO, parse_label

    method, budget, mode = parse_label(label)
    engine = (f"{method}-B{budget}" if budget else method) + ("" if mode == TREE_ATTENTION_AUTO else f"-{mode}")
    return f"{engine}_{dataset}_T{temperature:g}_c{concurrency}" + (f"_{option}" if option else "")


@contextlib.contextmanager
def profiled(out_dir: Path, name: str, steps: list[int], trace: bool) -> Iterator[None]:
    """Profile the block; then write ``out_dir/name.txt`` (``steps[0]``: the block's engine steps, set by the
    caller inside the block) and, with ``trace``, the gzipped Chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        yield
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.txt").write_text(summary_text(prof.events(), max(steps[0], 1), name))
    if trace:
        raw = out_dir / f"{name}.trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()


@contextlib.contextmanager
def python_profiled(out_dir: Path, name: str, steps: list[int]) -> Iterator[None]:
    """cProfile the block; then write ``out_dir/name.py.txt`` (:func:`python_summary_text`; ``steps[0]`` as for
    :func:`profiled`)."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        yield
    finally:
        profiler.disable()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.py.txt").write_text(python_summary_text(profiler, max(steps[0], 1), name))


def python_summary_text(profiler: cProfile.Profile, steps: int, title: str) -> str:
    """The top functions by own time and by cumulative time, per engine step (ms), of a cProfile run."""
    stats = pstats.Stats(profiler)
    total_s = stats.total_tt  # type: ignore[attr-defined]
    lines = [f"# {title}: {steps} engine steps under cProfile",
             f"profiled time per step   {total_s / steps * 1e3:9.3f} ms  (cProfile-slowed)"]
    # pstats' table: (file, line, function) -> (primitive calls, calls, own s, cumulative s, callers)
    table = stats.stats  # type: ignore[attr-defined]
    for key_index, title_part in ((2, "own"), (3, "cumulative")):
        ranked = sorted(table.items(), key=lambda item: -item[1][key_index])[:TOP_FUNCTIONS]
        lines += ["", f"## functions by {title_part} time per step   calls/step  own ms  cum ms"]
        for (path, line, func), (_, calls, own, cum, _) in ranked:
            where = f"{_short_path(path)}:{line}({func})"
            lines.append(f"{where[:100]:<100} {calls / steps:8.2f} {own / steps * 1e3:7.3f} {cum / steps * 1e3:7.3f}")
    return "\n".join(lines) + "\n"


def _short_path(path: str) -> str:
    """A source path from its package root on (``.../site-packages/vllm/x.py`` -> ``vllm/x.py``)."""
    for marker in ("site-packages/", "dist-packages/", "ub-site/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def _is_device(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def _duration_us(event: Any) -> float:
    return float(event.time_range.elapsed_us())


def summary_text(events: Sequence[Any], steps: int, title: str) -> str:
    """The per-step tables of the module docstring from ``profile.events()`` (torch FunctionEvents)."""
    # the stage ranges also appear on the device timeline (their span there), not as device work
    spans = [e for e in events if _is_device(e) and e.name.startswith(RANGE_PREFIX)]
    device = [e for e in events if _is_device(e) and not e.name.startswith(RANGE_PREFIX)]
    host = [e for e in events if not _is_device(e)]
    wall_us = (max(e.time_range.end for e in events) - min(e.time_range.start for e in events)) if events else 0.0
    # device events of the trace; without them (older profilers) the kernels linked to host ops
    busy_us = sum(_duration_us(e) for e in device) or sum(float(k.duration) for e in host for k in e.kernels)
    lines = [f"# {title}: {steps} engine steps",
             f"wall per step            {wall_us / steps / 1e3:9.3f} ms  (profiled span / steps)",
             f"device busy per step     {busy_us / steps / 1e3:9.3f} ms  ({len(device) / steps:.1f} device ops)",
             "", "## host API calls per step"]
    for name in API_CALLS:
        count = sum(1 for e in host if e.name == name)
        if count:
            lines.append(f"{name:<26} {count / steps:8.2f}")
    stages: dict[str, list[float]] = {}
    for e in host:
        if e.name.startswith(RANGE_PREFIX):
            entry = stages.setdefault(e.name[len(RANGE_PREFIX):], [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += _duration_us(e)
    for e in spans:
        stages.setdefault(e.name[len(RANGE_PREFIX):], [0, 0.0, 0.0])[2] += _duration_us(e)
    if stages:
        lines += ["", "## ubtree stages per step      calls   host ms  device span ms"]
        for name, (calls, host_us, dev_us) in stages.items():
            lines.append(f"{name:<28} {calls / steps:6.2f} {host_us / steps / 1e3:9.3f} {dev_us / steps / 1e3:10.3f}")
    lines += _top("device ops by time per step (us)", device, steps, _duration_us)
    lines += _top("host ops by self time per step (us)", [e for e in host if not e.name.startswith(RANGE_PREFIX)],
                  steps, lambda e: float(e.self_cpu_time_total))
    return "\n".join(lines) + "\n"


def _top(title: str, events: Sequence[Any], steps: int, cost: Any) -> list[str]:
    totals: dict[str, list[float]] = {}
    for e in events:
        entry = totals.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += cost(e)
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:TOP_OPS]
    lines = ["", f"## {title}   calls/step   us/step"]
    lines += [f"{name[:90]:<90} {calls / steps:8.2f} {us / steps:9.1f}" for name, (calls, us) in ranked]
    return lines
