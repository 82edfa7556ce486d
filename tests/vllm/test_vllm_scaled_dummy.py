"""The GPU tests' weights for config-only targets (vllm_models.SCALED_DUMMY_FORMAT) and their guard against a
model whose greedy output is a function of the last token alone (vllm_models.assert_continuations_depend_on_context).
"""
from __future__ import annotations

import pytest
import torch

from vllm_models import (SCALED_DUMMY_FORMAT, assert_continuations_depend_on_context, register_scaled_dummy_loader,
                         scale_dummy_weights)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = torch.nn.Module()
        self.input_layernorm.weight = torch.nn.Parameter(torch.full((64,), 1e-3))
        self.proj = torch.nn.Linear(64, 256)
        self.experts_w13 = torch.nn.Parameter(torch.zeros(4, 32, 64))
        self.A_log = torch.nn.Parameter(torch.full((2,), 5e-4))


def test_scaled_weights_are_drawn_per_name_and_compute_at_unit_scale():
    first, second = _Block(), _Block()
    scale_dummy_weights(first)
    scale_dummy_weights(second)
    assert torch.equal(first.proj.weight, second.proj.weight)  # seeded by name: every engine draws the same
    assert not torch.equal(first.proj.weight[:, :32], first.experts_w13[0])  # different names, different draws
    # fan-in scaling over the last dimension: unit-variance inputs give unit-scale outputs
    assert first.proj.weight.std().item() == pytest.approx(64 ** -0.5, rel=0.1)
    assert first.experts_w13.std().item() == pytest.approx(64 ** -0.5, rel=0.1)
    assert torch.equal(first.input_layernorm.weight, torch.ones(64))  # norm gains 1
    assert torch.equal(first.proj.bias, torch.zeros(256))
    assert torch.equal(first.A_log, torch.full((2,), 5e-4))  # other vectors keep vLLM's dummy values


def test_the_scaled_format_is_a_vllm_load_format():
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader

    register_scaled_dummy_loader()
    register_scaled_dummy_loader()  # idempotent
    block = _Block()
    get_model_loader(LoadConfig(load_format=SCALED_DUMMY_FORMAT)).load_weights(block, model_config=None)
    assert block.proj.weight.std().item() == pytest.approx(64 ** -0.5, rel=0.1)
    assert torch.equal(block.input_layernorm.weight, torch.ones(64))


def test_a_last_token_function_fails_the_context_guard():
    bigram = {t: (3 * t + 1) % 17 for t in range(17)}
    outputs = []
    for start in range(4):
        tokens = [start]
        for _ in range(30):
            tokens.append(bigram[tokens[-1]])
        outputs.append(tokens)
    with pytest.raises(AssertionError, match="one fixed token"):
        assert_continuations_depend_on_context(outputs, "bigram")
    # the same tokens, but 5 and 9 followed by different tokens in two places: the context matters
    outputs[1] = outputs[1][:10] + [5, 2, 9, 4] + outputs[1][10:]
    outputs[2] = outputs[2][:10] + [5, 7, 9, 11] + outputs[2][10:]
    assert_continuations_depend_on_context(outputs, "contextual")


@pytest.mark.e2e
def test_vllm_dummy_weights_make_a_bigram_model_and_the_scaled_ones_do_not(tmp_path):
    """A tiny Llama on the CPU engine: under vLLM's "dummy" weights the greedy output cycles through a fixed map of
    the last token (2026-12-05: period-2 cycles, no token with two successors), which the guard refuses; under the
    scaled weights it passes."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from test_vllm_gpu import prompts_for
    from ubtree_vllm.bench.engines import stop_engine
    from vllm_engines import ENGINE_KWARGS
    from vllm_models import save_tiny_llama

    register_scaled_dummy_loader()
    target = save_tiny_llama(tmp_path / "llama")
    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts_for(512)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, detokenize=False)
    outputs = {}
    for load_format in ("dummy", SCALED_DUMMY_FORMAT):
        llm = LLM(model=str(target), load_format=load_format, **ENGINE_KWARGS)
        outputs[load_format] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        stop_engine(llm)
    with pytest.raises(AssertionError, match="one fixed token"):
        assert_continuations_depend_on_context(outputs["dummy"], "dummy")
    assert_continuations_depend_on_context(outputs[SCALED_DUMMY_FORMAT], SCALED_DUMMY_FORMAT, least=16)
