"""GPU check (H200, vLLM 0.32.0, CUDA graphs on): greedy equality, the T > 0 distribution and a
first tokens/s comparison.

Skipped without CUDA (``gpu`` marker, see tests/conftest.py). Runs the V1 runner (pinned with
``UBTREE_VLLM_RUNNER=v1``: Model Runner V2, the default on CUDA, has test_vllm_mrv2_gpu.py) with the
tree-aware FLASH_ATTN subclass (tree rows through the Triton tree-mask kernel, launched from
fixed-size row buffers): vLLM captures FULL CUDA graphs for uniform decode batches and
PIECEWISE graphs around attention for the others.

bf16 (FlashAttention has no fp32): a tree forward and a one-token decode round differently,
so a greedy divergence is accepted only at a near-tie of the reference -- the engine
without speculation (returning raw logits) must rank the UBTree token second, at most
``NEAR_TIE_ULPS`` bf16 ulps below the first (logits are bf16, so a gap is a whole number of
ulps: one ulp is the smallest gap there is); any other divergence fails.

The reference engine's outputs (plain decoding of the same target, engine arguments and prompts) are kept by
``reference_cache.py`` between tests and between calls on a warm device machine, keyed by everything they depend
on (the target's files, the engine arguments, the environment, this repository's code, the builds and the GPU), so a
test mostly starts one engine, the UBTree one.

Optional environment (test-only): ``GPU_TEST_DRAFTER`` = a trained drafter folder for
SmolLM2 (default: an untrained export, acceptance ~1, so no speed-up is expected);
``GPU_TEST_RECORDS`` = a records.jsonl path to append the tokens/s comparison to
(``ubtree_vllm.bench.records``).
"""
from __future__ import annotations

import gc
import math
import os
import time
from pathlib import Path
from typing import Any

import pytest
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from gpu_memory import settle_gpu_memory
from reference_cache import cached_reference, light_outputs, reference_key
from vllm_engines import TINY_TREE, spec_counts
from vllm_models import (SCALED_DUMMY_FORMAT, assert_continuations_depend_on_context, register_scaled_dummy_loader,
                         save_tiny_deepseek_v2, save_tiny_falcon_h1, save_tiny_ling, save_tiny_llama,
                         save_tiny_nemotron_h, save_tiny_qwen3_next, save_untrained_drafter)
from vllm_oracle import ReferenceOracle, engine_runner, install_oracle
from ubtree_vllm.config import SamplingConfig

from ubtree_vllm import compat

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]


@pytest.fixture(autouse=True)
def v1_runner(monkeypatch):
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", "v1")


NEAR_TIE_ULPS = 1
MAX_TOKENS = 128
TREE = {"num_speculative_tokens": 16, "beam_width": 4, "top_k": 8}


def engine(model, speculative_config=None, **kwargs) -> LLM:
    # Engines run in this process (the GPU machine's engine-core subprocess hangs, see
    # ../shared/README.md): undo the capture flag a previous V1 (UBTree) engine left behind, and vLLM's cache of
    # its environment (an engine's start freezes it), so a test's monkeypatched VLLM_* variables reach this engine.
    # First wait for a previous engine's GPU memory to be released (vLLM's memory profiling fails a start while the
    # free memory moves).
    from vllm import envs as vllm_envs

    settle_gpu_memory()
    compat.allow_cudagraph_capture_for_next_engine()
    vllm_envs.disable_envs_cache()
    settings = dict(dtype="bfloat16", gpu_memory_utilization=0.3, max_model_len=2048, seed=0,
                    skip_tokenizer_init=True, disable_log_stats=False)
    return LLM(model=str(model), speculative_config=speculative_config, **{**settings, **kwargs})


def prompts_for(vocab_size: int, count: int = 8) -> list[list[int]]:
    return [[(7 * i + 13 * j + 1) % vocab_size for j in range(16 + 9 * i)] for i in range(count)]


