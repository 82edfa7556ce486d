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
import dataclasses
import gc
import json
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ubtree_vllm.bench.agreement import agreement_record, tokens_in_prompt_order
from ubtree_vllm.bench.measurement import RunResult, SpeedupTable, e2e_record, spec_counters, summarize_run
from ubtree_vllm.bench.profile import STAGE_TIMING_MODE as PROFILE_MODE
from ubtree_vllm.bench.profile import profiled, python_profiled, run_name
from ubtree_vllm.bench.prompts import PromptSet, dataset_prompt_sets
from ubtree_vllm.bench.round_cost import CARRIED, round_cost_records
from ubtree_vllm.bench.sampling_options import NEEDS_TOKENIZER, NONE, option_records, sampling_kwargs
from ubtree_vllm.bench.settings import (DRAFTER_FREE_METHODS, TREE_METHODS, BenchArgumentError, E2ESettings,
                                        MethodRun, dflash_chain_run, engine_core_env, engine_core_mode, environment,
                                        mtp_run, ngram_run, parse_label, planned_engines, settings_from_args,
                                        ubtree_chain_run, ubtree_run)
from ubtree_vllm.bench.stage_timing import read_stage_times, stage_records, stage_timing_env, uses_runner_clock

WARMUP_TOKENS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
Log = Callable[[str], None]


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


def has_tokenizer(target_path: str | Path) -> bool:
    return any((Path(target_path) / name).is_file() for name in TOKENIZER_FILES)


def build_engine(target_path: str | Path, run: MethodRun, engine_kwargs: dict[str, Any]) -> Any:
    """One `vllm.LLM` for `run`; stats logging on (spec-decode counters, per-request metrics)."""
    from vllm import LLM

    from ubtree_vllm import compat

    compat.allow_cudagraph_capture_for_next_engine()  # in-process engines: see compat
    kwargs = {"skip_tokenizer_init": not has_tokenizer(target_path), **engine_kwargs, "disable_log_stats": False}
    if run.speculative_config is not None:
        kwargs["speculative_config"] = dict(run.speculative_config)
    with environment(run.env):
        return LLM(model=str(target_path), **kwargs)


