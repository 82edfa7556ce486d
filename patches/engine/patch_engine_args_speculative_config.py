"""Accept ``"method": "ubtree"`` in ``EngineArgs.create_speculative_config``.

vLLM's ``SpeculativeConfig`` is a pydantic dataclass with a closed ``Literal`` of methods
and ``extra="forbid"``, and about ten places downstream branch on the method name. So
instead of teaching vLLM a new method, the wrapper translates the user's dict before
vLLM sees it (works for ``LLM(speculative_config=...)``, ``--speculative-config`` and
``--spec-method/--spec-model/--spec-tokens`` alike):

1. validate everything with :func:`ubtree_vllm.vllm.config.parse_speculative_config` and
   the engine-level checks below (ValueError before any engine process or memory exists);
2. hand vLLM ``{"method": "custom_class", "model": PROPOSER_CLASS_PATH,
   "num_speculative_tokens": B}`` -- which selects the V1 model runner, disables async
   scheduling and loads no draft model -- and put the UBTree settings into
   ``EngineArgs.additional_config["ubtree"]``;
On CUDA, when :func:`_runs_on_mrv2` picks Model Runner V2 (the default, docs/design/mrv2.md),
step 2 presents ``"dflash"`` with a proposer-only copy of the drafter instead, which keeps
vLLM on Model Runner V2 with async scheduling allowed.

3. after vLLM built the ``SpeculativeConfig``, point ``ParallelConfig.worker_cls`` at the
   UBTree worker of this platform (the parallel config is built before the speculative
   config, so only this hook can still set it) and, on CUDA, pin the FLASH_ATTN backend
   (TRITON_ATTN for a float32 target) that the UBTree worker overrides with its tree-aware subclass.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ubtree_vllm.patches._patching import replace_attr

NAME = "engine_args_speculative_config"


def _merged_user_spec(args: Any) -> dict[str, Any]:
    """The speculative dict exactly as vLLM will assemble it (flags merged, '-' -> '_')."""
    merged = dict(args.speculative_config or {})
    for flag, key, value in (("--spec-method", "method", args.spec_method),
                             ("--spec-model", "model", args.spec_model),
                             ("--spec-tokens", "num_speculative_tokens", args.spec_tokens)):
        if value is None:
            continue
        if key in merged:
            raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
        merged[key] = value
    return {str(k).replace("-", "_"): v for k, v in merged.items()}


def _check_engine_args(args: Any, mrv2: bool = False, mla: bool = False) -> None:
    """Engine options the UBTree path does not support yet; ValueError names each."""
    from vllm.platforms import current_platform

    from ubtree_vllm.vllm.config import CPU_WORKER_CLASS_PATH, GPU_WORKER_CLASS_PATH

    if not (current_platform.is_cpu() or current_platform.is_cuda()):
        raise ValueError(f"speculative method 'ubtree' supports the CPU and CUDA platforms, "
                         f"not {current_platform.device_name!r}")
    if args.worker_cls not in ("auto", CPU_WORKER_CLASS_PATH, GPU_WORKER_CLASS_PATH):
        raise ValueError(f"worker_cls must be 'auto' with speculative method 'ubtree' (the plugin "
                         f"installs its own worker), got {args.worker_cls!r}")
    if mrv2 and args.tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size must be 1 with speculative method 'ubtree' on Model Runner V2 "
                         f"(UBTREE_VLLM_RUNNER=mrv2), got {args.tensor_parallel_size}; the V1 runner "
                         f"(UBTREE_VLLM_RUNNER=auto or v1) serves tensor parallelism")
    for field in ("pipeline_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size"):
        if getattr(args, field) != 1:
            raise ValueError(f"{field} must be 1 with speculative method 'ubtree' (for now), "
                             f"got {getattr(args, field)}")
    if args.kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be 'auto' with speculative method 'ubtree', "
                         f"got {args.kv_cache_dtype!r}")
    if args.logits_processors:
        raise ValueError("logits_processors cannot be used with speculative method 'ubtree': "
                         "tree verification cannot apply them exactly")
    from ubtree_vllm.vllm.request_support import LOGPROBS_MODES

    if not mrv2 and args.logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)} with speculative method 'ubtree' on the "
                         f"V1 runner (the tree sampler reports the model's raw logits), got {args.logprobs_mode!r}")
    if args.async_scheduling and not mrv2:
        raise ValueError("async_scheduling must be off with speculative method 'ubtree' "
                         "(the tree commit runs synchronously in the V1 model runner)")
    if current_platform.is_cuda():
        name, allowed = _chosen_attention_backend(args), TREE_BACKENDS_CUDA_MLA if mla else TREE_BACKENDS_CUDA
        if name not in (None, "auto", *allowed):
            target = " for a multi-head latent attention target" if mla else ""
            raise ValueError(f"attention_backend must be one of {list(allowed)} (or unset) with speculative method "
                             f"'ubtree' on CUDA{target}, got {name!r}")


def _rewrite_to_vllm(args: Any, target_model_config: Any) -> None:
    """Validate the user's ubtree dict and replace it by the form vLLM understands."""
    from vllm.platforms import current_platform

    from ubtree_vllm import envs
    from ubtree_vllm.vllm.config import (ADDITIONAL_CONFIG_KEY, HYBRID_MAMBA2, MLA_TARGETS, MRV2_TREE_ATTENTION_MODES,
                                         PROPOSER_CLASS_PATH, RECURRENT_HYBRIDS, VLLM_METHOD, TargetInfo,
                                         check_hybrid_engine, default_budget_schedule, parse_speculative_config)

    target = TargetInfo.from_model_config(target_model_config)
    spec = parse_speculative_config(_merged_user_spec(args), target)
    check_hybrid_engine(target, current_platform.is_cpu(), args.tensor_parallel_size, bool(args.enable_prefix_caching),
                        cuda_hybrids=envs.UBTREE_CUDA_HYBRIDS)
    mla = any(a in MLA_TARGETS for a in target.architectures)
    # the target's recurrent or latent-attention layers run a CUDA tree form: V1 runner, PIECEWISE graphs
    cuda_tree_form = current_platform.is_cuda() and (mla or any(a in RECURRENT_HYBRIDS for a in target.architectures))
    if spec.tree_attention != "triton" and not current_platform.is_cuda():
        raise ValueError(f"speculative_config.tree_attention {spec.tree_attention!r} runs on CUDA only (FlashAttention "
                         f"attends the context); on {current_platform.device_name!r} use 'triton' or 'auto'")
    mrv2 = current_platform.is_cuda() and _runs_on_mrv2(envs.UBTREE_VLLM_RUNNER, spec, args.tensor_parallel_size,
                                                        hybrid=cuda_tree_form)
    if spec.tree_attention_auto:  # the user left the mode to the engine ("auto", the default)
        spec = dataclasses.replace(spec, tree_attention=_auto_tree_attention(args, target_model_config, mrv2))
    if spec.tree_attention in MRV2_TREE_ATTENTION_MODES and not mrv2:
        raise ValueError(f"speculative_config.tree_attention {spec.tree_attention!r} runs on Model Runner V2 only (the "
                         "default CUDA runner; it lays out uniform decode steps for it); this engine runs the V1 "
                         "runner: use 'triton' or 'flash_merge'")
    if spec.tree_attention == "flashinfer":
        from ubtree_vllm.vllm.attention.flashinfer_rows import flashinfer_available

        if not flashinfer_available():
            raise ValueError("speculative_config.tree_attention 'flashinfer' needs the flashinfer package "
                             "(flashinfer-python), which this environment lacks; use 'auto', 'triton' or 'flash_exact'")
    _check_engine_args(args, mrv2, mla=mla)
    if cuda_tree_form:
        _piecewise_graphs(args)
    if getattr(args, "use_replayssm", False) and any(a in HYBRID_MAMBA2 for a in target.architectures):
        raise ValueError("use_replayssm must be False with speculative method 'ubtree' (ReplaySSM's Mamba2 decode "
                         "calls have no tree form)")
    if _user_chose_graph_sizes(args):
        spec = dataclasses.replace(spec, wide_decode_graphs=False)
    if mrv2 and spec.budget_schedule is None and spec.budget_policy == "load_adaptive":
        spec = dataclasses.replace(spec, budget_schedule=default_budget_schedule(spec.tree.tree_budget),
                                   default_schedule=True)
    if mrv2:
        spec = _mrv2_form(args, spec)
    else:
        args.speculative_config = {"method": VLLM_METHOD, "model": PROPOSER_CLASS_PATH,
                                   "num_speculative_tokens": spec.tree.tree_budget}
    if not mrv2 and any(entry[2] == 0 for entry in spec.budget_schedule or ()):
        raise ValueError("speculative_config.num_speculative_tokens_per_batch_size: a budget of 0 (plain decoding "
                         "steps at that load) is served on Model Runner V2 only, which then skips the draft; this "
                         "engine runs the V1 runner: use budgets >= 1")
    if spec.budget_schedule is not None:  # vLLM's scheduler picks each step's budget (dynamic speculative decoding)
        args.speculative_config["num_speculative_tokens_per_batch_size"] = [list(e) for e in spec.budget_schedule]
    args.spec_method = args.spec_model = args.spec_tokens = None
    args.additional_config = {**(args.additional_config or {}), ADDITIONAL_CONFIG_KEY: spec.to_additional_config()}
    if current_platform.is_cuda() and mla:
        _pin_cuda_mla(args, target_model_config.dtype)
    elif current_platform.is_cuda() and _chosen_attention_backend(args) is None:
        args.attention_backend = cuda_tree_backend(target_model_config.dtype)
    if current_platform.is_cpu() and mla:
        _pin_cpu_mla(args)