def bf16_ulp(x: float) -> float:
    """Spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 2.0 ** -126))) - 7)


def divergences_beyond_near_ties(spec: list[list[int]], plain_outputs, case: str = "") -> list[str]:
    """The prompts whose ``spec[i]`` first differs from plain decoding's tokens other than at a near-tie, one line
    each; a near-tie (the reference's logprobs -- its top-2 and the emitted token, in the engine's logprobs mode --
    rank the speculative token within ``NEAR_TIE_ULPS`` bf16 ulps of the reference's) is printed. The mode must be
    the logits greedy decoding compared: raw without logits processors, ``processed_logits`` where a request's
    options (bias, penalties, masks) move them. Every prompt is judged, so one run shows how divergences spread."""
    where = f"{case}: " if case else ""
    failures = []
    for i, (got, out) in enumerate(zip(spec, plain_outputs)):
        expected = list(out.outputs[0].token_ids)
        if got == expected:
            continue
        pos = next(j for j, (a, b) in enumerate(zip(got, expected)) if a != b)
        ranked = out.outputs[0].logprobs[pos]  # {token: Logprob} top-2 logits of the engine without speculation
        if got[pos] not in ranked:
            failures.append(f"prompt {i} diverges at {pos}: token {got[pos]} not in the reference top-2 "
                            f"{ranked}")
            continue
        first, second = ranked[expected[pos]].logprob, ranked[got[pos]].logprob
        ulps = (first - second) / bf16_ulp(max(abs(first), abs(second)))
        if ulps > NEAR_TIE_ULPS:
            failures.append(f"prompt {i} diverges at {pos}: reference logits {first} vs {second} differ by {ulps:g} "
                            f"bf16 ulps (not a near-tie)")
            continue
        print(f"near-tie: {where}prompt {i} diverges at {pos} ({first} vs {second}, {ulps:g} ulps)")
    return failures


def assert_greedy_equal_up_to_near_ties(spec: list[list[int]], plain_outputs, case: str = "") -> None:
    """``spec[i]`` equals plain decoding's tokens, or first differs at a near-tie
    (:func:`divergences_beyond_near_ties`)."""
    failures = divergences_beyond_near_ties(spec, plain_outputs, case)
    where = f"{case}: " if case else ""
    assert not failures, f"{where}{len(failures)} of {len(spec)} prompts: " + "; ".join(failures)


def plain_reference(target, num_prompts, fresh=False, **engine_kwargs):
    """(greedy outputs with the top-2 raw logits, as ``reference_cache.light_outputs``; the prompts' token ids; seconds
    for the first prompt alone after a warm-up) of ``target`` without speculation, from ``reference_cache`` unless
    ``fresh`` or not there (then an engine computes them, and its seconds are this run's)."""
    def compute():
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        plain = engine(target, logprobs_mode="raw_logits", **engine_kwargs)
        prompt_ids = prompts_for(plain.llm_engine.model_config.get_vocab_size(), num_prompts)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        with_logits = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False,
                                     logprobs=2)
        reference = light_outputs(plain.generate(prompts, with_logits, use_tqdm=False))
        plain.generate(prompts, params, use_tqdm=False)  # warm-up
        start = time.perf_counter()
        plain.generate(prompts[:1], params, use_tqdm=False)
        plain_s = time.perf_counter() - start
        del plain
        gc.collect()  # the engine core process exits and frees its GPU memory before the next engine
        return reference, prompt_ids, plain_s

    key = reference_key(target, {"form": "run_pair", "num_prompts": num_prompts, "max_tokens": MAX_TOKENS,
                                 "engine": engine_kwargs})
    (reference, prompt_ids, plain_s), cached = cached_reference(key, compute, fresh=fresh)
    if cached:
        print(f"plain decoding of {target}: the cached reference {key} (its tok/s measured by the run that made it)")
    return reference, prompt_ids, plain_s


def run_pair(target, drafter, num_prompts=8, inspect_ubtree_engine=None, tree=None, exact=False, fresh_reference=False,
             **engine_kwargs):
    """Greedy equality of ``num_prompts`` prompts, UBTree (speculative keys ``tree``, default TREE) vs no speculation
    (``exact``: token for token, no near-tie exception; for float32 engines; the reference from
    :func:`plain_reference`). ``inspect_ubtree_engine(llm)``
    runs before the UBTree engine shuts down and only collects facts (the caller asserts on them
    afterwards, so no traceback keeps the engine alive). Returns (plain tok/s, ubtree tok/s, tau) at batch 1."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
    reference, prompt_ids, plain_s = plain_reference(target, num_prompts, fresh=fresh_reference, **engine_kwargs)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
    assert_continuations_depend_on_context([list(o.outputs[0].token_ids) for o in reference], str(target))
    ubtree = engine(target, {"method": "ubtree", "model": str(drafter), **(TREE if tree is None else tree)},
                    **engine_kwargs)
    spec = [list(o.outputs[0].token_ids) for o in ubtree.generate(prompts, params, use_tqdm=False)]
    start = time.perf_counter()
    ubtree.generate(prompts[:1], params, use_tqdm=False)
    ubtree_s = time.perf_counter() - start
    drafts, accepted = spec_counts(ubtree)
    tau = 1 + accepted / max(1, drafts)
    if inspect_ubtree_engine is not None:
        inspect_ubtree_engine(ubtree)
    # Shut the engine down before asserting: a failed test's traceback would keep it alive, and its late
    # shutdown tears down vLLM's parallel state under the next test's engine.
    del ubtree
    gc.collect()
    if exact:
        for i, (got, out) in enumerate(zip(spec, reference)):
            expected = list(out.outputs[0].token_ids)
            first = next((j for j, (a, b) in enumerate(zip(got, expected)) if a != b), None)
            assert first is None, f"prompt {i}: first difference at token {first}: {got[first]} vs {expected[first]}"
    else:
        assert_greedy_equal_up_to_near_ties(spec, reference)
    return MAX_TOKENS / plain_s, MAX_TOKENS / ubtree_s, tau


def save_tiny_qwen3(tmp_path):
    """(target, untrained drafter) folders: a random bf16 4-layer Qwen3 (vocab 4096, GQA 8/4, head 64), gamma 8."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=False)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "qwen3")
    return tmp_path / "qwen3", save_untrained_drafter(tmp_path / "qwen3", tmp_path / "qwen3-drafter", block_size=8,
                                                      top_k=16)


def test_greedy_equality_tiny_qwen3_cuda_graphs(tmp_path):
    run_pair(*save_tiny_qwen3(tmp_path))


@pytest.mark.parametrize("runner", ["mrv2", "v1"])
def test_float32_greedy_is_token_identical_smollm2(runner, default_target_dir, tmp_path, monkeypatch):
    """Issue 19's fp32 check: a float32 target on CUDA runs TRITON_ATTN (FlashAttention has no fp32 kernel; the
    UBTree engine pins it, attention/triton_attn.py recomputes the tree rows), and greedy UBTree output is token for
    token the same engine's without speculation (both on TRITON_ATTN), with the prompt-lookup branch on."""
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", runner)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    plain_tps, ubtree_tps, tau = run_pair(default_target_dir, smollm2_drafter(default_target_dir, tmp_path),
                                          tree={**TREE, "prompt_lookup": True}, exact=True, dtype="float32",
                                          attention_backend="TRITON_ATTN")
    print(f"{runner} fp32 SmolLM2 batch 1: no speculation {plain_tps:.1f} tok/s, ubtree {ubtree_tps:.1f} tok/s, "
          f"tau {tau:.2f}")
    if os.environ.get("GPU_TEST_DRAFTER"):  # accepted drafts: the KV commit in TRITON_ATTN's cache is exercised
        assert tau > 1.5, tau


