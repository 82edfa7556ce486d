"""Every architecture in ``SUPPORTED_ARCHITECTURES`` is exercised: Qwen2 and Qwen3 here (Llama
everywhere else, Qwen3-Next in test_vllm_gdn_hybrid.py), greedy UBTree with the copying oracle ==
the same engine without speculation."""
from __future__ import annotations

import pytest
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from ubtree_vllm.vllm.config import SUPPORTED_ARCHITECTURES
from vllm_engines import ENGINE_KWARGS, TINY_TREE
from vllm_models import save_tiny_qwen, save_untrained_drafter
from vllm_oracle import ReferenceOracle, engine_runner, install_oracle

PROMPTS = [[5, 9, 13, 400, 22], list(range(30, 75)), [7] * 12]
PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, detokenize=False)


def generate(llm, prompts):
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_targets_are_lossless(family, vllm_models_dir):
    assert f"{family.capitalize()}ForCausalLM" in SUPPORTED_ARCHITECTURES
    target = save_tiny_qwen(vllm_models_dir / f"tiny-{family}", family)
    drafter = save_untrained_drafter(target, vllm_models_dir / f"tiny-{family}-drafter")
    expected = generate(LLM(model=str(target), **ENGINE_KWARGS), PROMPTS)
    llm = LLM(model=str(target), speculative_config={"method": "ubtree", "model": str(drafter), **TINY_TREE},
              **ENGINE_KWARGS)
    assert generate(llm, PROMPTS) == expected
    oracle = ReferenceOracle(PROMPTS, expected, engine_runner(llm).drafter.config.tree, vocab_size=512)
    install_oracle(llm, oracle)
    assert generate(llm, PROMPTS) == expected
    assert oracle.calls > 0
