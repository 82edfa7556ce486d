"""Acceptance length tau of a drafter, measured with the lossless HF reference decoder.

tau = tokens emitted by verification rounds / number of verification rounds, pooled over
all prompts of a dataset (the bonus token counts; the first token, sampled from the
prefill, does not). It is the mean tokens committed per target forward, the quantity
speculative decoding multiplies throughput by. This decoder is the correctness oracle,
not the speed path, so e2e records written here carry tau only (throughput, TPOT and
speedup are null) and say so in `notes`.

Methods (same drafter checkpoint, same code path):
  single  proposer top-1 chain: UBTreeConfig(tree_budget=gamma, beam_width=1, top_k=1)
  ubtree  the tree: UBTreeConfig(tree_budget=B, beam_width=W, top_k=K)

Datasets (read from `data_dir`, default ../shared/data; each prompt is one user turn in
the target's chat template, generation stops at the tokenizer's EOS or after
max_new_tokens):
  spec_bench  spec_bench_question.jsonl, first turns. `num_prompts` < 480 takes a fixed
              balanced subset: round-robin over the six Spec-Bench tasks (the 80 MT-Bench
              rows count as one task), file order within a task.
  spec_bench:<task>  the rows of one Spec-Bench task (translation, summarization, qa,
              math_reasoning, rag), first turns, file order (ubtree_vllm/eval_datasets.py).
  mt_bench    mt_bench_question.jsonl, first turns, file order.
  humaneval   HumanEval.jsonl.gz, the `prompt` field verbatim, file order.
"""
from __future__ import annotations

import gzip
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ubtree_vllm.config import SamplingConfig, UBTreeConfig
from ubtree_vllm.decoding.reference import ReferenceDecoder
from ubtree_vllm.drafter.io import load_drafter
from ubtree_vllm.eval_datasets import EVAL_DATASETS, SPEC_BENCH_TASKS, check_eval_datasets, spec_bench_task
from ubtree_vllm.training.data import chat_prompt_ids, load_tokenizer_and_eos, resolve_target_path

# CLI method name -> record method name
METHODS = {"single": "ubtree-single", "ubtree": "ubtree"}


def _jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def spec_bench_subset(rows: Sequence[dict[str, Any]], num_prompts: int) -> list[dict[str, Any]]:
    """Round-robin over Spec-Bench tasks (MT-Bench categories merged), file order within each."""
    tasks: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        task = row["category"] if row["category"] in SPEC_BENCH_TASKS else "mt_bench"
        tasks.setdefault(task, []).append(row)
    chosen, rank = [], 0
    while len(chosen) < min(num_prompts, len(rows)):
        for items in tasks.values():
            if rank < len(items) and len(chosen) < num_prompts:
                chosen.append(items[rank])
        rank += 1
    return chosen


def load_eval_prompts(dataset: str, data_dir: str | Path, num_prompts: int | None = None) -> list[str]:
    """Prompt texts of a benchmark (module docstring); `num_prompts` None means all."""
    root = Path(data_dir)
    task = spec_bench_task(dataset)  # ValueError naming the allowed names
    if task is not None:
        texts = [r["turns"][0] for r in _jsonl(root / "spec_bench_question.jsonl") if r["category"] == task]
        return texts if num_prompts is None else texts[:num_prompts]
    if dataset == "spec_bench":
        rows = _jsonl(root / "spec_bench_question.jsonl")
        if num_prompts is not None and num_prompts < len(rows):
            rows = spec_bench_subset(rows, num_prompts)
        return [r["turns"][0] for r in rows]
    if dataset == "mt_bench":
        texts = [r["turns"][0] for r in _jsonl(root / "mt_bench_question.jsonl")]
    else:  # humaneval
        texts = [r["prompt"] for r in _jsonl(root / "HumanEval.jsonl.gz")]
    return texts if num_prompts is None else texts[:num_prompts]


def tree_config(method: str, block_size: int, tree_budget: int, beam_width: int, top_k: int) -> UBTreeConfig:
    if method == "single":
        return UBTreeConfig(tree_budget=block_size, beam_width=1, top_k=1, block_size=block_size)
    if method == "ubtree":
        return UBTreeConfig(tree_budget=tree_budget, beam_width=beam_width, top_k=top_k, block_size=block_size)
    raise ValueError(f"method must be one of {sorted(METHODS)}, got {method!r}")


@dataclass
class TauResult:
    method: str
    dataset: str
    temperature: float
    num_prompts: int
    tau: float
    num_rounds: int
    num_tokens: int
    tree: UBTreeConfig
    wall_s: float


