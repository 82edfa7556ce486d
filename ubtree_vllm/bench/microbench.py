"""`ubtree bench microbench`: per-round times of UBTree stages, appended as microbench records.

Registry: :data:`MICROBENCHES` maps a `--which` name to a :class:`Microbench`: a function
`(MicrobenchSettings) -> list[record dict]` plus whether it needs a CUDA device and the
drafter; adding a microbenchmark means adding one function and one entry here (and its
name to bench/cli.py:MICROBENCH_NAMES). `run_microbenches` checks every requested entry
(known name, CUDA present for GPU-only ones, `--drafter` for those that use it) before
running any. Entries:

  draft-postprocess        (CPU or GPU, uses --drafter) below
  tree-attention-vs-flash  (GPU only) bench/attention_bench.py: Triton tree attention vs
                           vLLM's FlashAttention on a Qwen3-8B layer, per --context-lens
  tree-attention-numerics  (GPU only) bench/attention_numerics.py: the tree rows' attention (Triton, flash_merge)
                           and plain decoding's FlashAttention for the same tokens, each against fp32, in
                           bf16 ulps, at Qwen3-8B's and SmolLM2's attention shapes, per --context-lens; and
                           how often a linear layer's output bits change with the verification's row count
  fa3-virtual-rows         (GPU only) bench/fa3_virtual_rows.py: whether one FlashAttention 3 call over every
                           tree row, each a sequence of its own, gives plain decoding's bits, with FA3's own
                           split counts and with the lone-decode counts pinned (mrv2.md §13's exact form)
  verify-forward           (GPU only) bench/verify_bench.py: one vLLM forward of 65 vs 17
                           new tokens on a dummy Qwen3-8B over a cached 1024-token context
  projection               (GPU only) bench/projection.py: UBTree's round cost in plain steps on a dummy
                           Qwen3-8B with an untrained drafter of its shape (B = 16/32/64, 1 and 32
                           requests in flight), for the report's projected speedups at tau = 4, 6, 8
  grammar-rows             (host) bench/grammar_bench.py: the scheduler's structured-output rows of one
                           B-node tree (xgrammar, JSON schema, the default target's tokenizer)
  tree-linear-state        (GPU only) bench/linear_state_bench.py: a Qwen3-Next GDN layer's tree step and
                           commit in both state forms (per-node states vs path recompute), time and peak
                           memory, 1 and 32 requests
  draft-stage              (CPU or GPU, uses --drafter) the whole drafting stage of a round as the
                           vLLM proposer runs it (backbone over DRAFT_STAGE_CONTEXT committed
                           positions, top-K, selector, tree), eager and, on CUDA, replayed from
                           its CUDA graph (vllm/draft_graphs.py); plus the acceptance walk
                           over the resulting tree as the V1 sampler runs it (verify/accept.py:
                           walk_trees, the Triton tree_accept on CUDA)

draft-postprocess: everything of a drafting round after the drafter backbone, i.e. the
serving path `UBTreeDrafter.draft_tree` minus `block_hidden`, calling the real functions:
  lm_head_topk       `UBTreeDrafter.top_k_candidates`: target LM head over the gamma block
                     hidden states, then the top-K per depth with its log-probs (on CUDA the one-pass
                     kernel triton_ops/vocab_top_k.py; its torch twin, a float32 log-softmax and
                     torch.topk, is also timed there, metric `lm_head_topk_torch_ms`)
  selector_scoring   `BigramSelector.score_tree_edges`: all K + (gamma - 1) K^2 edges
  tree_construction  `tree.search.construct_tree`: depth-wise beam + pruning to B nodes (on CUDA the
                     one-launch Triton kernel; its torch form `build_tree` is also timed there,
                     metric `tree_construction_torch_ms`)
  total              the three back to back (metric `draft_postprocess_ms`)
  graphed            on CUDA, the three back to back replayed from one CUDA graph, as the
                     proposer serves them (metric `draft_postprocess_graphed_ms`)
Inputs are random but shaped and distributed like serving: the drafter's own weights
(loaded from `--drafter`, bf16 on CUDA, fp32 on CPU), a random target embedding / LM head
of the drafter's [V, H] (std 0.02; serving binds the real ones, whose values do not change
the work), standard-normal block hidden states and random anchors; each stage consumes the
previous stage's real output, so top-K tokens are distinct per depth as in serving.
Selector tables are precomputed once, as at engine load. Timing: bench/timing.py.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ubtree_vllm.bench.records import hardware
from ubtree_vllm.bench.settings import BenchArgumentError, parse_list
from ubtree_vllm.bench.timing import GRAPH_CLOCK, TOTAL, summarize, time_launches, time_stages

# stage name (bench/timing.py) -> record metric
DRAFT_POSTPROCESS_METRICS = {
    "lm_head_topk": "lm_head_topk_ms",
    "selector_scoring": "selector_scoring_ms",
    "tree_construction": "tree_construction_ms",
    TOTAL: "draft_postprocess_ms",
}


@dataclass(frozen=True)
class MicrobenchSettings:
    drafter: str | None = None
    device: str = "auto"
    iters: int = 50
    warmup: int = 10
    tree_budget: int = 64
    beam_width: int = 12
    top_k: int = 64
    num_reqs: int = 1
    seed: int = 0
    # tree-attention-vs-flash: committed context lengths
    context_lens: tuple[int, ...] = (512, 2048, 8192)
    # verify-forward, projection: Qwen3-8B config.json overrides (tests: fewer layers) and vLLM engine overrides
    verify_config_overrides: Mapping[str, Any] | None = None
    verify_engine_kwargs: Mapping[str, Any] | None = None
    # projection: the tree budgets measured (one engine each, beside ar)
    projection_budgets: tuple[int, ...] = (16, 32, 64)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cuda", "cpu") and not name.startswith("cuda:"):
        raise BenchArgumentError(f"--device must be auto, cuda, cuda:N or cpu, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise BenchArgumentError(f"--device {name}: torch sees no CUDA device")
    return torch.device(name)


def _check_counts(settings: MicrobenchSettings) -> None:
    for flag, value in (("--iters", settings.iters), ("--num-reqs", settings.num_reqs)):
        if value < 1:
            raise BenchArgumentError(f"{flag} must be >= 1, got {value}")
    if settings.warmup < 0:
        raise BenchArgumentError(f"--warmup must be >= 0, got {settings.warmup}")


def draft_postprocess(settings: MicrobenchSettings) -> list[dict[str, Any]]:
    """Records (one per stage + total) of the draft post-processing microbenchmark."""
    from ubtree_vllm.tree.search import build_tree, construct_tree
    from ubtree_vllm.triton_ops.reference import vocab_top_k_reference

    _check_counts(settings)
    device = resolve_device(settings.device)
    if settings.drafter is None:
        raise BenchArgumentError("--drafter is required for --which draft-postprocess")
    gen = torch.Generator(device=device).manual_seed(settings.seed)
    drafter, tree_cfg, dtype = _bound_drafter(settings, device, gen)
    cfg = drafter.cfg
    # [N, gamma, H] block hidden states; [N] anchors
    hidden = torch.randn(settings.num_reqs, cfg.block_size, cfg.hidden_size, generator=gen, device=device,
                         dtype=dtype)
    anchor = torch.randint(0, cfg.vocab_size, (settings.num_reqs,), generator=gen, device=device)

    def score(cands):
        root, trans = drafter.selector.score_tree_edges(anchor, cands.tokens, cands.logp, cands.hidden,
                                                              drafter.embed_weight)
        return cands, root, trans

    stages = [
        ("lm_head_topk", lambda h: drafter.top_k_candidates(h, tree_cfg.top_k)),
        ("selector_scoring", score),
        ("tree_construction", lambda x: construct_tree(anchor, x[0].tokens, x[1], x[2], tree_cfg)),
    ]
    with torch.inference_mode():
        medians = summarize(time_stages(stages, hidden, device, settings.iters, settings.warmup))
    notes = (f"{_timing_notes(settings, device, dtype)} per round; random hidden states and random [V, H] "
             f"embedding/LM head; stages: UBTreeDrafter.top_k_candidates, BigramSelector.score_tree_edges, "
             f"tree.search.construct_tree")
    records = [_drafter_record(settings, cfg, tree_cfg, device, metric, medians[stage], notes)
               for stage, metric in DRAFT_POSTPROCESS_METRICS.items()]
    if device.type == "cuda":  # as served: the proposer replays drafting from a CUDA graph (vllm/draft_graphs.py)
        def postprocess() -> Any:
            value = hidden
            for _, fn in stages:
                value = fn(value)
            return value

        with torch.inference_mode():
            times, clock = time_launches(postprocess, device, settings.iters, settings.warmup)
        records.append(_drafter_record(
            settings, cfg, tree_cfg, device, "draft_postprocess_graphed_ms", statistics.median(times),
            f"{notes}; the three stages back to back, {clock}", cuda_graphs=clock == GRAPH_CLOCK))
        # The torch form of the tree search (the CPU path and the Triton kernel's oracle), for comparison.
        with torch.inference_mode():
            cands = drafter.top_k_candidates(hidden, tree_cfg.top_k)
            _, root, trans = score(cands)
            torch_ms = summarize(time_stages([("build_tree", lambda _: build_tree(anchor, cands.tokens, root, trans,
                                                                                  tree_cfg))],
                                             None, device, settings.iters, settings.warmup))["build_tree"]
        records.append(_drafter_record(settings, cfg, tree_cfg, device, "tree_construction_torch_ms", torch_ms,
                                       f"{notes}; tree.search.build_tree (torch ops) instead of the Triton kernel"))
        # ... and of the top K (a full-vocabulary log-softmax and torch.topk), beside the one-pass kernel
        with torch.inference_mode():
            topk_torch_ms = summarize(time_stages(
                [("topk_torch", lambda h: vocab_top_k_reference(
                    drafter.lm_head_logits(h).reshape(-1, cfg.vocab_size), tree_cfg.top_k))],
                hidden, device, settings.iters, settings.warmup))["topk_torch"]
        records.append(_drafter_record(settings, cfg, tree_cfg, device, "lm_head_topk_torch_ms", topk_torch_ms,
                                       f"{notes}; the LM head, then triton_ops.reference.vocab_top_k_reference "
                                       f"(float32 log-softmax over the vocabulary, torch.topk) instead of the "
                                       f"one-pass kernel"))
    return records


DRAFT_STAGE_CONTEXT = 512


def _bound_drafter(settings: MicrobenchSettings, device: torch.device, gen: torch.Generator):
    """(drafter bound to a random [V, H] embedding / LM head, tree config, dtype) for the drafter entries."""
    from ubtree_vllm.config import UBTreeConfig
    from ubtree_vllm.drafter.io import load_drafter

    if settings.drafter is None or not Path(settings.drafter).is_dir():
        raise BenchArgumentError(f"--drafter: drafter folder not found: {settings.drafter}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    drafter = load_drafter(settings.drafter, device=device, dtype=dtype)
    cfg = drafter.cfg
    try:
        tree_cfg = UBTreeConfig(tree_budget=settings.tree_budget, beam_width=min(settings.beam_width,
                                settings.tree_budget), top_k=settings.top_k, block_size=cfg.block_size)
        tree_cfg.check_vocab(cfg.vocab_size)
    except ValueError as exc:
        raise BenchArgumentError(f"--tree-budget/--beam-width/--top-k: {exc}") from None
    embed = 0.02 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, device=device, dtype=dtype)
    head = 0.02 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen, device=device, dtype=dtype)
    drafter.bind_target(embed, head)  # eval mode: precomputes the selector tables
    return drafter, tree_cfg, dtype


def _timing_notes(settings: MicrobenchSettings, device: torch.device, dtype: torch.dtype) -> str:
    clock = "CUDA events" if device.type == "cuda" else "time.perf_counter"
    return (f"median over {settings.iters} rounds after {settings.warmup} warm-up ({clock}), "
            f"{device.type} {str(dtype).removeprefix('torch.')}, {settings.num_reqs} request(s)")


def _drafter_record(settings: MicrobenchSettings, cfg: Any, tree_cfg: Any, device: torch.device, metric: str,
                    value: float, notes: str, cuda_graphs: bool = False) -> dict[str, Any]:
    """One ms record of a drafter microbenchmark (draft-postprocess, draft-stage)."""
    return {"kind": "microbench", "method": "ubtree", "target": cfg.target_name, "drafter": str(settings.drafter),
            "metric": metric, "value": round(value, 5), "unit": "ms", "batch_size": settings.num_reqs,
            "tree_budget": tree_cfg.tree_budget, "beam_width": tree_cfg.beam_width, "top_k": tree_cfg.top_k,
            "block_size": tree_cfg.block_size, "cuda_graphs": cuda_graphs, "hardware": hardware(device.type),
            "notes": notes}


def draft_stage(settings: MicrobenchSettings) -> list[dict[str, Any]]:
    """Records of the whole drafting stage (eager; graphed on CUDA) and of the acceptance walk."""
    from ubtree_vllm.types import DraftContext
    from ubtree_vllm.verify.accept import walk_trees
    from ubtree_vllm.vllm.draft_graphs import DraftGraphs

    _check_counts(settings)
    device = resolve_device(settings.device)
    gen = torch.Generator(device=device).manual_seed(settings.seed)
    drafter, tree_cfg, dtype = _bound_drafter(settings, device, gen)
    cfg = drafter.cfg
    num_reqs, width = settings.num_reqs, DRAFT_STAGE_CONTEXT
    positions = torch.arange(width, device=device)[None, :].expand(num_reqs, width)
    ctx = DraftContext(anchor=torch.randint(0, cfg.vocab_size, (num_reqs,), generator=gen, device=device),
                       anchor_pos=torch.full((num_reqs,), width, device=device),
                       features=torch.randn(num_reqs, width, cfg.num_features, generator=gen, device=device,
                                            dtype=dtype),
                       positions=positions, valid=torch.ones(num_reqs, width, dtype=torch.bool, device=device),
                       tokens=positions)
    stages = [("draft_stage_eager", lambda c: drafter.draft_tree(c, tree_cfg))]
    if device.type == "cuda":
        graphs = DraftGraphs(drafter, tree_cfg, device)
        stages.append(("draft_stage_graphed", lambda _: graphs(ctx)))
    with torch.inference_mode():
        tree = drafter.draft_tree(ctx, tree_cfg)
        draws = torch.randint(0, cfg.vocab_size, tree.tokens.shape, generator=gen, device=device)
        draws[:, 0] = tree.tokens[:, 1]  # the root's draw matches its first child: a walk of depth >= 1
        # the serving dispatch: the one-launch Triton walk on CUDA, accept_tree elsewhere
        stages.append(("acceptance", lambda _: walk_trees(tree.parents, tree.tokens, tree.depth, draws,
                                                         tree_cfg.block_size)))
        medians = summarize(time_stages(stages, ctx, device, settings.iters, settings.warmup))
    notes = (f"{_timing_notes(settings, device, dtype)}, context {width}; random features and random [V, H] "
             f"embedding/LM head; UBTreeDrafter.draft_tree eager, DraftGraphs replay (CUDA), "
             f"verify.accept.walk_trees (Triton tree_accept on CUDA, accept_tree elsewhere)")
    return [_drafter_record(settings, cfg, tree_cfg, device, f"{stage}_ms", medians[stage], notes,
                            cuda_graphs=stage == "draft_stage_graphed") for stage, _ in stages]


def _cuda_device(settings: MicrobenchSettings, name: str) -> torch.device:
    """The CUDA device a GPU-only entry runs on; BenchArgumentError naming the entry otherwise."""
    if not torch.cuda.is_available():
        raise BenchArgumentError(f"--which {name} needs a CUDA device (torch.cuda.is_available() is False)")
    device = resolve_device(settings.device)
    if device.type != "cuda":
        raise BenchArgumentError(f"--which {name} needs a CUDA device, got --device {settings.device}")
    return device


def tree_attention_vs_flash(settings: MicrobenchSettings) -> list[dict[str, Any]]:
    """Records of the tree-attention kernel against FlashAttention, per context length (GPU only)."""
    from ubtree_vllm.bench.attention_bench import attention_records, time_tree_vs_flash

    _check_counts(settings)
    if not settings.context_lens or any(c < 0 for c in settings.context_lens):
        raise BenchArgumentError(f"--context-lens: each value must be >= 0, got {list(settings.context_lens)}")
    device = _cuda_device(settings, "tree-attention-vs-flash")
    timings = [time_tree_vs_flash(c, device, settings.iters, settings.warmup, settings.seed)
               for c in settings.context_lens]
    return attention_records(timings, iters=settings.iters, warmup=settings.warmup, hardware=hardware(device.type))


def _check_page_multiples(settings: MicrobenchSettings, name: str) -> None:
    """--context-lens of the numerics entries: whole pages (the paths' pages follow the context's)."""
    from ubtree_vllm.bench.attention_numerics import SHAPES

    page = min(shape.block_size for shape in SHAPES)
    if not settings.context_lens or any(c < 0 or c % page for c in settings.context_lens):
        raise BenchArgumentError(f"--context-lens: each value must be a multiple of the page size {page} for "
                                 f"{name}, got {list(settings.context_lens)}")


def tree_attention_numerics(settings: MicrobenchSettings) -> list[dict[str, Any]]:
    """Records of the tree rows' attention error against fp32 and plain decoding's, per shape and context (GPU only)."""
    from ubtree_vllm.bench.attention_numerics import SHAPES, linear_records, measure, numerics_records

    _check_page_multiples(settings, "tree-attention-numerics")
    device = _cuda_device(settings, "tree-attention-numerics")
    results = [measure(shape, c, device, settings.seed) for shape in SHAPES for c in settings.context_lens]
    linear = [r for shape in SHAPES for r in linear_records(shape, device, hardware(device.type), settings.seed)]
    return numerics_records(results, hardware(device.type)) + linear


def fa3_virtual_rows(settings: MicrobenchSettings) -> list[dict[str, Any]]:
    """Records of one FlashAttention 3 call over every tree row against one call per row (GPU only)."""
    from ubtree_vllm.bench.attention_numerics import SHAPES
    from ubtree_vllm.bench.fa3_virtual_rows import measure, virtual_rows_records

    _check_page_multiples(settings, "fa3-virtual-rows")
    device = _cuda_device(settings, "fa3-virtual-rows")
    results = [measure(shape, c, device, settings.seed) for shape in SHAPES for c in settings.context_lens]
    return virtual_rows_records(results, hardware(device.type))


def verify_forward(settings: MicrobenchSettings) -> list[dict[str, Any]]:
    """Records of the 65- vs 17-token verification forward on a dummy Qwen3-8B (GPU only)."""
    from ubtree_vllm.bench.verify_bench import (CONTEXT_LEN, time_verify_forward, verify_records,
                                                write_target_config)

    _check_counts(settings)
    device = _cuda_device(settings, "verify-forward")
    overrides = dict(settings.verify_config_overrides or {})
    engine_kwargs = dict(settings.verify_engine_kwargs or {})
    with tempfile.TemporaryDirectory(prefix="ubtree-verify-") as folder:
        write_target_config(folder, overrides)
        medians, min_hits = time_verify_forward(folder, context_len=CONTEXT_LEN, iters=settings.iters,
                                                warmup=settings.warmup, seed=settings.seed, **engine_kwargs)
    target = "qwen3-8b-dummy" + "".join(f" {k}={v}" for k, v in sorted(overrides.items()))
    return verify_records(medians, context_len=CONTEXT_LEN, iters=settings.iters, warmup=settings.warmup,
                          hardware=hardware(device.type), min_cache_hits=min_hits, target=target,
                          cuda_graphs=not engine_kwargs.get("enforce_eager", False))


def projection(settings: MicrobenchSettings) -> Iterator[dict[str, Any]]:
    """Round-cost records on a dummy Qwen3-8B with an untrained drafter of its shape (GPU only)."""
    from ubtree_vllm.bench.projection import run_projection

    _cuda_device(settings, "projection")
    if not settings.projection_budgets or min(settings.projection_budgets) < 1:
        raise BenchArgumentError(f"--projection-budgets must be positive tree budgets, got {settings.projection_budgets}")
    return run_projection(seed=settings.seed, target_overrides=settings.verify_config_overrides,
                          engine_kwargs=settings.verify_engine_kwargs, budgets=settings.projection_budgets)


def grammar_rows(settings: MicrobenchSettings) -> list[dict[str, Any]]:
    """Structured output's per-round scheduler cost for a B-node tree (host only)."""
    from ubtree_vllm.bench.grammar_bench import grammar_rows as run

    _check_counts(settings)
    return run(settings)


