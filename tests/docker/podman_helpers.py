"""Helpers shared by the container tests and their fixtures (podman calls, recorded timings)."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CPU_IMAGE = "localhost/ubtree-vllm:cpu"

# (label, seconds) in the order measured, for the terminal summary.
TIMINGS: list[tuple[str, float]] = []


def record_time(label: str, seconds: float) -> None:
    TIMINGS.append((label, seconds))


def podman(env: dict[str, str], *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["podman", *args], capture_output=True, text=True, env=env, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args)} exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc
