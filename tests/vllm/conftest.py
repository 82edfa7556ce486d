"""Fixtures for the vLLM-facing tests: tiny model folders and the in-process engine mode.

Engines are expensive (~35 s for the first one in a process on 2 cores, a few seconds
for later ones), so test modules keep them in module-scoped fixtures and run in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which also lets tests reach the model runner).
The default multiprocess engine is exercised by the example and server tests, which start
vLLM in subprocesses with :func:`vllm_engines.subprocess_env`.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_models import save_copy_pair, save_tiny_llama, save_untrained_drafter  # noqa: E402


@pytest.fixture(scope="session")
def vllm_models_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("vllm_models")


@pytest.fixture(scope="session")
def tiny_target(vllm_models_dir) -> Path:
    """Random tiny Llama: vocab 512, hidden 64, 4 layers, head_dim 32."""
    return save_tiny_llama(vllm_models_dir / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_drafter(tiny_target, vllm_models_dir) -> Path:
    """Untrained drafter for tiny_target: gamma 4, K 16, target layers (1, 2)."""
    return save_untrained_drafter(tiny_target, vllm_models_dir / "tiny-drafter")


@pytest.fixture(scope="session")
def copy_pair(vllm_models_dir) -> tuple[Path, Path]:
    """Hand-built (target, drafter) where the drafter's weights copy the target (vocab 64)."""
    return save_copy_pair(vllm_models_dir / "copy-target", vllm_models_dir / "copy-drafter")


@pytest.fixture(scope="session")
def tiny_chat_target(vllm_models_dir, default_target_dir) -> Path:
    """Random tiny Llama with SmolLM2's tokenizer and chat template (for the OpenAI server)."""
    return save_tiny_llama(vllm_models_dir / "tiny-chat", vocab_size=49152, num_layers=3,
                           tokenizer_from=default_target_dir, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="session")
def tiny_chat_drafter(tiny_chat_target, vllm_models_dir) -> Path:
    return save_untrained_drafter(tiny_chat_target, vllm_models_dir / "tiny-chat-drafter", top_k=8)


@pytest.fixture(scope="session", autouse=True)
def _in_process_engines():
    """In-process engines for every test in this directory; subprocesses get their own env."""
    previous = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    yield
    if previous is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = previous
