"""UBTree drafting on Model Runner V2: vLLM's DFlash speculator, drafting a tree (docs/design/mrv2.md §2).

:class:`UBTreeSpeculator` subclasses MRV2's ``DFlashSpeculator``. vLLM's DFlash model is the
unigram proposer (it computes the same function as ``drafter/model.py:DFlashBackbone``, see
the plan's status note); after its block forward, the gamma mask rows go through our
pipeline instead of DFlash's per-row sampling: the target's LM head + top-K
(``UBTreeDrafter.top_k_candidates``), the bigram selector's edge scores and the beam/prune
tree search (``tree/search.py:build_tree``), the chain of ``bench/microbench.py:draft_postprocess``.
The B draft slots of a request get the tree's nodes 1..B (parents first); the tree's
topology (parents/depth ``[B + 1]``) lives in :attr:`UBTreeSpeculator.topology`, indexed by
MRV2's request state slot, for the runner's tree layout and the rejection sampler.

Configuration the engine must present (the runner's engine rewrite writes it):

* ``speculative_config``: ``method="dflash"``, ``num_speculative_tokens = B`` (the tree
  budget: the draft slots the target verifies), ``model`` = a *proposer-only* DFlash folder
  (``drafter/io.py:export_dflash_proposer``; vLLM's weight loader raises on the full
  drafter's ``selector.*`` tensors).
* ``additional_config["ubtree"]`` (:data:`ubtree_vllm.vllm.config.ADDITIONAL_CONFIG_KEY`):
  ``UBTreeVllmConfig.to_additional_config()``, i.e. ``{"drafter": <the FULL drafter folder,
  with selector.* weights>, "tree_budget": B, "beam_width": W, "top_k": K, "block_size":
  gamma, "runner": "mrv2"}``, read through ``ubtree_vllm.vllm.config.from_vllm_config``
  (``drafter_dir`` is the full drafter folder; only its selector is loaded here).

The two meanings of DFlash's ``num_speculative_steps`` are split: the DFlash query block is
gamma (``num_speculative_steps = gamma``, ``num_query_per_req = 1 + gamma``: the block is
non-causal, so its length changes every logit), while the draft slots ``draft_tokens
[max_reqs, B]`` and the context rows of a captured step (``B + 1`` per request) stay B.
B >= gamma is required (vLLM reserves B + 1 lookahead KV slots; the block writes 1 + gamma).

What the runner must do (``ubtree_vllm/vllm/mrv2/model_runner.py``): replace MRV2's
speculator by this class before ``load_model``; hand ``self.topology`` to the tree layout and
the rejection sampler (the tensors are never reallocated); call :meth:`reset_request` for
each request added; after verifying a step, commit the accepted paths
(``triton_ops/accepted_rows.py:commit_accepted_paths``: KV moved, linear positions restored) and
set :attr:`UBTreeSpeculator.pending_perm` to the permutation it returns before MRV2 calls
:meth:`propose`, so the drafter's context rows are linearised (target rows of the accepted path
moved to ``root + 1 .. root + k``).

With ``prompt_lookup`` the runner also hands over its ``req_states`` (MRV2's ``RequestState``):
after vLLM's ``post_update`` its ``all_token_ids[slot, :total_len[slot]]`` is the request's
prompt + output ending at the anchor, the history ``tree/lookup.py`` matches (the same history
as the V1 runner's ``drafter/proposer.py:context_history``).

:meth:`propose` copies the step's request state slots into a static buffer (``_draft_slots``;
rows past the step's requests, and every row of a dummy run, name a scratch topology row), and
the draft graph gathers the lookup histories from it and scatters each tree's topology to its
request's slot: the draft's FULL CUDA graph writes ``topology`` itself, no launch after it.

With ``coupled_drafting`` (the default) each tree is drafted under the noise its request's draws will take at
T > 0 (:meth:`UBTreeSpeculator._target_noise`, ``drafter/coupling.py``; docs/design/mrv2.md §11): the request's
temperature and seed and the keys of its sample rows, from the buffers ``prepare_dflash_inputs`` filled.

Everything inside :meth:`UBTreeSpeculator._generate_draft` is fixed-shape device work (it is
captured in the draft's FULL CUDA graph); :meth:`propose` adds only fixed-shape launches.

A budget of 0 (a load-adaptive schedule's range ``[first, last, 0]``: at that load the scheduler verifies no drafts,
plain decoding's steps): MRV2 still calls :meth:`propose` with ``num_speculative_tokens = 0`` and blanks every draft
column afterwards, so the block forward and the tree search would be thrown away. :meth:`propose` then only stores
the drafter's context K/V of the step's target rows (:meth:`UBTreeSpeculator._store_context_only`: DFlash's input
preparation and ``_precompute_context_kv``, eagerly, without the block's attention metadata, graph dispatch and
slot mappings, which cost most of DFlash's host time in such a step), so drafting resumes on a complete context
when the load falls. Nothing else changes: the topology of a step with drafts is always written by the propose
before it.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from vllm.config.compilation import CUDAGraphMode
from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.worker.gpu.spec_decode.dflash.cudagraph import DFlashCudaGraphManager
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator, prepare_dflash_inputs

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.drafter.coupling import CoupledNoise
from ubtree_vllm.drafter.io import load_drafter
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.tree.lookup import lookup_continuation
from ubtree_vllm.triton_ops.lookup_chain import lookup_chain_rows
from ubtree_vllm.vllm.config import ADDITIONAL_CONFIG_KEY, UBTreeVllmConfig, from_vllm_config
from ubtree_vllm.vllm.mrv2.rejection_sampler import TreeTopology
from ubtree_vllm.vllm.stage_clock import StageClock

logger = init_logger(__name__)

ROOT_PARENT = -1  # parents[:, 0]
NO_NODE = -2  # parents of absent nodes
_UNTIMED = StageClock(torch.device("cpu"), enabled=False)  # dummy runs (profiling, capture) are never timed


# ---- pure helpers (CPU-testable) -------------------------------------------------------------

def ubtree_settings(vllm_config: Any) -> UBTreeVllmConfig:
    """The engine's UBTree settings (``from_vllm_config``); ValueError when the engine is not configured for them."""
    config = from_vllm_config(vllm_config)
    if config is None:
        raise ValueError(f"UBTreeSpeculator needs an engine configured with method 'ubtree' for Model Runner V2 "
                         f"(speculative method 'dflash' and additional_config[{ADDITIONAL_CONFIG_KEY!r}] with "
                         f"'runner': 'mrv2')")
    return config


