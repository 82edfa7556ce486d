"""Run files: one YAML with a `data:` section (DataGenConfig) and a `train:` section (TrainConfig).

Command-line overrides are `KEY=VALUE` strings whose VALUE is parsed as YAML
(`beta=0`, `loss_decay=null`, `drafter.num_layers=1`); one level of dotting reaches into
a mapping-valued setting such as `drafter`. Unknown keys are rejected by the config
classes themselves, so a typo fails at start.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

SECTIONS = ("data", "train")


def read_section(path: str | Path | None, section: str) -> dict[str, Any]:
    """The mapping under `section` of the YAML run file (empty if `path` is None)."""
    if section not in SECTIONS:
        raise ValueError(f"section must be one of {SECTIONS}, got {section!r}")
    if path is None:
        return {}
    doc = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: a run file must be a mapping with sections {list(SECTIONS)}")  # noqa: TRY004 (config errors are ValueErrors)
    unknown = sorted(set(doc) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{path}: unknown top-level section(s) {unknown}; allowed: {list(SECTIONS)}")
    values = doc.get(section) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: section {section!r} must be a mapping")  # noqa: TRY004 (config errors are ValueErrors)
    return dict(values)


def apply_overrides(values: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return `values` updated by `KEY=VALUE` strings (module docstring)."""
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in values.items()}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like KEY=VALUE")
        value = yaml.safe_load(raw)
        head, dot, tail = key.partition(".")
        if dot:
            inner = out.setdefault(head, {})
            if not isinstance(inner, dict):
                raise ValueError(f"override {item!r}: {head!r} is not a mapping")
            inner[tail] = value
        else:
            out[key] = value
    return out
