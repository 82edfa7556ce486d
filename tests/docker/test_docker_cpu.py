"""The CPU image (docker/Dockerfile) serves the default target with UBTree and answers like plain vLLM.

Two containers of the same image run at once, each with a published loopback port: the
image's default command (``ubtree-serve``: SmolLM2-135M-Instruct in float32, UBTree with the
shipped drafter, B = 64) and the same command without speculation
(``UBTREE_SPECULATIVE_CONFIG=none``). Both get the same extra ``vllm serve`` options (a
KV-cache cap, so that two servers fit beside the rest of CI). Greedy fp32 chat and
completion requests, streaming and not, sent with httpx, must give identical text and
tokens; ``/metrics`` of the UBTree server must count accepted draft tokens; ``podman stop``
must end both with exit code 0. Containers started with a missing or a mismatched drafter
must exit non-zero with the plugin's message in their log.

Cost on 2 cores (measured 2026-12-01): 8 min 50 s for tests/docker from nothing: the image
build 221 s (2 s when every layer is cached), 172 s until both servers are ready, 15 s for
each bad-drafter container, about 2 minutes of requests and stops.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time

import httpx
import pytest

from http_servers import free_port, wait_healthy
from http_servers import streamed as http_streamed
from podman_helpers import REPO_ROOT, podman, record_time

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MODEL = "smollm2-135m-instruct"  # UBTREE_SERVED_MODEL_NAME in the image
# vLLM's multiprocess engine needs more /dev/shm than a container's default 64 MiB.
RUN_ARGS = ["--shm-size", "1g"]
# Appended to the image's command in both servers: the image default reserves a quarter of the
# host's memory for the KV cache; 512 MiB is some 11,000 float32 tokens of SmolLM2.
SERVE_ARGS = ["--kv-cache-memory-bytes", str(512 << 20), "--max-model-len", "4096"]
START_TIMEOUT_S = 900
STOP_TIMEOUT_S = 60

CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Write a Python function that returns the n-th Fibonacci number."]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


class Container:
    """One detached container of the CPU image, its port published on 127.0.0.1."""

    def __init__(self, env: dict[str, str], image: str, name: str, environment: dict[str, str]) -> None:
        self.env, self.name, self.port = env, name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        podman(env, "rm", "-f", "--ignore", name)
        options = [option for key, value in environment.items() for option in ("-e", f"{key}={value}")]
        podman(env, "run", "-d", "--name", name, "-p", f"127.0.0.1:{self.port}:8000", *RUN_ARGS, *options,
               image, *SERVE_ARGS)

    def state(self) -> tuple[str, int]:
        out = podman(self.env, "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", self.name).stdout.split()
        return out[0], int(out[1])

    def logs(self) -> str:
        return podman(self.env, "logs", self.name, check=False).stdout + podman(self.env, "logs", self.name,
                                                                                   check=False).stderr

    def log_tail(self) -> str:
        return self.logs()[-4000:]

    def wait_ready(self, deadline: float) -> None:
        def exited() -> str | None:
            status, code = self.state()
            return None if status == "running" else f"container {self.name} is {status} (exit code {code})"

        wait_healthy(self.url, deadline, exited, f"container {self.name} not ready within {START_TIMEOUT_S} s",
                     self.log_tail, poll_s=2)

    def stop(self) -> int:
        podman(self.env, "stop", "-t", str(STOP_TIMEOUT_S), self.name, timeout=STOP_TIMEOUT_S + 60)
        return self.state()[1]

    def remove(self) -> None:
        podman(self.env, "rm", "-f", "--ignore", self.name, check=False)


@pytest.fixture(scope="module")
def servers(podman_env, cpu_image):
    tag = f"ubtree-test-{os.getpid()}"
    ubtree = plain = None
    try:
        started = time.monotonic()
        ubtree = Container(podman_env, cpu_image, f"{tag}-ubtree", {})
        plain = Container(podman_env, cpu_image, f"{tag}-plain", {"UBTREE_SPECULATIVE_CONFIG": "none"})
        deadline = started + START_TIMEOUT_S
        ubtree.wait_ready(deadline)
        plain.wait_ready(deadline)
        record_time("both servers ready (UBTree and plain, started together)", time.monotonic() - started)
        yield ubtree, plain
    finally:
        for container in (ubtree, plain):
            if container is not None:
                container.remove()


def post(server: Container, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server: Container, path: str, body: dict) -> tuple[str, str | None]:
    """(text, finish_reason) of a streamed answer, joined from its server-sent events."""
    return http_streamed(server.url, path, {"model": MODEL, **body}, timeout=300)


def answer(server: Container, path: str, body: dict) -> dict:
    """The parts of a non-streamed answer that must not depend on speculation."""
    reply = post(server, path, {**body, "return_token_ids": True})
    choice = reply["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return {"text": text, "token_ids": choice.get("token_ids"), "finish_reason": choice["finish_reason"],
            "completion_tokens": reply["usage"]["completion_tokens"]}


def spec_counter(server: Container, name: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    values = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(f"vllm:{name}{{")]
    return sum(values)


# ---- bad input: these start their own short-lived containers -------------------------------

def run_to_exit(env: dict[str, str], image: str, *options: str) -> subprocess.CompletedProcess:
    name = f"ubtree-test-{os.getpid()}-bad"
    podman(env, "rm", "-f", "--ignore", name)
    try:
        return subprocess.run(["podman", "run", "--name", name, *RUN_ARGS, *options, image, *SERVE_ARGS],
                              capture_output=True, text=True, env=env, timeout=600)
    finally:
        podman(env, "rm", "-f", "--ignore", name, check=False)


def test_container_with_a_missing_drafter_exits_nonzero_with_the_plugin_message(podman_env, cpu_image):
    started = time.monotonic()
    proc = run_to_exit(podman_env, cpu_image, "-e", "UBTREE_DRAFTER=/opt/ubtree/no-such-drafter")
    record_time("container with a missing drafter, start to exit", time.monotonic() - started)
    assert proc.returncode != 0
    assert "speculative_config.model: drafter folder '/opt/ubtree/no-such-drafter' does not exist" in (
        proc.stdout + proc.stderr)


def test_container_with_a_mismatched_drafter_exits_nonzero_with_the_plugin_message(podman_env, cpu_image, tmp_path):
    # The shipped drafter, mounted as "another drafter" with the config of one made for a target with
    # Llama 2's 32,000-token vocabulary.
    drafter = tmp_path / "drafter"
    shutil.copytree(REPO_ROOT / "checkpoints" / "smollm2-135m-instruct-ubtree", drafter)
    config = json.loads((drafter / "config.json").read_text())
    config["vocab_size"] = 32000
    (drafter / "config.json").write_text(json.dumps(config))
    started = time.monotonic()
    proc = run_to_exit(podman_env, cpu_image, "-v", f"{drafter}:/drafters/other:ro",
                       "-e", "UBTREE_DRAFTER=/drafters/other")
    record_time("container with a mismatched drafter, start to exit", time.monotonic() - started)
    assert proc.returncode != 0
    assert "drafter does not match the target: vocab_size: drafter 32000, target 49152" in (
        proc.stdout + proc.stderr)


# ---- the two servers -------------------------------------------------------------------------

def test_default_command_serves_ubtree_in_float32(servers):
    ubtree, plain = servers
    log = ubtree.logs()
    assert '"method": "ubtree"' in log and "/opt/ubtree/drafter" in log
    assert "dtype=torch.float32" in log
    assert "--speculative-config" not in plain.logs()
    models = httpx.get(f"{ubtree.url}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_chat_matches_the_server_without_speculation(servers):
    ubtree, plain = servers
    for content in CHATS:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 48, "temperature": 0}
        expected = answer(plain, "/v1/chat/completions", body)
        assert expected["token_ids"], "the server returned no token ids (return_token_ids)"
        assert answer(ubtree, "/v1/chat/completions", body) == expected, content
        text, finish = streamed(ubtree, "/v1/chat/completions", body)
        assert (text, finish) == (expected["text"], expected["finish_reason"]), content
    # fp32 on the CPU: the default target answers correctly (bf16 on vLLM's CPU backend does not).
    first = answer(ubtree, "/v1/chat/completions",
                   {"messages": [{"role": "user", "content": CHATS[0]}], "max_tokens": 48, "temperature": 0})
    assert "Paris" in first["text"]


def test_completions_match_the_server_without_speculation(servers):
    ubtree, plain = servers
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0}
        expected = answer(plain, "/v1/completions", body)
        assert answer(ubtree, "/v1/completions", body) == expected, prompt
        text, finish = streamed(ubtree, "/v1/completions", body)
        assert (text, finish) == (expected["text"], expected["finish_reason"]), prompt
        plain_text, _ = streamed(plain, "/v1/completions", body)
        assert plain_text == expected["text"], prompt


def test_metrics_count_accepted_drafts(servers):
    ubtree, plain = servers
    assert spec_counter(ubtree, "spec_decode_num_drafts_total") > 0
    assert spec_counter(ubtree, "spec_decode_num_accepted_tokens_total") > 0
    assert spec_counter(plain, "spec_decode_num_drafts_total") == 0


def test_containers_stop_cleanly(servers):
    for container in servers:
        started = time.monotonic()
        code = container.stop()
        elapsed = time.monotonic() - started
        assert code == 0, f"{container.name} exited with {code} on podman stop:\n{container.log_tail()}"
        assert elapsed < STOP_TIMEOUT_S, f"{container.name} needed SIGKILL ({elapsed:.0f} s)"
