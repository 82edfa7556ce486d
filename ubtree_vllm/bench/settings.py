"""What `ubtree bench e2e` runs: parsed, validated flags and one `MethodRun` per vLLM engine.

Standard library only (plus the stdlib-only config modules), so the argument checks are
unit-testable without vLLM. Every error is a `BenchArgumentError` that names the flag and
the allowed values; the CLI prints it as one line.

Methods (the `--methods` names) and the engines they become, in run order (ar first, so
every later measurement can be paired with its AR baseline as soon as it is taken):
  ar            no speculation
  ngram         vLLM's built-in "method": "ngram" (prompt lookup, no drafter): per round up to
                --ngram-k tokens, those that followed an earlier occurrence of the context's last
                n tokens, n in [--ngram-lookup-min, --ngram-lookup-max]; the platform's default
                runner.
  mtp           vLLM's built-in "method": "mtp": the target's own multi-token-prediction layers draft a chain of
                --mtp-k tokens (no drafter); needs a target with MTP layers (e.g. `ubtree bench random-hybrid`'s
                Qwen3-Next, with --load-format dummy: its saved weights have none for them).
  dflash-chain  vLLM's built-in "method": "dflash" with the drafter's proposer exported by
                `drafter/io.py:export_dflash_proposer`; num_speculative_tokens = the
                drafter's block size gamma (one draft per mask slot, as the export writes in
                its meta file). If vLLM cannot load it the run falls back to `ubtree-chain`.
  ubtree-chain  (fallback only) "method": "ubtree" with B = gamma, W = 1, K = 1: the same
                single path, drafted by our plugin.
  ubtree        "method": "ubtree" on the V1 model runner (UBTREE_VLLM_RUNNER=v1 set for the engine), one
                engine per --tree-budgets value B, W = min(W, B), K.
  ubtree-mrv2   the same on Model Runner V2 (UBTREE_VLLM_RUNNER=mrv2: what a CUDA engine runs by default
                when B >= gamma; CUDA only).
  ubtree-lookup "ubtree" on the V1 runner with the prompt-lookup branch ("prompt_lookup": true, the
                n-gram window of --ngram-lookup-min/--ngram-lookup-max), one engine per B.
  ubtree-mrv2-lookup  the same branch on Model Runner V2 (CUDA only).
  ubtree-mrv2-lookup-uncoupled  the same without coupled drafting ("coupled_drafting": false: at T > 0 the trees
                are ranked by the drafter's log-probs alone, not under the target's sampling noise; what every
                MRV2 tree method drafted before 2026-12-05).
The tree methods pin their runner, so a method name means the same runner in every record.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ubtree_vllm.bench.sampling_options import check_sampling_options
from ubtree_vllm.config import (DEFAULT_COUPLED_EDGE_WEIGHT, MAX_LOOKUP_N, MAX_TREE_BUDGET, check_coupled_edge_weight,
                                max_tree_nodes)
from ubtree_vllm.eval_datasets import EVAL_DATASETS, allowed_datasets
from ubtree_vllm.vllm.config import MRV2_TREE_ATTENTION_MODES, TREE_ATTENTION_AUTO, TREE_ATTENTION_MODES

METHODS = ("ar", "ngram", "mtp", "dflash-chain", "ubtree", "ubtree-mrv2", "ubtree-lookup", "ubtree-mrv2-lookup",
           "ubtree-mrv2-lookup-uncoupled")
# Methods that run without --drafter; their records carry drafter null.
DRAFTER_FREE_METHODS = ("ar", "ngram", "mtp")
# --load-format values: the saved weights, or vLLM's random ones for every engine of the invocation
LOAD_FORMATS = ("auto", "dummy")
# Tree methods: one engine per tree budget, and the environment each engine is built under.
TREE_METHODS = {"ubtree": {"UBTREE_VLLM_RUNNER": "v1"}, "ubtree-mrv2": {"UBTREE_VLLM_RUNNER": "mrv2"},
                "ubtree-lookup": {"UBTREE_VLLM_RUNNER": "v1"}, "ubtree-mrv2-lookup": {"UBTREE_VLLM_RUNNER": "mrv2"},
                "ubtree-mrv2-lookup-uncoupled": {"UBTREE_VLLM_RUNNER": "mrv2"}}
# Tree methods with the prompt-lookup branch on (ubtree_vllm/tree/lookup.py).
LOOKUP_METHODS = ("ubtree-lookup", "ubtree-mrv2-lookup", "ubtree-mrv2-lookup-uncoupled")
# Tree methods drafting without the target's noise at T > 0 (drafter/coupling.py; the serving default couples)
UNCOUPLED_METHODS = ("ubtree-mrv2-lookup-uncoupled",)


def _tree_methods_on(methods: Sequence[str], runner: str) -> list[str]:
    """The tree methods among ``methods`` that run on ``runner`` ("v1" or "mrv2"; :data:`TREE_METHODS`)."""
    return [m for m in methods if TREE_METHODS.get(m, {}).get("UBTREE_VLLM_RUNNER") == runner]


class BenchArgumentError(ValueError):
    """A bad `ubtree bench` flag value; the message names the flag and what is allowed."""


@dataclass(frozen=True)
class MethodRun:
    """One vLLM engine of the benchmark and the tree fields its records carry."""

    # record method: ar | ngram | dflash-chain | ubtree-chain | ubtree | ubtree-mrv2 | ubtree-lookup |
    # ubtree-mrv2-lookup
    method: str
    # vLLM's speculative_config, None for ar
    speculative_config: dict[str, Any] | None = None
    tree_budget: int | None = None
    beam_width: int | None = None
    top_k: int | None = None
    block_size: int | None = None
    # free text carried into the records' notes (e.g. why a fallback was used)
    note: str = ""
    # environment variables set while the engine is built (the runner switch of ubtree-mrv2)
    env: dict[str, str] = field(default_factory=dict)
    # load-adaptive tree budget, in --budget-schedule's form ("1-4:64,5-32:16"); None: always tree_budget
    budget_schedule: str | None = None
    # tree methods: speculative_config.tree_attention asked for, then (bench/engines.py, once the engine runs) the mode
    # the engine serves; None for the other methods and for the CPU, whose attention backend has no such mode
    tree_attention: str | None = None
    # the coupled edge weight a coupled tree method drafts with at T > 0 (drafter/coupling.py); None: no coupling
    coupled_edge_weight: float | None = None

    @property
    def uses_drafter(self) -> bool:
        """Whether the engine drafts with --drafter (only then do its records name it)."""
        return self.method not in DRAFTER_FREE_METHODS


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Set ``values`` in ``os.environ`` for the block (read by the engine and workers it starts), then restore."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, old in saved.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old


@dataclass(frozen=True)
class E2ESettings:
    """Validated `ubtree bench e2e` flags (see bench/cli.py for their meaning)."""

    target: str = "default"
    drafter: str | None = None
    # --compare-drafters: every engine that drafts runs again with each of these, in the same invocation (one ar and
    # ngram baseline for all), so two drafters' speeds are compared on one machine
    compare_drafters: tuple[str, ...] = ()
    datasets: tuple[str, ...] = EVAL_DATASETS
    temperatures: tuple[float, ...] = (0.0, 1.0)
    num_prompts: int = 80
    max_new_tokens: int = 256
    methods: tuple[str, ...] = ("ar", "dflash-chain", "ubtree")
    tree_budgets: tuple[int, ...] = (16, 32, 64)
    beam_width: int = 12
    top_k: int = 64
    ngram_k: int = 8
    ngram_lookup_max: int = 4
    ngram_lookup_min: int = 2
    # mtp: tokens per round of the target's MTP chain
    mtp_k: int = 4
    # --load-format: "dummy" -- every engine draws random weights (vLLM's dummy loader; records say so in the target)
    load_format: str = "auto"
    concurrency: tuple[int, ...] = (1,)
    seed: int = 0
    stage_timing: bool = False
    agreement: bool = False
    # --profile DIR: torch.profiler summaries per run instead of records (bench/profile.py)
    profile_dir: str | None = None
    tensor_parallel_size: int = 1
    # --budget-schedule: ((first batch size, last batch size, B'), ...) for every tree method, None: the serving
    # default (budget_policy load_adaptive: default_budget_schedule(B) on MRV2, B pinned on V1)
    budget_schedule: tuple[tuple[int, int, int], ...] | None = None
    # --fixed-budget: budget_policy "fixed", B at every step on every runner
    fixed_budget: bool = False
    # --tree-attention: speculative_config.tree_attention modes; every tree method runs once per mode and budget
    tree_attention: tuple[str, ...] = (TREE_ATTENTION_AUTO,)
    # --sampling-options: every cell runs once per option ("none" first) and appends the options' cost records
    # instead of e2e records (bench/sampling_options.py); () -- the mode is off
    sampling_options: tuple[str, ...] = ()
    # --interleave K: every engine up at once, each cell's prompts in K chunks the engines run in turn
    # (bench/interleave.py); 1 -- one engine after the other
    interleave: int = 1
    # --coupled-edge-weight: speculative_config.coupled_edge_weight of the coupled tree methods; None: the serving default
    coupled_edge_weight: float | None = None
    # --engine-core: where vLLM's engine core runs, "process" (its own: vLLM's default, as `vllm serve` runs it) or
    # "in-process" (VLLM_ENABLE_V1_MULTIPROCESSING=0); None -- as that variable says (:func:`engine_core_mode`)
    engine_core: str | None = None
    # Drafter facts read from its config.json (None without a drafter).
    block_size: int | None = field(default=None, compare=False)
    vocab_size: int | None = field(default=None, compare=False)
    target_name: str | None = field(default=None, compare=False)


def parse_list(flag: str, text: str, convert: Callable[[str], Any], what: str) -> tuple[Any, ...]:
    """'a,b,c' -> (convert(a), ...); BenchArgumentError naming `flag` on an empty or bad item."""
    items = [item.strip() for item in str(text).split(",")]
    if not items or any(not item for item in items):
        raise BenchArgumentError(f"{flag} must be a comma-separated list of {what}, got {text!r}")
    try:
        return tuple(convert(item) for item in items)
    except ValueError:
        raise BenchArgumentError(f"{flag} must be a comma-separated list of {what}, got {text!r}") from None


def _edge_weight(text: str | None) -> float | None:
    """--coupled-edge-weight: None (the serving default) or a weight in (0, MAX_COUPLED_EDGE_WEIGHT]."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise BenchArgumentError(f"--coupled-edge-weight must be a number, got {text!r}") from None
    try:
        return check_coupled_edge_weight("--coupled-edge-weight", value)
    except ValueError as exc:
        raise BenchArgumentError(str(exc)) from None