def root_only_(parents: torch.Tensor, depth: torch.Tensor) -> None:
    """Set topology rows ``[..., B + 1]`` in place to a lone root (parents -1, -2, ...; depth 0)."""
    parents.fill_(NO_NODE)
    parents[..., 0].fill_(ROOT_PARENT)  # fill_, not `= ROOT_PARENT`: on a 0-dim view that is a host-to-device copy
    depth.zero_()


def tree_rows_from_hidden(
        drafter: UBTreeDrafter, tree_cfg: UBTreeConfig,
        # [R, gamma, H] proposer hidden states at the block's mask rows (depth 1..gamma)
        hidden: torch.Tensor,
        # [R] root tokens (any integer dtype)
        anchor: torch.Tensor,
        # the lookup branch (tree/lookup.py): chain [R, gamma] int64, chain_len [R] int64
        chain: tuple[torch.Tensor, torch.Tensor] | None = None,
        # coupled drafting (drafter/coupling.py): where the target's draws take their noise; None: uncoupled
        noise: CoupledNoise | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft one tree per request: ``(tokens [R, B] int64, parents [R, B + 1] int32, depth [R, B + 1] int32)``.

    The chain of ``UBTreeDrafter.draft_tree`` after its backbone forward: target LM head +
    top-K (``drafter.top_k_candidates``, the drafter bound to the target), then
    ``drafter.tree_from_candidates`` (selector edge scores, tree search). tokens are nodes 1..B (node 0, the root, is the anchor);
    parents are node indices (-1 at the root), parents first. Fixed shapes, no host sync:
    safe to capture in a CUDA graph once the selector's tables exist (eval mode, bound).
    """
    cands = drafter.top_k_candidates(hidden, tree_cfg.top_k, noise)  # [R, gamma, K]
    tree = drafter.tree_from_candidates(anchor.long(), cands, tree_cfg, chain)  # [R, B + 1]
    return tree.tokens[:, 1:], tree.parents.to(torch.int32), tree.depth.to(torch.int32)


def lookup_chain(
        # [max_num_reqs, L] int32: MRV2's RequestState.all_token_ids (device or UVA view)
        all_token_ids: torch.Tensor,
        # [max_num_reqs] int32: its total_len (prompt + output, the anchor included)
        total_len: torch.Tensor,
        # [R] int64 request state slots of the batch rows
        slots: torch.Tensor, tree_cfg: UBTreeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The lookup branch of each batch row: ``lookup_continuation`` over its request's history; on CUDA two Triton
    launches (``triton_ops.lookup_chain``), else one gather of the rows, then fixed-shape torch work. Returns chain
    [R, gamma] int64, chain_len [R]."""
    if all_token_ids.is_cuda:
        return lookup_chain_rows(all_token_ids, total_len, slots, tree_cfg.block_size, tree_cfg.lookup_min_n,
                                 tree_cfg.lookup_max_n)
    history = all_token_ids[slots].long()  # [R, L]
    length = total_len[slots].long().clamp(0, history.shape[1])  # [R]
    return lookup_continuation(history, length, tree_cfg.block_size, tree_cfg.lookup_min_n, tree_cfg.lookup_max_n)


def permute_target_rows(
        num_tokens: int,
        # num_layers x [T_pad, H] (or None), [T_pad, H]: the target's outputs for the verified batch
        aux_hidden_states: list[torch.Tensor] | None, last_hidden_states: torch.Tensor,
        # [num_tokens] int64: the step's row permutation (commit_accepted_paths / tree_layout.linearise_rows)
        perm: torch.Tensor,
        # DFlash's combine_hidden_states ([T, layers * H] -> [T, H], row-wise); None: permute each aux state
        combine: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[list[torch.Tensor] | None,
                                                                               torch.Tensor]:
    """Make a verified tree step look like a verified chain to DFlash's ``propose``.

    DFlash treats rows ``[ctx_start, ctx_end - num_rejected)`` as the accepted context. After a
    tree step, the accepted node at depth d sits at row ``root + path[d]``; ``hidden[perm]``
    holds it at row ``root + d``, as a chain would (the linear positions DFlash reads were
    restored by the same commit that produced ``perm``). Returns new tensors of ``num_tokens``
    rows: the aux states if there are any, else the last hidden states, i.e. whichever DFlash
    consumes. With ``combine`` and aux states, the aux states are first combined as DFlash would
    (concatenated, ``combine``) and the one result is permuted: returns ``(None, combined[perm])``,
    which DFlash takes as its context features (one row gather instead of one per aux layer).
    """
    if aux_hidden_states and combine is not None:  # row-wise, so permuting after combining is the same
        return None, combine(torch.cat([h[:num_tokens] for h in aux_hidden_states], dim=-1)).index_select(0, perm)
    if aux_hidden_states:
        return [h[:num_tokens].index_select(0, perm) for h in aux_hidden_states], last_hidden_states
    return aux_hidden_states, last_hidden_states[:num_tokens].index_select(0, perm)


def draft_graph_config(vllm_config: Any) -> Any:
    """The engine config as the draft's CUDA-graph manager must see it: without a load-adaptive budget.

    Every draft step queries ``1 + gamma`` tokens per request whatever the step's budget B'. vLLM's graph
    manager, given ``num_speculative_tokens_per_batch_size`` and a query length above B (B = gamma), takes
    the query to be ``B' + 1`` and adds graphs of ``B' + 1`` tokens per request (the target's rule): on the
    draft those hold ``n * (B' + 1)`` tokens for n requests of ``1 + gamma`` rows each, so a capture of 998
    requests in 5988 tokens overran the 16384-row input buffers (H200, 2026-12-03), and a smaller one would
    read its samples past the forward's rows. A shallow copy with the schedule dropped; the engine's own
    config is untouched (the target's graphs keep the schedule)."""
    spec = vllm_config.speculative_config
    if spec is None or not getattr(spec, "num_speculative_tokens_per_batch_size", None):
        return vllm_config
    config = copy.copy(vllm_config)
    config.speculative_config = copy.copy(spec)
    config.speculative_config.num_speculative_tokens_per_batch_size = None
    return config


def target_embedding_and_head(target_model: nn.Module, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, H], LM head [V, H]) of a vLLM target, its first ``vocab_size`` rows.

    Found the way vLLM's ``load_dflash_model`` shares them with the DFlash draft
    (``get_language_model()``, then ``.model.embed_tokens``; ``get_target_lm_head``); LoRA
    wrappers are unwrapped. On a tied target both are the same tensor. vLLM pads the
    vocabulary (and shards it over TP ranks): fewer than ``vocab_size`` rows is an error.
    """
    from vllm.v1.worker.gpu.spec_decode.eagle.utils import get_target_lm_head

    language_model = target_model.get_language_model() if hasattr(target_model, "get_language_model") \
        else target_model
    inner = getattr(language_model, "model", language_model)
    embed = getattr(inner, "embed_tokens", None)
    if embed is None:
        embed = getattr(inner, "embedding", None)
    head = get_target_lm_head(target_model, language_model)
    weights = []
    for name, module in (("input embedding", embed), ("LM head", head)):
        module = getattr(module, "base_layer", module)  # vLLM's LoRA wrappers
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError(f"{type(target_model).__name__}: no unquantized {name} weight to bind the UBTree "
                             f"selector to (found {type(module).__name__})")
        if weight.shape[0] < vocab_size:
            raise ValueError(f"{type(target_model).__name__}: the {name} has {weight.shape[0]} rows, fewer than the "
                             f"vocabulary ({vocab_size}); a vocabulary sharded over tensor-parallel ranks is not "
                             f"supported by ubtree on MRV2")
        weights.append(weight[:vocab_size])
    return weights[0], weights[1]


# ---- the speculator ----------------------------------------------------------------------------

class UBTreeSpeculator(DFlashSpeculator):
    """DFlash's block forward, then one UBTree tree of B nodes per request (see the module docstring)."""

    _speculator_name = "UBTree"
    stage_clock: StageClock = _UNTIMED  # the runner hands over its own (timed in stage-timing mode)

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        settings = ubtree_settings(vllm_config)
        self._check_settings(vllm_config, settings)
        super().__init__(vllm_config, device)
        self.ubtree_config = settings
        self.tree_cfg: UBTreeConfig = settings.tree
        self.tree_budget = self.num_speculative_steps  # B: draft slots, draft_tokens [max_reqs, B]
        self.gamma = settings.tree.block_size
        if self.parallel_drafting_token_id != settings.drafter.mask_token_id:
            raise ValueError(f"the DFlash folder's mask token {self.parallel_drafting_token_id} differs from the "
                             f"UBTree drafter's mask_token_id {settings.drafter.mask_token_id}")
        self._split_block_from_slots()
        # Greedy tree drafting: no draft distribution for the rejection sampler.
        if self.draft_logits is not None:
            logger.warning("ubtree drafts greedily: ignoring draft_sample_method='probabilistic'")
        self.draft_logits = None
        self._init_tree_buffers()
        self.ubtree_drafter: UBTreeDrafter | None = None  # selector + bound LM head, set by load_draft_model
        # [num_tokens] int64, set by the runner after verification, consumed by the next propose (module docstring)
        self.pending_perm: torch.Tensor | None = None
        self.req_states: Any | None = None  # MRV2's RequestState, handed over by the runner (prompt_lookup)

    @staticmethod
    def _check_settings(vllm_config: Any, settings: UBTreeVllmConfig) -> None:
        """ValueError/NotImplementedError for presentations this class cannot serve (before any allocation)."""
        spec = vllm_config.speculative_config
        budget, gamma = spec.num_speculative_tokens, settings.tree.block_size
        if budget != settings.tree.tree_budget:
            raise ValueError(f"speculative_config.num_speculative_tokens ({budget}) must equal the UBTree tree "
                             f"budget B ({settings.tree.tree_budget})")
        if budget < gamma:
            raise ValueError(f"the tree budget B (num_speculative_tokens = {budget}) must be >= the drafter's block "
                             f"size gamma ({gamma}): vLLM reserves B + 1 lookahead KV slots and the DFlash block "
                             f"writes 1 + gamma")
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            raise NotImplementedError("ubtree on MRV2 drafts with the whole target LM head; tensor parallelism "
                                      "(a vocabulary-sharded head) is not supported yet")
        if spec.enable_adaptive_verification:
            raise ValueError("ubtree on MRV2 does not support adaptive verification")
        if getattr(vllm_config, "watermark_config", None) is not None:
            raise ValueError("ubtree on MRV2 does not support watermarking")

    def _split_block_from_slots(self) -> None:
        """DFlash's block is gamma rows of masks (plus the anchor); the B draft slots stay as allocated."""
        self.num_speculative_steps = self.gamma
        self.num_query_per_req = 1 + self.gamma
        # Sample buffers (sample_indices/pos/idx_mapping) were sized max_reqs * B >= max_reqs * gamma.
        self.sample_col = torch.arange(self.gamma, dtype=torch.int32, device=self.device).repeat(self.max_num_reqs)

    def _init_tree_buffers(self) -> None:
        # Per request state slot, read by the tree layout and the rejection sampler; the extra last
        # row (scratch_slot) absorbs the draft graph's writes for rows that are no request's.
        self.scratch_slot = self.max_num_reqs
        shape = (self.max_num_reqs + 1, self.tree_budget + 1)
        self.topology = TreeTopology(parents=torch.empty(shape, dtype=torch.int32, device=self.device),
                                     depth=torch.empty(shape, dtype=torch.int32, device=self.device))
        root_only_(self.topology.parents, self.topology.depth)
        # [max_reqs] request state slot of each batch row, read inside _generate_draft (a static address for
        # the CUDA graph): the lookup branch's histories and the slot its tree's topology goes to
        self._draft_slots = torch.full((self.max_num_reqs,), self.scratch_slot, dtype=torch.int64,
                                       device=self.device)
        self._rows_with_slots = 0  # host: leading rows of _draft_slots that may hold request slots

    @torch.inference_mode()
    def reset_request(self, req_state_idx: int) -> None:
        """Topology of slot ``req_state_idx`` (a host int) back to a lone root; call when a request is added."""
        root_only_(self.topology.parents[req_state_idx], self.topology.depth[req_state_idx])

    def _num_graph_context_tokens(self, num_reqs: int) -> int:
        # Context rows a captured draft step stores: one tree verification (B + 1 rows) per request.
        return min(num_reqs * (self.tree_budget + 1), self.max_num_tokens)

    # ---- model loading -----------------------------------------------------------------------
    def load_draft_model(self, target_model: nn.Module, target_attn_layer_names: set[str]) -> nn.Module:
        """vLLM's DFlash model from the proposer-only folder, plus our selector bound to the target."""
        model = super().load_draft_model(target_model, target_attn_layer_names)  # load_dflash_model
        self.ubtree_drafter = self._load_selector(target_model)
        return model

    def _load_selector(self, target_model: nn.Module) -> UBTreeDrafter:
        """The full drafter folder's UBTreeDrafter (backbone dropped), in the target dtype, bound, eval mode."""
        drafter = load_drafter(self.ubtree_config.drafter_dir, device="cpu", dtype=self.dtype)  # eval mode
        drafter.backbone = None  # vLLM's DFlash model is the proposer; only the selector runs here
        drafter.requires_grad_(False).to(self.device)
        embed, head = target_embedding_and_head(target_model, drafter.cfg.vocab_size)
        drafter.bind_target(embed, head)  # eval mode: precomputes the selector's vocabulary tables
        return drafter

    # ---- CUDA graphs -------------------------------------------------------------------------
    def init_cudagraph_manager(self, cudagraph_mode: CUDAGraphMode) -> None:
        """FULL_DECODE_ONLY draft graphs whenever the engine uses graphs at all (the target may run PIECEWISE)."""
        supports_full = self.attn_cg_support.min_cg_support.value >= AttentionCGSupport.UNIFORM_BATCH.value
        wants_graphs = cudagraph_mode != CUDAGraphMode.NONE
        if wants_graphs and not supports_full:
            logger.warning("%s draft attention (%s) does not support full CUDA graphs; running the draft eagerly.",
                           self._speculator_name, self.attn_cg_support.min_cg_attn_backend)
        mode = CUDAGraphMode.FULL_DECODE_ONLY if wants_graphs and supports_full else CUDAGraphMode.NONE
        self.query_cudagraph_manager = DFlashCudaGraphManager(draft_graph_config(self.vllm_config), self.device, mode,
                                                              decode_query_len=self.num_query_per_req)

    # ---- drafting ------------------------------------------------------------------------------
    def _generate_draft(
        self,
        num_reqs: int,
        num_tokens_padded: int,
        attn_metadata: dict[str, Any] | None,
        slot_mappings: dict[str, torch.Tensor] | None,
        num_tokens_across_dp: torch.Tensor | None,
        cudagraph_runtime_mode: CUDAGraphMode = CUDAGraphMode.NONE,
    ) -> None:
        """Block forward, then a tree per request into ``draft_tokens[:num_reqs]`` and ``topology[_draft_slots]``.

        ``num_reqs`` may include CUDA-graph padding (their rows read query row 0 and stale
        anchors); :meth:`propose` points those rows' ``_draft_slots`` at the scratch slot.
        """
        last_hidden_states = self._run_model(num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
                                             cudagraph_runtime_mode)  # [T_pad, H]
        gamma, step = self.gamma, self.num_query_per_req
        # prepare_dflash_inputs: sample row r * gamma + (d - 1) = query row r * (1 + gamma) + d, d = 1..gamma
        hidden = last_hidden_states[self.sample_indices[:num_reqs * gamma]].view(num_reqs, gamma, -1)
        # Query row r * (1 + gamma) is request r's anchor: the bonus (or next prefill) token.
        anchor = self.input_buffers.input_ids[:num_reqs * step:step]  # [R] int32
        assert self.ubtree_drafter is not None, "load_model() must run before drafting"
        chain = None
        slots = self._draft_slots[:num_reqs]  # [R] int64, scratch_slot past the step's requests
        if self.tree_cfg.prompt_lookup:
            assert self.req_states is not None, "prompt_lookup needs the runner's req_states"
            chain = lookup_chain(self.req_states.all_token_ids.gpu, self.req_states.total_len.gpu,
                                 slots.clamp(max=self.max_num_reqs - 1), self.tree_cfg)  # scratch rows: any history
        noise = self._target_noise(num_reqs) if self.tree_cfg.coupled_drafting else None
        tokens, parents, depth = tree_rows_from_hidden(self.ubtree_drafter, self.tree_cfg, hidden, anchor, chain,
                                                       noise)
        self.draft_tokens[:num_reqs] = tokens  # [R, B]
        # [R, B + 1] to the requests' slots (index_copy_: no host sync, capturable); rows that are no
        # request's all land in scratch_slot
        self.topology.parents.index_copy_(0, slots, parents)
        self.topology.depth.index_copy_(0, slots, depth)

    def _target_noise(self, num_reqs: int) -> CoupledNoise:
        """Where the target's draws of this step's trees take their noise (drafter/coupling.py), from the buffers
        ``prepare_dflash_inputs`` filled (static addresses, read inside the draft graph): sample row
        ``r * gamma + d - 1`` holds depth d's request slot (-1: padding, any slot will do) and token position P,
        drawn by the row at P - 1 with the request's temperature and seed (per slot)."""
        num_rows = num_reqs * self.gamma
        slot = self.sample_idx_mapping[:num_rows].clamp(min=0).view(num_reqs, self.gamma)[:, 0].long()  # [R]
        key_pos = (self.sample_pos[:num_rows].long() - 1).clamp(min=0).view(num_reqs, self.gamma)  # [R, gamma]
        return CoupledNoise(temperature=self.temperature[slot], seeds=self.seeds[slot], key_pos=key_pos,
                            use_fp64=bool(self.use_fp64_gumbel))

    @torch.inference_mode()
    def propose(
        self,
        input_batch: Any,
        attn_metadata: dict[str, Any],
        slot_mappings: dict[str, torch.Tensor],
        # [num_tokens, hidden_size]
        last_hidden_states: torch.Tensor,
        # num_layers x [num_tokens, hidden_size]
        aux_hidden_states: list[torch.Tensor] | None,
        # [num_reqs]
        num_sampled: torch.Tensor,
        # [num_reqs]
        num_rejected: torch.Tensor,
        # [max_num_reqs]
        last_sampled: torch.Tensor,
        # [max_num_reqs]
        next_prefill_tokens: torch.Tensor,
        # [max_num_reqs]
        temperature: torch.Tensor,
        # [max_num_reqs]
        seeds: torch.Tensor,
        dp_sync_state: Any | None = None,
        dummy_run: bool = False,
        skip_attn_for_dummy_run: bool = False,
        mm_inputs: tuple[list[torch.Tensor], torch.Tensor] | None = None,
        is_profile: bool = False,
        num_speculative_tokens: int | None = None,
    ) -> torch.Tensor:
        """DFlash's propose over linearised target rows; the draft writes the trees' tokens and topology.

        Returns ``draft_tokens[:num_reqs]`` ``[R, B]`` int64 (nodes 1..B of each tree). Dummy
        runs (profiling, capture warm-up, DP padding) neither consume ``pending_perm`` nor
        touch a request's topology: their ``idx_mapping`` names stale request slots, so every
        row of theirs drafts into the scratch slot.
        """
        clock = _UNTIMED if dummy_run else self.stage_clock
        with clock.stage("draft_context"):
            self._set_draft_slots(input_batch, dummy_run)
            if not dummy_run and self.pending_perm is not None:
                perm, self.pending_perm = self.pending_perm, None
                aux_hidden_states, last_hidden_states = permute_target_rows(
                    input_batch.num_tokens, aux_hidden_states, last_hidden_states, perm,
                    combine=self.model.combine_hidden_states)
        with clock.stage("draft"):
            if num_speculative_tokens == 0 and not dummy_run:  # budget 0: the context K/V alone (module docstring)
                return self._store_context_only(input_batch, last_hidden_states, aux_hidden_states, num_sampled,
                                                num_rejected, last_sampled, next_prefill_tokens, temperature, seeds)
            return super().propose(
                input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states, num_sampled,
                num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, dp_sync_state=dp_sync_state,
                dummy_run=dummy_run, skip_attn_for_dummy_run=skip_attn_for_dummy_run, mm_inputs=mm_inputs,
                is_profile=is_profile, num_speculative_tokens=num_speculative_tokens)

    def _store_context_only(self, input_batch: Any, last_hidden_states: torch.Tensor,
                            aux_hidden_states: list[torch.Tensor] | None, num_sampled: torch.Tensor,
                            num_rejected: torch.Tensor, last_sampled: torch.Tensor, next_prefill_tokens: torch.Tensor,
                            temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """A budget-0 step's propose: the drafter's context K/V of the step's target rows, nothing else.

        The context half of vLLM 0.32's ``DFlashSpeculator.propose`` (its eager path), in its order: the features
        (``combine_hidden_states`` of the aux states) into ``hidden_states``, ``prepare_dflash_inputs`` per draft KV
        group (context positions and slots; it also fills the query buffers, which nothing reads this step), then
        ``_precompute_context_kv`` over every target row. Left out, as the block forward they serve is skipped:
        the block's attention metadata, CUDA-graph dispatch and per-layer slot mappings (on an H100 at 64 requests
        in flight, 2026-12-05, DFlash's whole propose took 0.94 ms of host time per such step against a 2.7 ms
        plain decoding step). PCP and DP, which the base also handles here, are refused by the engine arguments.
        Arguments as :meth:`propose`'s (the hidden rows already linearised); returns ``draft_tokens[:num_reqs]``,
        which MRV2 blanks at budget 0."""
        num_reqs, num_tokens = input_batch.num_reqs, input_batch.num_tokens
        if aux_hidden_states:
            hidden_states = self.model.combine_hidden_states(torch.cat(aux_hidden_states, dim=-1))
        else:
            hidden_states = last_hidden_states
        self.hidden_states[:num_tokens].copy_(hidden_states[:num_tokens])
        self.prepare_context_anchor(input_batch, num_rejected)
        for i, gid in enumerate(self.draft_kv_cache_group_ids):
            prepare_dflash_inputs(
                self.input_buffers, self.block_tables.slot_mappings[gid], self.context_positions,
                self._context_slot_mappings[i], self.sample_indices, self.sample_pos, self.sample_idx_mapping,
                self.temperature, self.seeds, input_batch, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, self.block_tables.input_block_tables[gid],
                self.block_tables.block_sizes[gid], self.block_tables.cp_rank, self.dcp_size,
                self.block_tables.cp_interleave, self.parallel_drafting_token_id, self.num_query_per_req,
                self.num_speculative_steps, self.max_num_reqs, self.max_num_tokens, self.max_model_len,
                self.sample_from_anchor)
        self._precompute_context_kv(0, num_tokens)
        return self.draft_tokens[:num_reqs]

    def _set_draft_slots(self, input_batch: Any, dummy_run: bool) -> None:
        """``_draft_slots[:R] = idx_mapping[:R]``, scratch_slot after (none for a dummy run); one launch at a steady
        batch size (rows past R are reset only when the batch shrank)."""
        num_reqs = 0 if dummy_run else input_batch.num_reqs
        if num_reqs:
            self._draft_slots[:num_reqs].copy_(input_batch.idx_mapping[:num_reqs])
        if self._rows_with_slots > num_reqs:
            self._draft_slots[num_reqs:self._rows_with_slots].fill_(self.scratch_slot)
        self._rows_with_slots = num_reqs
