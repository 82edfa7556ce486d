"""`ubtree bench e2e`: vLLM end-to-end speed of ar / ngram / dflash-chain / ubtree in one process.

For each engine of `settings.planned_engines` (ar first; ubtree once per tree budget B; with
`--compare-drafters`, every engine that drafts once more per compared drafter, after them):
build one `vllm.LLM`, send one warm-up request, then for every concurrency c (after a warm-up
of 2c requests of staggered lengths through the same window, `warm_up_at`, so one-time work at
a new batch size or in a mixed prefill + decode step -- Triton compiles of a kernel
specialization, a budget schedule's next bucket -- stays out of the measurement, as in a server
that has run a while), dataset and temperature run the dataset's
prompts and append one e2e record; then shut the engine
down (del + gc, `torch.cuda.empty_cache()` on CUDA) before building the next one, so only
one engine holds device memory at a time.

Concurrency c: a client-side sliding window over the engine's offline API. At most c
requests are in flight: the first c are enqueued, and each time one finishes the next
is enqueued (`LLM.enqueue` + `LLMEngine.step`), so c = 1 is batch size 1, requests one
after the other. The engine is built with `max_num_seqs = max(--concurrency)`, so every
concurrency of a sweep shares one engine (and its CUDA graphs).

Sampling: `SamplingParams(temperature=T, max_tokens=--max-new-tokens, ignore_eos=False)`
plus the target's EOS ids as stop ids; the engine seed is fixed (`--seed`), requests
carry no per-request seed (that would put vLLM's sampler on its per-request generator
path, which is not what serving measures). How tau, tok/s, TPOT and the speedup are
computed: bench/measurement.py. Each speculative run also appends its round cost in plain
decode steps against the ar run of the same cell (bench/round_cost.py). With `--stage-timing`
the runs append stage-time records instead of e2e records (bench/stage_timing.py); with
`--agreement`, greedy-divergence records against ar (bench/agreement.py); with `--profile DIR`,
torch.profiler tables per run and no records (bench/profile.py); with `--sampling-options`, each cell once
without an option and once per option, and the options' cost records (bench/sampling_options.py); with both
`--profile` and `--sampling-options`, each option's runs profiled (tables named by the option), no records.
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ubtree_vllm.bench.engines import (TOKENIZER_FILES, Engine, Log, cells, close_engine, has_tokenizer, measure,
                                       start_engine, warm_up, warm_up_at)
from ubtree_vllm.bench.interleave import iter_interleaved
from ubtree_vllm.bench.profile import profiled, python_profiled, run_name
from ubtree_vllm.bench.prompts import PromptSet, dataset_prompt_sets
from ubtree_vllm.bench.recorder import Recorder, summary_table
from ubtree_vllm.bench.sampling_options import NEEDS_TOKENIZER, sampling_kwargs
from ubtree_vllm.bench.settings import (BenchArgumentError, E2ESettings, engine_core_env, environment, planned_engines,
                                        settings_from_args)
from ubtree_vllm.bench.stage_timing import read_stage_times, uses_runner_clock

def is_recurrent_hybrid(target_path: str | Path) -> bool:
    """Whether the target's architecture has recurrent layers UBTree forks per node (Gated DeltaNet, Mamba2): its
    engines run without prefix caching, which UBTree refuses for them."""
    import json

    from ubtree_vllm.vllm.config import RECURRENT_HYBRIDS

    config = Path(target_path) / "config.json"
    architectures = (json.loads(config.read_text()).get("architectures") or []) if config.is_file() else []
    return any(a in RECURRENT_HYBRIDS for a in architectures)


# config.json fields that give a target MTP layers (Qwen3-Next's, DeepSeek's)
MTP_LAYER_FIELDS = ("mtp_num_hidden_layers", "num_nextn_predict_layers")


def check_mtp_target(target_path: str | Path, load_format: str) -> None:
    """BenchArgumentError unless the target has MTP layers (:data:`MTP_LAYER_FIELDS`) and, with the saved weights
    (``load_format`` auto), tensors for them (``mtp.*``): vLLM would fail later, after taking GPU memory."""
    import json

    from safetensors import safe_open

    config = Path(target_path) / "config.json"
    fields = json.loads(config.read_text()) if config.is_file() else {}
    if not any(int(fields.get(name) or 0) > 0 for name in MTP_LAYER_FIELDS):
        raise BenchArgumentError(f"--methods mtp needs a target with MTP layers ({' or '.join(MTP_LAYER_FIELDS)} "
                                 f"> 0 in config.json); {target_path} has none")
    if load_format == "dummy":
        return
    for shard in sorted(Path(target_path).glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            if any(name.startswith("mtp.") or ".mtp." in name for name in f.keys()):
                return
    raise BenchArgumentError(f"--methods mtp: {target_path}'s weights have no mtp.* tensors for its MTP layers; pass "
                             "--load-format dummy to run every engine on random weights")


def run_e2e(settings: E2ESettings, prompt_sets: Sequence[PromptSet], target_path: str | Path,
            engine_kwargs: dict[str, Any], records_path: str | Path | None = None,
            log: Log = print) -> list[dict[str, Any]]:
    """Every planned engine x concurrency x prompt set x temperature; returns the records (appended if a path)."""
    return list(iter_e2e(settings, prompt_sets, target_path, engine_kwargs, records_path, log))


def iter_e2e(settings: E2ESettings, prompt_sets: Sequence[PromptSet], target_path: str | Path,
             engine_kwargs: dict[str, Any], records_path: str | Path | None = None,
             log: Log = print) -> Iterator[dict[str, Any]]:
    """:func:`run_e2e`, yielding each cell's records as soon as they are measured (and appended, if a path), so a
    caller cut off by a time limit keeps the cells already done. With ``settings.interleave`` > 1 every engine is up
    at once and the engines take turns over chunks of each cell's prompts (bench/interleave.py)."""
    import torch

    if not prompt_sets or any(not ps.prompts for ps in prompt_sets):
        raise BenchArgumentError("every dataset needs at least one prompt")
    target_path = Path(target_path)
    engine_kwargs = {"seed": settings.seed, "max_num_seqs": max(settings.concurrency),
                     "tensor_parallel_size": settings.tensor_parallel_size, **engine_kwargs}
    target_name = settings.target_name or target_path.name
    if settings.load_format != "auto":
        engine_kwargs["load_format"] = settings.load_format
        target_name += f" ({settings.load_format} weights)"
    cuda_graphs = not engine_kwargs.get("enforce_eager", False) and torch.cuda.is_available()
    recorder = Recorder(settings, target_name, cuda_graphs, records_path, log)
    # every engine (and each --interleave child, spawned with this environment) starts in the mode of --engine-core
    with tempfile.TemporaryDirectory(prefix="ubtree-bench-") as scratch, environment(engine_core_env(settings)):
        if settings.interleave > 1:
            yield from iter_interleaved(settings, prompt_sets, target_path, engine_kwargs, Path(scratch), recorder, log)
            return
        for label, engine_settings in planned_engines(settings):
            engine = start_engine(label, engine_settings, settings, target_path, engine_kwargs, Path(scratch), log)
            try:
                yield from _measure_engine(engine, settings, prompt_sets, recorder)
            finally:
                close_engine(engine)


