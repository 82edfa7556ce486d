"""The V1 model runner with UBTree rounds: vLLM's runner plus five overrides.

One step of vLLM's V1 runner (``GPUModelRunner.execute_model`` + ``sample_tokens``) with
the UBTree hooks, in call order:

1. ``_prepare_inputs``  -- after vLLM computed positions and (linear) slot mappings, lay
   the step's trees over the batch (:func:`ubtree_vllm.vllm.tree_plan.build_plan`), write
   RoPE positions ``root_pos + depth`` for tree rows and publish the plan to the
   attention backends (:mod:`ubtree_vllm.vllm.attention.state`; on CUDA also into the
   fixed-size row buffers that CUDA-graph-captured tree attention reads);
2. ``_model_forward``   -- the target forward (tree rows get the ancestor mask; on CPU their
   K/V is stashed for the commit); the plan is withdrawn right after;
3. ``_sample``          -- :class:`ubtree_vllm.vllm.sampler.TreeRejectionSampler`;
4. ``_update_states_after_model_execute`` -- KV commit of the accepted paths
   (:mod:`ubtree_vllm.vllm.kv_commit`: inside the cache on CUDA, from the stash on CPU) and,
   for Gated DeltaNet layers, of their per-node recurrent states (:mod:`ubtree_vllm.vllm.recurrent.commit`);
5. ``propose_draft_token_ids`` (after vLLM's bookkeeping, as for every ``custom_class``
   proposer) -- write the committed rows' aux hidden states into the feature store, draft
   a tree per decoding request and hand vLLM its B nodes as the draft tokens
   (``take_draft_token_ids`` adds each tree's parents, for structured output's grammar).

Everything else (scheduling, KV allocation, stop handling, metrics) is vLLM's, unchanged.
With ``UBTREE_STAGE_TIMING=1`` each of these stages is timed (:mod:`ubtree_vllm.vllm.stage_clock`).
The runner requires the target to return aux hidden states (``SupportsEagle3``) for the
drafter's layers, and every attention layer to use a tree-aware impl.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ubtree_vllm import compat
from ubtree_vllm.triton_ops.kv_path_commit import kv_cache_pointers
from ubtree_vllm.types import DraftContext
from ubtree_vllm.verify.accept import AcceptResult
from ubtree_vllm.vllm.attention.state import RowBuffers, bind_tree_layers, tree_forward_state
from ubtree_vllm.vllm.config import from_vllm_config
from ubtree_vllm.vllm.features import ContextFeatureStore
from ubtree_vllm.vllm.recurrent.commit import commit_accepted_states
from ubtree_vllm.vllm.kv_commit import commit_accepted_paths, commit_accepted_paths_in_cache
from ubtree_vllm.vllm.proposer import UBTreeProposer
from ubtree_vllm.vllm.sampler import TreeRejectionSampler
from ubtree_vllm.vllm.stage_clock import StageClock
from ubtree_vllm.vllm.structured_output import TreeDraftTokenIds
from ubtree_vllm.vllm.tensor_parallel import RankDigest, from_driver, is_driver, tp_group
from ubtree_vllm.vllm.tree_plan import RequestTree, TreeStepPlan, ragged_arange, build_plan


class UBTreeRunnerMixin:
    """UBTree overrides for a vLLM V1 ``GPUModelRunner`` subclass (see the module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        compat.check_vllm_version()
        config = from_vllm_config(vllm_config)
        if config is None:
            raise ValueError(f"{type(self).__name__} needs an engine configured with method 'ubtree'")
        super().__init__(vllm_config, device)  # type: ignore[call-arg]
        if not isinstance(getattr(self, "drafter", None), UBTreeProposer):
            raise RuntimeError("the UBTree runner expects vLLM's custom_class drafter to be UBTreeProposer")
        self.ubtree_config = config
        # The target returns the aux hidden states of the drafter's layers (set before load_model).
        self.use_aux_hidden_state_outputs = True
        aux_ids = config.aux_layer_ids
        sorted_ids = sorted(set(aux_ids))
        # vLLM returns aux states in ascending layer order; the drafter wants its own order.
        self._aux_order = [sorted_ids.index(i) for i in aux_ids]
        # Tensor parallelism: trees drafted on the driver rank and its node draws, broadcast to every rank.
        self._tp_group = tp_group()
        # with TP, every rank must end with the same digest (vllm/tensor_parallel.py); empty without TP
        self.ubtree_tp_digest = RankDigest()
        self._tree_sampler = TreeRejectionSampler(
            config.tree.block_size, vllm_config.model_config.logprobs_mode,
            share_draws=None if self._tp_group is None else lambda draws: from_driver(draws, self._tp_group))
        self._tree_state = tree_forward_state()
        self._trees: dict[str, RequestTree] = {}
        self._plan: TreeStepPlan | None = None
        self._accept: AcceptResult | None = None
        self._features = ContextFeatureStore(config.drafter.num_features, self.dtype, self.device)
        # Fixed-size tree-row buffers for CUDA-graph-captured tree attention (FLASH_ATTN), one
        # entry per token; paths hold the root and at most gamma nodes.
        self._row_buffers = RowBuffers.empty(self.max_num_tokens, config.tree.block_size + 1, self.device)
        self.ubtree_stage_clock = StageClock.from_env(self.device)
        self._use_builtin_logits_processors()

    def _use_builtin_logits_processors(self) -> None:
        """All of vLLM's built-in logits processors (min_tokens, logit_bias, min_p), as plain decoding has them.

        With a speculative config vLLM builds only min_tokens' (its chain sampler cannot apply the
        others to drafts, and admission rejects them); the tree sampler applies each along every
        node's path (vllm/sampler.py), so their per-request state must exist. Replaced before any
        request is added; vLLM's later InputBatch rebuilds reuse ``input_batch.logitsprocs``.
        """
        from vllm.utils.torch_utils import PIN_MEMORY
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

        self.input_batch.logitsprocs = LogitsProcessors(
            ctor(self.vllm_config, self.device, PIN_MEMORY) for ctor in BUILTIN_LOGITS_PROCESSORS)

    # ---- the two calls of one vLLM step (timed as wholes in stage-timing mode) --------------
    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        with self.ubtree_stage_clock.stage("execute_model"):
            return super().execute_model(*args, **kwargs)  # type: ignore[misc]

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        with self.ubtree_stage_clock.stage("sample_tokens"):
            return super().sample_tokens(*args, **kwargs)  # type: ignore[misc]

    # ---- model / aux layers ------------------------------------------------------------
    def _get_eagle3_aux_layers_from_config(self) -> tuple[int, ...]:
        return self.ubtree_config.aux_layer_ids

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self._check_tree_attention()

    @property
    def served_tree_attention(self) -> str:
        """The tree-attention mode this runner serves (the V1 runner has no fallback: the engine-args choice)."""
        return self.ubtree_config.tree_attention

    def _check_tree_attention(self) -> None:
        """Every decoder attention layer must run a tree-aware impl (else: wrong tokens)."""
        layers = bind_tree_layers(self.compilation_config.static_forward_context, self._row_buffers,
                                  tree_attention=self.ubtree_config.tree_attention)
        self._tree_attention_layers = layers
        self._kv_cache_ptrs: torch.Tensor | None = None  # [L] int64, built at the first in-cache commit
        # FLASH_ATTN's tree impl: KV commit inside the cache, tree rows read from the row buffers.
        self._commit_in_cache = all(getattr(m.impl, "ubtree_commit_in_cache", False) for m in layers)

    # ---- 1. tree layout, positions -----------------------------------------------------
    def _prepare_inputs(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        clock = self.ubtree_stage_clock
        with clock.stage("prepare_inputs_vllm"):
            result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)  # type: ignore[misc]
        with clock.stage("tree_plan"):
            self._lay_out_trees(scheduler_output, num_scheduled_tokens)
        return result

    def _lay_out_trees(self, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        num_reqs = self.input_batch.num_reqs
        plan = build_plan(
            self.input_batch.req_ids, self.query_start_loc.np[: num_reqs + 1], num_scheduled_tokens,
            self.input_batch.num_computed_tokens_cpu[:num_reqs], self.input_ids.np,
            scheduler_output.scheduled_spec_decode_tokens, self._trees)
        if plan.has_tree_rows:  # chains keep vLLM's linear positions; trees get root_pos + depth
            trees = plan.to_device(self.device)  # the step's one host-to-device copy
            self.positions[trees.position_rows] = trees.position_values
        self._plan, self._accept = plan, None
        self._tree_state.begin(plan, self.device, self._row_buffers if self._commit_in_cache else None)

    # ---- 2. forward ---------------------------------------------------------------------
    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            with self.ubtree_stage_clock.stage("forward"):
                return super()._model_forward(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._tree_state.end_forward()

    # ---- 3. sampling ---------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        if spec_decode_metadata is None or self._plan is None:
            return super()._sample(logits, spec_decode_metadata)  # type: ignore[misc]
        plan = self._plan
        with self.ubtree_stage_clock.stage("accept"):
            output, self._accept = self._tree_sampler(plan, plan.to_device(self.device), logits,
                                                      self.input_batch.sampling_metadata)
        return output

    # ---- 4. KV commit --------------------------------------------------------------------
    def _update_states_after_model_execute(self, output_token_ids: torch.Tensor, scheduler_output: Any) -> None:
        super()._update_states_after_model_execute(output_token_ids, scheduler_output)  # type: ignore[misc]
        if self._plan is None or self._accept is None:
            return
        with self.ubtree_stage_clock.stage("kv_commit"):
            self._commit_kv(self._plan, self._accept)
            # GDN layers: the accepted path's states and conv inputs into chain order
            commit_accepted_states(self._tree_state.linear_stash.values(), self._accept.accepted_path,
                                   self._accept.num_accepted)

    def _commit_kv(self, plan: TreeStepPlan, accept: AcceptResult) -> None:
        if not self._commit_in_cache:  # CPU_ATTN: replay the stashed K/V
            commit_accepted_paths(self._tree_state, plan, accept.accepted_path, accept.num_accepted)
        elif len(plan.stash_rows):
            # FLASH_ATTN (FLASH_ATTN_MLA): this step's KV slot of every stash row, from vLLM's slot-mapping buffer.
            slot_mapping = self.input_batch.block_table[self._tree_attention_group()].slot_mapping.gpu
            stash_slots = slot_mapping[plan.to_device(self.device).stash_rows].long()
            caches = [layer.kv_cache for layer in self._tree_attention_layers]
            if self._kv_cache_ptrs is None:  # once: the caches are allocated before the first step and never move
                self._kv_cache_ptrs = kv_cache_pointers(caches)
            like = caches[0] if caches[0].dim() == 4 else caches[0].unsqueeze(1)  # MLA: [blocks, 1 head, slot, L + R]
            commit_accepted_paths_in_cache(self._kv_cache_ptrs, like, stash_slots, plan, accept.accepted_path,
                                           accept.num_accepted)

    def _tree_attention_group(self) -> int:
        """The KV cache group of the tree attention layers (a hybrid target's recurrent layers have groups of their
        own); NotImplementedError if they span several (the in-cache commit reads one slot mapping)."""
        names = {layer.layer_name for layer in self._tree_attention_layers}
        groups = [g for g, group in enumerate(self.kv_cache_config.kv_cache_groups) if names & set(group.layer_names)]
        if len(groups) != 1:
            raise NotImplementedError(f"ubtree's in-cache KV commit supports tree attention layers in one KV cache "
                                      f"group, found them in {len(groups)}")
        return groups[0]

    # ---- 5. features and drafting ----------------------------------------------------------
    def _input_fits_in_drafter(self, common_attn_metadata: Any) -> bool:
        # Tree positions stay within root_pos + gamma and the drafter has no KV cache of its
        # own, so drafting is always possible; vLLM's check would zero the drafts instead.
        return common_attn_metadata is not None

    def propose_draft_token_ids(self, scheduler_output: Any, sampled_token_ids: Any, sampling_metadata: Any,
                                hidden_states: torch.Tensor, sample_hidden_states: torch.Tensor,
                                aux_hidden_states: list[torch.Tensor] | None, spec_decode_metadata: Any,
                                common_attn_metadata: Any, slot_mappings: Any) -> list[list[int]]:
        """Commit this step's features, then draft a tree for every request that sampled a token."""
        assert isinstance(sampled_token_ids, list) and aux_hidden_states is not None
        plan = self._plan
        assert plan is not None
        clock = self.ubtree_stage_clock
        with clock.stage("feature_commit"):
            features = torch.cat([aux_hidden_states[i] for i in self._aux_order], dim=-1)  # [T, F]
            self._commit_features(scheduler_output, plan, features)
        # SYNC: host loops over requests below (no device read): vLLM hands the sampled tokens as
        # per-request host lists and takes the drafts back the same way (V1 custom_class contract),
        # and the trees are kept by request id for the next step's plan.
        req_ids = list(self.input_batch.req_ids)
        drafts: list[list[int]] = [[] for _ in req_ids]
        drafting = [i for i, tokens in enumerate(sampled_token_ids) if tokens]
        for i in set(range(len(req_ids))) - set(drafting):
            self._trees.pop(req_ids[i], None)
        if not drafting:
            return drafts
        if is_driver(self._tp_group):
            anchor_pos = [int(self.input_batch.num_tokens_no_spec[i]) - 1 for i in drafting]
            with clock.stage("draft_context"):
                ctx = self._draft_context([req_ids[i] for i in drafting], drafting,
                                          [sampled_token_ids[i][-1] for i in drafting], anchor_pos)
            with clock.stage("draft"):
                tree = self.drafter.propose(ctx)  # type: ignore[attr-defined]
                packed = torch.stack([tree.tokens, tree.parents, tree.depth]).long()  # [3, N, B + 1]
        else:  # another TP rank: the driver's trees (vllm/tensor_parallel.py)
            packed = torch.empty((3, len(drafting), self.ubtree_config.tree.tree_budget + 1), dtype=torch.long,
                                 device=self.device)
        packed = from_driver(packed, self._tp_group)
        with clock.stage("drafts_to_host"):
            # SYNC: vLLM's scheduler takes draft tokens as host lists (custom_class contract);
            # one device-to-host copy for tokens, parents and depth.
            host = packed.cpu().numpy()  # [3, N, B + 1]
        if self._tp_group is not None:  # host hashing only where there are ranks to compare
            self.ubtree_tp_digest.update(host, sampled_token_ids)
        # load-adaptive budget: vLLM's scheduler picked this step's B' (num_speculative_tokens_per_batch_size);
        # the first B' nodes of each tree are a subtree (parents first)
        tokens = host[0, :, 1:1 + self._step_budget(scheduler_output)].tolist()
        parents, depth = host[1], host[2]
        for k, i in enumerate(drafting):
            drafts[i] = tokens[k]
            self._trees[req_ids[i]] = RequestTree(draft_tokens=tokens[k], parents=parents[k], depth=depth[k])
        return drafts

    def take_draft_token_ids(self) -> Any:
        """vLLM's draft tokens plus each tree's parents, for the scheduler's grammar (vllm/structured_output.py)."""
        drafts = super().take_draft_token_ids()  # type: ignore[misc]
        if drafts is None:
            return None
        trees = self._trees
        parents = [trees[r].parents[1:1 + len(tokens)].tolist() if r in trees and tokens else []
                   for r, tokens in zip(drafts.req_ids, drafts.draft_token_ids)]
        return TreeDraftTokenIds(drafts.req_ids, drafts.draft_token_ids, parents)

    def _step_budget(self, scheduler_output: Any) -> int:
        """This step's tree budget: vLLM's dynamic choice where a schedule is set, else B."""
        budget = self.ubtree_config.tree.tree_budget
        chosen = getattr(scheduler_output, "num_spec_tokens_to_schedule", 0) or budget
        return min(budget, int(chosen))

    def _commit_features(self, scheduler_output: Any, plan: TreeStepPlan, features: torch.Tensor) -> None:
        """Write every request's committed rows (prefix rows, root, accepted path) at their positions.

        One batched write (:meth:`ContextFeatureStore.write_rows`): the prefix rows come from
        the host layout, the accepted-path rows from the sampler's device result. features [T, F].
        """
        num_reqs = plan.num_reqs
        if num_reqs == 0:
            return
        store, device, accept = self._features, features.device, self._accept
        start_rows = self.query_start_loc.np[:num_reqs].astype(np.int64)
        counts = plan.root_rows - start_rows + 1  # [Q] rows up to and including the root
        starts = plan.root_positions - (plan.root_rows - start_rows)  # [Q] position of each first row
        req_index = np.repeat(np.arange(num_reqs), counts)
        offset = ragged_arange(counts)
        req_slots = np.array(store.slots_of(list(self.input_batch.req_ids)[:num_reqs]), dtype=np.int64)
        depth = 0 if accept is None else accept.accepted_path.shape[1] - 1
        store.reserve(int(plan.root_positions.max()) + 1 + depth)
        # One host-to-device copy: prefix rows [3, R] (slot, position, row), then per request [4, Q].
        num_rows = len(req_index)
        host = np.concatenate([req_slots[req_index], starts[req_index] + offset, start_rows[req_index] + offset,
                               req_slots, starts, plan.root_positions, plan.root_rows])
        packed = torch.from_numpy(host).to(device)
        prefix = packed[:3 * num_rows].view(3, num_rows)
        per_req = packed[3 * num_rows:].view(4, num_reqs)
        store.write_rows(prefix[0], prefix[1], features[prefix[2]])
        ends = per_req[2] + 1
        if accept is not None:  # accepted nodes at depths 1..k -> positions root + 1 .. root + k
            path = accept.accepted_path[:, 1:]  # [Q, D]
            depths = torch.arange(1, depth + 1, device=device)
            store.write_rows(per_req[0][:, None].expand(-1, depth), per_req[2][:, None] + depths,
                             features[per_req[3][:, None] + path.clamp(min=0)],
                             keep=depths <= accept.num_accepted[:, None])
            ends = ends + accept.num_accepted
        store.set_valid_range(per_req[0], per_req[1], ends)

    def _draft_context(self, req_ids: list[str], batch_rows: list[int], anchors: list[int],
                       anchor_pos: list[int]) -> DraftContext:
        """DraftContext for the drafting requests: features of positions < anchor_pos."""
        store, device = self._features, self.device
        width = max([1, *anchor_pos])
        num_reqs = len(req_ids)
        # One host-to-device copy: [3, N] (slot, anchor, anchor position), then the [N, width] token ids.
        host = np.concatenate([np.array([store.slot_or_scratch(req_ids), anchors, anchor_pos], dtype=np.int64).ravel(),
                               self.input_batch.token_ids_cpu[batch_rows, :width].astype(np.int64).ravel()])
        packed = torch.from_numpy(host).to(device)
        slots, anchor, anchor_pos_t = packed[:3 * num_reqs].view(3, num_reqs)
        features, valid = store.gather_slots(slots, anchor_pos_t, width)
        positions = torch.arange(width, device=device)[None, :].expand(num_reqs, -1)
        return DraftContext(anchor=anchor, anchor_pos=anchor_pos_t, features=features, positions=positions,
                            valid=valid, tokens=packed[3 * num_reqs:].view(num_reqs, width))

    # ---- request lifecycle -----------------------------------------------------------------
    def _on_request_state_removed(self, req_id: str, req_state: Any) -> None:
        super()._on_request_state_removed(req_id, req_state)  # type: ignore[misc]
        self._trees.pop(req_id, None)
        self._features.drop(req_id)


class UBTreeCPUModelRunner(UBTreeRunnerMixin, CPUModelRunner):
    """vLLM's CPU V1 runner with UBTree rounds."""

    @property
    def served_tree_attention(self) -> None:
        """None: tree rows attend through the CPU backend (attention/cpu.py), which has no tree_attention mode."""
        return None


class UBTreeGPUModelRunner(UBTreeRunnerMixin, GPUModelRunner):
    """vLLM's V1 GPU runner with UBTree rounds (the MRV2 fast path is a later step)."""
