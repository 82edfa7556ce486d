"""One greedy run on the real default target (SmolLM2-135M-Instruct): UBTree == no speculation.

fp32 keeps rounding differences between tree verification and one-token decoding far
below the argmax gaps (as in tests/unit/test_reference_decoder.py); the drafter is an
untrained export, so this checks losslessness on the real architecture (30 layers, GQA,
tied embeddings, 49k vocabulary). The prompt-lookup branch is on (tree/lookup.py): on the
copying prompts it is what gets drafts accepted, through the V1 runner's real token history.
Logprobs of the emitted tokens (top ones and `logprob_token_ids`), and greedy text under presence/frequency/repetition penalties,
bad words, logit bias, allowed token ids and min_tokens (each applied along every node's path),
under repetition detection,
and under structured output (JSON schema, regex, choice: the grammar advanced along every node's
path, vllm/structured_output.py) are compared with plain decoding's; the JSON must parse and fit.
"""
from __future__ import annotations

import pytest
from chat_prompts import CHAT_PROMPTS, COPY_PROMPTS
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.sampling_params import RepetitionDetectionParams
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


PENALTIES = dict(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2)
REPETITION = dict(repetition_detection=RepetitionDetectionParams(max_pattern_size=6, min_count=2))


def generate(llm: LLM, prompts, logprobs: int | None = None, **options):
    """Greedy token ids per prompt; with `logprobs` (or `logprob_token_ids`), also each emitted token's
    {token id: logprob} of the top (or requested) ones."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False,
                            logprobs=logprobs, **options)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    if logprobs is None and not options.get("logprob_token_ids"):
        return tokens
    return tokens, [[{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs] for o in outs]


JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 150}},
               "required": ["name", "age"], "additionalProperties": False}
STRUCTURED = {"json": dict(json=JSON_SCHEMA), "regex": dict(regex=r"[0-9]{3}-[a-z]{2,6}"),
              "choice": dict(choice=["yes", "no", "maybe"])}


def assert_fits(name: str, text: str) -> None:
    """``text`` satisfies the STRUCTURED constraint ``name`` (the JSON parses and fits the schema)."""
    import json
    import re

    if name == "json":
        value = json.loads(text)  # raises with the text where it does not parse
        assert set(value) == {"name", "age"} and isinstance(value["age"], int), text
    elif name == "regex":
        assert re.fullmatch(STRUCTURED["regex"]["regex"], text), text
    else:
        assert text in STRUCTURED["choice"]["choice"], text


def generate_structured(llm: LLM, prompts, **constraint) -> tuple[list[list[int]], list[str]]:
    """Greedy token ids and texts under one structured-output constraint (stops where the grammar ends)."""
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(**constraint))
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [o.outputs[0].text for o in outs]


SCORED_IDS = [28, 330, 2]


def generate_scored(llm: LLM, prompts):
    """Greedy tokens and, per emitted token, the logprobs of it and of SCORED_IDS (``logprob_token_ids``)."""
    return generate(llm, prompts, logprob_token_ids=SCORED_IDS)


def assert_same_logprobs(got, expected) -> None:
    """The same top tokens with the same logprobs (fp32 on the CPU: tree and one-token rows differ in rounding)."""
    for got_req, want_req in zip(got, expected, strict=True):
        assert len(got_req) == len(want_req) == MAX_TOKENS
        for got_step, want_step in zip(got_req, want_req):
            assert got_step.keys() == want_step.keys()
            for token, value in want_step.items():
                assert abs(got_step[token] - value) < 1e-4, (token, got_step[token], value)


def processor_cases(greedy: list[list[int]], tokenizer) -> dict[str, dict]:
    """Options that each change the greedy text of these prompts: ban/boost/forbid tokens that plain decoding emits."""
    from collections import Counter

    counts = Counter(t for tokens in greedy for t in tokens)
    frequent = [t for t, _ in counts.most_common(3)]
    words = [w for w in (tokenizer.decode(greedy[0][1:3]).strip(), tokenizer.decode(greedy[1][4:5]).strip()) if w]
    return {
        "bad_words": {"bad_words": words},  # vLLM tokenizes each with and without a leading space
        "logit_bias": {"logit_bias": {frequent[1]: 6.0, frequent[2]: -100.0}},
        "allowed_token_ids": {"allowed_token_ids": sorted(set(counts) - {frequent[0]})},
        # the stop token may not be drawn before min_tokens: the most frequent token, banned for the whole answer
        "min_tokens": {"stop_token_ids": [frequent[0]], "min_tokens": MAX_TOKENS},
    }


def test_smollm2_greedy_batch_is_token_identical(default_target_dir, prompts, vllm_models_dir):
    drafter = save_untrained_drafter(default_target_dir, vllm_models_dir / "smollm2-drafter", block_size=4, top_k=8)
    # the tokenizer on: vLLM tokenizes bad words with it
    # (JSON without free whitespace: the small model would otherwise pad its JSON with newlines)
    kwargs = dict(ENGINE_KWARGS, kv_cache_memory_bytes=256 << 20, max_model_len=1024, skip_tokenizer_init=False,
                  structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
    plain = LLM(model=str(default_target_dir), **kwargs)
    expected = generate(plain, prompts)
    expected_lp = generate(plain, prompts[-3:], logprobs=3)  # the copying prompts: rounds of several tokens
    expected_ids = generate_scored(plain, prompts[-3:])
    expected_pen = generate(plain, prompts[-3:], **PENALTIES)
    expected_rep = generate(plain, prompts, **REPETITION)
    processors = processor_cases(expected[-3:], AutoTokenizer.from_pretrained(default_target_dir))
    expected_proc = {name: generate(plain, prompts[-3:], **options) for name, options in processors.items()}
    expected_struct = {name: generate_structured(plain, prompts, **c) for name, c in STRUCTURED.items()}
    del plain
    ubtree = LLM(model=str(default_target_dir), speculative_config={
        "method": "ubtree", "model": str(drafter), "num_speculative_tokens": 8, "beam_width": 3, "top_k": 4,
        "prompt_lookup": True}, **kwargs)
    assert generate(ubtree, prompts) == expected
    # logprobs: each emitted token's (and the top-3's) from the tree row that drew it, as plain decoding reports
    tokens, logprobs = generate(ubtree, prompts[-3:], logprobs=3)
    assert tokens == expected_lp[0]
    assert_same_logprobs(logprobs, expected_lp[1])
    # logprob_token_ids (vLLM's scoring form): the emitted token's and the requested ids', from the same rows
    tokens, logprobs = generate_scored(ubtree, prompts[-3:])
    assert tokens == expected_ids[0]
    assert_same_logprobs(logprobs, expected_ids[1])
    assert all(set(SCORED_IDS) <= step.keys() for req in logprobs for step in req)
    # penalties: each node's logits penalised over the outputs plus the node's own path
    assert generate(ubtree, prompts[-3:], **PENALTIES) == expected_pen
    assert expected_pen != expected_lp[0]  # the penalties changed the greedy text
    # repetition detection: vLLM's scheduler checks it after each accepted token, as for a chain
    tokens = generate(ubtree, prompts, **REPETITION)
    assert tokens == expected_rep
    assert any(len(t) < MAX_TOKENS for t in expected_rep)  # it stopped some answers early: the test can fail
    # vLLM's logits processors (bad words, logit bias, allowed tokens, min_tokens), each along every node's path
    for name, options in processors.items():
        assert generate(ubtree, prompts[-3:], **options) == expected_proc[name], name
        assert expected_proc[name] != expected[-3:], f"{name} did not change the greedy text"
    # structured output: each node's logits masked by the grammar advanced along its own path
    for name, constraint in STRUCTURED.items():
        tokens, texts = generate_structured(ubtree, prompts, **constraint)
        assert tokens == expected_struct[name][0], name
        for text in texts:
            assert_fits(name, text)
    drafts, accepted = spec_counts(ubtree)
    before = (drafts, accepted)
    generate(ubtree, prompts[-len(COPY_PROMPTS):])
    drafts, accepted = spec_counts(ubtree)
    # the untrained drafter accepts ~nothing alone (tests/unit/test_reference_decoder.py); copying does
    assert (accepted - before[1]) / (drafts - before[0]) > 0.3, (drafts, accepted, before)
