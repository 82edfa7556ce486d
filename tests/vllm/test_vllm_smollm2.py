"""One greedy run on the real default target (SmolLM2-135M-Instruct): UBTree == no speculation.

fp32 keeps rounding differences between tree verification and one-token decoding far
below the argmax gaps (as in tests/unit/test_reference_decoder.py); the drafter is an
untrained export, so this checks losslessness on the real architecture (30 layers, GQA,
tied embeddings, 49k vocabulary). The prompt-lookup branch is on (tree/lookup.py): on the
copying prompts it is what gets drafts accepted, through the V1 runner's real token history.
"""
from __future__ import annotations

import pytest
from chat_prompts import CHAT_PROMPTS, COPY_PROMPTS
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from vllm_engines import ENGINE_KWARGS, spec_counts
from vllm_models import save_untrained_drafter

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def prompts(default_target_dir):
    tok = AutoTokenizer.from_pretrained(default_target_dir)
    return [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for p in [*CHAT_PROMPTS, *COPY_PROMPTS]]


def generate(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_smollm2_greedy_batch_is_token_identical(default_target_dir, prompts, vllm_models_dir):
    drafter = save_untrained_drafter(default_target_dir, vllm_models_dir / "smollm2-drafter", block_size=4, top_k=8)
    kwargs = dict(ENGINE_KWARGS, kv_cache_memory_bytes=256 << 20, max_model_len=1024)
    plain = LLM(model=str(default_target_dir), **kwargs)
    expected = generate(plain, prompts)
    del plain
    ubtree = LLM(model=str(default_target_dir), speculative_config={
        "method": "ubtree", "model": str(drafter), "num_speculative_tokens": 8, "beam_width": 3, "top_k": 4,
        "prompt_lookup": True}, **kwargs)
    assert generate(ubtree, prompts) == expected
    drafts, accepted = spec_counts(ubtree)
    before = (drafts, accepted)
    generate(ubtree, prompts[-len(COPY_PROMPTS):])
    drafts, accepted = spec_counts(ubtree)
    # the untrained drafter accepts ~nothing alone (tests/unit/test_reference_decoder.py); copying does
    assert (accepted - before[1]) / (drafts - before[0]) > 0.3, (drafts, accepted, before)