# Hybrid and MLA targets on CUDA (issue 17), opt-in with UBTREE_CUDA_HYBRIDS=1 (the V1 runner, PIECEWISE graphs):
# Qwen3-Next (Gated DeltaNet, ubtree_vllm/vllm/recurrent/gdn_cuda.py; also with one expert, top 1, whose routing
# cannot flip: with its 4-expert top-2 MoE UBTree diverged beyond a near-tie in two H100 runs, 2026-12-06, at the
# same prompt and token, and a read of the tree form found no bookkeeping fault, so a routing flip is suspected),
# NemotronH and Falcon-H1 (Mamba2, ubtree_vllm/vllm/recurrent/mamba2.py), DeepSeek-V2 (multi-head latent
# attention on FLASH_ATTN_MLA, ubtree_vllm/vllm/attention/flash_mla.py; loaded in bf16; also with dense MLPs only,
# to tell MoE routing flips from the MLA tree path) and Ling-3.0 (Kimi Delta Attention,
# ubtree_vllm/vllm/recurrent/kda_cuda.py, and MLA; weights drawn by vLLM, scaled so its layers shape the output:
# SCALED_DUMMY_FORMAT)
HYBRIDS = {"qwen3_next": save_tiny_qwen3_next, "nemotron_h": save_tiny_nemotron_h, "falcon_h1": save_tiny_falcon_h1,
           "qwen3_next_dense": lambda path, **kw: save_tiny_qwen3_next(path, moe=False, **kw),
           # vLLM's MLA prefill on the H200 takes DeepSeek's nope / v head dims (128) only
           "deepseek_v2": lambda path, **kw: save_tiny_deepseek_v2(path, nope_dim=128, v_dim=128, **kw),
           "deepseek_v2_dense": lambda path, **kw: save_tiny_deepseek_v2(path, nope_dim=128, v_dim=128, moe=False,
                                                                         **kw),
           "ling": save_tiny_ling}
