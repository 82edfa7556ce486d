"""Random inputs of :func:`tree_attention`, laid out as vLLM's FlashAttention backend holds them.

Shared by the kernel tests (``tests/triton/test_tree_attention.py``) and the
tree-attention microbenchmark (``ubtree bench microbench --which tree-attention-vs-flash``),
so both launch the kernel on the same layout:

* the forward's rows are ``prefill_rows`` rows that belong to no request, then per request
  its root and tree nodes in flattened (parents-first) order, as vLLM flattens a batch;
* the paged cache is one FlashAttention ``kv_cache`` ``[num_blocks, H_kv, block_size, 2D]``
  viewed as ``kv_cache.transpose(1, 2).split(D, -1)`` (non-contiguous key / value views);
* each request owns ``cdiv(context + nodes, block_size)`` shuffled blocks, i.e. room for its
  context and for the K/V of all its tree nodes, as vLLM allocates slots before a forward.

Pure torch (no Triton): tensors are drawn on the CPU from one seeded generator, then moved.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class TreeAttentionInputs:
    """Inputs of one launch; ``args()`` gives them in launcher order (without ``out``)."""

    # [T, H, D] / [T, H_kv, D] / [T, H_kv, D]
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    # [num_blocks, block_size, H_kv, D] non-contiguous views of one FlashAttention kv_cache
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    # [num_reqs, max_blocks] int32, shuffled block ids
    block_table: torch.Tensor
    # [M] index dtype each; [M, P] index dtype, root-first, -1 padded
    row_index: torch.Tensor
    row_req: torch.Tensor
    row_context_len: torch.Tensor
    row_path: torch.Tensor
    scale: float
    # [num_reqs + 1] int32 first row of each request (the rows before request 0 are prefill rows)
    query_start_loc: torch.Tensor
    # [num_reqs] int32 context + tree nodes per request (FlashAttention's seqused_k)
    seq_lens: torch.Tensor

    def args(self) -> tuple:
        return (self.query, self.key, self.value, self.key_cache, self.value_cache, self.block_table,
                self.row_index, self.row_req, self.row_context_len, self.row_path, self.scale)


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Root-first node indices of the root -> ``node`` path (ancestors-or-self)."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def random_parents(num_nodes: int, max_depth: int, window: int, generator: torch.Generator) -> list[int]:
    """Parents of a random tree of ``num_nodes`` non-root nodes (plus the root, node 0).

    Node j's parent is drawn uniformly from the ``window`` most recent earlier nodes of depth
    < ``max_depth``, mimicking a depth-wise beam of width ``window`` (each node extends one
    of the latest frontier's nodes). Invariants: ``parents[0] == -1``, ``parents[j] < j``,
    every depth <= ``max_depth``. Returns a list of length ``num_nodes + 1``.
    """
    if num_nodes < 0 or max_depth < 1 or window < 1:
        raise ValueError(f"need num_nodes >= 0, max_depth >= 1, window >= 1; got {num_nodes}, {max_depth}, {window}")
    parents, depth = [-1], [0]
    open_nodes = [0]  # earlier nodes that may still take a child (depth < max_depth)
    for node in range(1, num_nodes + 1):
        recent = open_nodes[-window:]
        parent = recent[int(torch.randint(len(recent), (1,), generator=generator))]
        parents.append(parent)
        depth.append(depth[parent] + 1)
        if depth[node] < max_depth:
            open_nodes.append(node)
    return parents


def make_inputs(requests: Sequence[tuple[int, Sequence[int]]], *, device: torch.device | str,
                num_heads: int = 8, num_kv_heads: int = 2, head_size: int = 64, block_size: int = 16,
                dtype: torch.dtype = torch.float32, extra_path_pad: int = 1, index_dtype: torch.dtype = torch.int64,
                prefill_rows: int = 3, seed: int = 0) -> TreeAttentionInputs:
    """Inputs for ``requests`` = [(committed context length, parents of its nodes, root first)].

    Every non-root node of every request is a tree row; ``row_path`` is as wide as the
    deepest path plus ``extra_path_pad`` columns of -1. Values are standard normal.
    """
    gen = torch.Generator().manual_seed(seed)
    num_tokens = prefill_rows + sum(len(parents) for _, parents in requests)
    max_blocks = max(-(-(ctx + len(parents)) // block_size) for ctx, parents in requests)
    num_blocks = len(requests) * max_blocks + 3

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    query = randn(num_tokens, num_heads, head_size)
    key, value = randn(num_tokens, num_kv_heads, head_size), randn(num_tokens, num_kv_heads, head_size)
    kv_cache = randn(num_blocks, num_kv_heads, block_size, 2 * head_size)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)  # FlashAttentionImpl's view
    perm = torch.randperm(num_blocks, generator=gen)[:len(requests) * max_blocks]
    block_table = perm.view(len(requests), max_blocks).to(device, torch.int32)

    max_depth = max(len(path_to(p, n)) for _, p in requests for n in range(len(p)))
    rows, reqs, ctx_lens, paths = [], [], [], []
    starts, seq_lens = [prefill_rows], []
    root = prefill_rows
    for req, (ctx, parents) in enumerate(requests):
        for node in range(1, len(parents)):
            path = [root + n for n in path_to(parents, node)]
            rows.append(root + node)
            reqs.append(req)
            ctx_lens.append(ctx)
            paths.append(path + [-1] * (max_depth + extra_path_pad - len(path)))
        root += len(parents)
        starts.append(root)
        seq_lens.append(ctx + len(parents))

    def index(x, dtype=index_dtype):
        return torch.tensor(x, dtype=dtype, device=device)

    return TreeAttentionInputs(query, key, value, key_cache, value_cache, block_table, index(rows), index(reqs),
                               index(ctx_lens), index(paths).view(len(rows), max_depth + extra_path_pad),
                               scale=head_size ** -0.5, query_start_loc=index(starts, torch.int32),
                               seq_lens=index(seq_lens, torch.int32))
