"""Greedy UBTree on tiny random fp32 DeepSeek-V2 and -V3 targets (multi-head latent attention) is token-identical
to the same engine without speculation (CPU V1 runner, vLLM's CPU_MLA backend with the tree mask of
attention/cpu_mla.py).

One engine pair per family (V2: MoE, no q LoRA; V3: q LoRA, dense MLPs): one request at a time, a concurrent batch of different lengths, the copying oracle drafter (long
accepted paths off their depth, so every layer's latent-cache commit moves rows) and a load-adaptive budget (short
trees); at T = 1 on a vocabulary-8 model, UBTree's samples follow the same engine's without speculation. The mask
and the commit's latent writer have unit tests in test_vllm_cpu_mla.py.
"""
from __future__ import annotations

import gc
import random
import types

import pytest
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from ubtree_vllm.bench.e2e import stop_engine
from hybrid_checks import check_copying_drafter, check_load_adaptive_budget, generate, plain_references
from vllm_engines import ENGINE_KWARGS, TINY_TREE, spec_counts
from vllm_models import save_tiny_deepseek_v2, save_tiny_deepseek_v3, save_untrained_drafter

NUM_PROMPTS, MAX_TOKENS, VOCAB = 8, 24, 512
_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(_rng.randrange(3, 70))] for _ in range(NUM_PROMPTS)]
# vLLM's CPU MLA decode kernel takes 16-token blocks only; CPU_MLA pinned for both engines (the UBTree engine pins
# it itself; on AMX hosts vLLM would pick AMX_MLA for the plain one)
MLA_KWARGS = dict(ENGINE_KWARGS, block_size=16, attention_backend="CPU_MLA")
FAMILIES = {"deepseek-v2": save_tiny_deepseek_v2, "deepseek-v3": save_tiny_deepseek_v3}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def mla(request, vllm_models_dir):
    """The family's tiny target, an untrained drafter, plain decoding's greedy outputs (alone, batched) and a
    UBTree engine; pytest runs one family's tests before building the next's engines."""
    target = FAMILIES[request.param](vllm_models_dir / f"tiny-{request.param}")
    drafter = save_untrained_drafter(target, vllm_models_dir / f"tiny-{request.param}-drafter")
    references = plain_references(target, MLA_KWARGS, PROMPTS, MAX_TOKENS)
    llm = LLM(model=str(target), speculative_config={"method": "ubtree", "model": str(drafter), **TINY_TREE},
              **MLA_KWARGS)
    yield types.SimpleNamespace(target=target, drafter=drafter, one=references[0], batch=references[1], llm=llm)
    stop_engine(llm)


def test_greedy_one_request_at_a_time(mla):
    assert [generate(mla.llm, [p], MAX_TOKENS)[0] for p in PROMPTS] == mla.one


def test_greedy_concurrent_batch_of_different_lengths(mla):
    assert generate(mla.llm, PROMPTS, MAX_TOKENS) == mla.batch


def test_copying_drafter_accepts_long_paths(mla):
    check_copying_drafter(mla.llm, PROMPTS, mla.batch, VOCAB, MAX_TOKENS)


def test_load_adaptive_budget_verifies_short_trees(mla):
    check_load_adaptive_budget(mla.target, mla.drafter, MLA_KWARGS, PROMPTS, mla.batch, MAX_TOKENS)


def test_t1_samples_follow_plain_decodings_distribution(vllm_models_dir):
    """T = 1 on a vocabulary-8 model: 3000 continuations of 4 tokens from UBTree (untrained drafter, K = 6 of the 8
    tokens, so trees are often partly accepted) against 3000 from the same engine without speculation, a two-sample
    test per position and adjacent pair."""
    from exact_distribution import two_sample_pvalues  # scipy, imported only by this test

    target = save_tiny_deepseek_v2(vllm_models_dir / "vocab8-deepseek-v2", vocab_size=8, seed=3)
    drafter = save_untrained_drafter(target, vllm_models_dir / "vocab8-deepseek-v2-drafter", block_size=3, top_k=6,
                                     seed=1)
    kwargs = dict(MLA_KWARGS, max_num_seqs=64, max_model_len=64)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[1, 2, 3])] * 3000

    def samples(llm):
        return torch.tensor([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])

    plain = LLM(model=str(target), **kwargs)
    try:
        reference = samples(plain)
    finally:
        stop_engine(plain)
        del plain
        gc.collect()
    llm = LLM(model=str(target), speculative_config={"method": "ubtree", "model": str(drafter),
                                                     "num_speculative_tokens": 9, "beam_width": 3, "top_k": 6},
              **kwargs)
    try:
        drafted = samples(llm)
        drafts, accepted = spec_counts(llm)
    finally:
        stop_engine(llm)
        del llm
    assert accepted > 0.3 * drafts, (accepted, drafts)  # lossless only tested where trees are partly accepted
    pvals = two_sample_pvalues(drafted, reference, 8)
    assert min(pvals) > 1e-3 / len(pvals), pvals
