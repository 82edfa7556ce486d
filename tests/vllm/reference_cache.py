"""Plain-decoding references of the GPU tests, kept between tests and between calls on a warm device machine.

Most GPU tests compare a UBTree engine with the same target decoding without speculation, and starting that second
engine costs one to two minutes of a session's 30 minutes of device time. What plain decoding answers depends only
on the target's files, the engine arguments, the prompts and sampling parameters, the environment (``VLLM_*``,
``UBTREE_*``), the code that could touch a plain engine (this repository's ``ubtree_vllm/`` and ``patches/``), the
torch and vLLM builds and the GPU. Under a key of all of them a test's reference (token ids and logprobs as plain
Python values, :func:`light_outputs`) is pickled to ``$UBTREE_CACHE_DIR/gpu-test-references/`` and read back by the
next test asking for the same one; a test whose figures must come from its own run asks ``fresh=True``.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import types
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
REPO = Path(__file__).resolve().parents[2]
CODE_DIRS = ("ubtree_vllm", "patches")
# environment variables that name where things go, not what an engine computes
VOLATILE_ENV = ("UBTREE_COMMIT", "UBTREE_CACHE_DIR")
_digests: dict[tuple[str, int, int], str] = {}


def _file_digest(path: Path) -> str:
    stat = path.stat()
    memo = (str(path), stat.st_mtime_ns, stat.st_size)
    if memo not in _digests:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        _digests[memo] = h.hexdigest()
    return _digests[memo]


def tree_digest(root: Path, patterns: Iterable[str] = ("*",)) -> str:
    """sha256 over the relative names and contents of the files under ``root`` matching ``patterns``."""
    h = hashlib.sha256()
    files = sorted({p for pattern in patterns for p in root.rglob(pattern) if p.is_file()})
    for path in files:
        h.update(f"{path.relative_to(root)}\0{_file_digest(path)}\0".encode())
    return h.hexdigest()


def platform_facts() -> dict[str, str]:
    """The builds and the device a reference was computed with."""
    import torch
    import vllm

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"torch": torch.__version__, "vllm": vllm.__version__, "device": device}


def reference_key(target: str | Path, parts: Mapping[str, Any], env: Mapping[str, str] | None = None,
                  platform: Mapping[str, str] | None = None) -> str:
    """The cache key of a plain-decoding reference of ``target`` computed as ``parts`` describe (engine arguments,
    prompts, sampling parameters, what the computation returns: every value's ``repr``)."""
    env = os.environ if env is None else env
    h = hashlib.sha256()
    h.update(tree_digest(Path(target)).encode())
    for code in CODE_DIRS:
        h.update(tree_digest(REPO / code, ("*.py",)).encode())
    engine_env = sorted((k, v) for k, v in env.items() if k.startswith(("VLLM_", "UBTREE_")) and k not in VOLATILE_ENV)
    h.update(repr(engine_env).encode())
    h.update(repr(sorted((platform_facts() if platform is None else platform).items())).encode())
    h.update(repr(sorted((k, repr(v)) for k, v in parts.items())).encode())
    return h.hexdigest()[:32]


def cache_dir() -> Path:
    from ubtree_vllm import envs

    return Path(envs.UBTREE_CACHE_DIR).expanduser() / "gpu-test-references"


def cached_reference(key: str, compute: Callable[[], T], fresh: bool = False) -> tuple[T, bool]:
    """(``compute()``'s value, False), stored under ``key``; or (the stored value, True) when one is there and not
    ``fresh``. ``compute`` must return picklable plain values."""
    path = cache_dir() / f"{key}.pkl"
    if not fresh and path.exists():
        with open(path, "rb") as f:
            return pickle.load(f), True
    value = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    tmp.replace(path)
    return value, False


def light_outputs(outputs: Iterable[Any]) -> list[Any]:
    """vLLM ``RequestOutput``s as plain namespaces with what the greedy checks read: ``outputs[0].token_ids`` and,
    where requested, ``outputs[0].logprobs`` ([{token: namespace(logprob=float)}] per position)."""
    light = []
    for out in outputs:
        completion = out.outputs[0]
        logprobs = None
        if completion.logprobs is not None:
            logprobs = [{int(token): types.SimpleNamespace(logprob=float(lp.logprob)) for token, lp in step.items()}
                        for step in completion.logprobs]
        light.append(types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=list(completion.token_ids),
                                                                          logprobs=logprobs)]))
    return light