def tree_linear_state(settings: MicrobenchSettings) -> list[dict[str, Any]]:
    """A hybrid layer's tree step in both state forms: per-node states vs path recompute (GPU only)."""
    from ubtree_vllm.bench.linear_state_bench import tree_linear_state as run

    _check_counts(settings)
    return run(settings, _cuda_device(settings, "tree-linear-state"))


@dataclass(frozen=True)
class Microbench:
    run: Callable[[MicrobenchSettings], Iterable[dict[str, Any]]]
    gpu_only: bool
    uses_drafter: bool


MICROBENCHES: dict[str, Microbench] = {
    "draft-postprocess": Microbench(draft_postprocess, gpu_only=False, uses_drafter=True),
    "tree-attention-vs-flash": Microbench(tree_attention_vs_flash, gpu_only=True, uses_drafter=False),
    "tree-attention-numerics": Microbench(tree_attention_numerics, gpu_only=True, uses_drafter=False),
    "fa3-virtual-rows": Microbench(fa3_virtual_rows, gpu_only=True, uses_drafter=False),
    "verify-forward": Microbench(verify_forward, gpu_only=True, uses_drafter=False),
    "draft-stage": Microbench(draft_stage, gpu_only=False, uses_drafter=True),
    "projection": Microbench(projection, gpu_only=True, uses_drafter=False),
    "grammar-rows": Microbench(grammar_rows, gpu_only=False, uses_drafter=False),
    "tree-linear-state": Microbench(tree_linear_state, gpu_only=True, uses_drafter=False),
}


