"""TRITON_ATTN with tree rows (CUDA): vLLM's Triton attention, then one Triton launch for tree rows.

The backend vLLM uses where FlashAttention cannot run, float32 targets above all (FlashAttention has
no fp32 kernel): the UBTree engine pins it for an fp32 target on CUDA, FLASH_ATTN otherwise. Stock
Triton attention computes every row causally, then :func:`ubtree_vllm.vllm.attention.tree_rows.attend_tree_rows`
overwrites the rows of non-root tree nodes (the same launch, views and in-cache KV commit as
``flash.py``: both backends keep one ``[num_blocks, H_kv, block_size, 2 * head_size]`` cache, whatever
its physical strides). ``tree_attention: "flash_merge"`` needs FlashAttention and is refused for this
backend when the layers are bound (``attention/state.py:bind_tree_layers``).

Refused at construction, beyond ``tree_rows.TreeRowsImpl``'s refusals: quantized KV caches (the
tree kernel reads the cache in the model dtype); the UBTree engine config refuses fp8 KV caches first.
"""
from __future__ import annotations

from typing import Any

from vllm.utils.torch_utils import is_quantized_kv_cache
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from ubtree_vllm.vllm.attention.tree_rows import TreeRowsImpl


class TreeTritonAttentionBackend(TritonAttentionBackend):
    """TRITON_ATTN whose impl applies the ancestor mask to tree rows (name kept: TRITON_ATTN)."""

    @staticmethod
    def get_impl_cls() -> type["TreeTritonAttentionImpl"]:
        return TreeTritonAttentionImpl


class TreeTritonAttentionImpl(TreeRowsImpl, TritonAttentionImpl):
    """Stock Triton attention, then tree rows recomputed by the Triton tree-attention kernel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if is_quantized_kv_cache(self.kv_cache_dtype):
            raise NotImplementedError(f"ubtree tree attention on TRITON_ATTN reads an unquantized KV cache, got "
                                      f"kv_cache_dtype {self.kv_cache_dtype!r}")
