"""Shared pytest setup for every test directory.

* Tests marked ``gpu`` are skipped automatically when torch sees no CUDA device
  (the device is queried only if such a test was collected).
* Every test starts from fixed seeds for ``random`` and, when already imported,
  numpy and torch.
* ``default_target_dir``: the converted SmolLM2-135M-Instruct bf16 folder
  (converted once into ``$UBTREE_CACHE_DIR``, then cached across sessions).
* ``shared_data_dir``: ``../shared/data`` next to the repository; tests that
  need it are skipped where it is absent.
* ``fresh_python``: run a snippet in a new interpreter, for tests of import-time
  and process-global behaviour (plugin registration, lazy imports).
* With a CPU-only torch build, ``TRITON_INTERPRET=1`` is set here, before anything
  imports triton, so the ``triton_ops`` kernels run on CPU tensors under the Triton
  interpreter (``@triton.jit`` picks the interpreter at decoration time; an explicit
  value is kept). The build is read from ``torch.version``, which touches no driver.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

if torch.version.cuda is None and torch.version.hip is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
SEED = 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fixed_seeds() -> None:
    random.seed(SEED)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(SEED)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(SEED)


@pytest.fixture(scope="session")
def default_target_dir() -> Path:
    from ubtree_vllm.models.default_target import default_target_path

    return default_target_path()


@pytest.fixture(scope="session")
def shared_data_dir() -> Path:
    path = REPO_ROOT.parent / "shared" / "data"
    if not path.is_dir():
        pytest.skip(f"shared data directory {path} is absent")
    return path


@pytest.fixture
def fresh_python():
    """Return ``run(code, env=None) -> CompletedProcess`` executing ``code`` in a new interpreter.

    The snippet is dedented; a non-zero exit fails the calling test with the
    child's output.
    """

    def run(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=600,
        )
        if proc.returncode != 0:
            pytest.fail(
                f"child interpreter exited with {proc.returncode}\n"
                f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
            )
        return proc

    return run
