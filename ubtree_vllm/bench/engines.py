"""One engine of `ubtree bench e2e` and one measured run on it: build, warm up, run a prompt set through a sliding
window of requests, stop (bench/e2e.py plans the engines; bench/interleave.py runs them side by side).

Sampling: `SamplingParams(temperature=T, max_tokens=--max-new-tokens, ignore_eos=False)` plus the target's EOS ids as
stop ids; requests carry no per-request seed (that would put vLLM's sampler on its per-request generator path, which
is not what serving measures). Concurrency c: at most c requests in flight (`LLM.enqueue` + `LLMEngine.step`), the
next enqueued each time one finishes, so c = 1 is batch size 1.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from ubtree_vllm.bench.measurement import RunResult, spec_counters, summarize_run
from ubtree_vllm.bench.profile import STAGE_TIMING_MODE as PROFILE_MODE
from ubtree_vllm.bench.prompts import PromptSet
from ubtree_vllm.bench.settings import (DRAFTER_FREE_METHODS, TREE_METHODS, E2ESettings, MethodRun, dflash_chain_run,
                                        environment, mtp_run, ngram_run, parse_label, ubtree_chain_run, ubtree_run,
                                        with_served_attention)
from ubtree_vllm.bench.stage_timing import stage_timing_env

WARMUP_TOKENS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
Log = Callable[[str], None]


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
        llm = build_engine(target_path, run, engine_kwargs)
        return with_served_attention(run, llm.collective_rpc("ubtree_tree_attention")[0]), llm
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


def warm_up(llm: Any, prompt_sets: Sequence[PromptSet], settings: E2ESettings) -> None:
    """One unmeasured request (the first prompt, WARMUP_TOKENS at most) right after the engine starts."""
    warmup = dataclasses.replace(prompt_sets[0], prompts=prompt_sets[0].prompts[:1])
    measure(llm, warmup, 0.0, 1, min(WARMUP_TOKENS, settings.max_new_tokens))


def cells(prompt_sets: Sequence[PromptSet], settings: E2ESettings) -> Iterator[tuple[PromptSet, float, str | None]]:
    """(prompt set, temperature, sampling option or None) of one engine and concurrency, in run order: with
    --sampling-options each option of a cell right after "none", its baseline."""
    for prompt_set in prompt_sets:
        for temperature in settings.temperatures:
            for option in settings.sampling_options or (None,):
                yield prompt_set, temperature, option


@dataclasses.dataclass
class Engine:
    """One started engine of the plan: its label, run, vLLM engine and drafter (with its training totals)."""

    label: str
    run: MethodRun
    llm: Any
    drafter: str | None
    drafter_training: Mapping[str, int] | None


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
