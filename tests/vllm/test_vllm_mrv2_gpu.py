"""Model Runner V2 (UBTREE_VLLM_RUNNER=mrv2, in progress): greedy equality on the H200.

Skipped without CUDA (``gpu`` marker). The first engine runs eagerly, the second with CUDA graphs
(vLLM's default), each against the same target without speculation in the same process, with the
near-tie rule of test_vllm_gpu.py (a divergence only where the reference's top-2 raw logits are at
most one bf16 ulp apart).
"""
from __future__ import annotations

import os

import pytest

from test_vllm_gpu import run_pair
from vllm_models import save_untrained_drafter

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]


@pytest.fixture
def mrv2(monkeypatch):
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", "mrv2")
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_mrv2_greedy_equality_tiny_qwen3(mrv2, tmp_path, enforce_eager):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "qwen3")
    drafter = save_untrained_drafter(tmp_path / "qwen3", tmp_path / "qwen3-drafter", block_size=8, top_k=16)
    run_pair(tmp_path / "qwen3", drafter, enforce_eager=enforce_eager)


def test_mrv2_greedy_equality_smollm2(mrv2, default_target_dir, tmp_path):
    drafter = os.environ.get("GPU_TEST_DRAFTER") or save_untrained_drafter(
        default_target_dir, tmp_path / "smollm2-drafter", block_size=16, top_k=16)
    plain_tps, ubtree_tps, tau = run_pair(default_target_dir, drafter)
    print(f"MRV2 SmolLM2 batch 1: no speculation {plain_tps:.1f} tok/s, ubtree {ubtree_tps:.1f} tok/s, tau {tau:.2f}")
