"""UBTree on vLLM's Model Runner V2 (docs/design/mrv2.md §3-§6), the default runner on CUDA.

``UBTreeModelRunnerV2`` subclasses MRV2's ``GPUModelRunner`` and changes four things, each
through a method MRV2 already calls:

1. ``__init__``: the speculator is :class:`~ubtree_vllm.vllm.mrv2.speculator.UBTreeSpeculator`
   (the engine presents the speculative config as ``"dflash"``, so MRV2 built a plain DFlash
   speculator first), the runner owns the fixed-size tree-attention row buffers, and the drafts'
   host copy for the scheduler's grammar carries each tree's parents
   (:mod:`ubtree_vllm.vllm.mrv2.tree_drafts_handler`: structured output follows every node's path).
2. ``load_model``: the rejection sampler becomes
   :class:`~ubtree_vllm.vllm.mrv2.rejection_sampler.UBTreeRejectionSampler`, the sampler's penalties
   and bad words read each node's own path (:mod:`ubtree_vllm.vllm.mrv2.path_processors`), and the target's
   attention layers (not the drafter's) are bound to the row buffers.
3. ``prepare_attn``: after vLLM computed the slot mappings from linear positions (so node j's
   K/V goes to the slot of row root + j), the tree layout rewrites the positions to
   root + depth and fills the row buffers; the tree-aware FLASH_ATTN impl
   (``ubtree_vllm/vllm/attention/flash.py``) then recomputes the tree rows' attention. With
   ``tree_attention: "triton_stock_roots"`` or ``"flash_exact"``, in a uniform decode step
   (:func:`stock_roots_only`) the buffers cover every draft row and FlashAttention computes the roots alone
   (``"flash_exact"``: and every draft row, over scratch pages past the scheduler's blocks, ``exact_rows.py``).
4. ``postprocess_sampled``: after vLLM's bookkeeping, one launch commits the accepted paths
   (``triton_ops/accepted_rows.py:commit_accepted_paths``): the accepted nodes' K/V move to the
   slots of their depths in every target layer, the logits rows' linear positions are restored,
   and the hidden-row permutation is handed to the speculator, which drafts from the rows as a
   chain would have left them.

Everything on the decode path is fixed-shape device work; shapes depend on host-known sizes.
With ``UBTREE_STAGE_TIMING=1`` the stages of a step are timed (:mod:`ubtree_vllm.vllm.stage_clock`):
``execute_model`` > (``prepare_inputs_vllm``, ``tree_layout``; the rest is the target forward),
``sample_tokens`` > (``accept``: logits + tree acceptance, ``kv_commit``: vLLM's bookkeeping + the
KV move, ``draft_context``: linearising the target rows, ``draft``: the block forward + tree).
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from vllm.logger import init_logger
from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from ubtree_vllm.triton_ops.accepted_rows import commit_accepted_paths
from ubtree_vllm.triton_ops.kv_path_commit import kv_cache_pointers
from ubtree_vllm.vllm.attention.exact_rows import (ScratchPages, check_scheduler_metadata_layout,
                                                   engine_scratch_pages)
from ubtree_vllm.vllm.attention.flashinfer_rows import WORKSPACE_BYTES as FLASHINFER_WORKSPACE_BYTES
from ubtree_vllm.vllm.attention.flashinfer_rows import FlashInferTreeRows, LayerShape
from ubtree_vllm.vllm.attention.state import RowBuffers, bind_tree_layers, tree_forward_state
from ubtree_vllm.vllm.config import MRV2_TREE_ATTENTION_MODES, from_vllm_config
from ubtree_vllm.vllm.mrv2.rejection_sampler import UBTreeRejectionSampler
from ubtree_vllm.vllm.mrv2.path_processors import install_path_processors
from ubtree_vllm.vllm.mrv2.speculator import UBTreeSpeculator
from ubtree_vllm.vllm.mrv2.tree_drafts_handler import TreeDraftTokensHandler
from ubtree_vllm.vllm.mrv2.tree_layout import lay_out_tree_rows
from ubtree_vllm.vllm.stage_clock import StageClock

logger = init_logger(__name__)


def stock_roots_only(input_batch: Any) -> bool:
    """``tree_attention: "triton_stock_roots"``: the step is a uniform decode step (vLLM's own rule for a batch it
    may replay in a uniform decode graph, more than one row per request) whose every token row is a logits row, so
    FlashAttention computes the roots alone and the tree layout covers every other row (host-known sizes, no sync).

    RuntimeError for a uniform decode step with other rows: MRV2 may replay it in a FULL graph captured with the
    roots-only call, which would leave those rows unwritten."""
    from vllm.v1.worker.utils import get_uniform_decode_token_count

    all_logits = int(input_batch.cu_num_logits_np[-1]) == input_batch.num_tokens
    scheduled = input_batch.num_scheduled_tokens
    uniform_len = get_uniform_decode_token_count(len(scheduled), input_batch.num_tokens,
                                                 int(scheduled.max()) if len(scheduled) else 0,
                                                 input_batch.decode_graph_eligible)
    if uniform_len is None or uniform_len < 2:
        return False
    if not all_logits:
        raise RuntimeError(f"ubtree: a uniform decode step of {input_batch.num_tokens} tokens has "
                           f"{int(input_batch.cu_num_logits_np[-1])} logits rows; tree_attention 'triton_stock_roots' "
                           "computes the roots with FlashAttention and needs a tree-attention entry for every other row")
    return True


class UBTreeModelRunnerV2(GPUModelRunner):
    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        config = from_vllm_config(vllm_config)
        if config is None or config.runner != "mrv2":
            raise ValueError(f"{type(self).__name__} needs an engine configured with method 'ubtree' on MRV2")
        super().__init__(vllm_config, device)
        if self.use_pp:  # PCP is refused with the engine arguments (the PCP manager exists only after KV init)
            raise NotImplementedError("ubtree on Model Runner V2 does not support pipeline parallelism")
        self.ubtree_config = config
        # tree_attention "triton_stock_roots" / "flash_exact": in uniform decode steps FlashAttention computes the
        # roots alone; "flash_exact" the other rows too, over scratch pages past the scheduler's (set at KV init)
        self._tree_attention = config.tree_attention  # the mode served ("triton" after an "auto" fallback)
        self._exact_scratch: ScratchPages | None = None
        # tree_attention "flashinfer": the wrappers (bound after KV init) and their float workspace, allocated here so
        # the memory profile counts it
        self._flashinfer: FlashInferTreeRows | None = None
        self._flashinfer_workspace = (torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
                                      if config.tree_attention == "flashinfer" else None)
        self.gamma = config.tree.block_size
        self.ubtree_stage_clock = StageClock.from_env(device)
        self.speculator = UBTreeSpeculator(vllm_config, device)  # replaces MRV2's DFlashSpeculator
        self.speculator.stage_clock = self.ubtree_stage_clock
        self.speculator.req_states = self.req_states  # the lookup branch's histories (prompt_lookup)
        # the drafts' host copy for structured output carries each tree's parents (the grammar follows every path)
        self.draft_tokens_handler = TreeDraftTokensHandler(device, self.speculator.topology.parents)
        self._row_buffers = RowBuffers.empty(self.max_num_tokens, self.gamma + 1, device)
        self._kv_cache_ptrs: torch.Tensor | None = None  # [L] target layers' caches, at the first commit
        self._target_layers: list[Any] = []
        self._target_group = 0
        # (input_batch, slot_mappings [groups, T_pad]) of the step being verified, for the commit
        self._step: tuple[Any, torch.Tensor] | None = None

    # ---- the two calls of one vLLM step and vLLM's stages inside them (timed in stage-timing mode) ------
    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        with self.ubtree_stage_clock.stage("execute_model"):
            return super().execute_model(*args, **kwargs)

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        with self.ubtree_stage_clock.stage("sample_tokens"):
            return super().sample_tokens(*args, **kwargs)

    def prepare_inputs(self, *args: Any, **kwargs: Any) -> Any:
        with self.ubtree_stage_clock.stage("prepare_inputs_vllm"):
            return super().prepare_inputs(*args, **kwargs)

    def sample(self, *args: Any, **kwargs: Any) -> Any:
        with self.ubtree_stage_clock.stage("accept"):
            return super().sample(*args, **kwargs)

    # ---- 2. sampler swap, layer binding -----------------------------------------------------
    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        result = super().load_model(*args, **kwargs)
        self.rejection_sampler = UBTreeRejectionSampler(self.sampler, self.speculator.topology, self.gamma)
        topology = self.speculator.topology
        install_path_processors(self.sampler, topology.parents, topology.depth, self.gamma)
        return result

    def initialize_kv_cache(self, kv_cache_config: Any, is_profiling: bool = False,
                            kv_cache_allocation_context: Any = None) -> None:
        # Bind before any step or graph capture (a FULL graph captured before the bind would
        # hold no tree attention); again after the profiling run's caches are replaced.
        self._exact_scratch = None
        if self._tree_attention == "flash_exact" and not is_profiling:
            # the engine core gave the scheduler this many blocks fewer (patch engine_core_kv_cache_configs): the
            # views cover them again, past every block the scheduler hands out
            self._exact_scratch = engine_scratch_pages(self.vllm_config, first_page=kv_cache_config.num_blocks)
            kv_cache_config = copy.copy(kv_cache_config)
            kv_cache_config.num_blocks += self._exact_scratch.num_pages
        super().initialize_kv_cache(kv_cache_config, is_profiling, kv_cache_allocation_context)
        try:
            self._bind_target_layers()
        except NotImplementedError as why:  # the layers cannot serve flash_exact after all
            if not (self._tree_attention == "flash_exact" and self.ubtree_config.tree_attention_auto):
                raise
            unused = 0 if self._exact_scratch is None else self._exact_scratch.num_pages  # none in a profiling init
            logger.warning("ubtree: tree_attention 'auto' falls back to 'triton' (%s); the %d scratch pages kept for "
                           "'flash_exact' stay unused", why, unused)
            self._tree_attention, self._exact_scratch = "triton", None
            self._bind_target_layers()
        self._kv_cache_ptrs = None

    @property
    def served_tree_attention(self) -> str:
        """The tree-attention mode this runner serves (what "auto" chose, after any fallback)."""
        return self._tree_attention

    @property
    def _stock_roots_mode(self) -> bool:
        """The mode served lays out uniform decode steps with the roots alone for FlashAttention."""
        return self._tree_attention in MRV2_TREE_ATTENTION_MODES

    def decline_exact_rows(self) -> None:
        """Serve "triton" where "auto" chose "flash_exact" and the engine core kept no scratch pages for it (they did
        not fit beside one request of max_model_len); before the KV cache is initialized. (A runner whose layers
        refused flash_exact in the profiling run serves "triton" already.)"""
        if not (self.ubtree_config.tree_attention == "flash_exact" and self.ubtree_config.tree_attention_auto):
            raise RuntimeError(f"ubtree: only tree_attention 'auto' can decline 'flash_exact' (this engine's mode is "
                               f"{self.ubtree_config.tree_attention!r}, auto={self.ubtree_config.tree_attention_auto})")
        self._tree_attention = "triton"

    def _bind_target_layers(self) -> None:
        """The target's attention layers (the drafter's excluded) read the row buffers; after every KV init."""
        self._target_layers = bind_tree_layers(self.compilation_config.static_forward_context, self._row_buffers,
                                               exclude=self.speculator.draft_attn_layer_names,
                                               tree_attention=self._tree_attention,
                                               exact_scratch=self._exact_scratch)
        elsewhere = sorted({type(m.impl).__name__ for m in self._target_layers
                            if not getattr(m.impl, "ubtree_commit_in_cache", False)})
        if elsewhere:
            raise RuntimeError(f"ubtree on MRV2 commits KV inside a FLASH_ATTN or TRITON_ATTN cache; the target's "
                               f"layers use {elsewhere}")
        self._row_buffers.full_graphs_covered = self._stock_roots_mode and self._full_graphs_uniform_decode()
        names = {m.layer_name for m in self._target_layers}
        groups = [gid for gid, g in enumerate(self.kv_cache_config.kv_cache_groups) if names & set(g.layer_names)]
        if len(groups) != 1:
            raise NotImplementedError(f"ubtree on MRV2 needs the target's layers in one KV cache group, got {groups}")
        self._target_group = groups[0]
        if self._exact_scratch is not None:
            self._check_exact_rows()
        self._flashinfer = self._bind_flashinfer() if self._tree_attention == "flashinfer" else None

    def _bind_flashinfer(self) -> FlashInferTreeRows:
        """tree_attention "flashinfer" at KV init: the wrappers' shapes from the target's layers, bound to each."""
        shapes = {LayerShape(m.impl.num_heads, m.impl.num_kv_heads, m.impl.head_size, self.model_config.dtype,
                             m.impl.scale) for m in self._target_layers}
        if len(shapes) != 1:
            raise NotImplementedError(f"tree_attention 'flashinfer' needs one attention shape across the target's "
                                      f"layers, got {sorted(shapes, key=repr)}")
        shape = shapes.pop()
        budgets = {self.ubtree_config.tree.tree_budget, *(b for _, _, b in self.ubtree_config.budget_schedule or ())}
        rows = FlashInferTreeRows(self.device, self._flashinfer_workspace, shape,
                                  self.kernel_block_sizes[self._target_group], self.max_model_len,
                                  query_lens=frozenset(1 + b for b in budgets if b > 0))
        for m in self._target_layers:
            m.impl.ubtree_flashinfer = rows
        return rows

    def _check_exact_rows(self) -> None:
        """tree_attention "flash_exact" at KV init: pages as the scratch assumes, and FA3's metadata as it pins it."""
        kernel_pages = self.kernel_block_sizes[self._target_group]
        if kernel_pages != self.cache_config.block_size:
            raise NotImplementedError(f"tree_attention 'flash_exact' needs the attention kernel's pages to be the KV "
                                      f"cache blocks; this engine splits blocks of {self.cache_config.block_size} "
                                      f"into kernel pages of {kernel_pages}")
        impl = self._target_layers[0].impl
        check_scheduler_metadata_layout(self.device, impl.num_heads, impl.num_kv_heads, impl.head_size,
                                        self.model_config.dtype, kernel_pages)

    def _full_graphs_uniform_decode(self) -> bool:
        """Every FULL graph replays uniform decode steps only: the mixed mode is not FULL (else a FULL graph may replay
        a prefill) and vLLM captures no varlen decode graphs (adaptive verification)."""
        from vllm.config import CUDAGraphMode

        return (self.compilation_config.cudagraph_mode.mixed_mode() != CUDAGraphMode.FULL
                and getattr(self, "adaptive_verification", None) is None)

    # ---- 3. tree positions and attention rows --------------------------------------------------
    def prepare_attn(self, input_batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        with self.ubtree_stage_clock.stage("tree_layout"):
            return self._prepare_tree_attn(input_batch)

    def _prepare_tree_attn(self, input_batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        block_tables, slot_mappings = super().prepare_attn(input_batch)  # linear slots: node j at root + j
        buffers = self._row_buffers
        if input_batch.num_draft_tokens > 0:
            buffers.covers_forward = self._stock_roots_mode and stock_roots_only(input_batch)
            lay_out_tree_rows(input_batch.positions, input_batch.logits_indices, input_batch.cu_num_logits,
                              input_batch.expanded_idx_mapping, input_batch.expanded_local_pos,
                              self.speculator.topology.parents, self.speculator.topology.depth, self.gamma,
                              buffers.row_index, buffers.row_req, buffers.row_context_len, buffers.row_path,
                              cover_rows=buffers.covers_forward)
            if self._flashinfer is not None and buffers.covers_forward:
                self._plan_flashinfer(input_batch, block_tables)
            tree_forward_state().begin_device_rows()
            self._step = (input_batch, slot_mappings)
        else:  # prefill / no drafts: stock attention
            buffers.covers_forward = False
            buffers.row_index.fill_(-1)
            tree_forward_state().end_forward()
            self._step = None
        return block_tables, slot_mappings

    def _plan_flashinfer(self, input_batch: Any, block_tables: tuple[torch.Tensor, ...]) -> None:
        """tree_attention "flashinfer": plan this uniform decode step's wrapper before its forward (a FULL graph's
        replay reads the plan's buffers); host bounds and host-known sizes only."""
        num_reqs, q = input_batch.num_reqs_after_padding, int(input_batch.num_scheduled_tokens.max())
        if not self._flashinfer.serves(num_reqs, q):
            return
        buffers = self._row_buffers
        self._flashinfer.plan(num_reqs, q, input_batch.seq_lens_cpu_upper_bound.numpy()[:input_batch.num_reqs],
                              input_batch.seq_lens, buffers.row_index, buffers.row_path,
                              block_tables[self._target_group])

    def prepare_dummy_attn(self, input_batch: Any, valid_state_slots: bool = False) -> Any:
        self._row_buffers.row_index.fill_(-1)  # capture / profile runs: every entry skipped
        self._row_buffers.covers_forward = False
        tree_forward_state().end_forward()
        return super().prepare_dummy_attn(input_batch, valid_state_slots)

    # ---- 4. KV commit, hand-over to the drafter ---------------------------------------------------
    def postprocess_sampled(self, idx_mapping: torch.Tensor, sampled_tokens: torch.Tensor, num_sampled: torch.Tensor,
                            num_rejected: torch.Tensor, query_start_loc: torch.Tensor | None = None) -> None:
        with self.ubtree_stage_clock.stage("kv_commit"):
            self._postprocess_and_commit(idx_mapping, sampled_tokens, num_sampled, num_rejected, query_start_loc)

    def _postprocess_and_commit(self, idx_mapping: torch.Tensor, sampled_tokens: torch.Tensor,
                                num_sampled: torch.Tensor, num_rejected: torch.Tensor,
                                query_start_loc: torch.Tensor | None) -> None:
        super().postprocess_sampled(idx_mapping, sampled_tokens, num_sampled, num_rejected, query_start_loc)
        tree_forward_state().end_forward()
        accept, self.rejection_sampler.last_accept = self.rejection_sampler.last_accept, None
        step, self._step = self._step, None
        if accept is None or step is None:
            return
        input_batch, slot_mappings = step
        caches = [m.kv_cache for m in self._target_layers]
        if self._kv_cache_ptrs is None:  # the caches are allocated before the first step and never move
            self._kv_cache_ptrs = kv_cache_pointers(caches)
        # nothing reads the positions between here and the drafter, which needs them linear
        self.speculator.pending_perm = commit_accepted_paths(
            self._kv_cache_ptrs, caches[0], slot_mappings[self._target_group], input_batch.num_tokens,
            input_batch.logits_indices, input_batch.cu_num_logits, accept.accepted_path, accept.num_accepted,
            accept.accepted_path.shape[1] - 1, positions=input_batch.positions)

    # ---- request lifecycle --------------------------------------------------------------------
    def add_requests(self, scheduler_output: Any) -> None:
        super().add_requests(scheduler_output)
        for new_req in scheduler_output.scheduled_new_reqs:  # SYNC: host loop over new requests only, at admission
            self.speculator.reset_request(self.req_states.req_id_to_index[new_req.req_id])