def stop_engine(llm: Any) -> None:
    """Stop the engine core (its process in multiprocess mode); the caller then drops `llm`."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def release_memory() -> None:
    """Collect the dropped engine and give its cached device memory back."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_requests(llm: Any, prompts: Sequence[Sequence[int]], params: Any,
                 concurrency: int) -> tuple[list[Any], float, int]:
    """Finished RequestOutputs (completion order), wall seconds and engine steps, <= `concurrency` in flight.
    `params`: one SamplingParams for every prompt, or a sequence of them, one per prompt."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    per_prompt = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
    queue = deque(zip(prompts, per_prompt))
    outputs: list[Any] = []
    in_flight = steps = 0
    started = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            prompt, prompt_params = queue.popleft()
            llm.enqueue(TokensPrompt(prompt_token_ids=list(prompt)), prompt_params, use_tqdm=False)
            in_flight += 1
        if not engine.has_unfinished_requests():
            raise RuntimeError(f"vLLM reports no unfinished request while {in_flight} are in flight")
        steps += 1
        for output in engine.step():
            if output.finished:
                outputs.append(output)
                in_flight -= 1
    return outputs, time.perf_counter() - started, steps


def sampling_params(prompt_set: PromptSet, temperature: float, max_new_tokens: int,
                    options: Mapping[str, Any] | None = None) -> Any:
    """The SamplingParams of every measured request (module docstring), plus ``options``."""
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=max_new_tokens, ignore_eos=False, detokenize=False,
                          stop_token_ids=list(prompt_set.stop_token_ids) or None, **(options or {}))


def measure(llm: Any, prompt_set: PromptSet, temperature: float, concurrency: int, max_new_tokens: int,
            outputs_to: list[Any] | None = None, options: Mapping[str, Any] | None = None) -> RunResult:
    """One measured run of a prompt set (counters read around it, see bench/measurement.py); the finished
    RequestOutputs are appended to `outputs_to` when given; `options`: more SamplingParams keywords, on every
    request (bench/sampling_options.py)."""
    params = sampling_params(prompt_set, temperature, max_new_tokens, options)
    before = spec_counters(llm.get_metrics())
    outputs, wall_s, steps = run_requests(llm, prompt_set.prompts, params, concurrency)
    if outputs_to is not None:
        outputs_to.extend(outputs)
    return summarize_run(outputs, wall_s, before, spec_counters(llm.get_metrics()), steps)


def _start_engine(label: str, settings: E2ESettings, target_path: Path, engine_kwargs: dict[str, Any],
                  scratch: Path, log: Log) -> tuple[MethodRun, Any]:
    """(the run, its engine) for a planned label; dflash-chain falls back to ubtree-chain."""
    method, budget, attention = parse_label(label)
    if method in TREE_METHODS:
        run = ubtree_run(settings, budget, method, attention)
    elif label == "ngram":
        run = ngram_run(settings)
    elif label == "mtp":
        run = mtp_run(settings)
    elif label == "dflash-chain":
        from ubtree_vllm.drafter.io import META_FILE, export_dflash_proposer

        proposer = export_dflash_proposer(settings.drafter, Path(tempfile.mkdtemp(prefix="dflash-proposer-",
                                                                                  dir=scratch)))
        num_tokens = json.loads((proposer / META_FILE).read_text())["num_speculative_tokens"]
        run = dflash_chain_run(settings, proposer, num_tokens)
        try:
            return run, build_engine(target_path, run, engine_kwargs)
        except Exception as exc:  # vLLM re-raises loader errors from the engine core as various types
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
            release_memory()
            log(f"bench e2e: vLLM could not load the drafter's proposer as method 'dflash' ({reason}); "
                f"falling back to ubtree-chain (B = block size {settings.block_size}, W = 1, K = 1)")
            run = ubtree_chain_run(settings, note=f"fallback: vLLM 'dflash' failed to load ({reason})")
    else:
        run = MethodRun(label)
    return run, build_engine(target_path, run, engine_kwargs)


def warm_up_at(llm: Any, prompt_set: PromptSet, concurrency: int) -> None:
    """Unmeasured: 2 x ``concurrency`` prompts of the set (cycled when it has fewer) through the same sliding
    window, each request stopping after a different number of tokens (WARMUP_TOKENS / 4 .. WARMUP_TOKENS), so
    requests finish at different steps and new ones are prefilled beside decoding ones: the batch sizes and the
    mixed prefill + decode steps of a measured run meet their one-time work (a kernel's first compile, a
    schedule's next bucket) here, not in the measurement, as in a server that has run a while."""
    from vllm import SamplingParams

    prompts = [prompt_set.prompts[i % len(prompt_set.prompts)] for i in range(2 * concurrency)]
    params = [SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS * (1 + i % 4) // 4, ignore_eos=True,
                             detokenize=False) for i in range(len(prompts))]
    run_requests(llm, prompts, params, concurrency)


def cells(prompt_sets: Sequence[PromptSet], settings: E2ESettings) -> Iterator[tuple[PromptSet, float, str | None]]:
    """(prompt set, temperature, sampling option or None) of one engine and concurrency, in run order: with
    --sampling-options each option of a cell right after "none", its baseline."""
    for prompt_set in prompt_sets:
        for temperature in settings.temperatures:
            for option in settings.sampling_options or (None,):
                yield prompt_set, temperature, option