def parse_budget_schedule(text: str | None) -> tuple[tuple[int, int, int], ...] | None:
    """'1-4:64,5-32:16' -> ((1, 4, 64), (5, 32, 16)): requests in flight first-last verify B' nodes per tree
    (vLLM's num_speculative_tokens_per_batch_size); None or '' -> None. BenchArgumentError on a bad entry."""
    if not text:
        return None
    entries = []
    for item in str(text).split(","):
        try:
            sizes, budget = item.split(":")
            first, last = sizes.split("-")
            entry = (int(first), int(last), int(budget))
        except ValueError:
            raise BenchArgumentError(f"--budget-schedule must be comma-separated FIRST-LAST:BUDGET entries "
                                     f"(e.g. 1-4:64,5-32:16), got {item!r}") from None
        if not 1 <= entry[0] <= entry[1] or entry[2] < 0:
            raise BenchArgumentError(f"--budget-schedule: entry {item!r} needs 1 <= FIRST <= LAST and BUDGET >= 0 "
                                     "(0: plain decoding steps at that load, Model Runner V2 only)")
        entries.append(entry)
    return tuple(entries)


def schedule_text(schedule: tuple[tuple[int, int, int], ...]) -> str:
    """The --budget-schedule form of a parsed schedule (what records carry)."""
    return ",".join(f"{first}-{last}:{budget}" for first, last, budget in schedule)