def _measure_engine(engine: Engine, settings: E2ESettings, prompt_sets: Sequence[PromptSet],
                    recorder: Recorder) -> Iterator[dict[str, Any]]:
    """Every concurrency x cell of one engine, one after the other (the sequential plan)."""
    llm, label = engine.llm, engine.label
    profiling = settings.profile_dir is not None
    clocked = settings.stage_timing and uses_runner_clock(engine.run)
    traced: set[str | None] = set()  # --profile: each engine's first run per sampling option also writes its trace
    warm_up(llm, prompt_sets, settings)
    for concurrency in settings.concurrency:
        if concurrency > 1:  # the batch sizes and mixed steps this concurrency runs, unmeasured
            warm_up_at(llm, prompt_sets[0], concurrency)
        for prompt_set, temperature, option in cells(prompt_sets, settings):
            if clocked:
                read_stage_times(llm, reset=True)
            outputs: list[Any] = []
            steps = [0]
            name = run_name(label, prompt_set.dataset, temperature, concurrency, option)
            extra = sampling_kwargs(option, settings.max_new_tokens) if option else None
            profile = (profiled(Path(settings.profile_dir), name, steps, trace=option not in traced) if profiling
                       else contextlib.nullcontext())
            with profile:
                result = measure(llm, prompt_set, temperature, concurrency, settings.max_new_tokens, outputs, extra)
                steps[0] = result.engine_steps
            traced.add(option)
            if profiling:  # the same cell again under cProfile alone: the host code's shares
                py_steps = [0]
                with python_profiled(Path(settings.profile_dir), name, py_steps):
                    py_steps[0] = measure(llm, prompt_set, temperature, concurrency, settings.max_new_tokens,
                                          None, extra).engine_steps
            times = read_stage_times(llm, reset=True) if clocked else None
            yield from recorder.take(engine, prompt_set, temperature, concurrency, option, result, outputs, times,
                                     records=not profiling)


