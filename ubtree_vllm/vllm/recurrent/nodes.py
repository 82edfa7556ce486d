"""What the tree forms of vLLM's recurrent layers share: node bookkeeping, per-node conv windows, the roll.

A linear-attention layer (Gated DeltaNet: ``gdn_cpu``; Mamba2: ``mamba2``) gets the step's tokens of its
speculative sequences in order; sequence i is the tree of plan request ``req[i]`` (node 0 the root, parents
first). Both layers keep vLLM's chain convention for the rolling conv-input buffer ``[dim, width - 1 + S]`` in
the sequence's first state slot:

* the window a step resumes from is the ``width - 1`` columns at offset ``num_accepted - 1``;
* after the step the buffer holds that window's newest ``width - 2`` inputs, then node j's input in column
  ``width - 2 + j`` (:func:`roll_conv_buffers`), so the commit of the accepted path
  (:func:`ubtree_vllm.vllm.recurrent.commit.commit_accepted_states`) moves columns like state slots.

The bookkeeping is host numpy from the step plan, turned once per step into index tensors on the caches' device
(:class:`TreeIndex`, shared by the step's layers through ``TreeForwardState.step_cache``); the tensor work runs on
that device (CPU, or CUDA for ``gdn_cuda``) and never reads a device tensor back on the host.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from ubtree_vllm.vllm.attention.state import tree_forward_state
from ubtree_vllm.vllm.tree_plan import TreeStepPlan


@dataclass(frozen=True)
class TreeTokens:
    """Host bookkeeping of a step's speculative tokens, all [T] int64 unless noted."""

    seq: np.ndarray  # sequence of each token
    node: np.ndarray  # node index within its tree
    parent: np.ndarray  # parent node, -1 at the root
    depth: np.ndarray
    start: np.ndarray  # [Q] first token of each sequence
    seq_lens: np.ndarray  # [Q] tokens (tree nodes) of each sequence


def tree_tokens(plan: TreeStepPlan, req: np.ndarray, seq_lens: np.ndarray, layer_name: str) -> TreeTokens:
    """Bookkeeping for sequences that are the trees of plan requests ``req`` [Q] with ``seq_lens`` [Q] tokens;
    RuntimeError when the layer's sequences are not the step's trees (never computes on a wrong layout)."""
    if not np.array_equal(plan.num_nodes[req], seq_lens):
        raise RuntimeError(f"ubtree: the {layer_name} speculative sequences ({seq_lens.tolist()} tokens) are not "
                           f"the step's trees ({plan.num_nodes[req].tolist()} nodes)")
    seq = np.repeat(np.arange(len(seq_lens)), seq_lens)
    start = np.cumsum(seq_lens) - seq_lens
    node = np.arange(len(seq)) - start[seq]
    return TreeTokens(seq=seq, node=node, parent=plan.parents[req[seq], node], depth=plan.depth[req[seq], node],
                      start=start, seq_lens=seq_lens)


@dataclass(frozen=True)
class TreeIndex:
    """A step's tree bookkeeping for linear layers of conv width ``width``, as index tensors on the caches' device."""

    tokens: TreeTokens
    width: int
    seq: torch.Tensor  # [T] int64 sequence of each token
    node: torch.Tensor  # [T] int64 node index within its tree
    # [1 + T, width - 1] int64 rows of node_windows' source (the Q committed windows' columns, then the step's
    # inputs) making each token's window in row 1 + t; row 0 repeats row 1 (vLLM's null block, never read)
    window_rows: torch.Tensor
    # per depth, shallowest first: (rows, seq, node, parent) [n] int64 of that depth's tokens
    depths: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...]

    @functools.cached_property
    def paths(self) -> "TreePaths":
        """Every root -> leaf path of every tree below its root, as sequences (:func:`chain_paths`); built on first
        use (only the KDA form's chain launch reads it), once per step: the index is shared by the step's layers."""
        return chain_paths(self.tokens, self.seq.device)