# engine settings of a family beyond HYBRID_ENGINE: a config-only target loads weights vLLM draws (seeded: both
# engines of a test get the same); vLLM's default GDN prefill on the H200 (FlashInfer's) needs the CuTe DSL, which
# the device image cannot import ("No module named 'cutlass'", 2026-12-05), so Qwen3-Next prefills with vLLM's
# Triton kernels, in both engines alike (of both tests). The first Ling run (H100, 2026-12-05) loaded vLLM's plain
# "dummy" weights, under which the greedy output is a function of the last token (vllm_models.SCALED_DUMMY_FORMAT
# says why): it passed, and said little of KDA or MLA
HYBRID_LOAD = {"ling": dict(load_format=SCALED_DUMMY_FORMAT, attention_backend="FLASH_ATTN_MLA"),
               "deepseek_v2": dict(attention_backend="FLASH_ATTN_MLA"),  # the reference's too: the UBTree engine's
               "deepseek_v2_dense": dict(attention_backend="FLASH_ATTN_MLA"),
               "qwen3_next": dict(additional_config={"gdn_prefill_backend": "triton"}),
               "qwen3_next_dense": dict(additional_config={"gdn_prefill_backend": "triton"})}
# their engines: no prefix caching (UBTree refuses it for recurrent states), the tiny models' 1024 positions, and
# the reference engine runs as the UBTree engine is made to (the V1 runner, PIECEWISE graphs; fixture below): with
# vLLM's defaults it would run FULL graphs (and Model Runner V2 for DeepSeek-V2), whose attention splits the context
# differently. The DeepSeek-V2 divergence by 5 bf16 ulps (prompt 0, token 45) was the same under both references
# (H200 and H100, 2026-12-05), so that was not its cause
HYBRID_ENGINE = dict(enable_prefix_caching=False, max_model_len=1024, compilation_config={"cudagraph_mode": "PIECEWISE"})


@pytest.fixture(params=sorted(HYBRIDS))
def tiny_hybrid(request, tmp_path, monkeypatch):
    """(family, target, untrained drafter, engine settings): a random hybrid (or MLA target) of one family, served in
    bf16 under UBTREE_CUDA_HYBRIDS=1."""
    monkeypatch.setenv("UBTREE_CUDA_HYBRIDS", "1")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")  # the reference engine's runner: the UBTree engine's
    register_scaled_dummy_loader()
    target = HYBRIDS[request.param](tmp_path / request.param)
    drafter = save_untrained_drafter(target, tmp_path / f"{request.param}-drafter")
    return request.param, target, drafter, {**HYBRID_ENGINE, **HYBRID_LOAD.get(request.param, {})}