def _auto_tree_attention(args: Any, target_model_config: Any, mrv2: bool) -> str:
    """The mode ``tree_attention: "auto"`` takes on this engine: "flash_exact" where the engine arguments say it can
    serve it (``exact_rows.serves_exact_rows_by_default``), else "triton"."""
    from vllm.platforms import current_platform

    from ubtree_vllm.vllm.attention.exact_rows import serves_exact_rows_by_default

    capability = current_platform.get_device_capability() if current_platform.is_cuda() else None
    exact = serves_exact_rows_by_default(
        mrv2=mrv2, capability_major=None if capability is None else capability.major,
        dtype=target_model_config.dtype, head_size=target_model_config.get_head_size(),
        attention_backend=_chosen_attention_backend(args), kv_cache_dtype=str(args.kv_cache_dtype),
        sliding_window=target_model_config.get_sliding_window())
    return "flash_exact" if exact else "triton"


def _chosen_attention_backend(args: Any) -> str | None:
    """The attention backend the user chose (``attention_backend`` or ``attention_config.backend``), by name; None
    when unset."""
    backend = args.attention_backend or getattr(args.attention_config, "backend", None)
    return getattr(backend, "name", backend)


def _pin_cpu_mla(args: Any) -> None:
    """An MLA target on the CPU runs CPU_MLA, the backend with a tree-aware subclass (vLLM would pick AMX_MLA on
    AMX hosts); ValueError if the user chose another."""
    name = _chosen_attention_backend(args)
    if name not in (None, "auto", "CPU_MLA"):
        raise ValueError(f"attention_backend must be 'CPU_MLA' (or unset) with speculative method 'ubtree' for a "
                         f"multi-head latent attention target on the CPU, got {name!r}")
    if name is None:
        args.attention_backend = "CPU_MLA"


