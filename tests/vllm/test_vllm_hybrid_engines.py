"""Greedy UBTree on tiny random bf16 hybrids is token-identical to the same engine without speculation.

One engine pair per family (Qwen3-Next: Gated DeltaNet; NemotronH: Mamba2; CPU V1 runner): one request at a
time, a concurrent batch of different lengths, the copying oracle drafter (long accepted paths off their depth,
so every recurrent layer's commit moves states and conv inputs) and a load-adaptive budget (short trees). The
layer-level tests are in test_vllm_gdn_hybrid.py and test_vllm_mamba2_hybrid.py.
"""
from __future__ import annotations

import random
import types

import pytest
from vllm import LLM

from ubtree_vllm.bench.e2e import stop_engine
from hybrid_checks import check_copying_drafter, check_load_adaptive_budget, generate, plain_references
from vllm_engines import ENGINE_KWARGS, TINY_TREE
from vllm_models import save_tiny_nemotron_h, save_tiny_qwen3_next, save_untrained_drafter

NUM_PROMPTS, MAX_TOKENS, VOCAB = 8, 24, 512
_rng = random.Random(1234)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(_rng.randrange(3, 70))] for _ in range(NUM_PROMPTS)]
# bf16 (the CPU GDN kernels' only dtype); prefix caching off (vLLM's recurrent-state caching commits chains)
HYBRID_KWARGS = dict(ENGINE_KWARGS, dtype="bfloat16", enable_prefix_caching=False)
FAMILIES = {"qwen3-next": save_tiny_qwen3_next, "nemotron-h": save_tiny_nemotron_h}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def hybrid(request, vllm_models_dir):
    """The family's tiny target, an untrained drafter, plain decoding's greedy outputs (alone, batched) and a
    UBTree engine; pytest runs one family's tests before building the next's engines."""
    target = FAMILIES[request.param](vllm_models_dir / f"tiny-{request.param}")
    drafter = save_untrained_drafter(target, vllm_models_dir / f"tiny-{request.param}-drafter")
    references = plain_references(target, HYBRID_KWARGS, PROMPTS, MAX_TOKENS)
    llm = LLM(model=str(target), speculative_config={"method": "ubtree", "model": str(drafter), **TINY_TREE},
              **HYBRID_KWARGS)
    yield types.SimpleNamespace(target=target, drafter=drafter, one=references[0], batch=references[1], llm=llm)
    stop_engine(llm)


def test_greedy_one_request_at_a_time(hybrid):
    assert [generate(hybrid.llm, [p], MAX_TOKENS)[0] for p in PROMPTS] == hybrid.one


def test_greedy_concurrent_batch_of_different_lengths(hybrid):
    assert generate(hybrid.llm, PROMPTS, MAX_TOKENS) == hybrid.batch


def test_copying_drafter_accepts_long_paths(hybrid):
    check_copying_drafter(hybrid.llm, PROMPTS, hybrid.batch, VOCAB, MAX_TOKENS)


def test_load_adaptive_budget_verifies_short_trees(hybrid):
    check_load_adaptive_budget(hybrid.target, hybrid.drafter, HYBRID_KWARGS, PROMPTS, hybrid.batch, MAX_TOKENS)
