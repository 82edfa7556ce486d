"""Every ``UBTREE_*`` environment variable, documented in one place.

Contract:

* :data:`ENVIRONMENT_VARIABLES` is the registry: name -> :class:`EnvVar`
  (default, parser, documentation).  Adding a variable means adding one entry.
* Values are read lazily, on every attribute access (``envs.UBTREE_CACHE_DIR``),
  through the module ``__getattr__``.  Nothing is cached, so a value set with
  ``os.environ`` or ``monkeypatch.setenv`` after import is honoured.
* No other module calls ``os.getenv``/``os.environ`` for a ``UBTREE_*`` name;
  they import this module and read the attribute.
* An unknown ``UBTREE_*`` attribute raises :class:`AttributeError` (typos fail
  loudly instead of silently reading the default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class EnvVar:
    """One environment variable: its unparsed default, its parser and its meaning."""

    # Value used when the variable is unset or empty (still passed through `parse`).
    default: str
    # Converts the raw string into the typed value handed to callers.
    parse: Callable[[str], Any]
    # One or two sentences for users; rendered by `describe()`.
    doc: str


def _flag(raw: str) -> bool:
    value = raw.strip().lower()
    if value not in ("0", "1", "true", "false"):
        raise ValueError(f"expected one of 0, 1, true, false, got {raw!r}")
    return value in ("1", "true")


def _choice(raw: str, allowed: tuple[str, ...]) -> str:
    value = raw.strip().lower()
    if value not in allowed:
        raise ValueError(f"expected one of {', '.join(allowed)}, got {raw!r}")
    return value


def _path(raw: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(raw))).absolute()


ENVIRONMENT_VARIABLES: dict[str, EnvVar] = {
    "UBTREE_CACHE_DIR": EnvVar(
        default="~/.cache/ubtree_vllm",
        parse=_path,
        doc=(
            "Directory for files the plugin derives once and reuses, e.g. the bf16 "
            "HF folder of the default target converted from its GGUF file."
        ),
    ),
    "UBTREE_DRAFT_CUDA_GRAPHS": EnvVar(
        default="1",
        parse=_flag,
        doc=(
            "1: replay the drafting stage (drafter, top-K, selector, tree search) from CUDA "
            "graphs whenever the engine uses CUDA graphs; 0: draft eagerly (debugging; slower)."
        ),
    ),
    "UBTREE_STAGE_TIMING": EnvVar(
        default="0",
        parse=lambda raw: _choice(raw, ("0", "1", "ranges")),
        doc=(
            "1: the UBTree runner times each stage of its steps, synchronizing the device at "
            "stage boundaries (diagnosis; `ubtree bench e2e --stage-timing` sets it); ranges: each "
            "stage is a torch.profiler range named ubtree:<stage>, no sync (`ubtree bench e2e --profile`); 0: off."
        ),
    ),
    "UBTREE_VLLM_RUNNER": EnvVar(
        default="auto",
        parse=lambda raw: _choice(raw, ("auto", "v1", "mrv2")),
        doc=(
            "vLLM model runner for 'ubtree' on CUDA (the CPU always runs V1): auto (default) = Model Runner V2 "
            "(docs/design/mrv2.md) unless num_speculative_tokens < the drafter's block size or "
            "VLLM_USE_V2_MODEL_RUNNER=0, then V1; v1 / mrv2 force one (mrv2 refuses B < gamma)."
        ),
    ),
    "UBTREE_CUDA_HYBRIDS": EnvVar(
        default="0",
        parse=_flag,
        doc=(
            "1: serve hybrid targets on CUDA with the tree forms of their recurrent layers through vLLM's CUDA "
            "calls: Gated DeltaNet (Qwen3-Next, ubtree_vllm/vllm/recurrent/gdn_cuda.py) and Mamba2 (NemotronH, "
            "Falcon-H1, ubtree_vllm/vllm/recurrent/mamba2.py); V1 runner, PIECEWISE CUDA graphs. Opt-in until their "
            "H200 tests (tests/vllm/test_vllm_gpu.py, test_vllm_gdn_cuda_layer.py) have passed; 0 (default): "
            "refused on CUDA."
        ),
    ),
    "UBTREE_COMMIT": EnvVar(
        default="",
        parse=str,
        doc=(
            "Commit recorded in benchmark records when the working tree has no git "
            "metadata (e.g. a copy on a remote GPU machine); empty means ask git."
        ),
    ),
}


def get(name: str) -> Any:
    """Return the parsed current value of ``name``; ``KeyError`` if it is not registered."""
    var = ENVIRONMENT_VARIABLES[name]
    raw = os.environ.get(name, "")
    try:
        return var.parse(raw if raw != "" else var.default)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}: {exc}") from None


def describe() -> str:
    """Human-readable table of every variable, its default and its meaning."""
    lines = []
    for name, var in ENVIRONMENT_VARIABLES.items():
        lines.append(f"{name} (default: {var.default})\n    {var.doc}")
    return "\n".join(lines)


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(ENVIRONMENT_VARIABLES))