# Families judged against vLLM's own speculation as well as the 1-ulp near-tie rule. On a tiny random DeepSeek-V2 in
# bf16 every multi-token verification (UBTree's, and vLLM's draft_model and n-gram alike) rounds its rows
# differently from a one-token decode: on the CPU (2026-12-05, 8 prompts x 4 models) vLLM's draft_model diverged
# beyond 1 ulp on 7 prompts of 32 and UBTree on 8, at the same positions by the same gaps (up to 8 ulps) in several,
# and teacher-forced prefill logits differed from decode logits by a median 2 and up to 16 ulps. The standard is then
# the project's: no more often different than vLLM's own speculative methods (issue 19: at most 2x the rate). The
# recurrent families joined them after the H100 runs of 2026-12-06, where UBTree left plain decoding by 2-3 ulps on
# one or two prompts of 8 (Falcon-H1, Qwen3-Next) and plain decoding at another batch shape did not. Ling keeps the
# 1-ulp rule alone: whether vLLM's draft_model runs beside its MLA and KDA layers is not known.
MLA_BASELINE_FAMILIES = ("deepseek_v2", "deepseek_v2_dense")
BASELINE_FAMILIES = (*MLA_BASELINE_FAMILIES, "qwen3_next", "qwen3_next_dense", "nemotron_h", "falcon_h1")
BASELINE_SPEC = {"method": "draft_model", "num_speculative_tokens": 4}  # the MLA targets draft for themselves
BASELINE_RATIO = 2  # UBTree's prompts beyond a near-tie may be at most this many times the baseline's
MIN_ORACLE_ROUNDS = 20  # the copying oracle's tau is judged over at least this many rounds drafted from the reference


def baseline_spec(family: str, target, vocab_size: int) -> dict[str, Any]:
    """vLLM's draft_model speculation for ``family``'s yardstick engine. An MLA target drafts for itself. vLLM 0.32
    cannot take a recurrent hybrid as its own draft model (Qwen3-Next's folder loads as its MTP module and lacks the
    MTP weights; CPU, 2026-12-06), so those draft with a random one-layer Llama of the target's vocabulary: the
    verified rows go through the target's multi-token path whatever the drafter proposes, and that path's rounding is
    what the yardstick measures. One layer because vLLM groups a hybrid's KV-cache layers by the smallest layer
    type's count and the drafter's layers must share one group (2 and 4 layers failed that check on Qwen3-Next)."""
    if family in MLA_BASELINE_FAMILIES:
        return {**BASELINE_SPEC, "model": str(target)}
    drafter = save_tiny_llama(Path(target).parent / f"{family}-llama-drafter", vocab_size=vocab_size, num_layers=1)
    return {**BASELINE_SPEC, "model": str(drafter)}


