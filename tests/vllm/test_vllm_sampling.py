"""T > 0 through vLLM with UBTree: continuations follow the target's exact distribution.

Vocabulary-8 random Llama (head_dim 32, the CPU kernel's minimum), untrained drafter
with K = 6 of the 8 tokens per depth so that trees are often partly accepted; 3000
continuations of 4 tokens per setting, chi-square against the enumerated law of the HF
model with the same weights (see ``tests/exact_distribution.py``); the same under vLLM's logits
processing and under a grammar whose allowed tokens depend on the path (structured output).
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from vllm_engines import ENGINE_KWARGS, spec_counts
from ubtree_vllm.config import SamplingConfig
from exact_distribution import distribution_pvalues, exact_joint
from vllm_models import save_tiny_llama, save_untrained_drafter

VOCAB, HORIZON, NUM_SAMPLES, PROMPT = 8, 4, 3000, [1, 2, 3]
ALPHA = 1e-3
CASES = [SamplingConfig(1.0), SamplingConfig(0.8, top_k=5), SamplingConfig(1.2, top_p=0.85),
         SamplingConfig(1.0, top_k=6, top_p=0.9)]


@pytest.fixture(scope="module")
def vocab8(vllm_models_dir):
    target = save_tiny_llama(vllm_models_dir / "vocab8", vocab_size=VOCAB, hidden_size=64, num_layers=3,
                             num_heads=2, num_kv_heads=1, init_range=0.15, seed=3)
    drafter = save_untrained_drafter(target, vllm_models_dir / "vocab8-drafter", block_size=3, top_k=6, seed=1)
    return target, drafter


@pytest.fixture(scope="module")
def llm(vocab8):
    target, drafter = vocab8
    kwargs = dict(ENGINE_KWARGS, max_num_seqs=256, max_model_len=64)
    return LLM(model=str(target), speculative_config={"method": "ubtree", "model": str(drafter),
                                                      "num_speculative_tokens": 9, "beam_width": 3, "top_k": 6},
               **kwargs)


@pytest.fixture(scope="module")
def hf_target(vocab8):
    return AutoModelForCausalLM.from_pretrained(vocab8[0], dtype=torch.float32).eval()


def draw_samples(llm: LLM, params: SamplingParams) -> torch.Tensor:
    """[NUM_SAMPLES, HORIZON] continuations of PROMPT; asserts drafts were accepted (> 0.3 accepted tokens per
    round), since losslessness is only tested where trees are partly accepted."""
    drafts_before, accepted_before = spec_counts(llm)
    outs = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)] * NUM_SAMPLES, params, use_tqdm=False)
    drafts, accepted = spec_counts(llm)
    assert (accepted - accepted_before) > 0.3 * (drafts - drafts_before), (accepted, drafts)
    samples = torch.tensor([list(o.outputs[0].token_ids) for o in outs])
    assert samples.shape == (NUM_SAMPLES, HORIZON)
    return samples


@pytest.mark.parametrize("sampling", CASES, ids=str)
def test_samples_follow_the_target_distribution(llm, hf_target, sampling):
    params = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                            max_tokens=HORIZON, ignore_eos=True, detokenize=False)
    samples = draw_samples(llm, params)
    pvals = distribution_pvalues(samples, exact_joint(hf_target, PROMPT, VOCAB, HORIZON, sampling))
    assert min(pvals) > ALPHA / len(pvals), pvals


def test_samples_follow_the_target_distribution_under_vllms_logits_processing(llm, hf_target):
    """Penalties, logit bias, allowed token ids, min_tokens and min_p at T = 1, each applied at every tree node along
    its own path: the samples follow the law of plain decoding with the same processing (vLLM's order: allowed
    mask, min_tokens, logit bias, penalties, then temperature and min_p)."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    options = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3, logit_bias={3: 1.5, 6: -1.0},
                   allowed_token_ids=[0, 1, 2, 3, 4, 5, 6], stop_token_ids=[5], min_tokens=HORIZON, min_p=0.08)
    params = SamplingParams(temperature=1.0, max_tokens=HORIZON, ignore_eos=True, detokenize=False, **options)

    # vLLM's min_tokens bans all of a request's stop tokens, the model's EOS included even with ignore_eos
    stops = sorted({5, hf_target.config.eos_token_id})

    def process(logits: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
        logits = logits.clone()
        logits[..., 7] = float("-inf")  # allowed_token_ids
        logits[..., stops] = float("-inf")  # the stop tokens (EOS too), before min_tokens (= the horizon)
        logits[..., 3] += 1.5
        logits[..., 6] -= 1.0
        num = len(seqs)
        prompt = torch.tensor(PROMPT).expand(num, -1)
        for t in range(HORIZON):  # penalties over the prompt and the output so far
            logits[:, t] = apply_all_penalties(logits[:, t], prompt, torch.full((num,), 0.4), torch.full((num,), 0.3),
                                               torch.full((num,), 1.3), seqs[:, :t].tolist())
        return logits

    samples = draw_samples(llm, params)
    assert not any((samples == t).any() for t in [*stops, 7])
    joint = exact_joint(hf_target, PROMPT, VOCAB, HORIZON, SamplingConfig(1.0), process=process, min_p=0.08)
    pvals = distribution_pvalues(samples, joint)
    assert min(pvals) > ALPHA / len(pvals), pvals
    plain = exact_joint(hf_target, PROMPT, VOCAB, HORIZON, SamplingConfig(1.0))
    assert min(distribution_pvalues(samples, plain)) < ALPHA  # the processing changes the law: the test can fail


# A grammar whose allowed tokens depend on the path: two pairs from {ab, af, ba, dd, ee}, then g's (no end
# within the horizon, so no stop token is allowed); tokens 0..6 = "a".."g", 7 = "</s>". Token 2 ("c") is
# the model config's EOS, which vLLM hands the grammar as a stop token: the grammar never uses it.
GRAMMAR_REGEX = "(ab|af|ba|dd|ee)(ab|af|ba|dd|ee)g+"
PAIR_SECOND = {0: [1, 5], 1: [0], 3: [3], 4: [4]}


def with_letter_tokenizer(model_dir, out_dir):
    """A copy of a vocabulary-8 model folder with a raw one-character-per-token tokenizer (a grammar needs one):
    tokens 0..6 = "a".."g", 7 = "</s>". Returns ``out_dir``."""
    import shutil

    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(model_dir, out_dir, dirs_exist_ok=True)
    vocab = {c: i for i, c in enumerate("abcdefg")} | {"</s>": 7}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="g")),
                            eos_token="</s>").save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def grammar_llm(vocab8, vllm_models_dir):
    """The vocabulary-8 target with its letter tokenizer (:func:`with_letter_tokenizer`)."""
    target = with_letter_tokenizer(vocab8[0], vllm_models_dir / "vocab8-tokenizer")
    kwargs = dict(ENGINE_KWARGS, max_num_seqs=256, max_model_len=64, skip_tokenizer_init=False)
    return LLM(model=str(target), speculative_config={"method": "ubtree", "model": str(vocab8[1]),
                                                      "num_speculative_tokens": 9, "beam_width": 3, "top_k": 6},
               **kwargs)


