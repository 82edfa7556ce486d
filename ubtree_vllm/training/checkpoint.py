"""Training checkpoints (exact resume) and the loss-curve plot.

A checkpoint `checkpoints/step-0000123.pt` holds everything the next step depends on:
drafter weights (float32 master copy), optimizer and LR-scheduler state, RNG states,
the data cursor (samples consumed so far), the step, tokens seen, accumulated training
wall time, the logged history and the run config. Data order and anchor draws are pure
functions of (seed, cursor, step) (see train.py), so resuming from step s gives the same
step s + 1 as the uninterrupted run.

Files are written to a temporary name and renamed, so a crash never leaves a truncated
checkpoint that looks valid; the newest `keep` checkpoints are kept.
"""
from __future__ import annotations

import os
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_DIR = "checkpoints"
CHECKPOINT_FORMAT = 1
_NAME = re.compile(r"^step-(\d{7})\.pt$")


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Checkpoint files of a run, oldest first."""
    folder = Path(output_dir) / CHECKPOINT_DIR
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _NAME.match(p.name))


def save_checkpoint(output_dir: str | Path, step: int, payload: dict[str, Any], keep: int) -> Path:
    folder = Path(output_dir) / CHECKPOINT_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save({"format": CHECKPOINT_FORMAT, "step": step, **payload}, tmp)
    os.replace(tmp, path)
    for old in list_checkpoints(output_dir)[:-keep]:
        old.unlink()
    return path


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    state = torch.load(path, map_location="cpu", weights_only=False)
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: unsupported checkpoint format {state.get('format')!r}")
    return state


def plot_history(history: Sequence[dict[str, float]], path: str | Path, title: str) -> Path | None:
    """Loss curves (loss, CE, KL) and accuracy metrics vs step as a PNG; None without history."""
    if not history:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for key in ("loss", "ce", "kl", "hard_ce"):
        ax_loss.plot(steps, [h[key] for h in history], label=key)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("nats")
    ax_loss.set_yscale("log")
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    for key in ("top1", "topk_hit", "selector_top1"):
        ax_acc.plot(steps, [h[key] for h in history], label=key)
    ax_acc.set_xlabel("step")
    ax_acc.set_ylabel("rate")
    ax_acc.set_ylim(0, 1)
    ax_tau = ax_acc.twinx()
    ax_tau.plot(steps, [h["chain_tau"] for h in history], color="black", linestyle="--", label="chain_tau")
    ax_tau.set_ylabel("chain tau proxy")
    ax_acc.legend(loc="upper left")
    ax_tau.legend(loc="lower right")
    ax_acc.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return path