def _pin_cuda_mla(args: Any, dtype: Any) -> None:
    """An MLA target on CUDA runs FLASH_ATTN_MLA, the MLA backend with a tree-aware subclass (vLLM's first choice on
    sm90); ValueError for a float32 target (FlashAttention MLA runs bfloat16 and float16 only)."""
    import torch

    if dtype == torch.float32:
        raise ValueError("dtype must be bfloat16 or float16 with speculative method 'ubtree' for a multi-head latent "
                         "attention target on CUDA (its tree form runs on FLASH_ATTN_MLA, which has no float32 "
                         "kernel), got float32")
    if _chosen_attention_backend(args) is None:
        args.attention_backend = "FLASH_ATTN_MLA"


# CUDA attention backends with a tree-aware subclass (ubtree_vllm/vllm/attention/flash.py, triton_attn.py; for
# multi-head latent attention flash_mla.py)
TREE_BACKENDS_CUDA = ("FLASH_ATTN", "TRITON_ATTN")
TREE_BACKENDS_CUDA_MLA = ("FLASH_ATTN_MLA",)


def cuda_tree_backend(dtype: Any) -> str:
    """The backend pinned for a target of ``dtype`` on CUDA: FLASH_ATTN, or TRITON_ATTN for float32 (FlashAttention
    has no fp32 kernel; vLLM itself picks a Triton backend there)."""
    import torch

    return "TRITON_ATTN" if dtype == torch.float32 else "FLASH_ATTN"


