"""Model Runner V2 (UBTREE_VLLM_RUNNER=mrv2, in progress): greedy equality and T > 0 on the H200.

Skipped without CUDA (``gpu`` marker). Greedy: the first engine runs eagerly, the second with CUDA
graphs (vLLM's default), each against the same target without speculation in the same process, with
the near-tie rule of test_vllm_gpu.py (a divergence only where the reference's top-2 raw logits are at
most one bf16 ulp apart). T > 0: the two-sample test of test_vllm_gpu.py, with CUDA graphs.
"""
from __future__ import annotations

import pytest

from test_vllm_gpu import check_sampling_distribution, run_pair, save_tiny_qwen3, smollm2_drafter

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]


@pytest.fixture
def mrv2(monkeypatch):
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", "mrv2")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_mrv2_greedy_equality_tiny_qwen3(mrv2, tmp_path, enforce_eager):
    run_pair(*save_tiny_qwen3(tmp_path), enforce_eager=enforce_eager)


def test_mrv2_greedy_equality_smollm2(mrv2, default_target_dir, tmp_path):
    plain_tps, ubtree_tps, tau = run_pair(default_target_dir, smollm2_drafter(default_target_dir, tmp_path))
    print(f"MRV2 SmolLM2 batch 1: no speculation {plain_tps:.1f} tok/s, ubtree {ubtree_tps:.1f} tok/s, tau {tau:.2f}")


def test_mrv2_sampling_distribution_cuda_graphs(mrv2, tmp_path):
    check_sampling_distribution(tmp_path)