def run_cli(args: argparse.Namespace) -> int:
    from ubtree_vllm.training.data import resolve_target_path

    settings = settings_from_args(args)
    try:
        target_path = resolve_target_path(args.target)
    except FileNotFoundError as exc:
        raise BenchArgumentError(f"--target: {exc}") from None
    if "mtp" in settings.methods:
        check_mtp_target(target_path, settings.load_format)
    needing = [name for name in settings.sampling_options if name in NEEDS_TOKENIZER]
    if needing and not has_tokenizer(target_path):
        raise BenchArgumentError(f"--sampling-options {','.join(needing)} need the target's tokenizer; {target_path} "
                                 f"has none of {', '.join(TOKENIZER_FILES)}")
    try:
        prompt_sets = dataset_prompt_sets(target_path, settings.datasets, args.data_dir, settings.num_prompts)
    except FileNotFoundError as exc:
        raise BenchArgumentError(f"--data-dir: {exc}") from None
    engine_kwargs = {"dtype": args.dtype, "enforce_eager": args.enforce_eager,
                     "gpu_memory_utilization": args.gpu_memory_utilization}
    if args.kv_cache_memory_bytes is not None:
        engine_kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.max_model_len is not None:
        engine_kwargs["max_model_len"] = args.max_model_len
    if getattr(args, "distributed_executor_backend", None):
        engine_kwargs["distributed_executor_backend"] = args.distributed_executor_backend
    if is_recurrent_hybrid(target_path):  # UBTree refuses vLLM's prefix caching of recurrent states; all alike
        engine_kwargs["enable_prefix_caching"] = False
    records_path = None if args.no_record or settings.profile_dir is not None else args.records
    rows = run_e2e(settings, prompt_sets, target_path, engine_kwargs, records_path)
    if settings.profile_dir is not None:
        print(f"bench e2e: profile tables in {settings.profile_dir}")
    elif settings.agreement:
        for r in rows:
            print(f"{r['method']:<12} B={r['tree_budget']} {r['dataset']} c={r['concurrency']} "
                  f"{r['metric']} {r['value']:.3f} ({r['notes'].split(': ', 1)[1]})")
    elif settings.sampling_options:
        for r in rows:
            print(f"{r['method']:<12} B={r['tree_budget']} {r['dataset']} T={r['temperature']} c={r['concurrency']} "
                  f"{r['sampling_options']:<12} {r['metric']:<26} {r['value']:9.3f} ms")
    elif settings.stage_timing:
        for r in rows:
            print(f"{r['method']:<12} B={r['tree_budget']} {r['dataset']} T={r['temperature']} "
                  f"{r['metric']:<28} {r['value']:9.3f} ms")
    else:
        print(summary_table([r for r in rows if r["kind"] == "e2e"]))
        for r in rows:
            if r["kind"] == "microbench":
                print(f"{r['method']:<12} B={r['tree_budget']} {r['dataset']} T={r['temperature']} "
                      f"c={r['concurrency']} {r['metric']} {r['value']:.3f} {r['unit']}")
    if records_path is not None and not args.no_report:
        from ubtree_vllm.bench.report import regenerate

        for path in regenerate(records_path):
            print(path)
    return 0