@dataclass(frozen=True)
class TreePaths:
    """The step's trees as chains: one sequence per leaf, its nodes from depth 1 down to the leaf (a tree of the root
    alone has none). Shared ancestors appear in every path through them."""

    rows: torch.Tensor  # [P_tokens] int64 token row of each path token, path after path
    cu_seqlens: torch.Tensor  # [P + 1] int32 path offsets into rows
    seq: torch.Tensor  # [P] int64 sequence of each path
    # [P, max_len + 1] int64 node of each path token (columns 0 .. len - 1), then 0 (the root) in the last column;
    # -1 elsewhere
    nodes: torch.Tensor
    # [n] int64 the tokens below the roots, and for each a position in rows computing it (its first occurrence)
    below: torch.Tensor
    below_at: torch.Tensor


def tree_index(plan: TreeStepPlan, req: np.ndarray, seq_lens: np.ndarray, layer_name: str, width: int,
               device: torch.device) -> TreeIndex:
    """The :class:`TreeIndex` of sequences that are the trees of plan requests ``req`` [Q] with ``seq_lens`` [Q]
    tokens (checked: :func:`tree_tokens`). Built by the step's first such layer and kept in
    ``TreeForwardState.step_cache`` (cleared before every target forward) for the others."""
    cache = tree_forward_state().step_cache
    key = ("recurrent.nodes", req.tobytes(), seq_lens.tobytes(), width, str(device))
    cached = cache.get(key)
    if cached is not None and cached[0] is plan:
        return cached[1]
    tokens = tree_tokens(plan, req, seq_lens, layer_name)
    seq, parent, depth, start = tokens.seq, tokens.parent, tokens.depth, tokens.start
    num_seqs, hist = len(seq_lens), width - 1
    rows = np.empty((len(seq), hist), dtype=np.int64)  # [T, width - 1]
    parent_token = np.where(parent >= 0, start[seq] + parent, -1)  # [T]
    ancestor = parent_token  # [T] token at distance m before each token, -1 past the root
    for m in range(1, width):  # distance m: the ancestor at m if m <= depth, else committed column hist - (m - depth)
        rows[:, hist - m] = np.where(m <= depth, num_seqs * hist + ancestor, seq * hist + hist - (m - depth))
        ancestor = np.where(ancestor >= 0, parent_token[np.maximum(ancestor, 0)], -1)

    on_device = functools.partial(_on_device, device=device)
    depths = []
    for d in range(int(depth.max()) + 1):
        at = np.nonzero(depth == d)[0]  # [n]
        depths.append((on_device(at), on_device(seq[at]), on_device(tokens.node[at]), on_device(parent[at])))
    index = TreeIndex(tokens=tokens, width=width, seq=on_device(seq), node=on_device(tokens.node),
                      window_rows=on_device(np.concatenate([rows[:1], rows])), depths=tuple(depths))
    cache[key] = (plan, index)
    return index


def _on_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host bookkeeping as an int64 index tensor on ``device``."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)


def chain_paths(tokens: TreeTokens, device: torch.device) -> TreePaths:
    """The :class:`TreePaths` of ``tokens`` (host numpy), as index tensors on ``device``."""
    has_child = np.zeros(len(tokens.seq), dtype=bool)
    below_root = tokens.parent >= 0
    has_child[(tokens.start[tokens.seq] + tokens.parent)[below_root]] = True
    path_rows, path_seq, path_nodes, lens = [], [], [], []
    for leaf in np.nonzero(below_root & ~has_child)[0]:
        chain, row = [], leaf
        while tokens.parent[row] >= 0:  # up to, not including, the root
            chain.append(row)
            row = tokens.start[tokens.seq[row]] + tokens.parent[row]
        chain.reverse()
        path_rows.extend(chain)
        path_seq.append(tokens.seq[leaf])
        path_nodes.append(tokens.node[chain])
        lens.append(len(chain))
    width = max(lens, default=0) + 1
    nodes = np.full((len(lens), width), -1, dtype=np.int64)
    for i, chain_nodes in enumerate(path_nodes):
        nodes[i, :len(chain_nodes)] = chain_nodes
    nodes[:, -1] = 0
    rows = np.asarray(path_rows, dtype=np.int64)
    below, below_at = np.unique(rows, return_index=True)  # every token below a root lies on a path
    cu_seqlens = np.concatenate([[0], np.cumsum(lens)])
    on_device = functools.partial(_on_device, device=device)
    return TreePaths(rows=on_device(rows), cu_seqlens=on_device(cu_seqlens).to(torch.int32),
                     seq=on_device(np.asarray(path_seq, dtype=np.int64)), nodes=on_device(nodes),
                     below=on_device(below), below_at=on_device(below_at))