def _user_chose_graph_sizes(args: Any) -> bool:
    """True when the engine args set CUDA-graph capture sizes (then the UBTree worker keeps them as
    they are instead of adding the tree-step sizes of ``ubtree_vllm.vllm.decode_graphs``)."""
    compilation = args.compilation_config
    return any(value is not None for value in (
        args.cudagraph_capture_sizes, args.max_cudagraph_capture_size,
        getattr(compilation, "cudagraph_capture_sizes", None), getattr(compilation, "max_cudagraph_capture_size", None)))


def _runs_on_mrv2(runner: str, spec: Any, tensor_parallel_size: int = 1, hybrid: bool = False) -> bool:
    """The CUDA runner for ``spec`` (a parsed ``UBTreeVllmConfig``) under ``UBTREE_VLLM_RUNNER=runner``.

    ``auto`` takes Model Runner V2 unless it cannot serve the engine -- a tree budget below the
    drafter's block size (vLLM reserves B lookahead KV slots, the drafter writes gamma) or
    ``VLLM_USE_V2_MODEL_RUNNER=0`` or tensor parallelism (V1 only so far) or a hybrid or MLA target (``hybrid``: the
    recurrent or latent-attention layers' tree forms are wired on the V1 runner; vLLM's MRV2 refuses hybrids) -- and
    then the V1 runner, saying why; ``mrv2`` with such a target is a ValueError. ``prompt_lookup`` runs on either
    (MRV2's branch passed its H200 greedy test on 2026-12-01), and so does a budget schedule (MRV2's load-adaptive
    greedy test with B = gamma passed on the H200 on 2026-12-03, after the draft graph fix of
    ``mrv2/speculator.py:draft_graph_config``)."""
    if hybrid and runner == "mrv2":
        raise ValueError("UBTREE_VLLM_RUNNER=mrv2 cannot serve a hybrid or multi-head latent attention target with "
                         "speculative method 'ubtree' (the tree forms of its recurrent or latent-attention layers run "
                         "on the V1 runner): use auto or v1")
    if runner != "auto":
        return runner == "mrv2"
    from vllm import envs as vllm_envs
    from vllm.logger import init_logger

    budget, gamma = spec.tree.tree_budget, spec.tree.block_size
    reason = ("VLLM_USE_V2_MODEL_RUNNER=0" if vllm_envs.VLLM_USE_V2_MODEL_RUNNER is False else
              f"num_speculative_tokens ({budget}) < the drafter's block size ({gamma})" if budget < gamma else
              f"tensor_parallel_size {tensor_parallel_size} (tensor parallelism is served on the V1 runner)"
              if tensor_parallel_size > 1 else
              "a hybrid or MLA target (the tree forms of its recurrent or latent-attention layers run on the V1 runner)"
              if hybrid else None)
    if reason:
        init_logger(__name__).info("ubtree runs on the V1 model runner: %s (Model Runner V2 needs neither)", reason)
    return reason is None


