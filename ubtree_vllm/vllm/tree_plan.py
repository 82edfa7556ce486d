"""One verification step's draft trees, laid out over vLLM's flattened token batch.

vLLM schedules a request with drafts as ``1 + s`` query rows: the root (the last sampled
token) and the first ``s <= B`` draft slots. The drafter filled the B slots with the
tree's nodes 1..B in parents-first order, so the scheduled prefix (the scheduler may
truncate) is itself a valid tree: node j of the request lives in row ``root_row + j``
and, because slot mappings are computed from the *linear* positions, in KV slot
``slot(root_pos + j)``. What changes for a tree is:

* RoPE position of node j: ``root_pos + depth[j]`` (:attr:`TreeStepPlan.positions`);
* attention: node j sees the context (positions < root_pos) and its ancestors-or-self
  only (:attr:`TreeStepPlan.row_path` for the attention backends);
* acceptance: node-wise walk (:mod:`ubtree_vllm.vllm.sampler`);
* commit: the accepted node at depth d moves from row ``root_row + node`` to
  ``root_row + d`` (:mod:`ubtree_vllm.vllm.kv_commit`).

When the scheduled drafts are not the ones the runner proposed (e.g. vLLM zeroed them),
the request is verified as a chain (parent of node j is j - 1), which is always exact.

Everything here is host-side bookkeeping on numpy arrays that vLLM's own
``_prepare_inputs`` already holds (no device reads); :meth:`TreeStepPlan.to_device`
copies the few index arrays the device code needs once per step, in one transfer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

# Parent index of padding nodes: never equal to a real node index, so the acceptance
# walk can never move into padding.
PAD_PARENT = -2


@dataclass
class RequestTree:
    """A proposed tree, kept on the host until the step that verifies it."""

    # [B] draft tokens of nodes 1..B (what the scheduler receives)
    draft_tokens: list[int]
    # [B + 1] int64 parent of each node, -1 at the root, parents[j] < j
    parents: np.ndarray
    # [B + 1] int64 depth of each node, 0 at the root
    depth: np.ndarray


@dataclass
class DeviceTrees:
    """The plan's tensors used inside the forward and the sampler (on the runner's device)."""

    # [num_reqs, max_nodes] int64; PAD_PARENT beyond a request's nodes
    parents: torch.Tensor
    # [num_reqs, max_nodes] int64
    depth: torch.Tensor
    # [num_reqs, max_nodes] int64 token of each node (node 0 = root); -1 padding
    tokens: torch.Tensor
    # [num_rows] int64 global rows of the attention tree rows (see TreeStepPlan.row_index)
    row_index: torch.Tensor
    # [num_rows, max_depth + 1] int64 global rows of the root->row path, -1 padded
    row_path: torch.Tensor
    # [num_rows] int64 context length (= root position) of the row's request
    row_context_len: torch.Tensor
    # [num_rows] int64 request index (row of the attention metadata) of each tree row
    row_req: torch.Tensor
    # [num_rows] int64 depth of each tree row
    row_depth: torch.Tensor
    # [num_commit_nodes] int64 global rows whose fresh K/V the attention stashes for the commit
    stash_rows: torch.Tensor
    # [num_tree_nodes] int64 rows of vLLM's position buffer to overwrite, and their RoPE positions
    position_rows: torch.Tensor
    position_values: torch.Tensor


@dataclass
class TreeStepPlan:
    """Trees of one step, host side. Request order = vLLM's input batch order."""

    num_reqs: int
    # max nodes over requests (1 + max scheduled drafts)
    max_nodes: int
    # static bound on depth for the acceptance walk (max over the step's trees)
    max_depth: int
    # [num_reqs] int64 global row of each request's root
    root_rows: np.ndarray
    # [num_reqs] int64 RoPE position of the root (= tokens before it in the KV cache)
    root_positions: np.ndarray
    # [num_reqs] int64 nodes verified per request (1 + scheduled drafts)
    num_nodes: np.ndarray
    # [num_reqs, max_nodes] int64, PAD_PARENT padded
    parents: np.ndarray
    # [num_reqs, max_nodes] int64, 0 padded
    depth: np.ndarray
    # [num_reqs, max_nodes] int64 node tokens, -1 padded
    tokens: np.ndarray
    # [num_reqs] bool: the request's tree is not a chain (needs mask, positions, commit)
    is_tree: np.ndarray
    # Attention rows: every non-root node of a request with is_tree.
    # [num_rows] int64 global row, request index, depth; [num_rows, max_depth + 1] path rows
    row_index: np.ndarray
    row_req: np.ndarray
    row_depth: np.ndarray
    row_path: np.ndarray
    # [num_reqs] int64 start of each is_tree request's nodes in stash_rows (-1 if none)
    stash_offset: np.ndarray
    # [num_stash] int64 global rows of all nodes of is_tree requests
    stash_rows: np.ndarray
    device: DeviceTrees | None = field(default=None, repr=False)

    @property
    def has_tree_rows(self) -> bool:
        return len(self.row_index) > 0

    @property
    def row_context_len(self) -> np.ndarray:
        """[num_rows] int64 committed context length (= root position) of each tree row's request."""
        return self.root_positions[self.row_req]

    def positions(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, positions) to overwrite in vLLM's position buffer: root_pos + depth per node."""
        req = np.nonzero(self.is_tree)[0]
        if len(req) == 0:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty
        counts = self.num_nodes[req]
        req_rep = np.repeat(req, counts)
        node = ragged_arange(counts)
        rows = self.root_rows[req_rep] + node
        return rows, self.root_positions[req_rep] + self.depth[req_rep, node]

    def to_device(self, device: torch.device) -> DeviceTrees:
        """Copy the index arrays used by attention, sampler and commit to ``device`` (once)."""
        if self.device is None:
            # One host-to-device copy of all arrays, then views of it.
            position_rows, position_values = self.positions()
            arrays = {"parents": self.parents, "depth": self.depth, "tokens": self.tokens,
                      "row_index": self.row_index, "row_path": self.row_path,
                      "row_context_len": self.row_context_len, "row_req": self.row_req,
                      "row_depth": self.row_depth, "stash_rows": self.stash_rows,
                      "position_rows": position_rows, "position_values": position_values}
            packed = torch.from_numpy(np.concatenate([a.astype(np.int64).ravel() for a in arrays.values()]))
            packed = packed.to(device, non_blocking=True)
            views, start = {}, 0
            for name, a in arrays.items():
                views[name] = packed[start:start + a.size].view(a.shape)
                start += a.size
            self.device = DeviceTrees(**views)
        return self.device