ENGINE_CORE_MODES = ("process", "in-process")
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# vLLM's start method for the engine core's process (and its workers)
SPAWN_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def engine_core_mode(settings: E2ESettings) -> str:
    """Where the invocation's engine cores run: ``settings.engine_core``, else what vLLM reads from
    VLLM_ENABLE_V1_MULTIPROCESSING (unset or true: a process of its own)."""
    if settings.engine_core is not None:
        return settings.engine_core
    value = os.environ.get(MULTIPROCESSING_ENV, "1").strip().lower()
    return "in-process" if value in ("0", "false") else "process"


def engine_core_env(settings: E2ESettings) -> dict[str, str]:
    """The environment an engine of this invocation starts under: VLLM_ENABLE_V1_MULTIPROCESSING for the mode and, for
    an engine core of its own on CUDA, vLLM's spawn start method (the bench's process may have initialised CUDA
    before an engine starts -- a record's hardware name does -- and a forked engine core then fails with "Cannot
    re-initialize CUDA in forked subprocess", as the first engine of an H100 bench did on 2026-12-08)."""
    import torch

    if engine_core_mode(settings) == "in-process":
        return {MULTIPROCESSING_ENV: "0"}
    return {MULTIPROCESSING_ENV: "1", **({SPAWN_ENV: "spawn"} if torch.cuda.is_available() else {})}