def test_hybrid_greedy_equality_and_copying_oracle(tiny_hybrid):
    """One engine without speculation and one UBTree engine per family (engine starts are most of a device call):

    1. the untrained drafter: greedy output of the batch of 8 equals plain decoding's up to bf16 near-ties (the
       recurrent layers make plain decoding's one-token calls per node, but a tree forward's GEMMs and attention are
       not plain decoding's);
    2. the copying oracle on the same engine: plain decoding's continuation on a second branch cut at random depths,
       so accepted paths run off their depth and every recurrent layer's commit moves state slots and conv columns
       (an MLA target's: latent rows in its cache); equal up to near-ties again, with tau > 2 over the rounds the
       oracle drafted from plain decoding's continuation (:meth:`ReferenceOracle.on_reference_rounds`; at least
       :data:`MIN_ORACLE_ROUNDS` of them).

    Each UBTree case may diverge beyond a near-tie on as many prompts as plain decoding does from itself when each
    prompt runs alone (another batch shape: a bf16 model whose layers amplify rounding shows it here, with no
    speculation involved); for every family but Ling, where a UBTree case exceeds that, a third engine runs vLLM's
    draft_model speculation (:func:`baseline_spec`) on the same prompts, and the allowance is at least
    :data:`BASELINE_RATIO` times its count.
    An output off plain decoding's (even at a near-tie) leaves the oracle nothing to copy, so vLLM's acceptance
    counters, which count those rounds too, are printed only."""
    family, target, drafter, settings = tiny_hybrid
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)

    def plain_decoding():
        plain = engine(target, logprobs_mode="raw_logits", **settings)
        vocab = plain.llm_engine.model_config.get_vocab_size()
        prompt_ids = prompts_for(vocab)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
        reference = light_outputs(plain.generate(prompts, SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False, logprobs=2), use_tqdm=False))
        # plain decoding against itself at another batch shape (each prompt alone): its GEMMs and attention split
        # differently, as a verification's do, so no speculative method can be held to fewer divergences than this
        alone = [list(plain.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts]
        del plain
        gc.collect()
        return vocab, prompt_ids, reference, alone

    (vocab, prompt_ids, reference, alone), _ = cached_reference(
        reference_key(target, {"form": "hybrid", "max_tokens": MAX_TOKENS, "engine": settings}), plain_decoding)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in prompt_ids]
    continuations = [list(o.outputs[0].token_ids) for o in reference]
    assert_continuations_depend_on_context(continuations, str(target))
    batch_shape = divergences_beyond_near_ties(alone, reference, "plain decoding, one prompt at a time")
    ubtree = engine(target, {"method": "ubtree", "model": str(drafter), **TINY_TREE}, **settings)
    untrained = [list(o.outputs[0].token_ids) for o in ubtree.generate(prompts, params, use_tqdm=False)]
    oracle = ReferenceOracle(prompt_ids, continuations, engine_runner(ubtree).drafter.config.tree, vocab_size=vocab)
    install_oracle(ubtree, oracle)
    drafts_before, accepted_before = spec_counts(ubtree)
    copied = [list(o.outputs[0].token_ids) for o in ubtree.generate(prompts, params, use_tqdm=False)]
    drafts, accepted = spec_counts(ubtree)
    drafts, accepted, calls = drafts - drafts_before, accepted - accepted_before, oracle.calls
    on_reference, tau_on_reference = oracle.on_reference_rounds()
    del ubtree, oracle
    gc.collect()
    allowed = len(batch_shape)
    baseline_note = f" (plain decoding one prompt at a time: {allowed} of {len(prompts)}"
    cases = ((untrained, "untrained drafter"), (copied, "copying oracle"))
    beyond = {case: divergences_beyond_near_ties(spec, reference, case) for spec, case in cases}
    # the third engine only where its count could change the verdict: a UBTree case past plain decoding's own
    # allowance (an engine start is most of a family's share of a device call)
    if family in BASELINE_FAMILIES and any(len(found) > allowed for found in beyond.values()):
        vllm_spec = engine(target, baseline_spec(family, target, vocab), **settings)
        baseline = [list(o.outputs[0].token_ids) for o in vllm_spec.generate(prompts, params, use_tqdm=False)]
        del vllm_spec
        gc.collect()
        baseline_failures = divergences_beyond_near_ties(baseline, reference, "vLLM draft_model")
        allowed = max(allowed, BASELINE_RATIO * len(baseline_failures))
        baseline_note += f"; vLLM draft_model: {len(baseline_failures)} of {len(prompts)}"
    baseline_note += f"; so {allowed} allowed)"
    print(f"{family}{baseline_note}")
    # equality first: a divergence also starves the oracle (it copies plain decoding's continuation), so its report
    # says more than the tau's; both cases are judged before failing
    failures = []
    for spec, case in cases:
        if len(beyond[case]) > allowed:
            failures.append(f"{case}: {len(beyond[case])} of {len(spec)} prompts beyond a near-tie{baseline_note}: "
                            + "; ".join(beyond[case]))
        elif beyond[case]:
            print(f"{family} {case}: {len(beyond[case])} of {len(spec)} prompts beyond a near-tie{baseline_note}")
    # printed as well: a device call's timeout kills pytest before its -rfE summary (2026-12-06: three families
    # failed there and the log kept only their near-tie lines)
    for failure in failures:
        print(f"{family} FAILED: {failure}")
    assert not failures, "; ".join(failures)
    tau = 1 + accepted / max(1, drafts)
    print(f"{family} copying oracle: tau {tau_on_reference:.2f} over {on_reference} rounds drafted from the reference "
          f"({calls} calls; all rounds, vLLM's counters: tau {tau:.2f}, {accepted:g} of {drafts:g} drafts accepted)")
    assert on_reference >= MIN_ORACLE_ROUNDS, (
        f"the copying oracle drafted only {on_reference} rounds from the reference with a later round to measure "
        f"them by ({calls} propose calls): it was not exercised")
    assert tau_on_reference > 2.0, (on_reference, tau_on_reference, calls, drafts, accepted)


