"""Prompt sets for `ubtree bench e2e`: token-id prompts per dataset, built before any engine.

The default source is the eval-tau one (training/evaluate.py): the same prompt files,
subsets and chat template, so vLLM speed records and reference-decoder tau records of a
dataset describe the same prompts. Callers (tests) may pass their own `PromptSet`s
instead, e.g. raw token ids for a tiny random target without a tokenizer.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PromptSet:
    """One dataset's prompts, ready for vLLM's TokensPrompt."""

    dataset: str
    # token ids of each prompt (already in the target's chat template)
    prompts: tuple[tuple[int, ...], ...]
    # extra stop ids (the target's EOS ids from tokenizer + generation config)
    stop_token_ids: tuple[int, ...] = ()


def dataset_prompt_sets(target_path: str | Path, datasets: Sequence[str], data_dir: str | Path,
                        num_prompts: int) -> list[PromptSet]:
    """The first `num_prompts` prompts of each dataset as one user turn in the target's chat template."""
    from ubtree_vllm.training.data import chat_prompt_ids, load_tokenizer_and_eos
    from ubtree_vllm.training.evaluate import load_eval_prompts

    tokenizer, eos = load_tokenizer_and_eos(target_path)
    sets = []
    for dataset in datasets:
        texts = load_eval_prompts(dataset, data_dir, num_prompts)
        sets.append(PromptSet(dataset, tuple(tuple(chat_prompt_ids(tokenizer, t)) for t in texts), tuple(eos)))
    return sets
