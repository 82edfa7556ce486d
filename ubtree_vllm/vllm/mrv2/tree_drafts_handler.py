"""The drafts MRV2 hands to the scheduler, with each tree's parents (structured output on Model Runner V2).

MRV2 keeps drafts on the device; only when a batch has structured-output requests does its
``DraftTokensHandler`` copy them to the host (asynchronously, on a side stream), so the scheduler's
grammar can validate them and build the next step's bitmask rows. For a tree that grammar must
follow each node's own path (``ubtree_vllm/vllm/structured_output.py``, shared with the V1
runner), so :class:`TreeDraftTokensHandler` copies each tree's parents in the same hand-over and
returns :class:`~ubtree_vllm.vllm.structured_output.TreeDraftTokenIds`. The scheduler patch
``scheduler_tree_drafts`` stores the parents on the request before vLLM validates the drafts,
on both paths that receive them (``update_draft_token_ids``, and ``update_draft_token_ids_in_output``
under async scheduling).

Contract: ``set_draft_tokens`` is called after the speculator wrote the step's trees
(``draft_tokens[slot, :B]`` and ``topology.parents[slot, :B + 1]``, node j's parent at column j);
the parents are gathered on the main stream before the copy is queued (the next step's draft
overwrites the topology), like vLLM's gather of the draft tokens. Batches without
structured-output requests copy nothing, as in vLLM.
"""
from __future__ import annotations

import numpy as np
import torch
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.worker.gpu.async_utils import async_copy_to_np
from vllm.v1.worker.gpu.spec_decode.utils import DraftTokensHandler

from ubtree_vllm.vllm.structured_output import TreeDraftTokenIds


def with_tree_parents(drafts: DraftTokenIds, parents: np.ndarray | None) -> DraftTokenIds:
    """``drafts`` plus the parents of their nodes (``parents [R, n]``: node j + 1's parent, 0 = the root).

    None (no structured-output request in the batch, so no copy was made): the drafts as vLLM returns them."""
    if parents is None:
        return drafts
    if parents.shape[0] != len(drafts.req_ids):
        raise RuntimeError(f"ubtree: {parents.shape[0]} tree topologies for {len(drafts.req_ids)} drafting requests")
    return TreeDraftTokenIds(drafts.req_ids, drafts.draft_token_ids, parents.tolist())


class TreeDraftTokensHandler(DraftTokensHandler):
    """vLLM's handler plus the trees' parents (module docstring)."""

    def __init__(self, device: torch.device | None,
                 # [max_num_reqs + 1, B + 1] int32: the speculator's topology.parents, by request state slot
                 parents: torch.Tensor) -> None:
        super().__init__(device)
        self.parents = parents
        self.parents_np: np.ndarray | None = None  # [R, n] int32, host copy of the latest structured-output step

    def set_draft_tokens(self, input_batch, draft_tokens: torch.Tensor) -> None:
        super().set_draft_tokens(input_batch, draft_tokens)  # draft_tokens [R, n]
        self.parents_np = None
        if self.draft_tokens_np is None:  # no grammar in this batch: the scheduler needs neither
            return
        num_nodes = draft_tokens.shape[1]
        parents = self.parents[input_batch.idx_mapping, 1:1 + num_nodes]  # [R, n], gathered on the main stream
        self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.copy_stream):
            self.parents_np = async_copy_to_np(parents)
            parents.record_stream(self.copy_stream)  # read on the copy stream: keep the allocator off it
            self.copy_event.record()  # after both copies (same stream): get_draft_tokens waits for this one

    def get_draft_tokens(self) -> DraftTokenIds | None:
        drafts = super().get_draft_tokens()  # SYNC: vLLM's wait for the copy, only for structured-output batches
        return drafts if drafts is None else with_tree_parents(drafts, self.parents_np)