def test_samples_follow_the_target_distribution_under_a_grammar(grammar_llm, hf_target):
    """Structured output at T = 1: every node's logits masked by the grammar advanced along its own path
    (vllm/structured_output.py), so the samples follow plain decoding's masked law."""
    from vllm.sampling_params import StructuredOutputsParams

    def process(logits: torch.Tensor, seqs: torch.Tensor) -> torch.Tensor:
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        for t in range(HORIZON):
            if t % 2 == 0:
                allowed[:, t, list(PAIR_SECOND)] = True
            else:
                for first, seconds in PAIR_SECOND.items():
                    rows = seqs[:, t - 1] == first
                    for s in seconds:
                        allowed[rows, t, s] = True
            # prefixes the grammar refused have probability 0; any finite row keeps the product defined
            allowed[~allowed[:, t].any(-1), t] = True
        return logits.masked_fill(~allowed, float("-inf"))

    params = SamplingParams(temperature=1.0, max_tokens=HORIZON, detokenize=False,
                            structured_outputs=StructuredOutputsParams(regex=GRAMMAR_REGEX))
    samples = draw_samples(grammar_llm, params)
    joint = exact_joint(hf_target, PROMPT, VOCAB, HORIZON, SamplingConfig(1.0), process=process)
    pvals = distribution_pvalues(samples, joint)
    assert min(pvals) > ALPHA / len(pvals), pvals
    plain = exact_joint(hf_target, PROMPT, VOCAB, HORIZON, SamplingConfig(1.0))
    assert min(distribution_pvalues(samples, plain)) < ALPHA  # the grammar changes the law: the test can fail