def _piecewise_graphs(args: Any) -> None:
    """A hybrid or MLA target on CUDA runs PIECEWISE CUDA graphs: its recurrent layers' ops
    (``qwen_gdn_attention_core``, ``mamba_mixer2``, ``bailing_v3_kda_attention``: vLLM's splitting ops) then run
    eagerly, as their tree forms' per-step host work needs (ubtree_vllm/vllm/recurrent/gdn_cuda.py,
    recurrent/mamba2.py), and so does MLA attention (FULL graphs of its tree form wait for its H200 tests);
    ValueError if the user chose a mode with FULL graphs."""
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    if isinstance(args.compilation_config, dict):
        args.compilation_config = CompilationConfig(**args.compilation_config)
    mode = args.compilation_config.cudagraph_mode
    if mode is None:
        args.compilation_config.cudagraph_mode = CUDAGraphMode.PIECEWISE
    elif CUDAGraphMode(mode) not in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE):
        raise ValueError(f"compilation_config.cudagraph_mode must be PIECEWISE or NONE (or unset) with speculative "
                         f"method 'ubtree' for a hybrid or MLA target on CUDA (its tree forms run outside CUDA "
                         f"graphs), "
                         f"got {CUDAGraphMode(mode).name}")


def _mrv2_form(args: Any, spec: Any) -> Any:
    """Model Runner V2: present ``"dflash"`` with a proposer-only copy of the drafter (vLLM's DFlash
    model computes our backbone; the selector stays ours)."""
    import hashlib

    from ubtree_vllm import envs
    from ubtree_vllm.drafter.io import export_dflash_proposer
    from ubtree_vllm.vllm.config import MRV2_PROPOSERS_DIR, MRV2_VLLM_METHOD

    gamma, budget = spec.tree.block_size, spec.tree.tree_budget
    if budget < gamma:
        raise ValueError(f"num_speculative_tokens ({budget}) must be >= the drafter's block size gamma ({gamma}) "
                         "on Model Runner V2: vLLM reserves num_speculative_tokens lookahead KV slots and the "
                         "drafter writes gamma of them")
    digest = hashlib.sha256(spec.drafter_dir.encode()).hexdigest()[:16]
    proposer = export_dflash_proposer(spec.drafter_dir, envs.UBTREE_CACHE_DIR / MRV2_PROPOSERS_DIR / digest)
    args.speculative_config = {"method": MRV2_VLLM_METHOD, "model": str(proposer), "num_speculative_tokens": budget}
    return dataclasses.replace(spec, runner="mrv2")


def _select_worker(target_parallel_config: Any) -> None:
    from vllm.platforms import current_platform

    from ubtree_vllm.vllm.config import CPU_WORKER_CLASS_PATH, GPU_WORKER_CLASS_PATH

    if target_parallel_config.worker_cls == "auto":
        target_parallel_config.worker_cls = (CPU_WORKER_CLASS_PATH if current_platform.is_cpu()
                                             else GPU_WORKER_CLASS_PATH)


def apply() -> None:
    from vllm.engine.arg_utils import EngineArgs

    from ubtree_vllm.vllm.config import ADDITIONAL_CONFIG_KEY, METHOD, is_mrv2_form, is_ubtree_speculative_config

    original = EngineArgs.create_speculative_config

    def create_speculative_config(self: Any, target_model_config: Any, target_parallel_config: Any) -> Any:
        if _merged_user_spec(self).get("method") == METHOD:
            _rewrite_to_vllm(self, target_model_config)
        speculative_config = original(self, target_model_config, target_parallel_config)
        if is_mrv2_form(self.additional_config, speculative_config):
            _select_worker(target_parallel_config)  # the MRV2 form: our worker builds UBTreeModelRunnerV2
        elif is_ubtree_speculative_config(speculative_config):
            if ADDITIONAL_CONFIG_KEY not in (self.additional_config or {}):
                raise ValueError(f"speculative_config {speculative_config.model!r} is internal to "
                                 f"ubtree_vllm; use \"method\": {METHOD!r}")
            _select_worker(target_parallel_config)
        return speculative_config

    create_speculative_config.__doc__ = original.__doc__
    replace_attr(EngineArgs, "create_speculative_config", create_speculative_config, NAME)
