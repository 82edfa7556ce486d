"""`ubtree bench e2e --agreement`: how often a speculative method's greedy output differs from no speculation.

Speculative decoding is lossless in exact arithmetic; in bf16 a tree step's rows are computed
in other kernels and batch shapes than one-token decoding, so near-ties between the top two
logits can flip. With the flag every planned engine answers the same prompts greedily
(T = 0) and each method's token ids are compared, prompt by prompt, with the `ar` run of the
same invocation. One microbench record per (method, dataset):

  greedy_divergence_rate  prompts whose output differs from ar's / prompts (unit "fraction");
                          the notes give the count and the mean index of the first differing token.

No e2e (speed) records are written in this mode. Pure functions here; run_e2e drives the engines.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ubtree_vllm.bench.settings import MethodRun

METRIC = "greedy_divergence_rate"


def first_divergence(reference: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first token where `got` differs from `reference` (a length difference counts); None if equal."""
    for i, (a, b) in enumerate(zip(reference, got)):
        if a != b:
            return i
    return None if len(reference) == len(got) else min(len(reference), len(got))


def tokens_in_prompt_order(outputs: Sequence[Any], prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The output token ids of finished RequestOutputs, reordered to `prompts` (matched by prompt token ids)."""
    slots: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(prompts):
        slots.setdefault(tuple(prompt), []).append(i)
    ordered: list[list[int] | None] = [None] * len(prompts)
    for out in outputs:
        waiting = slots.get(tuple(out.prompt_token_ids))
        if not waiting:
            raise ValueError("an output's prompt is not among the run's prompts")
        ordered[waiting.pop(0)] = list(out.outputs[0].token_ids)
    missing = [i for i, tokens in enumerate(ordered) if tokens is None]
    if missing:
        raise ValueError(f"no output for prompt(s) {missing}")
    return ordered  # type: ignore[return-value]


def agreement_record(run: MethodRun, reference: Sequence[Sequence[int]], got: Sequence[Sequence[int]], *,
                     target: str, drafter: str | None, dataset: str, concurrency: int, max_new_tokens: int,
                     cuda_graphs: bool, tau: float | None, tp: int = 1) -> dict[str, Any]:
    """The microbench record of one method's greedy outputs against ar's on the same prompts."""
    if len(reference) != len(got) or not reference:
        raise ValueError(f"need the same non-zero number of outputs, got {len(reference)} and {len(got)}")
    firsts = [f for f in (first_divergence(r, g) for r, g in zip(reference, got)) if f is not None]
    mean_first = f"{sum(firsts) / len(firsts):.1f}" if firsts else "-"
    notes = (f"ubtree bench e2e --agreement: {len(firsts)} of {len(reference)} greedy outputs differ from ar's in "
             f"the same invocation (mean index of the first differing token {mean_first}; at most {concurrency} "
             f"request(s) in flight)")
    return {"kind": "microbench", "method": run.method, "target": target,
            "drafter": drafter if run.uses_drafter else None, "dataset": dataset, "num_prompts": len(reference),
            "max_new_tokens": max_new_tokens, "temperature": 0.0, "batch_size": concurrency,
            "concurrency": concurrency, "tp": tp, "cuda_graphs": cuda_graphs, "tree_budget": run.tree_budget,
            "beam_width": run.beam_width, "top_k": run.top_k, "block_size": run.block_size,
            "budget_schedule": run.budget_schedule, "tree_attention": run.tree_attention,
            "tau": None if tau is None else round(tau, 4), "metric": METRIC,
            "value": round(len(firsts) / len(reference), 5), "unit": "fraction", "notes": notes}