def check_selection(names: tuple[str, ...], settings: MicrobenchSettings) -> None:
    """BenchArgumentError naming the flag and entry for an unknown / repeated name, a GPU-only entry
    without CUDA, or a drafter-using entry without --drafter; runs nothing."""
    unknown = [n for n in names if n not in MICROBENCHES]
    if unknown:
        raise BenchArgumentError(f"--which: unknown microbenchmark {unknown[0]!r}; allowed: "
                                 f"{', '.join(MICROBENCHES)}, all")
    if not names:
        raise BenchArgumentError("--which lists no microbenchmark")
    if len(set(names)) != len(names):
        raise BenchArgumentError(f"--which lists a microbenchmark twice: {','.join(names)}")
    for name in names:
        if MICROBENCHES[name].gpu_only:
            _cuda_device(settings, name)
    drafter_users = [n for n in names if MICROBENCHES[n].uses_drafter]
    if drafter_users and settings.drafter is None:
        raise BenchArgumentError(f"--drafter is required for --which {','.join(drafter_users)}")


def parse_which(value: str) -> tuple[str, ...]:
    """`--which` value -> entry names ('all': every registered entry, in registry order)."""
    names = parse_list("--which", value, str, "microbenchmark names")
    return tuple(MICROBENCHES) if names == ("all",) else names