# Falcon-H1 runs NemotronH's Mamba2 tree form, and at vocabulary 8 its untrained drafter's trees were accepted too
# rarely on the CPU for the test's precondition (tests/vllm/test_vllm_cpu_families.py)
@pytest.mark.parametrize("family", ["qwen3_next", "nemotron_h"])
def test_t1_hybrid_samples_follow_plain_decodings_distribution(family, tmp_path, monkeypatch):
    """At T = 1 on a vocabulary-8 hybrid: 3000 continuations of 4 tokens from UBTree (untrained drafter, K = 6 of 8,
    so trees are often partly accepted) against 3000 from the same engine without speculation, a two-sample test
    per position and adjacent pair."""
    import torch
    from exact_distribution import two_sample_pvalues  # scipy, imported only by this test

    monkeypatch.setenv("UBTREE_CUDA_HYBRIDS", "1")
    target = HYBRIDS[family](tmp_path / f"vocab8-{family}", vocab_size=8, seed=3)
    drafter = save_untrained_drafter(target, tmp_path / f"vocab8-{family}-drafter", block_size=3, top_k=6, seed=1)
    small = dict(HYBRID_LOAD.get(family, {}), max_model_len=64, max_num_seqs=64, enable_prefix_caching=False)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, detokenize=False)
    prompts = [TokensPrompt(prompt_token_ids=[1, 2, 3])] * 3000

    def samples(llm):
        return torch.tensor([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])

    plain = engine(target, **small)
    reference = samples(plain)
    del plain
    gc.collect()
    ubtree = engine(target, {"method": "ubtree", "model": str(drafter), "num_speculative_tokens": 9,
                             "beam_width": 3, "top_k": 6}, **small)
    drafted = samples(ubtree)
    drafts, accepted = spec_counts(ubtree)
    del ubtree  # shut down before asserting (see run_pair)
    gc.collect()
    assert accepted > 0.3 * drafts, (accepted, drafts)  # lossless only tested where trees are partly accepted
    pvals = two_sample_pvalues(drafted, reference, 8)
    assert min(pvals) > ALPHA / len(pvals), pvals


def smollm2_drafter(default_target_dir, tmp_path):
    """GPU_TEST_DRAFTER (a trained drafter folder) or an untrained export for SmolLM2."""
    return os.environ.get("GPU_TEST_DRAFTER") or save_untrained_drafter(
        default_target_dir, tmp_path / "smollm2-drafter", block_size=16, top_k=16)


def test_greedy_equality_and_speed_smollm2(default_target_dir, tmp_path):
    drafter = smollm2_drafter(default_target_dir, tmp_path)
    plain_tps, ubtree_tps, tau = run_pair(default_target_dir, drafter, fresh_reference=True)  # both timed here
    print(f"SmolLM2 batch 1: no speculation {plain_tps:.1f} tok/s, ubtree {ubtree_tps:.1f} tok/s, tau {tau:.2f}")
    records = os.environ.get("GPU_TEST_RECORDS")
    if records:
        from ubtree_vllm.bench.records import append_record

        common = dict(kind="e2e", target="smollm2-135m-instruct", dataset="synthetic-token-prompts",
                      num_prompts=1, max_new_tokens=MAX_TOKENS, temperature=0.0, batch_size=1, concurrency=1,
                      tp=1, cuda_graphs=True, command="pytest tests/vllm/test_vllm_gpu.py")
        append_record({**common, "method": "ar", "output_tokens_per_s": plain_tps}, records)
        append_record({**common, "method": "ubtree", "drafter": str(drafter), "tree_budget": 16, "beam_width": 4,
                       "top_k": 8, "tau": tau, "output_tokens_per_s": ubtree_tps,
                       "speedup_vs_ar": ubtree_tps / plain_tps}, records)


