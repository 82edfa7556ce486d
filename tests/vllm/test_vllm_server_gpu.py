"""The OpenAI server on the GPU: ``examples/serve.sh`` with its defaults (SmolLM2-135M-Instruct,
B = 64, CUDA graphs, the default runner) answers like ``vllm serve`` of the same target.

Skipped without CUDA (``gpu`` marker). The drafter is GPU_TEST_DRAFTER (the shipped one on the
device) or an untrained export. Both servers run vLLM's default multiprocess engine. Greedy texts
must match the server without speculation up to a bf16 near-tie: where they first differ, the
reference's two best tokens must be at most one bf16 ulp of a logit of 16-32 (0.125) apart (the
reference's logprobs give the gap; logprob differences are logit differences).
"""
from __future__ import annotations

import os
import time

import httpx
import pytest

from test_vllm_gpu import smollm2_drafter
from test_vllm_server import REPO_ROOT, Server, free_port, serve_command, streamed_text

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

ARGS = ["--max-model-len", "2048", "--seed", "0", "--max-num-seqs", "8", "--served-model-name", "smol"]
NEAR_TIE = 0.125
START_TIMEOUT_S = float(os.environ.get("GPU_SERVER_START_TIMEOUT_S", "300"))  # each server
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Three tips for staying healthy are"]
CHAT = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def servers(default_target_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("server_logs")
    drafter = smollm2_drafter(default_target_dir, tmp_path_factory.mktemp("drafter"))
    plain_port, ubtree_port = free_port(), free_port()
    plain = Server("plain", [*serve_command(default_target_dir), "--host", "127.0.0.1", "--port", str(plain_port),
                             "--gpu-memory-utilization", "0.25", *ARGS], plain_port, log_dir)
    ubtree = None
    try:  # one after the other: vLLM's start-up memory profile asserts if another engine frees memory meanwhile
        plain.wait_ready(time.monotonic() + START_TIMEOUT_S)
        ubtree = Server("ubtree", ["bash", str(REPO_ROOT / "examples" / "serve.sh"), "--drafter", str(drafter),
                                   "--port", str(ubtree_port), "--", *ARGS], ubtree_port, log_dir)
        ubtree.wait_ready(time.monotonic() + START_TIMEOUT_S)
        yield plain, ubtree
    finally:
        codes = [server.shutdown() for server in (plain, ubtree) if server is not None]
    assert all(code is not None for code in codes)


def post(server: Server, path: str, body: dict) -> dict:
    response = httpx.post(f"{server.url}{path}", json={"model": "smol", **body}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def assert_same_up_to_near_tie(got: str, steps: list[tuple[str, list[float]]]) -> None:
    """``steps``: the reference's (token text, its two best logprobs) per generated token."""
    expected = "".join(text for text, _ in steps)
    if got == expected:
        return
    prefix = ""
    for i, (text, top2) in enumerate(steps):
        if not got.startswith(prefix + text):
            gap = top2[0] - top2[1] if len(top2) > 1 else float("inf")
            assert gap <= NEAR_TIE, (f"first difference at token {i} ({text!r}), not a near-tie "
                                     f"(top-2 gap {gap:.4f}):\nubtree:    {got!r}\nreference: {expected!r}")
            return
        prefix += text
    raise AssertionError(f"ubtree text is longer than the reference:\n{got!r}\n{expected!r}")


def completion_steps(choice: dict) -> list[tuple[str, list[float]]]:
    logprobs = choice["logprobs"]
    return [(text, sorted(top.values(), reverse=True)[:2])
            for text, top in zip(logprobs["tokens"], logprobs["top_logprobs"])]


def chat_steps(choice: dict) -> list[tuple[str, list[float]]]:
    return [(entry["token"], sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)[:2])
            for entry in choice["logprobs"]["content"]]


def test_completions_match_the_server_without_speculation(servers):
    plain, ubtree = servers
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 96, "temperature": 0}
        reference = post(plain, "/v1/completions", {**body, "logprobs": 2})["choices"][0]
        got = post(ubtree, "/v1/completions", body)["choices"][0]["text"]
        assert_same_up_to_near_tie(got, completion_steps(reference))
        assert streamed_text(ubtree, "/v1/completions", body, "smol") == got


def test_chat_matches_the_server_without_speculation(servers):
    plain, ubtree = servers
    body = {"messages": CHAT, "max_tokens": 64, "temperature": 0}
    reference = post(plain, "/v1/chat/completions", {**body, "logprobs": True, "top_logprobs": 2})["choices"][0]
    got = post(ubtree, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
    assert_same_up_to_near_tie(got, chat_steps(reference))
    assert streamed_text(ubtree, "/v1/chat/completions", body, "smol") == got


def test_metrics_show_accepted_drafts(servers):
    _, ubtree = servers
    totals = {}
    for line in httpx.get(f"{ubtree.url}/metrics", timeout=30).text.splitlines():
        for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total"):
            if line.startswith(name):
                totals[name] = totals.get(name, 0.0) + float(line.split()[-1])
    drafts = totals.get("vllm:spec_decode_num_drafts_total", 0.0)
    assert drafts > 0, totals
    tau = 1 + totals.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / drafts
    print(f"server acceptance length {tau:.2f} over {drafts:.0f} drafts")
    if os.environ.get("GPU_TEST_DRAFTER"):  # the trained drafter is accepted
        assert tau > 1.5, tau
