"""FLASH_ATTN_MLA with tree rows (CUDA): vLLM's FlashAttention MLA decode, then one Triton launch for tree rows.

Multi-head latent attention layers (DeepSeek-V2/V3; Ling-3.0's ``BailingMoeV3MLAAttention``) on the H200 run
FLASH_ATTN_MLA, vLLM's first MLA choice on sm90. Its metadata builder takes requests of up to ``1 + B`` query rows as
decodes (``query_len_support`` VARLEN), so a UBTree step's root and drafts reach ``forward_mqa`` in the absorbed form:
``q = (q_latent [T, H, L], q_rope [T, H, R])`` against the latent cache ``[num_blocks, block_size, L + R]``, which
already holds this forward's fresh rows (vLLM writes them before attention), causally among a request's rows.

:meth:`TreeFlashAttnMLAImpl.forward_mqa` keeps that call and then overwrites the rows of non-root tree nodes with
:func:`~ubtree_vllm.vllm.attention.tree_rows.attend_latent_tree_rows` (the Triton tree MLA kernel): each such row
attends to its request's committed context, read through the block table, plus its ancestors-or-self among the fresh
rows, gathered from the cache at the forward's slot mapping. The launch reads the runner's fixed-size :class:`~ubtree_vllm.vllm.attention.state.RowBuffers` (entries
-1 skipped) and no device value on the host, so it is captured in CUDA graphs like the stock call. Roots keep the
stock kernel's arithmetic: they are plain decoding's rows.

The KV commit of accepted paths copies latent rows inside the caches
(:func:`ubtree_vllm.vllm.kv_commit.commit_accepted_paths_in_cache`, the cache viewed with one KV head). Decode context
parallelism is refused (its partial outputs are merged by log-sum-exp across ranks; tree rows do not return one).
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backends.mla.flashattn_mla import FlashAttnMLABackend, FlashAttnMLAImpl

from ubtree_vllm.vllm.attention.state import RowBuffers, tree_forward_state
from ubtree_vllm.vllm.attention.tree_rows import attend_latent_tree_rows


class TreeFlashAttnMLABackend(FlashAttnMLABackend):
    """FLASH_ATTN_MLA whose impl applies the ancestor mask to tree rows (name kept: FLASH_ATTN_MLA)."""

    @staticmethod
    def get_impl_cls() -> type["TreeFlashAttnMLAImpl"]:
        return TreeFlashAttnMLAImpl


class TreeFlashAttnMLAImpl(FlashAttnMLAImpl):
    """Stock FlashAttention MLA decode, then tree rows recomputed by the Triton tree MLA kernel."""

    ubtree_tree_aware = True  # checked by the UBTree runners after model load (attention/state.py:bind_tree_layers)
    ubtree_commit_in_cache = True  # the runners commit accepted paths inside the latent caches
    # The UBTree runner's fixed-size row buffers, bound after model load (None: an engine without UBTree).
    ubtree_row_buffers: RowBuffers | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.dcp_world_size > 1:
            raise NotImplementedError("ubtree tree attention for MLA does not support decode context parallelism "
                                      f"(dcp_world_size {self.dcp_world_size}) yet")

    def forward_mqa(self, q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: Any, layer: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q: (q_latent [T, H, L], q_rope [T, H, R]) or [T, H, L + R]; kv_c_and_k_pe_cache [num_blocks, block_size,
        L + R]; returns ([T, H, L] output, vLLM's lse)."""
        out, lse = super().forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)
        buffers = self.ubtree_row_buffers
        if buffers is None or not (tree_forward_state().has_tree_rows or torch.cuda.is_current_stream_capturing()):
            return out, lse
        attend_latent_tree_rows(q, kv_c_and_k_pe_cache, attn_metadata.slot_mapping, attn_metadata.decode.block_table,
                                out, buffers, self.kv_lora_rank, self.scale)
        return out, lse