# T > 0: vocabulary-8 random Llama (head_dim 64), untrained drafter with K = 6 of 8 tokens so trees are
# often partly accepted. bf16 arithmetic differs from an fp32 HF enumeration (and may move a token
# across a top-k / top-p boundary), so the reference is the same target in the same engine without
# speculation: a two-sample chi-square per position and per adjacent pair.
VOCAB, HORIZON, NUM_SAMPLES, PROMPT, ALPHA = 8, 4, 10000, [1, 2, 3], 1e-3
# (sampling, logits options): min_p and logit_bias at every node, penalties along each node's path (both runners)
SAMPLING_CASES = [(SamplingConfig(1.0), {}), (SamplingConfig(0.8, top_k=5), {}), (SamplingConfig(1.2, top_p=0.85), {}),
                  (SamplingConfig(1.0, top_k=6, top_p=0.9), {}),
                  (SamplingConfig(1.0), {"min_p": 0.1, "logit_bias": {3: 1.5, 6: -1.0}}),
                  (SamplingConfig(1.0), {"presence_penalty": 0.4, "frequency_penalty": 0.3, "repetition_penalty": 1.3})]


def sample_continuations(llm: LLM, case: tuple[SamplingConfig, dict]) -> Any:  # a torch.Tensor
    import torch

    sampling, options = case
    params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            max_tokens=HORIZON, ignore_eos=True, detokenize=False, **options)
    outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * NUM_SAMPLES, params, use_tqdm=False)
    return torch.tensor([list(o.outputs[0].token_ids) for o in outs])


def test_sampling_distribution_cuda_graphs(tmp_path):
    check_sampling_distribution(tmp_path)


def check_sampling_distribution(tmp_path):
    """UBTree at T > 0 against the same engine without speculation (also run on MRV2 by test_vllm_mrv2_gpu.py)."""
    from exact_distribution import two_sample_pvalues  # scipy, imported only by this test

    target = save_tiny_llama(tmp_path / "vocab8", vocab_size=VOCAB, hidden_size=128, num_layers=3, num_heads=2,
                             num_kv_heads=1, init_range=0.15, seed=3)
    drafter = save_untrained_drafter(target, tmp_path / "vocab8-drafter", block_size=3, top_k=6, seed=1)
    small = dict(max_model_len=64, max_num_seqs=256)
    plain = engine(target, **small)
    reference = [sample_continuations(plain, case) for case in SAMPLING_CASES]
    del plain
    gc.collect()
    # budget_policy fixed: the whole 9-node tree at every step. Up to 256 requests are in flight here, where the
    # load-adaptive default (Model Runner V2) verifies 1 node of each tree: on an H100 (a2125fa) that step accepted
    # 0.24 tokens per round, under the 0.3 this test asks before it judges anything
    ubtree = engine(target, {"method": "ubtree", "model": str(drafter), "num_speculative_tokens": 9,
                             "beam_width": 3, "top_k": 6, "budget_policy": "fixed"}, **small)
    results = []
    for case in SAMPLING_CASES:
        before = spec_counts(ubtree)
        samples = sample_continuations(ubtree, case)
        results.append((samples, before, spec_counts(ubtree)))
    del ubtree  # shut down before asserting (see run_pair)
    gc.collect()
    for case, ref, (samples, before, after) in zip(SAMPLING_CASES, reference, results):
        # Losslessness is only tested if drafts were accepted: > 0.3 accepted tokens per round.
        assert after[1] - before[1] > 0.3 * (after[0] - before[0]), (case, before, after)
        pvals = two_sample_pvalues(samples, ref, VOCAB)
        assert min(pvals) > ALPHA / len(pvals), (case, pvals)