def measure_tau(decoder: ReferenceDecoder, prompts: Sequence[Sequence[int]], temperature: float, batch_size: int,
                max_new_tokens: int, seed: int, eos: Sequence[int]) -> tuple[int, int]:
    """(tokens emitted by verification rounds, rounds) over all prompts, in length-sorted batches."""
    order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
    tokens = rounds = 0
    for b, start in enumerate(range(0, len(order), batch_size)):
        batch = [prompts[i] for i in order[start:start + batch_size]]
        outputs = decoder.generate(batch, max_new_tokens, SamplingConfig(temperature=temperature), seed=seed + b,
                                   eos_token_ids=eos)
        tokens += sum(sum(o.tokens_per_round) for o in outputs)
        rounds += sum(len(o.tokens_per_round) for o in outputs)
    return tokens, rounds


def _drafter_notes(drafter_dir: Path) -> str:
    meta_path = drafter_dir / "ubtree_meta.json"
    if not meta_path.is_file():
        return ""
    meta = json.loads(meta_path.read_text())
    cfg = meta.get("training", {}).get("config", {})
    data = meta.get("data", {})
    return (f"; drafter trained with selector_loss={cfg.get('selector_loss')} beta={cfg.get('beta')} "
            f"T_train={data.get('temperature')}")


def load_target_and_drafter(drafter_dir: str | Path, target: str = "default", device: str = "auto"
                            ) -> tuple[torch.nn.Module, Any, Any, list[int]]:
    """(HF target, drafter bound to it, tokenizer, EOS ids) on ``device`` (auto: CUDA if any), both in eval mode:
    bf16 on CUDA, fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target_path = resolve_target_path(target)
    tokenizer, eos = load_tokenizer_and_eos(target_path)
    model = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).to(dev).eval()
    drafter = load_drafter(Path(drafter_dir), device=dev, dtype=dtype)
    drafter.bind_hf_target(model)
    drafter.eval()
    return model, drafter, tokenizer, eos


def evaluate(drafter_dir: str | Path, target: str = "default", datasets: Sequence[str] = EVAL_DATASETS,
             methods: Sequence[str] = ("single", "ubtree"), temperatures: Sequence[float] = (0.0, 1.0),
             num_prompts: int | None = None, batch_size: int = 16, max_new_tokens: int = 256,
             tree_budget: int = 64, beam_width: int = 12, top_k: int = 64, data_dir: str | Path = "../shared/data",
             device: str = "auto", seed: int = 0, records_path: str | None = "docs/benchmarks/records.jsonl",
             log: Callable[[str], None] = print) -> list[TauResult]:
    """Measure tau for every (dataset, method, temperature); one e2e record each."""
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"method must be one of {sorted(METHODS)}, got {m!r}")
    check_eval_datasets(datasets)  # before any model is loaded
    drafter_dir = Path(drafter_dir)
    model, drafter, tokenizer, eos = load_target_and_drafter(drafter_dir, target, device)
    gamma = drafter.cfg.block_size
    trees = {m: tree_config(m, gamma, tree_budget, beam_width, top_k) for m in methods}
    notes = _drafter_notes(drafter_dir)

    results = []
    for dataset in datasets:
        texts = load_eval_prompts(dataset, data_dir, num_prompts)
        prompts = [chat_prompt_ids(tokenizer, t) for t in texts]
        for method in methods:
            decoder = ReferenceDecoder(model, drafter, trees[method])
            for temperature in temperatures:
                started = time.monotonic()
                tokens, rounds = measure_tau(decoder, prompts, temperature, batch_size, max_new_tokens, seed, eos)
                tree = trees[method]
                result = TauResult(method, dataset, float(temperature), len(prompts), tokens / max(1, rounds),
                                   rounds, tokens, tree, time.monotonic() - started)
                results.append(result)
                log(f"eval-tau: {dataset} T={temperature:g} {method} (B={tree.tree_budget} W={tree.beam_width} "
                    f"K={tree.top_k}): tau {result.tau:.3f} over {rounds} rounds, {result.wall_s:.0f}s")
                if records_path:
                    from ubtree_vllm.bench.records import append_record
                    from ubtree_vllm.drafter.io import training_totals

                    append_record({
                        "kind": "e2e", "method": METHODS[method], "target": drafter.cfg.target_name,
                        "drafter": str(drafter_dir), "dataset": dataset, "num_prompts": len(prompts),
                        "max_new_tokens": max_new_tokens, "temperature": float(temperature),
                        "batch_size": batch_size, "tp": 1, "cuda_graphs": False,
                        "tree_budget": tree.tree_budget, "beam_width": tree.beam_width, "top_k": tree.top_k,
                        "block_size": tree.block_size, "tau": round(result.tau, 4),
                        **training_totals(drafter_dir),
                        "notes": (f"tau from the HF reference decoder (lossless tree verification), not the vLLM "
                                  f"speed path: {tokens} tokens / {rounds} verification rounds{notes}"),
                    }, path=records_path)
    return results
