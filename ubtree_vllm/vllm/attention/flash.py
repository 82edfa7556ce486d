"""FLASH_ATTN with tree rows (CUDA): stock FlashAttention, then one Triton launch for tree rows.

FlashAttention computes every row causally; the rows of non-root tree nodes are then
overwritten by :func:`ubtree_vllm.triton_ops.tree_attention`, one launch per layer. Each
tree row attends to its request's committed context, read from FlashAttention's per-token
paged cache (``kv_cache.transpose(1, 2).split(head_size, -1)`` gives ``[num_blocks,
block_size, num_kv_heads, head_size]`` key and value views), plus its ancestors-or-self
among the fresh K/V of this forward.

CUDA graphs. The launch reads the step's tree rows from fixed-size buffers
(:class:`~ubtree_vllm.vllm.attention.state.RowBuffers` owned by the UBTree runner and bound
to each layer's impl, one entry per token of the forward, filled before every forward;
unused entries are skipped), not from
per-step tensors, and no device value is read on the host. So a FULL CUDA graph captured
with this launch stays valid at every replay, and the metadata builder keeps
FlashAttention's own CUDA-graph support: vLLM captures FULL graphs for uniform decode
batches (every request verifies 1 + B tokens) and PIECEWISE graphs around attention for
the others. During capture the launch is always recorded; in eager calls it is skipped
when the step has no tree rows.

The KV commit of accepted paths copies inside this cache
(:func:`ubtree_vllm.vllm.kv_commit.commit_accepted_paths_in_cache`), so nothing is stashed.

Sliding windows, soft caps, ALiBi, sinks and KV-sharing layers are refused at construction
(not implemented for tree rows); fp8 KV caches are refused by the UBTree engine config.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadata)

from ubtree_vllm.triton_ops import tree_attention
from ubtree_vllm.vllm.attention.state import RowBuffers, tree_forward_state


class TreeFlashAttentionBackend(FlashAttentionBackend):
    """FLASH_ATTN whose impl applies the ancestor mask to tree rows (name kept: FLASH_ATTN)."""

    @staticmethod
    def get_impl_cls() -> type["TreeFlashAttentionImpl"]:
        return TreeFlashAttentionImpl


class TreeFlashAttentionImpl(FlashAttentionImpl):
    """Stock FlashAttention, then tree rows recomputed by the Triton tree-attention kernel."""

    # Checked by the UBTree runner after model load.
    ubtree_tree_aware = True
    # The runner commits accepted paths inside the KV cache (no per-layer stash).
    ubtree_commit_in_cache = True
    # The UBTree runner's fixed-size row buffers, bound after model load. Engines without
    # UBTree in the same process (the backend override is process-wide) leave it None and
    # run stock FlashAttention, also under CUDA-graph capture.
    ubtree_row_buffers: RowBuffers | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        unsupported = [name for name, used in (
            ("sliding_window", self.sliding_window != (-1, -1)),
            ("logits_soft_cap", bool(self.logits_soft_cap)),
            ("alibi_slopes", self.alibi_slopes is not None),
            ("sinks", self.sinks is not None),
            ("kv_sharing_target_layer_name", self.kv_sharing_target_layer_name is not None)) if used]
        if unsupported and self.attn_type == AttentionType.DECODER:
            raise NotImplementedError(f"ubtree tree attention on CUDA does not support {unsupported} yet")

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FlashAttentionMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, H, D]; key/value [T, H_kv, D]; kv_cache [num_blocks, H_kv, block, 2D] (logical)."""
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        if attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return output
        buffers = self.ubtree_row_buffers  # None: a layer of an engine without UBTree
        if buffers is None or not (tree_forward_state().has_tree_rows or torch.cuda.is_current_stream_capturing()):
            return output
        self._attend_tree_rows(query, key, value, kv_cache, attn_metadata.block_table, output, buffers)
        return output

    def _attend_tree_rows(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          block_table: torch.Tensor, output: torch.Tensor, buffers: RowBuffers) -> None:
        """Overwrite the output rows of the buffers' tree rows; one launch over T entries.

        query [T, H, D]; key/value [T, H_kv, D]; kv_cache [num_blocks, H_kv, block_size, 2D]
        (logical); block_table [num_reqs, max_blocks] int32; output [T, H, D] (mutable).
        """
        num_tokens = query.shape[0]
        # (B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D)), as FlashAttentionImpl reads the cache.
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        tree_attention(query, key, value, key_cache, value_cache, block_table,
                       buffers.row_index[:num_tokens], buffers.row_req[:num_tokens],
                       buffers.row_context_len[:num_tokens], buffers.row_path[:num_tokens],
                       self.scale, output)  # output: mutable
