"""`ubtree bench e2e --interleave K`: every engine up at once, taking turns over chunks of each cell's prompts.

Each engine runs in a process of its own (bench/engine_process.py: in-process engines side by side broke CUDA-graph
replay on the H200).

The sequential plan measures one engine after the other, minutes apart, so a drift of the machine's speed
between them lands in the speedups (in the H200 sampling-option records of 2026-12-04, ar's step time moved
from run to run by far more than any option cost). Here all planned engines are started first (their memory
shares add up: pass --gpu-memory-utilization / engines; with --kv-cache-memory-bytes they start side by side,
engine_process.starts_side_by_side), then each cell's prompts are cut into K chunks of
consecutive prompts and, chunk by chunk, every engine runs the chunk, the order rotating by one engine per
chunk; an engine's run of the cell is the sum of its chunks (tokens, wall time, engine steps; its spec-decode counters read
before its first chunk and after its last). Drift then falls on every method alike. A chunk's sliding window
drains at its end, so with more than one request in flight a cell gets fewer chunks where K would make them
shorter than twice the concurrency (:func:`chunk_count`; the records' notes give the count).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ubtree_vllm.bench.engine_process import EngineProcess, starts_side_by_side
from ubtree_vllm.bench.engines import Log, cells, log_engine_start, sampling_params
from ubtree_vllm.bench.measurement import summarize_run
from ubtree_vllm.bench.prompts import PromptSet
from ubtree_vllm.bench.recorder import Recorder
from ubtree_vllm.bench.sampling_options import sampling_kwargs
from ubtree_vllm.bench.settings import E2ESettings, planned_engines


def chunk_bounds(num_prompts: int, chunks: int) -> list[tuple[int, int]]:
    """[start, end) of ``min(chunks, num_prompts)`` runs of consecutive prompts, sizes differing by at most one."""
    chunks = max(1, min(chunks, num_prompts))
    edges = [num_prompts * i // chunks for i in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


def chunk_count(num_prompts: int, interleave: int, concurrency: int) -> int:
    """Chunks of one cell: ``interleave``, fewer where a chunk would hold fewer than 2 x ``concurrency`` prompts (a
    chunk's window drains at its end, so shorter chunks would mostly run below the concurrency asked for); at
    least one, which still alternates the engines cell by cell."""
    if concurrency <= 1:
        return interleave
    return max(1, min(interleave, num_prompts // (2 * concurrency)))


def turn_order(num_engines: int, chunk: int) -> list[int]:
    """The engines' order for chunk ``chunk``: the plan's order rotated by one per chunk."""
    shift = chunk % num_engines
    return [*range(shift, num_engines), *range(shift)]


def chunk_speedups(rates: Sequence[float], ar_rates: Sequence[float]) -> str:
    """The notes' spread of a run: its tokens/s over ar's on each chunk (the same prompts, run back to back), so
    a reader sees how far the cell's one speedup moved from chunk to chunk."""
    ratios = ", ".join(f"{rate / base:.2f}" if base > 0 else "-" for rate, base in zip(rates, ar_rates))
    return f"speedup over ar per chunk: {ratios}"


def iter_interleaved(settings: E2ESettings, prompt_sets: Sequence[PromptSet], target_path: Path,
                     engine_kwargs: dict[str, Any], scratch: Path, recorder: Recorder,
                     log: Log) -> Iterator[dict[str, Any]]:
    """Every cell measured on all engines in turns (module docstring); records in the plan's engine order per cell,
    so ar's come first and every other run pairs with the ar run of the same chunks."""
    engines: list[EngineProcess] = []
    side_by_side = starts_side_by_side(engine_kwargs)
    try:
        for label, engine_settings in planned_engines(settings):
            log_engine_start(label, engine_settings, settings, log)
            engines.append(EngineProcess(label, engine_settings, settings, target_path, engine_kwargs, scratch))
            if not side_by_side:
                engines[-1].wait_started()
        for engine in engines:
            engine.wait_started()
            engine.call("warm_up", prompt_sets)
        for concurrency in settings.concurrency:
            if concurrency > 1:  # the batch sizes and mixed steps this concurrency runs, unmeasured
                for engine in engines:
                    engine.call("warm_up_at", prompt_sets[0], concurrency)
            for prompt_set, temperature, option in cells(prompt_sets, settings):
                params = sampling_params(prompt_set, temperature, settings.max_new_tokens,
                                         sampling_kwargs(option, settings.max_new_tokens) if option else None)
                outputs: list[list[Any]] = [[] for _ in engines]
                wall = [0.0] * len(engines)
                steps = [0] * len(engines)
                rates: list[list[float]] = [[] for _ in engines]  # tokens/s of each chunk, per engine
                before = [engine.call("counters") for engine in engines]
                bounds = chunk_bounds(len(prompt_set.prompts),
                                      chunk_count(len(prompt_set.prompts), settings.interleave, concurrency))
                for index, (start, end) in enumerate(bounds):
                    for i in turn_order(len(engines), index):
                        done, seconds, count = engines[i].call("run", prompt_set.prompts[start:end], params,
                                                               concurrency)
                        outputs[i] += done
                        wall[i] += seconds
                        steps[i] += count
                        rates[i].append(sum(len(o.outputs[0].token_ids) for o in done) / seconds if seconds else 0.0)
                ar = next((i for i, engine in enumerate(engines) if engine.label == "ar"), None)
                for i, engine in enumerate(engines):
                    result = summarize_run(outputs[i], wall[i], before[i], engine.call("counters"), steps[i])
                    note = f"interleaved: {len(bounds)} chunks of the prompts, the {len(engines)} engines in turn"
                    if ar is not None and i != ar and len(bounds) > 1:
                        note += f"; {chunk_speedups(rates[i], rates[ar])}"
                    yield from recorder.take(engine.engine, prompt_set, temperature, concurrency, option, result,
                                             outputs[i], note=note)
    finally:
        for engine in engines:
            engine.close()
