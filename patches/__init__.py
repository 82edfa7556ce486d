"""The patch manifest: every change ubtree_vllm makes to vLLM, and when it is applied.

Installed as ``ubtree_vllm.patches`` (see the package-dir remap in
``pyproject.toml``).

:data:`MANIFEST` lists every patch. Each patch lives in its own module
``ubtree_vllm.patches.<stage>.patch_<name>`` exposing a zero-argument, idempotent
``apply()`` (built on :mod:`ubtree_vllm.patches._patching`), has exactly one
:class:`PatchSpec` entry here and one unit test in ``tests/vllm/test_vllm_patches.py``.

Stages:

* ``"engine"``: process-global patches, applied by
  :func:`ubtree_vllm.plugin.register` in every process vLLM starts. They only
  change behaviour for engines configured with ``"method": "ubtree"``, except
  ``cpu_rope_multihead``, which fixes a vLLM CPU bug in the model function itself.
* ``"worker"``: patches that may touch CUDA or worker state, applied at worker
  initialisation (:class:`ubtree_vllm.vllm.worker.UBTreeCPUWorker` /
  ``UBTreeGPUWorker``), never at import or plugin-registration time.

:func:`apply` is idempotent per process and stage, and applies the entries of
one stage in manifest order.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass, fields
from typing import Literal, get_args

logger = logging.getLogger(__name__)

Stage = Literal["engine", "worker"]
STAGES: tuple[str, ...] = get_args(Stage)


@dataclass(frozen=True)
class PatchSpec:
    """One manifest entry: what is patched, why, how, and when the patch can go.

    Every text field must be non-empty; ``__post_init__`` enforces it, so a
    malformed entry fails at import time rather than in a worker process.
    """

    # Unique short identifier, e.g. "scheduler_lookahead_slots".
    name: str
    # Fully qualified upstream symbol that is replaced or wrapped, e.g.
    # "vllm.v1.worker.gpu.model_runner.init_speculator".  Rebind it where it is looked up.
    vllm_symbol: str
    # Why upstream vLLM cannot do this without the patch.
    why: str
    # What the patch does to the symbol (wrap, replace, add attribute, ...).
    how: str
    # The upstream change (issue/PR/release) after which the patch is deleted.
    removal_condition: str
    # When it is applied; see the module docstring.
    stage: Stage = "engine"
    # Module with a zero-argument `apply()`; defaults to ubtree_vllm.patches.<stage>.patch_<name>.
    module: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "module" and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"PatchSpec.{f.name} must be a non-empty string, got {value!r}")
        if self.stage not in STAGES:
            raise ValueError(
                f"PatchSpec {self.name!r}: stage must be one of {STAGES}, got {self.stage!r}"
            )
        if not self.module:
            object.__setattr__(self, "module", f"{__name__}.{self.stage}.patch_{self.name}")
        if not self.module.startswith(f"{__name__}."):
            raise ValueError(
                f"PatchSpec {self.name!r}: module {self.module!r} is outside {__name__}"
            )


# Applied in this order within a stage.
MANIFEST: tuple[PatchSpec, ...] = (
    PatchSpec(
        name="engine_args_speculative_config",
        vllm_symbol="vllm.engine.arg_utils.EngineArgs.create_speculative_config",
        why=("SpeculativeConfig.method is a closed Literal (extra='forbid'), so vLLM rejects "
             "'ubtree'; ParallelConfig.worker_cls is built before the speculative config and "
             "cannot be chosen from it."),
        how=("Wraps the method: a {'method': 'ubtree', ...} dict is validated "
             "(ubtree_vllm.vllm.config) and rewritten to method 'custom_class' with the UBTree "
             "proposer, the UBTree settings go to additional_config['ubtree'], then worker_cls is "
             "set to the UBTree worker (and FLASH_ATTN pinned on CUDA)."),
        removal_condition=("vLLM accepts out-of-tree speculative methods with their own config "
                           "block and worker/runner selection (no such upstream API in 0.32/0.33)."),
    ),
    PatchSpec(
        name="sampling_params_spec_decode",
        vllm_symbol="vllm.sampling_params.SamplingParams._validate_spec_decode",
        why=("Tree verification cannot reproduce the chain-only options exactly yet (thinking_token_budget, "
             "trace replay), while vLLM's own spec-decode check rejects min_p and logit_bias, which both "
             "runners' tree samplers apply at every node."),
        how=("Wraps the method: for the 'ubtree' speculative config vLLM's check is replaced by "
             "VLLMValidationError for every option in "
             "ubtree_vllm.vllm.request_support.unsupported_options (so min_p and logit_bias pass); "
             "other methods keep vLLM's check."),
        removal_condition=("The tree sampler implements those options on both runners and vLLM lets a "
                           "proposer declare its supported sampling options."),
    ),
    PatchSpec(
        name="scheduler_tree_drafts",
        vllm_symbol="vllm.v1.core.sched.scheduler.Scheduler.update_draft_token_ids",
        why=("The scheduler receives drafts as flat token lists and validates them against the grammar "
             "as one chain; a tree's topology has no place in vLLM's DraftTokenIds."),
        how=("Wraps the method and its async-scheduling twin update_draft_token_ids_in_output: the parents "
             "carried by the UBTree runners' TreeDraftTokenIds are stored on each structured-output request "
             "(ubtree_vllm.vllm.structured_output) before vLLM's code runs; other methods' drafts pass "
             "untouched."),
        removal_condition=("vLLM's scheduler carries a draft topology (tree speculative decoding upstream, "
                           "e.g. a parents field in DraftTokenIds)."),
    ),
    PatchSpec(
        name="structured_output_tree",
        vllm_symbol="vllm.v1.structured_output.StructuredOutputManager.grammar_bitmask",
        why=("grammar_bitmask fills draft row i after drafts 0..i-1 and validate_tokens cuts the drafts at "
             "the first refused one: both assume a chain, so a tree node's row would follow its siblings."),
        how=("Wraps grammar_bitmask and validate_tokens: for requests whose drafts are a tree, each node's "
             "row is the grammar advanced along root -> node (vLLM's grammar objects, accept_tokens and "
             "rollback; reasoning bounds per path) and every node is kept; chains take vLLM's code."),
        removal_condition="vLLM's structured-output manager supports tree drafts (same upstream change).",
    ),
    PatchSpec(
        name="engine_core_kv_cache_configs",
        vllm_symbol="vllm.v1.engine.core.get_kv_cache_configs",
        why=("On a hybrid target every request holds 1 + num_speculative_tokens recurrent-state slots per "
             "linear layer; when they do not fit, vLLM's start-up check suggests a shorter max_model_len and "
             "knows nothing of the tree budget, the knob that sets that cost. tree_attention 'flash_exact' needs "
             "KV cache pages the scheduler never hands out, and vLLM has no way to keep some back."),
        how=("Wraps the name EngineCore looks up, for 'ubtree' engines only. With linear layers it logs the "
             "per-request state cost at the configured budget and, when vLLM's check raises, re-raises naming "
             "speculative_config.num_speculative_tokens and the largest budget that fits, searched with the "
             "specs each worker rebuilds for a smaller budget (HybridBudgetRPC in "
             "ubtree_vllm.vllm.recurrent.memory; reached through the executor that a thin wrapper of "
             "EngineCore._initialize_kv_caches makes visible). With 'flash_exact' it lowers each config's "
             "num_blocks by the scratch pages (vllm/attention/exact_rows.py), which the MRV2 runner adds back; "
             "where they do not fit and 'auto' chose the mode, the workers are told to serve 'triton' instead. "
             "Other engines call vLLM's function unchanged."),
        removal_condition=("vLLM sizes speculative recurrent-state slots itself and reports the largest "
                           "num_speculative_tokens that fits (no such check in 0.32), and lets a runner reserve "
                           "KV cache blocks (or tree rows no longer need scratch pages)."),
    ),
    PatchSpec(
        name="cpu_rope_multihead",
        vllm_symbol="vllm.model_executor.layers.rotary_embedding.base.RotaryEmbedding.forward_cpu",
        why=("vLLM 0.32's CPU rotary op mis-rotates [tokens, heads, head_size] inputs with more than one head, "
             "which DeepSeek-V2/V3's multi-head latent attention passes (the query's RoPE part): on the CPU such a "
             "target computes another function than its HF model, one that differs between one-token and "
             "multi-token rows, so even vLLM's own n-gram speculation changes its greedy tokens."),
        how=("Wraps the method: such inputs are rotated by vLLM's forward_native and written back in place; 2-D and "
             "single-head inputs keep vLLM's op. Process-global and for plain engines too (it fixes the model "
             "function, which both sides of a greedy comparison must compute). CPU platform only."),
        removal_condition="vLLM's CPU rotary op handles 3-D multi-head tensors (as forward_native does).",
    ),
    PatchSpec(
        name="cpu_worker_model_runner",
        vllm_symbol="vllm.v1.worker.cpu_worker.CPUModelRunner",
        why=("CPUWorker.init_device constructs the V1 runner through this module-level name "
             "and, unlike the GPU Worker, has no _make_model_runner() hook."),
        how=("Rebinds the name in vllm.v1.worker.cpu_worker to a factory returning "
             "UBTreeCPUModelRunner for 'ubtree' engines and the stock CPUModelRunner otherwise."),
        removal_condition="CPUWorker builds its runner through Worker._make_model_runner().",
        stage="worker",
    ),
    PatchSpec(
        name="attention_backends",
        vllm_symbol="vllm.v1.attention.backends.registry.AttentionBackendEnum",
        why=("vLLM 0.32 has no tree attention: CPU_ATTN, CPU_MLA, FLASH_ATTN and TRITON_ATTN support only "
             "causal, non-causal or sliding-window masks, not an ancestor mask over draft rows."),
        how=("register_backend() overrides CPU_ATTN and CPU_MLA (CPU) or FLASH_ATTN and TRITON_ATTN (CUDA; "
             "TRITON_ATTN serves float32 targets) with subclasses that recompute tree rows under the ancestor "
             "mask (CPU_MLA: masks its dense new-token attention) (CPU: stashing tree K/V for the KV commit); "
             "the selector cache is cleared."),
        removal_condition=("vLLM ships a tree attention backend again (it had TREE_ATTN up to "
                           "~0.11) or an attention-mask hook in CommonAttentionMetadata."),
        stage="worker",
    ),
    PatchSpec(
        name="cpu_gdn_tree_forward",
        vllm_symbol="vllm.model_executor.layers.mamba.ops.cpu.gdn_attention._spec_forward",
        why=("vLLM's CPU Gated DeltaNet serves a request's speculative tokens as one chain (conv over the "
             "chain, state after token t in slot t); a tree node needs its parent's state and its "
             "ancestors' conv inputs, and vLLM has no hook for a draft topology."),
        how=("Rebinds the module-level name that _cpu_gdn_attention_spec_aware calls: during a UBTree "
             "step's target forward the tokens run as the step's trees (ubtree_vllm.vllm.recurrent.gdn_cpu: node j's "
             "window from its root path, its state from its parent's, written to slot j) and the layer is "
             "recorded for the runner's commit of the accepted path (ubtree_vllm.vllm.recurrent.commit); "
             "otherwise vLLM's function runs. CPU platform only."),
        removal_condition=("vLLM's linear-attention backends take a draft topology (tree speculative decoding "
                           "upstream, e.g. parents in the GDN metadata) or expose a per-node state hook."),
        stage="worker",
    ),
    PatchSpec(
        name="mamba2_tree_decode",
        vllm_symbol="vllm.model_executor.layers.mamba.mamba_mixer2.selective_state_update",
        why=("vLLM's Mamba2 mixer runs a request's speculative tokens through causal_conv1d_update and "
             "selective_state_update as one chain (the CPU conv even ignores num_accepted_tokens); a tree node "
             "needs its parent's state and its ancestors' conv inputs, and vLLM has no hook for a draft topology."),
        how=("Rebinds the two module-level names the mixer calls (causal_conv1d_update too): during a UBTree "
             "step's target forward the decode tokens run as the step's trees (ubtree_vllm.vllm.recurrent.mamba2: "
             "node j's window from its root path through vLLM's one-token conv, its state from its parent's "
             "through vLLM's one-token state update, written to slot j) and the layer is recorded for the "
             "runner's commit of the accepted path; otherwise vLLM's functions run. CPU, and CUDA for targets "
             "admitted by UBTREE_CUDA_HYBRIDS=1."),
        removal_condition=("vLLM's Mamba2 mixer takes a draft topology (tree speculative decoding upstream) or "
                           "exposes a per-node state hook."),
        stage="worker",
    ),
    PatchSpec(
        name="cuda_gdn_tree_forward",
        vllm_symbol="vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn.QwenGatedDeltaNetAttention._forward_core",
        why=("vLLM's CUDA Gated DeltaNet serves a request's speculative tokens as one chain (causal_conv1d_update "
             "and fused_sigmoid_gating_delta_rule_update with num_accepted_tokens); a tree node needs its parent's "
             "state and its ancestors' conv inputs, and vLLM has no hook for a draft topology."),
        how=("Wraps _forward_core (the layer's trees from the step plan before vLLM's code, the commit record "
             "after) and rebinds the two module-level names it calls: their speculative calls run as the step's "
             "trees through vLLM's one-token calls (ubtree_vllm.vllm.recurrent.gdn_cuda), every other call runs vLLM's "
             "function; layers are built with enable_fused_gdn_spec_decode off. CUDA only, for targets admitted by "
             "UBTREE_CUDA_HYBRIDS=1."),
        removal_condition=("vLLM's linear-attention backends take a draft topology (tree speculative decoding "
                           "upstream, e.g. parents in the GDN metadata) or expose a per-node state hook."),
        stage="worker",
    ),
    PatchSpec(
        name="cuda_kda_tree_forward",
        vllm_symbol="vllm.model_executor.models.bailing_moe_v3.BailingMoeV3KimiDeltaAttention._forward",
        why=("vLLM's CUDA Kimi Delta Attention (Ling-3.0) serves a request's speculative tokens as one chain "
             "(three causal_conv1d_update calls and fused_recurrent_kda_fwd with num_accepted_tokens); a tree node "
             "needs its parent's state and its ancestors' conv inputs, and vLLM has no hook for a draft topology."),
        how=("Wraps _forward (the layer's trees from the step plan before vLLM's code, the commit record after) and "
             "rebinds the two module-level names it calls: their speculative calls run as the step's trees through "
             "vLLM's own calls (the Gated DeltaNet conv form; ubtree_vllm.vllm.recurrent.kda_cuda: the roots through "
             "fused_recurrent_kda, plain decoding's call, the nodes below them as root -> leaf chains of vLLM's "
             "speculative call), every other call runs vLLM's function. CUDA only, for targets admitted by "
             "UBTREE_CUDA_HYBRIDS=1."),
        removal_condition=("vLLM's linear-attention backends take a draft topology (tree speculative decoding "
                           "upstream) or expose a per-node state hook."),
        stage="worker",
    ),
    PatchSpec(
        name="falcon_h1_hidden_states",
        vllm_symbol="vllm.model_executor.models.falcon_h1.FalconH1Model.forward",
        why=("The drafter conditions on the hidden states entering chosen target layers, which vLLM's runners "
             "request through SupportsEagle3; vLLM 0.32's FalconH1ForCausalLM does not implement it, so a UBTree "
             "engine on Falcon-H1 failed at start although its Mamba2 mixers verify trees as NemotronH's do."),
        how=("Replaces FalconH1Model.forward with vLLM's layer loop plus the taps (the stream entering each tapped "
             "layer, and after the last when tapped; returns (hidden, aux)) and adds the SupportsEagle3 members to "
             "FalconH1ForCausalLM; without taps vLLM's forward runs unchanged."),
        removal_condition="vLLM's FalconH1ForCausalLM implements SupportsEagle3 (EagleModelMixin).",
        stage="worker",
    ),
    PatchSpec(
        name="bailing_moe_v3_hidden_states",
        vllm_symbol="vllm.model_executor.models.bailing_moe_v3.BailingMoeV3Model.forward",
        why=("The drafter conditions on the hidden states entering chosen target layers, which vLLM's runners "
             "request through SupportsEagle3; vLLM 0.32's BailingMoeV3ForCausalLM (Ling-3.0) does not implement it, "
             "so a UBTree engine on Ling-3.0 would fail at start."),
        how=("Replaces BailingMoeV3Model.forward with vLLM's layer loop plus the taps (hidden_states + residual "
             "entering each tapped layer, and after the last when tapped; returns (hidden, aux)) and adds the "
             "SupportsEagle3 members to BailingMoeV3ForCausalLM; without taps vLLM's forward runs unchanged."),
        removal_condition="vLLM's BailingMoeV3ForCausalLM implements SupportsEagle3 (EagleModelMixin).",
        stage="worker",
    ),
    PatchSpec(
        name="cpu_gdn_native_conv",
        vllm_symbol="vllm.model_executor.layers.mamba.ops.cpu.gdn_attention.is_arm_bf16",
        why=("vLLM 0.32 packs GDN conv weights for its C++ conv on every ARM-bf16 or AVX-512 BF16 CPU and "
             "plain decoding runs that kernel there, but its speculation-aware CPU GDN paths run it only on AMX "
             "or ARM bf16: on an AVX-512 BF16 CPU without AMX a speculative engine prefills through the torch "
             "conv (other arithmetic), so no speculative engine matches plain decoding's tokens there."),
        how=("Rebinds the module-level is_arm_bf16 those paths combine with the AMX test to vLLM's packing "
             "predicate (ARM bf16 or AVX-512 BF16); the non-speculative path, which already tests AVX-512 BF16, "
             "is unchanged. CPU platform only."),
        removal_condition=("vLLM's speculation-aware CPU GDN paths test the same predicate as the weight "
                           "packing (AVX-512 BF16 included)."),
        stage="worker",
    ),
)

_lock = threading.Lock()
_applied_stages: set[str] = set()


def validate_manifest(manifest: tuple[PatchSpec, ...] | None = None) -> None:
    """Raise ``ValueError`` if names repeat or two entries patch the same symbol in one stage."""
    manifest = MANIFEST if manifest is None else manifest
    seen_names: set[str] = set()
    seen_symbols: set[tuple[str, str]] = set()
    for spec in manifest:
        if not isinstance(spec, PatchSpec):
            raise ValueError(f"manifest entry {spec!r} is not a PatchSpec")
        if spec.name in seen_names:
            raise ValueError(f"duplicate patch name {spec.name!r}")
        if (spec.stage, spec.vllm_symbol) in seen_symbols:
            raise ValueError(f"{spec.vllm_symbol!r} is patched twice in stage {spec.stage!r}")
        seen_names.add(spec.name)
        seen_symbols.add((spec.stage, spec.vllm_symbol))


def apply(stage: str) -> tuple[str, ...]:
    """Apply every manifest patch of ``stage`` once per process; return the names applied now.

    Raises ``ValueError`` for an unknown stage.  A second call for the same
    stage applies nothing and returns ``()``.  With an empty manifest nothing
    is imported or changed.
    """
    if stage not in STAGES:
        raise ValueError(f"unknown patch stage {stage!r}; expected one of {STAGES}")
    with _lock:
        if stage in _applied_stages:
            return ()
        validate_manifest()
        applied: list[str] = []
        for spec in MANIFEST:
            if spec.stage != stage:
                continue
            importlib.import_module(spec.module).apply()
            logger.debug("ubtree_vllm: applied patch %s to %s", spec.name, spec.vllm_symbol)
            applied.append(spec.name)
        _applied_stages.add(stage)
        return tuple(applied)