def _check_members(flag: str, values: Sequence[str], allowed: Sequence[str], what: str) -> None:
    for value in values:
        if value not in allowed:
            raise BenchArgumentError(f"{flag}: unknown {what} {value!r}; allowed: {', '.join(allowed)}")


def validate(settings: E2ESettings, check_datasets: bool = True) -> E2ESettings:
    """Check every value; returns `settings` with the drafter facts filled in.

    `check_datasets=False` when the caller injects its own prompt sets (tests).
    """
    from ubtree_vllm.drafter.config import DrafterConfig

    _check_members("--methods", settings.methods, METHODS, "method")
    if len(set(settings.methods)) != len(settings.methods):
        raise BenchArgumentError(f"--methods lists a method twice: {','.join(settings.methods)}")
    if check_datasets:
        _check_members("--datasets", settings.datasets, allowed_datasets(), "dataset")
    bad = [t for t in settings.temperatures if not 0.0 <= t < float("inf")]
    if bad:
        raise BenchArgumentError(f"--temperatures: each value must be a finite number >= 0, got {bad[0]}")
    for flag, value in (("--num-prompts", settings.num_prompts), ("--max-new-tokens", settings.max_new_tokens),
                        ("--beam-width", settings.beam_width), ("--top-k", settings.top_k),
                        ("--ngram-k", settings.ngram_k), ("--ngram-lookup-min", settings.ngram_lookup_min),
                        ("--mtp-k", settings.mtp_k)):
        if value < 1:
            raise BenchArgumentError(f"{flag} must be >= 1, got {value}")
    if any(m in LOOKUP_METHODS for m in settings.methods) and settings.ngram_lookup_max > MAX_LOOKUP_N:
        raise BenchArgumentError(f"--ngram-lookup-max must be <= {MAX_LOOKUP_N} with the lookup methods "
                                 f"({', '.join(LOOKUP_METHODS)}: the longest n-gram their branch matches), "
                                 f"got {settings.ngram_lookup_max}")
    if settings.ngram_lookup_max < settings.ngram_lookup_min:
        raise BenchArgumentError(f"--ngram-lookup-max must be >= --ngram-lookup-min ({settings.ngram_lookup_min}), "
                                 f"got {settings.ngram_lookup_max}")
    _check_members("--load-format", (settings.load_format,), LOAD_FORMATS, "load format")
    _check_members("--tree-attention", settings.tree_attention, (TREE_ATTENTION_AUTO, *TREE_ATTENTION_MODES), "mode")
    if len(set(settings.tree_attention)) != len(settings.tree_attention):
        raise BenchArgumentError(f"--tree-attention lists a mode twice: {','.join(settings.tree_attention)}")
    v1_tree, mrv2_tree = _tree_methods_on(settings.methods, "v1"), _tree_methods_on(settings.methods, "mrv2")
    if settings.load_format == "dummy" and mrv2_tree:
        raise BenchArgumentError(f"--load-format dummy: {', '.join(mrv2_tree)} load the drafter's proposer through "
                                 "vLLM's loader on Model Runner V2, so it would get random weights too; use ubtree / "
                                 "ubtree-lookup (V1 runner, which loads the drafter itself)")
    mrv2_modes = [mode for mode in settings.tree_attention if mode in MRV2_TREE_ATTENTION_MODES]
    if mrv2_modes and v1_tree:
        raise BenchArgumentError(f"--tree-attention {','.join(mrv2_modes)} runs on Model Runner V2 only; drop "
                                 f"{', '.join(v1_tree)} (V1 runner) from --methods or use ubtree-mrv2 / ubtree-mrv2-lookup")
    if settings.tensor_parallel_size < 1:
        raise BenchArgumentError(f"--tensor-parallel-size must be >= 1, got {settings.tensor_parallel_size}")
    if settings.tensor_parallel_size > 1 and mrv2_tree:
        raise BenchArgumentError(f"--tensor-parallel-size > 1: {', '.join(mrv2_tree)} run on Model Runner V2, which "
                                 "does not support tensor parallelism; use ubtree (V1 runner)")
    bad = [c for c in settings.concurrency if c < 1]
    if bad:
        raise BenchArgumentError(f"--concurrency: each value must be >= 1, got {bad[0]}")
    if settings.agreement:
        if "ar" not in settings.methods:
            raise BenchArgumentError("--agreement compares every method with ar: add ar to --methods")
        if settings.temperatures != (0.0,):
            raise BenchArgumentError(f"--agreement compares greedy outputs: --temperatures must be 0, got "
                                     f"{','.join(str(t) for t in settings.temperatures)}")
    # --sampling-options with --profile: each option's rounds profiled (tables named by the option), no records
    modes = [flag for flag, on in (("--profile", settings.profile_dir is not None), ("--agreement", settings.agreement),
                                   ("--stage-timing", settings.stage_timing),
                                   ("--sampling-options", bool(settings.sampling_options)
                                    and settings.profile_dir is None)) if on]
    if len(modes) > 1:
        raise BenchArgumentError(f"{' and '.join(modes)} are separate modes; pass one")
    if settings.interleave < 1:
        raise BenchArgumentError(f"--interleave must be >= 1 (1: one engine after the other), "
                                 f"got {settings.interleave}")
    if settings.interleave > 1 and (settings.profile_dir is not None or settings.stage_timing):
        raise BenchArgumentError("--interleave runs every engine at once; --profile and --stage-timing time one "
                                 "engine at a time: pass --interleave 1 with them")
    if settings.engine_core is not None:
        _check_members("--engine-core", (settings.engine_core,), ENGINE_CORE_MODES, "mode")
    if engine_core_mode(settings) == "process" and (settings.profile_dir is not None or settings.stage_timing):
        raise BenchArgumentError("--profile and --stage-timing read the model runner, which needs the engine core in "
                                 "this process: pass --engine-core in-process (or VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    if settings.sampling_options:
        try:
            settings = dataclasses.replace(settings, sampling_options=check_sampling_options(
                "--sampling-options", settings.sampling_options))
        except ValueError as exc:
            raise BenchArgumentError(str(exc)) from None

    if settings.fixed_budget and settings.budget_schedule is not None:
        raise BenchArgumentError("--fixed-budget pins B at every step and --budget-schedule varies it; pass one")
    if settings.budget_schedule is not None and not any(m in TREE_METHODS for m in settings.methods):
        raise BenchArgumentError(f"--budget-schedule applies to the tree methods ({', '.join(TREE_METHODS)}); "
                                 f"--methods has none")
    if settings.compare_drafters:
        if all(m in DRAFTER_FREE_METHODS for m in settings.methods):
            raise BenchArgumentError(f"--compare-drafters reruns the methods that draft; --methods "
                                     f"{','.join(settings.methods)} has none")
        folders = [Path(d).expanduser().resolve() for d in (settings.drafter, *settings.compare_drafters) if d]
        if len(set(folders)) != len(folders):
            raise BenchArgumentError("--compare-drafters names --drafter or a folder twice: "
                                     f"{','.join(settings.compare_drafters)}")
        for other in settings.compare_drafters:  # each one checked as --drafter is
            try:
                validate(dataclasses.replace(settings, drafter=other, compare_drafters=()), check_datasets=False)
            except BenchArgumentError as exc:
                raise BenchArgumentError(str(exc).replace("--drafter", "--compare-drafters", 1)) from None
    if all(m in DRAFTER_FREE_METHODS for m in settings.methods):
        return settings
    if settings.drafter is None:
        names = [repr(m) for m in DRAFTER_FREE_METHODS]
        free = ", ".join(names[:-1]) + " and " + names[-1]
        raise BenchArgumentError(f"--drafter is required for --methods {','.join(settings.methods)} "
                                 f"(only {free} run without a drafter)")
    drafter_dir = Path(settings.drafter).expanduser()
    if not drafter_dir.is_dir():
        raise BenchArgumentError(f"--drafter: drafter folder not found: {settings.drafter}")
    try:
        cfg = DrafterConfig.load(drafter_dir)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        raise BenchArgumentError(f"--drafter: {settings.drafter} is not a UBTree drafter folder: {exc}") from None
    if settings.top_k > cfg.vocab_size:
        raise BenchArgumentError(f"--top-k must be in [1, {cfg.vocab_size}] (the drafter's vocabulary), "
                                 f"got {settings.top_k}")
    if any(m in TREE_METHODS for m in settings.methods):
        for budget in settings.tree_budgets:
            width = min(settings.beam_width, budget) if budget >= 1 else settings.beam_width
            hi = min(MAX_TREE_BUDGET, max_tree_nodes(width, settings.top_k, cfg.block_size))
            if not 1 <= budget <= hi:
                raise BenchArgumentError(
                    f"--tree-budgets: B={budget} is out of range [1, {hi}] for --beam-width {settings.beam_width}, "
                    f"--top-k {settings.top_k} and the drafter's block size {cfg.block_size}")
            mrv2_tree = _tree_methods_on(settings.methods, "mrv2")
            if mrv2_tree and budget < cfg.block_size:
                raise BenchArgumentError(f"--tree-budgets: B={budget} is below the drafter's block size "
                                         f"{cfg.block_size}; {', '.join(mrv2_tree)} run on Model Runner V2, which "
                                         "needs B >= gamma")
        if len(set(settings.tree_budgets)) != len(settings.tree_budgets):
            raise BenchArgumentError(f"--tree-budgets lists a budget twice: {settings.tree_budgets}")
        if settings.budget_schedule is not None:
            top = max(entry[2] for entry in settings.budget_schedule)
            if min(settings.tree_budgets) < top:
                raise BenchArgumentError(f"--budget-schedule verifies up to {top} nodes per tree; every "
                                         f"--tree-budgets value must be >= it, got {min(settings.tree_budgets)}")
    return dataclasses.replace(settings, block_size=cfg.block_size, vocab_size=cfg.vocab_size,
                               target_name=cfg.target_name)


def settings_from_args(args: argparse.Namespace, check_datasets: bool = True) -> E2ESettings:
    """Parse the comma-separated flags of `ubtree bench e2e` and validate them."""
    return validate(E2ESettings(
        target=args.target,
        drafter=args.drafter,
        compare_drafters=parse_list("--compare-drafters", args.compare_drafters, str, "drafter folders")
        if getattr(args, "compare_drafters", None) else (),
        datasets=parse_list("--datasets", args.datasets, str, "dataset names"),
        temperatures=parse_list("--temperatures", args.temperatures, float, "numbers"),
        num_prompts=args.num_prompts,
        max_new_tokens=args.max_new_tokens,
        methods=parse_list("--methods", args.methods, str, "method names"),
        tree_budgets=parse_list("--tree-budgets", args.tree_budgets, int, "integers"),
        beam_width=args.beam_width,
        top_k=args.top_k,
        ngram_k=args.ngram_k,
        ngram_lookup_max=args.ngram_lookup_max,
        ngram_lookup_min=args.ngram_lookup_min,
        mtp_k=getattr(args, "mtp_k", 4),
        load_format=getattr(args, "load_format", "auto"),
        concurrency=parse_list("--concurrency", args.concurrency, int, "integers"),
        seed=args.seed,
        stage_timing=args.stage_timing,
        agreement=getattr(args, "agreement", False),
        profile_dir=getattr(args, "profile", None),
        tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
        budget_schedule=parse_budget_schedule(getattr(args, "budget_schedule", None)),
        fixed_budget=getattr(args, "fixed_budget", False),
        tree_attention=parse_list("--tree-attention", getattr(args, "tree_attention", TREE_ATTENTION_AUTO), str,
                                  "modes"),
        interleave=getattr(args, "interleave", 1),
        coupled_edge_weight=_edge_weight(getattr(args, "coupled_edge_weight", None)),
        engine_core=getattr(args, "engine_core", None),
        sampling_options=parse_list("--sampling-options", args.sampling_options, str, "option names")
        if getattr(args, "sampling_options", None) else (),
    ), check_datasets=check_datasets)


def ubtree_run(settings: E2ESettings, budget: int, method: str = "ubtree",
               tree_attention: str = TREE_ATTENTION_AUTO) -> MethodRun:
    """A tree method (:data:`TREE_METHODS`) at tree budget B = ``budget``, its tree rows attending by
    ``tree_attention`` (one of ``settings.tree_attention``; "auto", the serving default, leaves it to the engine)."""
    width = min(settings.beam_width, budget)
    env = TREE_METHODS[method]
    spec = {"method": "ubtree", "model": str(settings.drafter), "num_speculative_tokens": budget,
            "beam_width": width, "top_k": settings.top_k}
    note = " ".join(f"{k}={v}" for k, v in env.items())
    if method in LOOKUP_METHODS:
        spec.update(prompt_lookup=True, prompt_lookup_min=settings.ngram_lookup_min,
                    prompt_lookup_max=settings.ngram_lookup_max)
        note += f" prompt-lookup branch, lookup window {settings.ngram_lookup_min}-{settings.ngram_lookup_max} tokens"
    else:  # the plain tree, whatever the serving default
        spec["prompt_lookup"] = False
    on_mrv2 = env.get("UBTREE_VLLM_RUNNER") == "mrv2"
    edge_weight = None
    if method in UNCOUPLED_METHODS:
        spec["coupled_drafting"] = False
        note += " coupled_drafting false"
    elif on_mrv2:  # coupled drafting, the serving default (no effect on V1)
        edge_weight = DEFAULT_COUPLED_EDGE_WEIGHT
        if settings.coupled_edge_weight is not None:
            spec["coupled_edge_weight"] = edge_weight = settings.coupled_edge_weight
    schedule = None
    if settings.budget_schedule is not None:
        spec["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in settings.budget_schedule]
        schedule = schedule_text(settings.budget_schedule)
        note += f" load-adaptive budget {schedule} (requests in flight FIRST-LAST: nodes verified per tree)"
    elif settings.fixed_budget:
        spec["budget_policy"] = "fixed"
        note += " fixed budget (budget_policy fixed)"
    elif on_mrv2:  # the serving default: budget_policy load_adaptive
        from ubtree_vllm.vllm.config import default_budget_schedule

        schedule = schedule_text(default_budget_schedule(budget))
        note += f" load-adaptive budget {schedule} (the default policy; requests in flight FIRST-LAST: nodes per tree)"
    # always named; "auto" (the serving default) is resolved by the engine, which bench/engines.py then asks
    spec["tree_attention"] = tree_attention
    if tree_attention != TREE_ATTENTION_AUTO:
        note += f" tree_attention={tree_attention}"
    return MethodRun(method, spec, tree_budget=budget, beam_width=width, top_k=settings.top_k,
                     block_size=settings.block_size, note=note, env=dict(env), budget_schedule=schedule,
                     tree_attention=tree_attention, coupled_edge_weight=edge_weight)


def with_served_attention(run: MethodRun, served: str | None) -> MethodRun:
    """``run`` naming the tree-attention mode its engine serves (None on the CPU); the note says where "auto" chose
    it."""
    note = run.note
    if run.tree_attention == TREE_ATTENTION_AUTO:
        note += f" tree_attention auto (served {served or 'by the CPU backend'})"
    return dataclasses.replace(run, tree_attention=served, note=note)


def ngram_run(settings: E2ESettings) -> MethodRun:
    """vLLM's n-gram prompt lookup: k = --ngram-k tokens per round (the record's B; W = K = 1), no drafter."""
    k, low, high = settings.ngram_k, settings.ngram_lookup_min, settings.ngram_lookup_max
    return MethodRun("ngram", {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": high,
                               "prompt_lookup_min": low},
                     tree_budget=k, beam_width=1, top_k=1,
                     note=f"vLLM n-gram prompt lookup: k={k} tokens per round, lookup window {low}-{high} tokens")


def mtp_run(settings: E2ESettings) -> MethodRun:
    """vLLM's MTP speculation: the target's own MTP layers draft --mtp-k tokens per round (the record's B; W = K =
    1), no drafter."""
    k = settings.mtp_k
    return MethodRun("mtp", {"method": "mtp", "num_speculative_tokens": k}, tree_budget=k, beam_width=1, top_k=1,
                     note=f"vLLM MTP: the target's multi-token-prediction layers, a chain of k={k} tokens per round")


def ubtree_chain_run(settings: E2ESettings, note: str = "") -> MethodRun:
    """The single proposer path through the plugin: B = gamma, W = 1, K = 1 (V1 runner, as ``ubtree``)."""
    gamma = settings.block_size
    return MethodRun("ubtree-chain", {"method": "ubtree", "model": str(settings.drafter),
                                      "num_speculative_tokens": gamma, "beam_width": 1, "top_k": 1,
                                      "prompt_lookup": False},
                     tree_budget=gamma, beam_width=1, top_k=1, block_size=settings.block_size, note=note,
                     env=dict(TREE_METHODS["ubtree"]))


def dflash_chain_run(settings: E2ESettings, proposer_dir: str | Path, num_speculative_tokens: int) -> MethodRun:
    """vLLM's DFlash on the exported proposer folder (see drafter/io.py:export_dflash_proposer)."""
    return MethodRun("dflash-chain", {"method": "dflash", "model": str(proposer_dir),
                                      "num_speculative_tokens": num_speculative_tokens},
                     tree_budget=num_speculative_tokens, beam_width=1, top_k=1, block_size=settings.block_size)


def planned_methods(settings: E2ESettings) -> list[str]:
    """Engine labels in run order: 'ar', 'ngram', 'dflash-chain', then '<tree method>:B' per budget and tree-attention
    mode ('<tree method>:B@<mode>' for a mode other than "auto"; :func:`parse_label` reads them back)."""
    order = [m for m in METHODS if m in settings.methods]
    labels: list[str] = []
    for method in order:
        if method not in TREE_METHODS:
            labels.append(method)
            continue
        labels += [f"{method}:{b}" + ("" if mode == TREE_ATTENTION_AUTO else f"@{mode}")
                   for b in settings.tree_budgets for mode in settings.tree_attention]
    return labels


def planned_engines(settings: E2ESettings) -> list[tuple[str, E2ESettings]]:
    """(label, the settings its engine runs with) in run order: :func:`planned_methods` with ``--drafter``, then the
    labels that draft again with each of ``--compare-drafters`` (validated, drafter facts filled in)."""
    engines = [(label, settings) for label in planned_methods(settings)]
    for other in settings.compare_drafters:
        alt = validate(dataclasses.replace(settings, drafter=other, compare_drafters=()), check_datasets=False)
        engines += [(label, alt) for label in planned_methods(alt) if label not in DRAFTER_FREE_METHODS]
    return engines


def parse_label(label: str) -> tuple[str, int | None, str]:
    """(method, B or None, tree-attention mode) of a :func:`planned_methods` label."""
    method, _, rest = label.partition(":")
    budget, _, mode = rest.partition("@")
    return method, int(budget) if budget else None, mode or TREE_ATTENTION_AUTO
