"""Helpers of the tests that start OpenAI servers (tests/vllm/test_vllm_server.py: processes;
tests/docker: containers)."""
from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, deadline: float, exited: Callable[[], str | None], not_ready: str,
                 log_tail: Callable[[], str], poll_s: float) -> None:
    """Poll ``url``/health until it answers 200. ``exited()`` says why the server is gone (None while it
    runs): a RuntimeError with that reason; past ``deadline`` a TimeoutError with ``not_ready``; both
    end with the server's log tail."""
    while time.monotonic() < deadline:
        reason = exited()
        if reason is not None:
            raise RuntimeError(f"{reason}:\n{log_tail()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{not_ready}:\n{log_tail()}")


def streamed(url: str, path: str, body: dict, timeout: float) -> tuple[str, str | None]:
    """(text, finish_reason) of a streamed completion or chat answer, joined from its server-sent events."""
    parts, finish = [], None
    with httpx.stream("POST", f"{url}{path}", json={"stream": True, **body}, timeout=timeout) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[len("data: "):])["choices"][0]
            parts.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            finish = choice.get("finish_reason") or finish
    return "".join(parts), finish
