"""Benchmark prompt sets by name (torch-free, so flag checks need no torch): the three sets and Spec-Bench's tasks.

``spec_bench``, ``mt_bench``, ``humaneval`` (``training/evaluate.py:load_eval_prompts`` reads them), and
``spec_bench:<task>``: the rows of one Spec-Bench task, file order, e.g. ``spec_bench:summarization`` or
``spec_bench:rag``, where copying from the prompt lives (issue 16: the prompt-lookup branch by category).
"""
from __future__ import annotations

from collections.abc import Sequence

EVAL_DATASETS = ("spec_bench", "mt_bench", "humaneval")
# Spec-Bench's own tasks (its other 80 rows are MT-Bench's questions, ten per MT-Bench category)
SPEC_BENCH_TASKS = ("translation", "summarization", "qa", "math_reasoning", "rag")
TASK_SEPARATOR = ":"


def allowed_datasets() -> tuple[str, ...]:
    """Every accepted name, for error messages."""
    return (*EVAL_DATASETS, *(f"spec_bench{TASK_SEPARATOR}{task}" for task in SPEC_BENCH_TASKS))


def spec_bench_task(dataset: str) -> str | None:
    """The task of a ``spec_bench:<task>`` name; None for the three whole sets. ValueError naming the allowed
    names for anything else."""
    if dataset in EVAL_DATASETS:
        return None
    base, sep, task = dataset.partition(TASK_SEPARATOR)
    if base == "spec_bench" and sep and task in SPEC_BENCH_TASKS:
        return task
    raise ValueError(f"dataset must be one of {', '.join(allowed_datasets())}, got {dataset!r}")


def check_eval_datasets(datasets: Sequence[str]) -> None:
    """:func:`spec_bench_task` on every name (its ValueError), before any model or file is loaded."""
    for dataset in datasets:
        spec_bench_task(dataset)
