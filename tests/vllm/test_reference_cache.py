"""The GPU tests' cache of plain-decoding references (reference_cache.py), on the CPU: a reference is reused only
under the same target files, computation, environment, code and platform, and comes back as computed."""
from __future__ import annotations

import types

from reference_cache import cached_reference, light_outputs, reference_key

PLATFORM = {"torch": "t", "vllm": "v", "device": "d"}


def test_the_key_follows_everything_a_plain_engine_answers_from(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text('{"vocab_size": 8}')
    (target / "model.safetensors").write_bytes(b"weights")
    env = {"VLLM_USE_V2_MODEL_RUNNER": "1", "UBTREE_VLLM_RUNNER": "mrv2", "UBTREE_COMMIT": "abc", "HOME": "/root"}
    parts = {"form": "run_pair", "num_prompts": 8, "engine": {"dtype": "bfloat16"}}
    key = reference_key(target, parts, env, PLATFORM)
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for f in target.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    # the same files elsewhere, another commit label, an unrelated variable: the same reference
    assert reference_key(copy, parts, {**env, "UBTREE_COMMIT": "def", "HOME": "/x"}, PLATFORM) == key
    changed = [
        reference_key(target, {**parts, "engine": {"dtype": "float32"}}, env, PLATFORM),
        reference_key(target, {**parts, "num_prompts": 6}, env, PLATFORM),
        reference_key(target, parts, {**env, "VLLM_USE_V2_MODEL_RUNNER": "0"}, PLATFORM),
        reference_key(target, parts, {**env, "UBTREE_VLLM_RUNNER": "v1"}, PLATFORM),
        reference_key(target, parts, env, {**PLATFORM, "device": "NVIDIA H200"}),
    ]
    (copy / "model.safetensors").write_bytes(b"other weights")
    changed.append(reference_key(copy, parts, env, PLATFORM))
    assert len({key, *changed}) == len(changed) + 1


def test_a_reference_is_computed_once_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("UBTREE_CACHE_DIR", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return [[1, 2, 3]], 0.5

    assert cached_reference("k1", compute) == (([[1, 2, 3]], 0.5), False)
    assert cached_reference("k1", compute) == (([[1, 2, 3]], 0.5), True) and len(calls) == 1
    assert cached_reference("k1", compute, fresh=True) == (([[1, 2, 3]], 0.5), False) and len(calls) == 2
    assert cached_reference("k2", compute)[1] is False and len(calls) == 3


def test_outputs_keep_the_tokens_and_logprobs_the_greedy_checks_read():
    logprob = types.SimpleNamespace
    out = types.SimpleNamespace(outputs=[types.SimpleNamespace(
        token_ids=(5, 6), logprobs=[{5: logprob(logprob=-0.1, rank=1), 7: logprob(logprob=-2.5, rank=2)},
                                    {6: logprob(logprob=-0.2, rank=1)}])])
    plain = types.SimpleNamespace(outputs=[types.SimpleNamespace(token_ids=[9], logprobs=None)])
    light = light_outputs([out, plain])
    assert light[0].outputs[0].token_ids == [5, 6] and light[1].outputs[0].logprobs is None
    assert {t: p.logprob for t, p in light[0].outputs[0].logprobs[0].items()} == {5: -0.1, 7: -2.5}
    assert light[1].outputs[0].token_ids == [9]
