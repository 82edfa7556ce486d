"""Greedy UBTree through vLLM (in-process engine) is token-identical to vLLM without speculation.

Tiny random Llama; the untrained drafter checks losslessness with (almost) nothing
accepted, the oracle drafter (test-only, installed in-process) hides the reference on a
non-first branch and cuts it at random depths, which drives multi-token acceptances,
the KV commit of moved nodes and the drafter features of accepted paths.
"""
from __future__ import annotations

import random

import pytest
from vllm import LLM, SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt

from vllm_engines import ENGINE_KWARGS, TINY_TREE, spec_counts
from vllm_oracle import ReferenceOracle, engine_runner, install_oracle

NUM_PROMPTS, MAX_TOKENS = 8, 24
_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(_rng.randrange(3, 70))] for _ in range(NUM_PROMPTS)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)


def generate(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain_llm(tiny_target):
    return LLM(model=str(tiny_target), **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def ubtree_llm(tiny_target, tiny_drafter, plain_llm):
    # Created after plain_llm: each new engine re-registers vLLM's Prometheus metrics
    # (the process-global registry that get_metrics() reads), so the last one wins.
    return LLM(model=str(tiny_target), speculative_config={"method": "ubtree", "model": str(tiny_drafter), **TINY_TREE},
               **ENGINE_KWARGS)


@pytest.fixture(scope="module")
def reference_batch(plain_llm):
    return generate(plain_llm, PROMPTS)


def test_engine_runs_the_ubtree_runner(ubtree_llm):
    runner = engine_runner(ubtree_llm)
    assert type(runner).__name__ == "UBTreeCPUModelRunner"
    assert runner.drafter.config.tree.tree_budget == TINY_TREE["num_speculative_tokens"]


def test_greedy_one_request_at_a_time(plain_llm, ubtree_llm):
    for prompt in PROMPTS:
        assert generate(ubtree_llm, [prompt]) == generate(plain_llm, [prompt])


def test_greedy_concurrent_batch_of_different_lengths(ubtree_llm, reference_batch):
    assert generate(ubtree_llm, PROMPTS) == reference_batch


def test_copying_drafter_accepts_long_paths_and_metrics_report_it(ubtree_llm, reference_batch):
    runner = engine_runner(ubtree_llm)
    oracle = ReferenceOracle(PROMPTS, reference_batch, runner.drafter.config.tree, vocab_size=512)
    drafts_before, accepted_before = spec_counts(ubtree_llm)
    install_oracle(ubtree_llm, oracle)
    try:
        assert generate(ubtree_llm, PROMPTS) == reference_batch
    finally:
        install_oracle(ubtree_llm, None)
    drafts, accepted = spec_counts(ubtree_llm)
    mean_acceptance_length = 1 + (accepted - accepted_before) / (drafts - drafts_before)
    assert oracle.calls > 0
    assert mean_acceptance_length > 2.0, mean_acceptance_length


def test_stop_and_max_tokens_inside_an_accepted_path(plain_llm, ubtree_llm, reference_batch):
    runner = engine_runner(ubtree_llm)
    install_oracle(ubtree_llm, ReferenceOracle(PROMPTS, reference_batch, runner.drafter.config.tree,
                                               vocab_size=512, corrupt_prob=0.0))
    try:
        for prompt, ref in zip(PROMPTS[:3], reference_batch[:3]):
            stop = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[ref[9]], detokenize=False)
            short = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, detokenize=False)
            for params in (stop, short):
                assert generate(ubtree_llm, [prompt], params) == generate(plain_llm, [prompt], params)
    finally:
        install_oracle(ubtree_llm, None)


def test_options_trees_cannot_serve_are_rejected(ubtree_llm):
    with pytest.raises(VLLMValidationError, match=r"\['thinking_token_budget'\] are not supported with speculative "
                                                  r"decoding method 'ubtree'"):
        generate(ubtree_llm, PROMPTS[:1], SamplingParams(max_tokens=4, thinking_token_budget=2, detokenize=False))
    assert len(generate(ubtree_llm, PROMPTS[:1])[0]) == MAX_TOKENS  # the engine keeps serving


def test_load_adaptive_budget_verifies_the_scheduled_first_nodes(tiny_target, tiny_drafter, reference_batch):
    """num_speculative_tokens_per_batch_size: with 8 requests in flight vLLM's scheduler picks B' = 3 of B = 8, the
    runner hands it the first 3 nodes of each tree (numbered by rank: the best 3-node subtree), and greedy output stays
    plain decoding's."""
    schedule = [[1, 4, 8], [5, 16, 3]]
    llm = LLM(model=str(tiny_target), speculative_config={"method": "ubtree", "model": str(tiny_drafter), **TINY_TREE,
                                                          "num_speculative_tokens_per_batch_size": schedule},
              **ENGINE_KWARGS)
    try:
        got = generate(llm, PROMPTS)
        metrics = llm.get_metrics()
    finally:
        del llm
    assert got == reference_batch
    totals = {m.name: float(m.value) for m in metrics if m.name in ("vllm:spec_decode_num_drafts",
                                                                    "vllm:spec_decode_num_draft_tokens")}
    drafts, tokens = totals["vllm:spec_decode_num_drafts"], totals["vllm:spec_decode_num_draft_tokens"]
    # mostly 3 nodes per round (8 in flight); 8 only in the last rounds, once fewer than 5 requests are left
    assert drafts > 0 and tokens / drafts < 5, totals


def test_a_budget_schedule_that_cannot_fit_the_token_budget_fails_at_start(tiny_target, tiny_drafter):
    """16 requests at B' = 8 verify 144 tokens per step; with max_num_batched_tokens = 64 the worker refuses the
    engine before building anything, naming the entry and the largest budget that fits."""
    with pytest.raises(ValueError, match=r"entry \[1, 16, 8\]: 16 requests verify 144 tokens per step but "
                                         r"max_num_batched_tokens is 64; the largest budget that fits 16 requests is 3"):
        LLM(model=str(tiny_target), speculative_config={"method": "ubtree", "model": str(tiny_drafter), **TINY_TREE,
                                                        "num_speculative_tokens_per_batch_size": [[1, 16, 8]]},
            **{**ENGINE_KWARGS, "max_num_seqs": 16, "max_num_batched_tokens": 64})


@pytest.mark.parametrize("mode", ["flash_merge", "triton_stock_roots", "flash_exact", "flashinfer"])
def test_cuda_tree_attention_modes_are_refused_off_cuda(tiny_target, tiny_drafter, mode):
    with pytest.raises(ValueError, match=rf"tree_attention '{mode}' runs on CUDA only .* use 'triton'"):
        LLM(model=str(tiny_target), speculative_config={"method": "ubtree", "model": str(tiny_drafter), **TINY_TREE,
                                                        "tree_attention": mode}, **ENGINE_KWARGS)