class OptionLedger:
    """What the --sampling-options records of a run compare with: ar's tok/s with the same option in the same cell
    (ar runs first), and the round time of the same engine without an option ("none" runs first in a cell)."""

    def __init__(self) -> None:
        self._ar_tokens_per_s: dict[tuple, float] = {}
        self._no_option_round_ms: dict[tuple, float] = {}

    def records(self, label: str, drafter: str | None, record: Mapping[str, Any], option: str) -> list[dict[str, Any]]:
        """The cost records of one run (its e2e ``record``, measured with ``option``) of engine ``label``."""
        cell = (record["dataset"], record["temperature"], record["concurrency"])
        if record["method"] == "ar":
            self._ar_tokens_per_s[(*cell, option)] = record["output_tokens_per_s"]
        engine = (label, drafter, *cell)
        new = option_records(record, option, self._ar_tokens_per_s.get((*cell, option)),
                             self._no_option_round_ms.get(engine), {k: record.get(k) for k in CARRIED})
        if option == NONE and new:
            self._no_option_round_ms[engine] = new[0]["value"]
        return new


def run_e2e(settings: E2ESettings, prompt_sets: Sequence[PromptSet], target_path: str | Path,
            engine_kwargs: dict[str, Any], records_path: str | Path | None = None,
            log: Log = print) -> list[dict[str, Any]]:
    """Every planned engine x concurrency x prompt set x temperature; returns the records (appended if a path)."""
    return list(iter_e2e(settings, prompt_sets, target_path, engine_kwargs, records_path, log))


@dataclasses.dataclass
class Engine:
    """One started engine of the plan: its label, run, vLLM engine and drafter (with its training totals)."""

    label: str
    run: MethodRun
    llm: Any
    drafter: str | None
    drafter_training: Mapping[str, int] | None


class Recorder:
    """Turns each measured run into the records of the invocation's mode (e2e + round cost, --agreement,
    --stage-timing, --sampling-options), pairs them with ar's, appends them when a path is given."""

    def __init__(self, settings: E2ESettings, target: str, cuda_graphs: bool, records_path: str | Path | None,
                 log: Log) -> None:
        self.settings, self.target, self.cuda_graphs, self.records_path, self.log = (
            settings, target, cuda_graphs, records_path, log)
        self.speedups = SpeedupTable()
        self.rows: list[dict[str, Any]] = []
        self.greedy_ar: dict[tuple[str, int], list[list[int]]] = {}  # --agreement: ar's outputs per (dataset, conc)
        self.options = OptionLedger()  # --sampling-options: the baselines each option's records compare with
        self.engine_core = engine_core_mode(settings)  # the e2e records' notes name it

    def take(self, engine: Engine, prompt_set: PromptSet, temperature: float, concurrency: int, option: str | None,
             result: RunResult, outputs: list[Any], stage_times: Any = None, records: bool = True,
             note: str = "") -> list[dict[str, Any]]:
        """The records of one measured run (appended if a path); ``records=False`` (--profile): log it only;
        ``note``: how the run was measured, added to the run's own note in the records."""
        from ubtree_vllm.bench.records import append_record

        settings, run, drafter = self.settings, engine.run, engine.drafter
        if note:
            run = dataclasses.replace(run, note=f"{run.note}; {note}" if run.note else note)
        speedup = (None if option else
                   self.speedups.speedup(run.method, prompt_set.dataset, temperature, concurrency, result.tokens_per_s))
        where = dict(target=self.target, drafter=drafter, dataset=prompt_set.dataset, temperature=temperature,
                     concurrency=concurrency, max_new_tokens=settings.max_new_tokens, cuda_graphs=self.cuda_graphs,
                     tp=settings.tensor_parallel_size)
        record = e2e_record(run, result, speedup=speedup, drafter_training=engine.drafter_training,
                            engine_core=self.engine_core, **where)
        self.log(f"bench e2e: {summary_line(record)}" + (f" option={option}" if option else ""))
        if not records:  # the profiler slows the steps: tables only, no records
            new = []
        elif settings.agreement:  # greedy outputs against ar's: agreement records only
            tokens = tokens_in_prompt_order(outputs, prompt_set.prompts)
            cell = (prompt_set.dataset, concurrency)
            if run.method == "ar":
                self.greedy_ar[cell] = tokens
            new = [] if run.method == "ar" else [agreement_record(
                run, self.greedy_ar[cell], tokens, target=self.target, drafter=drafter, dataset=prompt_set.dataset,
                concurrency=concurrency, max_new_tokens=settings.max_new_tokens, cuda_graphs=self.cuda_graphs,
                tau=result.tau, tp=settings.tensor_parallel_size)]
        elif settings.stage_timing:  # timed steps are slower: stage records only
            new = stage_records(run, result, stage_times, **where)
        elif option:  # --sampling-options: the option's cost records only
            new = self.options.records(engine.label, drafter, record, option)
        else:  # + its round cost in plain steps against this invocation's ar cell
            new = [record, *round_cost_records([*(r for r in self.rows if r["method"] == "ar"), record])]
        if self.records_path is not None:
            new = [append_record(r, self.records_path) for r in new]
        self.rows.extend(new)
        return new


