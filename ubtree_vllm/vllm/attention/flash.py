"""FLASH_ATTN with tree rows (CUDA): stock FlashAttention, then one Triton launch for tree rows.

FlashAttention computes every row causally; the rows of non-root tree nodes are then
overwritten by :func:`ubtree_vllm.triton_ops.tree_attention`, one launch per layer over
the step's :class:`~ubtree_vllm.vllm.tree_plan.DeviceTrees` (``row_index``, ``row_req``,
``row_context_len``, ``row_path``) and the metadata's block table. Each tree row attends
to its request's committed context, read from FlashAttention's per-token paged cache
(``kv_cache.transpose(1, 2).split(head_size, -1)`` gives ``[num_blocks, block_size,
num_kv_heads, head_size]`` key and value views), plus its ancestors-or-self among the
fresh K/V of this forward. The launch reads no device value.

The builder still reports ``AttentionCGSupport.NEVER``: the plan's tensors (number of
tree rows, path width) change shape every step and are published outside the attention
metadata, so a captured graph would replay stale addresses and shapes. vLLM then
captures PIECEWISE CUDA graphs around attention (attention is a splitting op) instead
of FULL graphs.

Sliding windows, soft caps, ALiBi and sinks are refused at construction (not implemented
for tree rows); fp8 KV caches are refused by the UBTree engine config.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadata,
                                                   FlashAttentionMetadataBuilder)

from ubtree_vllm.triton_ops import tree_attention
from ubtree_vllm.vllm.attention.state import begin_tree_rows
from ubtree_vllm.vllm.tree_plan import DeviceTrees


class TreeFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    """FlashAttention metadata; never captured in FULL graphs (the tree plan changes shape per step)."""

    _cudagraph_support = AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config: Any, kv_cache_spec: Any) -> AttentionCGSupport:
        return AttentionCGSupport.NEVER


class TreeFlashAttentionBackend(FlashAttentionBackend):
    """FLASH_ATTN whose impl applies the ancestor mask to tree rows (name kept: FLASH_ATTN)."""

    @staticmethod
    def get_impl_cls() -> type["TreeFlashAttentionImpl"]:
        return TreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TreeFlashAttentionMetadataBuilder]:
        return TreeFlashAttentionMetadataBuilder


class TreeFlashAttentionImpl(FlashAttentionImpl):
    """Stock FlashAttention, then tree rows recomputed by the Triton tree-attention kernel."""

    # Checked by the UBTree runner after model load.
    ubtree_tree_aware = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        unsupported = [name for name, used in (
            ("sliding_window", self.sliding_window != (-1, -1)),
            ("logits_soft_cap", bool(self.logits_soft_cap)),
            ("alibi_slopes", self.alibi_slopes is not None),
            ("sinks", self.sinks is not None)) if used]
        if unsupported and self.attn_type == AttentionType.DECODER:
            raise NotImplementedError(f"ubtree tree attention on CUDA does not support {unsupported} yet")

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: FlashAttentionMetadata, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, H, D]; key/value [T, H_kv, D]; kv_cache [num_blocks, H_kv, block, 2D] (logical)."""
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        active = begin_tree_rows(self, layer, key, value, attn_metadata, stash=False)
        if active is None:
            return output
        _, trees = active
        self._attend_tree_rows(query, key, value, kv_cache, attn_metadata.block_table, output, trees)
        return output

    def _attend_tree_rows(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          block_table: torch.Tensor, output: torch.Tensor, trees: DeviceTrees) -> None:
        """Overwrite the output rows of non-root tree nodes (``trees.row_index``); one launch.

        query [T, H, D]; key/value [T, H_kv, D]; kv_cache [num_blocks, H_kv, block_size, 2D]
        (logical); block_table [num_reqs, max_blocks] int32; output [T, H, D] (mutable).
        """
        # (B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D)), as FlashAttentionImpl reads the cache.
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        tree_attention(query, key, value, key_cache, value_cache, block_table,
                       trees.row_index, trees.row_req, trees.row_context_len, trees.row_path,
                       self.scale, output)  # output: mutable
