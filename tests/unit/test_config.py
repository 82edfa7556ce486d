"""Bad settings fail early with a ValueError that names the field and the allowed range."""
from __future__ import annotations

import pytest
from transformers import LlamaConfig

from ubtree_vllm.config import SamplingConfig, UBTreeConfig
from ubtree_vllm.drafter.config import DrafterConfig


def test_paper_defaults_are_valid():
    cfg = UBTreeConfig()
    assert (cfg.tree_budget, cfg.beam_width, cfg.top_k, cfg.block_size) == (64, 12, 64, 16)
    assert cfg.num_verify_tokens == 65


@pytest.mark.parametrize("kwargs,field", [
    ({"tree_budget": 0}, "tree_budget"),
    ({"tree_budget": 500}, "tree_budget"),  # more than W * gamma = 192 nodes
    ({"tree_budget": 2.5}, "tree_budget"),
    ({"beam_width": 0}, "beam_width"),
    ({"top_k": 0}, "top_k"),
    ({"block_size": 0}, "block_size"),
    ({"block_size": 65}, "block_size"),
    ({"block_size": True}, "block_size"),
])
def test_tree_config_errors_name_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        UBTreeConfig(**kwargs)


def test_unknown_keys_rejected():
    with pytest.raises(ValueError, match="unknown UBTree setting.*beam"):
        UBTreeConfig.from_dict({"beam": 3})
    assert UBTreeConfig.from_dict({"tree_budget": 16}).tree_budget == 16


def test_top_k_larger_than_vocab():
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 32\]"):
        UBTreeConfig(top_k=64).check_vocab(32)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"),
])
def test_sampling_errors(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingConfig(**kwargs)


def tiny_llama(**kw) -> LlamaConfig:
    base = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2)
    base.update(kw)
    return LlamaConfig(**base)


def test_drafter_config_mismatch_names_fields():
    cfg = DrafterConfig.for_target(tiny_llama(), "tiny")
    with pytest.raises(ValueError, match="vocab_size.*hidden_size"):
        cfg.check_hf_target(tiny_llama(vocab_size=99, hidden_size=64))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        cfg.check_hf_target(tiny_llama(num_hidden_layers=6))


@pytest.mark.parametrize("overrides,field", [
    ({"block_size": 1}, "block_size"),
    ({"top_k": 101}, "top_k"),
    ({"target_layer_ids": (0, 3)}, "target_layer_ids"),
    ({"mask_token_id": 100}, "mask_token_id"),
])
def test_drafter_config_errors(overrides, field):
    with pytest.raises(ValueError, match=field):
        DrafterConfig.for_target(tiny_llama(), "tiny", **overrides)


def test_drafter_config_roundtrip(tmp_path):
    cfg = DrafterConfig.for_target(tiny_llama(), "tiny", block_size=4, top_k=8)
    cfg.save(tmp_path)
    assert DrafterConfig.load(tmp_path) == cfg
    with pytest.raises(FileNotFoundError, match="config.json"):
        DrafterConfig.load(tmp_path / "missing")