def start_engine(label: str, engine_settings: E2ESettings, settings: E2ESettings, target_path: Path,
                 engine_kwargs: dict[str, Any], scratch: Path, log: Log) -> Engine:
    """Log the start, then :func:`open_engine`."""
    log_engine_start(label, engine_settings, settings, log)
    return open_engine(label, engine_settings, settings, target_path, engine_kwargs, scratch, log)


def log_engine_start(label: str, engine_settings: E2ESettings, settings: E2ESettings, log: Log) -> None:
    log(f"bench e2e: starting engine for {label}" + (f" (drafter {engine_settings.drafter})"
                                                     if settings.compare_drafters and label not in DRAFTER_FREE_METHODS
                                                     else ""))


def open_engine(label: str, engine_settings: E2ESettings, settings: E2ESettings, target_path: Path,
                engine_kwargs: dict[str, Any], scratch: Path, log: Log) -> Engine:
    """Build the engine of a planned label (under the stage-timing / profiling environment of the mode)."""
    from ubtree_vllm.drafter.io import training_totals

    drafter = engine_settings.drafter
    profiling = settings.profile_dir is not None
    with stage_timing_env("1" if settings.stage_timing else PROFILE_MODE if profiling else None):
        run, llm = _start_engine(label, engine_settings, target_path, engine_kwargs, scratch, log)
    return Engine(label, run, llm, drafter, training_totals(drafter) if drafter else None)


def close_engine(engine: Engine) -> None:
    stop_engine(engine.llm)
    engine.llm = None
    release_memory()


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
            from ubtree_vllm.bench.interleave import iter_interleaved

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


def warm_up(llm: Any, prompt_sets: Sequence[PromptSet], settings: E2ESettings) -> None:
    """One unmeasured request (the first prompt, WARMUP_TOKENS at most) right after the engine starts."""
    warmup = dataclasses.replace(prompt_sets[0], prompts=prompt_sets[0].prompts[:1])
    measure(llm, warmup, 0.0, 1, min(WARMUP_TOKENS, settings.max_new_tokens))


SUMMARY_COLUMNS = (("method", "method", 12), ("B", "tree_budget", 4), ("dataset", "dataset", 10),
                   ("T", "temperature", 4), ("conc", "concurrency", 4), ("tau", "tau", 6),
                   ("tok/s", "output_tokens_per_s", 9), ("TPOT ms", "tpot_ms", 8), ("speedup", "speedup_vs_ar", 7))


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def summary_line(record: dict[str, Any]) -> str:
    return " ".join(f"{name}={_cell(record[key])}" for name, key, _ in SUMMARY_COLUMNS)


def summary_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [" ".join(f"{name:>{width}}" for name, _, width in SUMMARY_COLUMNS)]
    lines += [" ".join(f"{_cell(r[key]):>{width}}" for _, key, width in SUMMARY_COLUMNS) for r in rows]
    return "\n".join(lines)


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
