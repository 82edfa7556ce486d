"""The reference decoder is lossless: greedy token equality on SmolLM2, exact sampling on a tiny model."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from chat_prompts import CHAT_PROMPTS, COPY_PROMPTS
from exact_distribution import distribution_pvalues, exact_joint
from oracle_drafter import OracleDrafter
from ubtree_vllm.config import SamplingConfig, UBTreeConfig
from ubtree_vllm.decoding.reference import ReferenceDecoder
from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.verify.sampling import processed_probs

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm(default_target_dir):
    tok = AutoTokenizer.from_pretrained(default_target_dir)
    # float32 keeps tree-vs-chain rounding differences far below any argmax gap.
    model = AutoModelForCausalLM.from_pretrained(default_target_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for p in CHAT_PROMPTS]
    plain = ReferenceDecoder(model).generate(prompts, NEW_TOKENS)
    assert all(len(o.token_ids) == NEW_TOKENS for o in plain)
    return model, prompts, [o.token_ids for o in plain]


def untrained_drafter(model, block_size: int, top_k: int) -> UBTreeDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(model.config, "smollm2-135m-instruct", block_size=block_size, top_k=top_k)
    drafter = UBTreeDrafter(cfg)
    drafter.bind_hf_target(model)
    return drafter.eval()


def test_greedy_untrained_drafter(smollm):
    """Random drafter weights (acceptance ~1 token per round): output identical to plain greedy."""
    model, prompts, expected = smollm
    drafter = untrained_drafter(model, block_size=8, top_k=16)
    cfg = UBTreeConfig(tree_budget=24, beam_width=4, top_k=16, block_size=8)
    outs = ReferenceDecoder(model, drafter, cfg).generate(prompts, NEW_TOKENS)
    assert [o.token_ids for o in outs] == expected


def test_greedy_paper_tree_shape(smollm):
    """The paper's tree (B=64, W=12, K=64, gamma=16) on two prompts: still token-identical."""
    model, prompts, expected = smollm
    drafter = untrained_drafter(model, block_size=16, top_k=64)
    outs = ReferenceDecoder(model, drafter, UBTreeConfig()).generate(prompts[:2], 32)
    assert [o.token_ids for o in outs] == [e[:32] for e in expected[:2]]


def test_greedy_copying_drafter_accepts_long_paths(smollm):
    model, prompts, expected = smollm
    cfg = UBTreeConfig(tree_budget=32, beam_width=4, top_k=8, block_size=8)
    oracle = OracleDrafter(model, model.config.vocab_size)
    outs = ReferenceDecoder(model, oracle, cfg, feature_layer_ids=()).generate(prompts, NEW_TOKENS)
    assert [o.token_ids for o in outs] == expected
    tau = sum(o.acceptance_length for o in outs) / len(outs)
    assert tau > 6.0, tau  # the oracle branch is almost always kept: ~gamma + 1 tokens per round


# ---- sampling: exact distribution on a tiny-vocabulary model --------------------------------
VOCAB, HORIZON, NUM_SAMPLES = 8, 4, 3000
PROMPT = [1, 2, 3]


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.4,
                      max_position_embeddings=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).float().eval()


def spec_samples(model, sampling: SamplingConfig, decoder_cls=ReferenceDecoder, seed: int = 0,
                 prompt_lookup: bool = False) -> torch.Tensor:
    torch.manual_seed(1)
    dcfg = DrafterConfig.for_target(model.config, "tiny", block_size=3, top_k=6, num_layers=1, head_dim=8,
                                    selector_rank=8)
    drafter = UBTreeDrafter(dcfg)
    drafter.bind_hf_target(model)
    decoder = decoder_cls(model, drafter.eval(), UBTreeConfig(tree_budget=9, beam_width=3, top_k=6, block_size=3,
                                                              prompt_lookup=prompt_lookup, lookup_min_n=1))
    outs = decoder.generate([PROMPT] * NUM_SAMPLES, HORIZON, sampling, seed=seed)
    rounds = sum(len(o.tokens_per_round) for o in outs)
    # Lossless is only meaningful if speculation actually accepted draft tokens.
    assert sum(sum(o.tokens_per_round) for o in outs) > 1.3 * rounds
    return torch.tensor([o.token_ids for o in outs])