def ragged_arange(counts: np.ndarray) -> np.ndarray:
    """[3, 1, 2] -> [0, 1, 2, 0, 0, 1]."""
    total = int(counts.sum())
    starts = np.repeat(np.cumsum(counts) - counts, counts)
    return np.arange(total, dtype=np.int64) - starts


def chain_topology(num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Parents and depth of a chain of ``num_nodes`` nodes (root included)."""
    idx = np.arange(num_nodes, dtype=np.int64)
    return idx - 1, idx


def build_plan(req_ids: Sequence[str], query_start_loc: np.ndarray, num_scheduled: np.ndarray,
               num_computed: np.ndarray, input_ids: np.ndarray,
               scheduled_drafts: Mapping[str, Sequence[int]],
               trees: Mapping[str, RequestTree]) -> TreeStepPlan:
    """Lay out the step's trees over the batch.

    query_start_loc [num_reqs + 1], num_scheduled [num_reqs], num_computed [num_reqs]:
    vLLM's per-request query layout of this step; input_ids [>= num_tokens]: the step's
    input ids on the host; scheduled_drafts: vLLM's ``scheduled_spec_decode_tokens``;
    trees: the trees the runner proposed last step, by request id.
    """
    num_reqs = len(req_ids)
    num_drafts = np.array([len(scheduled_drafts.get(r, ())) for r in req_ids], dtype=np.int64)
    num_nodes = num_drafts + 1
    max_nodes = int(num_nodes.max()) if num_reqs else 1
    root_rows = query_start_loc[:num_reqs].astype(np.int64) + num_scheduled[:num_reqs] - num_nodes
    root_positions = num_computed[:num_reqs].astype(np.int64) + num_scheduled[:num_reqs] - num_nodes

    parents = np.full((num_reqs, max_nodes), PAD_PARENT, dtype=np.int64)
    depth = np.zeros((num_reqs, max_nodes), dtype=np.int64)
    tokens = np.full((num_reqs, max_nodes), -1, dtype=np.int64)
    is_tree = np.zeros(num_reqs, dtype=bool)
    # SYNC: host loop over requests (no device read): vLLM gives the scheduled drafts as a dict of
    # per-request lists (V1 contract); each is matched against the tree proposed last step.
    for i, req_id in enumerate(req_ids):
        n = int(num_nodes[i])
        drafts = list(scheduled_drafts.get(req_id, ()))
        tokens[i, 0] = input_ids[root_rows[i]]
        tokens[i, 1:n] = drafts
        tree = trees.get(req_id)
        if n > 1 and tree is not None and list(tree.draft_tokens[: n - 1]) == drafts:
            parents[i, :n], depth[i, :n] = tree.parents[:n], tree.depth[:n]
            is_tree[i] = bool((tree.parents[1:n] != np.arange(n - 1)).any())
        else:
            parents[i, :n], depth[i, :n] = chain_topology(n)
    max_depth = max(1, int(depth.max()) if num_reqs else 1)

    # Attention rows: every non-root node of a real tree, with its root->node path.
    tree_req = np.nonzero(is_tree)[0]
    counts = num_nodes[tree_req] - 1
    row_req = np.repeat(tree_req, counts)
    row_node = ragged_arange(counts) + 1
    row_index = root_rows[row_req] + row_node
    row_depth = depth[row_req, row_node]
    row_path = np.full((len(row_req), max_depth + 1), -1, dtype=np.int64)
    cur = row_node.copy()
    for d in range(max_depth, -1, -1):
        on_path = row_depth >= d
        row_path[on_path, d] = root_rows[row_req[on_path]] + cur[on_path]
        cur = np.where(on_path, parents[row_req, cur].clip(min=0), cur)

    stash_counts = num_nodes[tree_req]
    stash_offset = np.full(num_reqs, -1, dtype=np.int64)
    stash_offset[tree_req] = np.cumsum(stash_counts) - stash_counts
    stash_rows = root_rows[np.repeat(tree_req, stash_counts)] + ragged_arange(stash_counts)
    return TreeStepPlan(
        num_reqs=num_reqs, max_nodes=max_nodes, max_depth=max_depth, root_rows=root_rows,
        root_positions=root_positions, num_nodes=num_nodes, parents=parents, depth=depth,
        tokens=tokens, is_tree=is_tree, row_index=row_index, row_req=row_req, row_depth=row_depth,
        row_path=row_path, stash_offset=stash_offset, stash_rows=stash_rows)
