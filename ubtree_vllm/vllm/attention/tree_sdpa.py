"""Reference tree attention in PyTorch for backends with a plain per-token paged layout.

Used by the CUDA backend (:mod:`ubtree_vllm.vllm.attention.flash`) until the Triton op of
the GPU fast path exists: for one request, gather its context K/V from the paged cache,
take the fresh K/V of its tree nodes, and run scaled-dot-product attention with
"context: all visible; nodes: ancestor-or-self" (the exact set a non-speculative decode
at the node's position attends to).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_paged_tokens(cache: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Tokens 0 .. num_tokens - 1 of one request from a per-token paged cache.

    cache: [num_blocks, block_size, num_kv_heads, head_size] (e.g. FlashAttention's key or
    value cache view); block_ids: [max_blocks] the request's block-table row.
    Returns [num_tokens, num_kv_heads, head_size].
    """
    block_size = cache.shape[1]
    pos = torch.arange(num_tokens, device=cache.device)
    blocks = block_ids.long()[torch.div(pos, block_size, rounding_mode="floor")]
    return cache[blocks, pos % block_size]


def tree_rows_attention(query: torch.Tensor, ctx_key: torch.Tensor, ctx_value: torch.Tensor,
                        node_key: torch.Tensor, node_value: torch.Tensor, node_mask: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Attention of tree rows over the context plus their ancestors-or-self.

    query:     [m, num_heads, head_size] the rows to compute (some nodes of one tree)
    ctx_key/ctx_value:   [c, num_kv_heads, head_size] committed context (all visible)
    node_key/node_value: [n, num_kv_heads, head_size] the tree's nodes (root first)
    node_mask: [m, n] bool, True where the row may see the node (ancestor-or-self)
    Returns [m, num_heads, head_size] in query's dtype.
    """
    num_heads, num_kv_heads = query.shape[1], ctx_key.shape[1]
    group = num_heads // num_kv_heads
    key = torch.cat([ctx_key, node_key], 0).repeat_interleave(group, dim=1)  # [c + n, H, D]
    value = torch.cat([ctx_value, node_value], 0).repeat_interleave(group, dim=1)
    ctx_mask = node_mask.new_ones((node_mask.shape[0], ctx_key.shape[0]))
    mask = torch.cat([ctx_mask, node_mask], 1)  # [m, c + n]
    out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
                                         attn_mask=mask[None], scale=scale)
    return out.transpose(0, 1)
