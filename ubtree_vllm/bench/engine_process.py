"""One bench engine in a process of its own, driven over a pipe (``--interleave``: every engine up at once).

vLLM engines built side by side in one process share process-wide state (compiled-graph caches, CUDA-graph
capture flags, the tree-attention hand-over): on the H200 (2026-12-04) the first of three in-process engines
tried to capture a CUDA graph in the middle of serving once the other two had started, and stopped. A child
process per engine (``spawn``) gives each the state a lone engine has, as separate bench invocations would.

The child builds the engine (:func:`~ubtree_vllm.bench.engines.open_engine`) and then serves calls: ``warm_up``,
``warm_up_at``, ``run`` (:func:`~ubtree_vllm.bench.engines.run_requests`: the finished RequestOutputs, the wall
seconds and the engine steps, all measured in the child, so the pipe's cost is never timed) and
``counters`` (the spec-decode counters). Errors come back as the child's traceback and are raised in the
parent. The constructor only spawns the child; :meth:`EngineProcess.wait_started` waits for its engine. Engines
start one after the other (each waits for the last to be up), so no engine's memory profiling at start-up sees
another process allocate or free device memory, unless :func:`starts_side_by_side` says the engines skip that
profiling.
"""
from __future__ import annotations

import multiprocessing
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ubtree_vllm.bench.settings import E2ESettings, engine_core_mode

if TYPE_CHECKING:
    from ubtree_vllm.bench.engines import Engine

START_TIMEOUT_S = 1800  # an engine start (compile, graph capture) on the slowest machine the bench runs on
CLOSE_TIMEOUT_S = 120


def starts_side_by_side(engine_kwargs: dict[str, Any]) -> bool:
    """Whether engines with these vLLM arguments may start at once: with a fixed ``kv_cache_memory_bytes``
    vLLM 0.32's worker sizes the KV cache without memory profiling (gpu_worker.determine_available_memory), so
    another process allocating meanwhile cannot break its start; its start-up check then only needs
    ``gpu_memory_utilization`` x device memory free (a small share: pass one). On the H200 (2026-12-05) four engines
    started one after the other took over 9 minutes, the whole device call."""
    return engine_kwargs.get("kv_cache_memory_bytes") is not None


def child_is_daemon(settings: E2ESettings) -> bool:
    """Whether an engine's child is a daemon (killed with the bench if it dies): only with the engine core in the
    child itself. A daemon may not start processes, and an engine core of its own is one (vLLM's default); such a
    child still ends when the bench's end of the pipe closes (:func:`serve_engine`)."""
    return engine_core_mode(settings) == "in-process"


class EngineProcess:
    """The parent's handle on one engine in a child process. ``engine``: its
    :class:`~ubtree_vllm.bench.engines.Engine` (label, run, drafter) with ``llm`` None: the engine lives in the child."""

    def __init__(self, label: str, engine_settings: E2ESettings, settings: E2ESettings, target_path: Path,
                 engine_kwargs: dict[str, Any], scratch: Path) -> None:
        context = multiprocessing.get_context("spawn")
        self.label = label
        self._conn, child = context.Pipe()
        self._process = context.Process(target=serve_engine, name=f"bench-engine-{label}",
                                        daemon=child_is_daemon(settings),
                                        args=(child, label, engine_settings, settings, target_path, engine_kwargs,
                                              scratch))
        self._process.start()
        child.close()
        self.engine: Engine | None = None

    def wait_started(self) -> None:
        """Wait for the child's engine to be up (RuntimeError with its traceback if it failed); sets ``engine``."""
        from ubtree_vllm.bench.engines import Engine

        if self.engine is None:
            run, drafter, training = self._receive(START_TIMEOUT_S)
            self.engine = Engine(self.label, run, None, drafter, training)

    def call(self, name: str, *args: Any) -> Any:
        """The child's answer to ``name(*args)`` (module docstring); RuntimeError with its traceback on failure."""
        self._conn.send((name, args))
        return self._receive(None)

    def close(self) -> None:
        """Shut the engine down and end the child (killed if it does not end in time)."""
        if self._process.is_alive():
            try:
                self._conn.send(("close", ()))
                self._receive(CLOSE_TIMEOUT_S)
            except (RuntimeError, OSError):
                pass
        self._process.join(CLOSE_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._conn.close()

    def _receive(self, timeout_s: float | None) -> Any:
        if timeout_s is not None and not self._conn.poll(timeout_s):
            raise RuntimeError(f"bench e2e: engine {self.label} did not answer within {timeout_s} s")
        try:
            status, payload = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"bench e2e: the process of engine {self.label} ended (exit code "
                               f"{self._process.exitcode}); its output is above") from None
        if status == "error":
            raise RuntimeError(f"bench e2e: engine {self.label} failed in its process:\n{payload}")
        return payload


def serve_engine(conn: Any, label: str, engine_settings: E2ESettings, settings: E2ESettings, target_path: Path,
                 engine_kwargs: dict[str, Any], scratch: Path) -> None:
    """The child: build the engine, answer calls until ``close`` (module docstring)."""
    from ubtree_vllm.bench.engines import close_engine, open_engine, run_requests, warm_up, warm_up_at
    from ubtree_vllm.bench.measurement import spec_counters

    try:
        engine = open_engine(label, engine_settings, settings, target_path, engine_kwargs, scratch, print)
    except BaseException:  # noqa: BLE001 - every start failure goes back to the parent
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", (engine.run, engine.drafter, engine.drafter_training)))
    handlers = {
        "warm_up": lambda prompt_sets: warm_up(engine.llm, prompt_sets, settings),
        "warm_up_at": lambda prompt_set, concurrency: warm_up_at(engine.llm, prompt_set, concurrency),
        "run": lambda prompts, params, concurrency: run_requests(engine.llm, prompts, params, concurrency),
        "counters": lambda: spec_counters(engine.llm.get_metrics()),
    }
    while True:
        try:
            name, args = conn.recv()
        except (EOFError, OSError):  # the parent is gone: end, and the engine's memory with the process
            return
        if name == "close":
            close_engine(engine)
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[name](*args)))
        except BaseException:  # noqa: BLE001 - the parent raises it
            conn.send(("error", traceback.format_exc()))