def node_windows(x: torch.Tensor, conv_buf: torch.Tensor, slots: torch.Tensor, num_accepted: torch.Tensor,
                 index: TreeIndex, dim_first: bool) -> torch.Tensor:
    """[1 + T, dim, width - 1] each token's conv window, in row 1 + t (the conv kernels skip row 0, vLLM's
    null block), in the layout of vLLM's conv cache (``dim_first``: dim-contiguous rows, else width-contiguous).

    Window of token t (oldest first): for distance m = width - 1 .. 1 before t, its ancestor at distance m if
    m <= depth[t], else column ``width - 1 - (m - depth[t])`` of its sequence's committed window. x [T, dim];
    conv_buf [num_slots, dim, state_len] (read before :func:`roll_conv_buffers`); slots [Q, 1 + S];
    num_accepted [Q]."""
    num_seqs, hist = slots.shape[0], index.width - 1
    # [Q * (width - 1) + T, dim]: the committed windows, then the step's inputs
    offsets = (num_accepted - 1)[:, None] + torch.arange(hist, device=conv_buf.device)  # [Q, width - 1]
    committed = conv_buf[slots[:, 0, None], :, offsets]  # [Q, width - 1, dim]
    source = torch.cat([committed.reshape(num_seqs * hist, -1), x.to(conv_buf.dtype)])
    windows = source[index.window_rows].transpose(1, 2)
    return windows.contiguous() if dim_first else windows


def roll_conv_buffers(x: torch.Tensor, conv_buf: torch.Tensor, slots: torch.Tensor, num_accepted: torch.Tensor,
                      index: TreeIndex) -> None:
    """Each sequence's buffer: its resumed window's newest width - 2 inputs, then node j's input in column
    ``width - 2 + j``. x [T, dim]; conv_buf [num_slots, dim, state_len] (mutated)."""
    buf_slot = slots[:, 0, None]  # [Q, 1]
    kept_cols = torch.arange(index.width - 2, device=conv_buf.device)  # [width - 2]
    kept = conv_buf[buf_slot, :, num_accepted[:, None] + kept_cols]  # [Q, width - 2, dim], gathered before writing
    conv_buf[buf_slot, :, kept_cols] = kept
    conv_buf[slots[index.seq, 0], :, index.width - 2 + index.node] = x.to(conv_buf.dtype)


def fork_states_by_depth(state: torch.Tensor, slots: torch.Tensor, num_accepted: torch.Tensor,
                         index: TreeIndex) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Depth by depth, shallowest first: copy each node's parent's state into the node's own slot, then yield
    (rows [n] the tokens at that depth, dst [n] their slots) for the caller to advance those states one token
    in place before the next depth is forked. Node j's state goes to slot j; its parent's is in the parent's
    slot, the root's in slot ``num_accepted - 1`` (the state the sequence resumes from). state [num_slots, ...]
    (mutated); slots [Q, 1 + S]; num_accepted [Q]."""
    for rows, seq, node, parent in index.depths:
        dst = slots[seq, node]
        src = torch.where(parent < 0, slots[seq, num_accepted[seq] - 1], slots[seq, parent.clamp(min=0)])
        state.index_copy_(0, dst, state.index_select(0, src))
        yield rows, dst