def run_microbenches(names: tuple[str, ...], settings: MicrobenchSettings,
                     records_path: str | Path | None = None) -> list[dict[str, Any]]:
    """Run the named microbenchmarks; append their records when `records_path` is given, each as soon as its entry
    produces it (an entry may be a generator: projection yields a record per measured cell)."""
    from ubtree_vllm.bench.records import append_record

    check_selection(names, settings)
    rows = []
    for name in names:
        for record in MICROBENCHES[name].run(settings):
            rows.append(append_record(record, records_path) if records_path is not None else record)
    return rows


def summary_fields(record: Mapping[str, Any]) -> str:
    """The printed context of one record: its tree fields (those set) and hardware."""
    fields = [f"{label}={record[key]}" for label, key in (("target", "target"), ("B", "tree_budget"),
                                                          ("W", "beam_width"), ("K", "top_k"),
                                                          ("gamma", "block_size"))
              if record.get(key) is not None]
    return ", ".join([" ".join(fields), record["hardware"]])


def run_cli(args: argparse.Namespace) -> int:
    settings = MicrobenchSettings(drafter=args.drafter, device=args.device, iters=args.iters, warmup=args.warmup,
                                  tree_budget=args.tree_budget, beam_width=args.beam_width, top_k=args.top_k,
                                  num_reqs=args.num_reqs,
                                  context_lens=parse_list("--context-lens", args.context_lens, int, "integers"),
                                  projection_budgets=parse_list("--projection-budgets", args.projection_budgets, int,
                                                                "integers"))
    records_path = None if args.no_record else args.records
    rows = run_microbenches(parse_which(args.which), settings, records_path)
    width = max(len(r["metric"]) for r in rows)
    for r in rows:
        print(f"{r['metric']:<{width}}  {r['value']:10.4f} {r['unit']:<2}  ({summary_fields(r)})")
    if records_path is not None and not args.no_report:
        from ubtree_vllm.bench.report import regenerate

        for path in regenerate(records_path):
            print(path)
    return 0