SAMPLING_CASES = [SamplingConfig(1.0), SamplingConfig(0.8, top_k=5), SamplingConfig(1.2, top_p=0.85),
                  SamplingConfig(1.0, top_k=6, top_p=0.9)]
ALPHA = 1e-3


@pytest.mark.parametrize("sampling", SAMPLING_CASES, ids=str)
def test_sampling_matches_target_distribution(tiny_target, sampling):
    joint = exact_joint(tiny_target, PROMPT, VOCAB, HORIZON, sampling)
    pvals = distribution_pvalues(spec_samples(tiny_target, sampling), joint)
    assert min(pvals) > ALPHA / len(pvals), pvals


def test_sampling_with_the_lookup_branch_matches_target_distribution(tiny_target):
    """The prompt-lookup branch (tree/lookup.py; 1- to 4-grams over an 8-token vocabulary match almost
    every round) changes the trees, never the distribution."""
    sampling = SamplingConfig(1.0)
    joint = exact_joint(tiny_target, PROMPT, VOCAB, HORIZON, sampling)
    pvals = distribution_pvalues(spec_samples(tiny_target, sampling, prompt_lookup=True), joint)
    assert min(pvals) > ALPHA / len(pvals), pvals


def test_greedy_with_the_lookup_branch_is_lossless_and_copies(smollm):
    model, _, _ = smollm
    tok = AutoTokenizer.from_pretrained(model.name_or_path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                       return_dict=False) for p in COPY_PROMPTS]
    expected = [o.token_ids for o in ReferenceDecoder(model).generate(prompts, 40)]
    drafter = untrained_drafter(model, block_size=8, top_k=16)
    taus = {}
    for lookup in (False, True):
        cfg = UBTreeConfig(tree_budget=24, beam_width=4, top_k=16, block_size=8, prompt_lookup=lookup)
        outs = ReferenceDecoder(model, drafter, cfg).generate(prompts, 40)
        assert [o.token_ids for o in outs] == expected
        taus[lookup] = sum(o.acceptance_length for o in outs) / len(outs)
    # the untrained drafter alone accepts ~nothing (measured 1.05); copying from the prompt: 1.62
    assert taus[False] < 1.2 and taus[True] > 1.5, taus


class SharedNoiseDecoder(ReferenceDecoder):
    """A plausible bug: one random draw per request reused at every tree node."""

    def sample_nodes(self, logits, params, generator):
        probs = processed_probs(logits, params)
        noise = torch.empty_like(probs[:, :1]).exponential_(1.0, generator=generator)
        return (probs / noise).argmax(dim=-1)


class GreedyWalkDecoder(ReferenceDecoder):
    """A plausible bug: accept children by the target's argmax, sample only the bonus."""

    def sample_nodes(self, logits, params, generator):
        sampled = super().sample_nodes(logits, params, generator)
        is_leafward = torch.zeros_like(sampled, dtype=torch.bool)
        is_leafward[:, 1:] = True  # every non-root node decides acceptance greedily
        return torch.where(is_leafward, logits.argmax(-1), sampled)


@pytest.mark.parametrize("decoder_cls", [SharedNoiseDecoder, GreedyWalkDecoder])
def test_sampling_test_detects_wrong_rules(tiny_target, decoder_cls):
    """The chi-square test above has the power to reject plausible wrong acceptance rules."""
    sampling = SAMPLING_CASES[0]
    joint = exact_joint(tiny_target, PROMPT, VOCAB, HORIZON, sampling)
    pvals = distribution_pvalues(spec_samples(tiny_target, sampling, decoder_cls), joint)
    assert min(pvals) < ALPHA / len(pvals) / 100, pvals
