"""FLASH_ATTN with tree rows (CUDA): stock FlashAttention, then tree rows in PyTorch.

The correct-first GPU path of the V1 runner; the fused Triton kernel comes with the GPU
fast-path work. FlashAttention's paged cache is per token (``kv_cache.transpose(1, 2)
.split(head_size, -1)`` gives ``[num_blocks, block_size, num_kv_heads, head_size]`` key
and value views), so tree rows are recomputed with
:func:`ubtree_vllm.vllm.attention.tree_sdpa.tree_rows_attention` over the gathered
context and the fresh node K/V. The Python per-request loop runs eagerly, so the
builder reports ``AttentionCGSupport.NEVER``: vLLM then captures PIECEWISE CUDA graphs
around attention (attention is a splitting op) instead of FULL graphs.

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

from ubtree_vllm.tree.topology import ancestor_mask
from ubtree_vllm.vllm.attention.state import begin_tree_rows, tree_forward_state
from ubtree_vllm.vllm.attention.tree_sdpa import gather_paged_tokens, tree_rows_attention
from ubtree_vllm.vllm.tree_plan import TreeStepPlan


class TreeFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    """FlashAttention metadata; never captured in FULL graphs (tree rows run in Python)."""

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
    """Stock FlashAttention, then tree rows recomputed under the ancestor mask."""

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
        active = begin_tree_rows(self, layer, key, value, attn_metadata)
        if active is None:
            return output
        plan, trees = active
        state = tree_forward_state()
        masks = state.step_cache.get("ancestor_masks")
        if masks is None:
            masks = ancestor_mask(trees.parents.clamp(min=-1), plan.max_depth)  # [num_reqs, n, n]
            state.step_cache["ancestor_masks"] = masks
        self._attend_tree_rows(query, key, value, kv_cache, attn_metadata.block_table, output, plan, masks)
        return output

    def _attend_tree_rows(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          block_table: torch.Tensor, output: torch.Tensor, plan: TreeStepPlan,
                          masks: torch.Tensor) -> None:
        """Overwrite output rows of non-root tree nodes. masks: [num_reqs, n, n] ancestor-or-self."""
        # (B, H, N, 2D) -> ((B, N, H, D), (B, N, H, D)), as FlashAttentionImpl reads the cache.
        key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
        # Host loop over tree requests: the plan is host data, no device value is read.
        for req in plan.is_tree.nonzero()[0].tolist():
            ctx_len, n = int(plan.root_positions[req]), int(plan.num_nodes[req])
            root = int(plan.root_rows[req])
            block_ids = block_table[req]
            rows = slice(root + 1, root + n)
            output[rows] = tree_rows_attention(
                query[rows], gather_paged_tokens(key_cache, block_ids, ctx_len),
                gather_paged_tokens(value_cache, block_ids, ctx_len), key[root:root + n], value[root:root + n],
                masks[req, 1:n, :n], self.scale).to(output.dtype)
