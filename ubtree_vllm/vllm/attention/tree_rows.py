"""What every CUDA tree-aware backend does around its stock kernel: compute the tree rows.

(Multi-head latent attention, FLASH_ATTN_MLA: :func:`attend_latent_tree_rows`, the same row buffers over the latent
cache; ``attention/flash_mla.py``.)

The stock impl (FLASH_ATTN, TRITON_ATTN) computes every row causally; :func:`attend_tree_rows` then
overwrites the rows of non-root tree nodes with :func:`ubtree_vllm.triton_ops.tree_attention`, one
launch per layer over the runner's fixed-size :class:`~ubtree_vllm.vllm.attention.state.RowBuffers`
(each row attends to its request's committed context in the paged cache plus its ancestors-or-self
among this forward's fresh K/V). With ``tree_attention: "triton_stock_roots"`` (Model Runner V2,
FLASH_ATTN), a uniform decode step's buffers hold an entry for every row but the roots
(:func:`rows_covered`; so every FULL graph of tree steps), and the stock call runs over the roots alone
(``q_len`` 1, the call plain decoding makes: the roots' logits keep plain decoding's numerics) instead of
over every row: at batch 1 on SmolLM2 that call was among the largest items of a round's device time (H200
profile, 2026-12-04), spent on rows the launch overwrites. Computing the roots with the tree kernel too
(31e8dc1) failed the MRV2 greedy test on the H200 and was withdrawn. ``tree_attention: "flash_exact"`` lays out
steps the same way and computes every row of such a step, roots included, by one FlashAttention 3 call, each row a
sequence of its own (``attention/exact_rows.py``), instead of the roots' call and the Triton launch.

Both backends keep K and V in one cache of logical shape
``[num_blocks, H_kv, block_size, 2 * head_size]``, so the same views, launch and in-cache KV commit
serve both. Captured in FULL CUDA graphs like the stock kernel (no host read of a device value).
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType

from ubtree_vllm.triton_ops import tree_attention
from ubtree_vllm.triton_ops.tree_mla_attention import tree_mla_attention
from ubtree_vllm.vllm.attention.state import RowBuffers, tree_forward_state


class TreeRowsImpl:
    """Mixin before a stock CUDA impl (``class X(TreeRowsImpl, FlashAttentionImpl)``): the attributes the UBTree runners
    read, the refusal at construction of features tree rows do not implement, and the forward: the stock kernel,
    then the tree rows recomputed (:meth:`_tree_context` may hand the kernel the context part)."""

    ubtree_tree_aware = True  # checked by the UBTree runners after model load (attention/state.py:bind_tree_layers)
    ubtree_commit_in_cache = True  # the runners commit accepted paths inside the KV cache (no per-layer stash)
    # The UBTree runner's fixed-size row buffers, bound after model load. Engines without UBTree in the same
    # process (the backend override is process-wide) leave it None and run the stock kernel alone, also under
    # CUDA-graph capture.
    ubtree_row_buffers: RowBuffers | None = None
    # tree_attention "flash_exact": the scratch pages of the rows' virtual sequences (vllm/attention/exact_rows.py),
    # bound with the row buffers once the runner's KV cache holds them; None: the Triton kernel computes the rows
    ubtree_exact_scratch: Any = None
    # tree_attention "flashinfer": the runner's FlashInfer wrappers (vllm/attention/flashinfer_rows.py), bound with the
    # row buffers; None otherwise
    ubtree_flashinfer: Any = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        refuse_unsupported_features(self)

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, H, D]; key/value [T, H_kv, D]; kv_cache [num_blocks, H_kv, block, 2D] (logical)."""
        buffers = tree_row_buffers(self, attn_metadata)
        covered = buffers is not None and rows_covered(buffers, attn_metadata)
        if not covered:
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,  # type: ignore[misc]
                                     output_scale, output_block_scale)
        if buffers is None:
            return output
        key_cache, value_cache = cache_views(kv_cache, self.head_size)  # type: ignore[attr-defined]
        if covered and self.ubtree_exact_scratch is not None and self.ubtree_exact_scratch.serves(query.shape[0]):
            self._exact_rows(query, key, value, key_cache, value_cache, attn_metadata, output, buffers)
            return output
        if covered:
            self._stock_roots(query, key_cache, value_cache, attn_metadata, output)
        context_out, context_lse = self._tree_context(query, key_cache, value_cache, attn_metadata)
        attend_tree_rows(query, key, value, key_cache, value_cache, attn_metadata.block_table, output, buffers,
                         self.scale, context_out, context_lse)  # type: ignore[attr-defined]
        return output

    def _stock_roots(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     attn_metadata: Any, output: torch.Tensor) -> None:
        """The stock kernel over the roots alone of a uniform decode step (``tree_attention: "triton_stock_roots"``,
        which ``attention/state.py:bind_tree_layers`` allows only for impls that implement this)."""
        raise NotImplementedError(f"{type(self).__name__} computes no roots alone")

    def _exact_rows(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor, buffers: RowBuffers) -> None:
        """Every row of a covered forward, roots included, by the stock kernel as plain decoding computes it
        (``tree_attention: "flash_exact"``, which ``attention/state.py:bind_tree_layers`` allows only for impls that
        implement this)."""
        raise NotImplementedError(f"{type(self).__name__} computes no exact tree rows")

    def _tree_context(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      attn_metadata: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(context_out, context_lse) computed elsewhere for ``tree_attention``, or (None, None): the kernel walks
        each row's committed context itself."""
        return None, None


def refuse_unsupported_features(impl: Any) -> None:
    """NotImplementedError naming the layer features tree rows do not implement (decoder layers only)."""
    unsupported = [name for name, used in (
        ("sliding_window", impl.sliding_window != (-1, -1)),
        ("logits_soft_cap", bool(impl.logits_soft_cap)),
        ("alibi_slopes", impl.alibi_slopes is not None),
        ("sinks", impl.sinks is not None),
        ("kv_sharing_target_layer_name", impl.kv_sharing_target_layer_name is not None)) if used]
    if unsupported and impl.attn_type == AttentionType.DECODER:
        raise NotImplementedError(f"ubtree tree attention on CUDA does not support {unsupported} yet")


def tree_row_buffers(impl: Any, attn_metadata: Any) -> RowBuffers | None:
    """The buffers to recompute this forward's tree rows from, or None: profiling run, not a decoder layer, an
    engine without UBTree (no buffers bound), or an eager step without tree rows (a capture always launches)."""
    buffers = impl.ubtree_row_buffers
    if attn_metadata is None or impl.attn_type != AttentionType.DECODER or buffers is None:
        return None
    if not (tree_forward_state().has_tree_rows or torch.cuda.is_current_stream_capturing()):
        return None
    return buffers


def rows_covered(buffers: RowBuffers, attn_metadata: Any) -> bool:
    """The tree launch computes every row of this forward but the roots, so the stock kernel runs over the roots
    alone: a step the runner laid out so (``RowBuffers.covers_forward``), or the capture of a FULL graph of tree steps
    (uniform decode: ``full_graphs_covered`` and more than one query row per request)."""
    if torch.cuda.is_current_stream_capturing():
        return buffers.full_graphs_covered and attn_metadata.max_query_len > 1
    return buffers.covers_forward


def cache_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [num_blocks, H_kv, block_size, 2 * head_size] (logical) -> key, value [num_blocks, block_size, H_kv,
    head_size] views, as FLASH_ATTN and TRITON_ATTN read it."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache


def attend_tree_rows(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                     value_cache: torch.Tensor, block_table: torch.Tensor, output: torch.Tensor, buffers: RowBuffers,
                     scale: float, context_out: torch.Tensor | None = None,
                     context_lse: torch.Tensor | None = None) -> None:
    """Overwrite ``output``'s tree rows; one launch over the forward's T entries.

    query [T, H, D]; key/value [T, H_kv, D]; key/value_cache [num_blocks, block_size, H_kv, D];
    block_table [num_reqs, max_blocks] int32; output [T, H, D] (mutable); context_out/lse: the context part
    computed elsewhere (``tree_attention``'s contract), else the kernel walks the context itself."""
    num_tokens = query.shape[0]
    tree_attention(query, key, value, key_cache, value_cache, block_table,
                   buffers.row_index[:num_tokens], buffers.row_req[:num_tokens],
                   buffers.row_context_len[:num_tokens], buffers.row_path[:num_tokens],
                   scale, output,  # output: mutable
                   context_out=context_out, context_lse=context_lse)


def attend_latent_tree_rows(q: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, block_table: torch.Tensor, out: torch.Tensor,
                            buffers: RowBuffers, latent: int, scale: float) -> None:
    """Overwrite ``out``'s tree rows; one launch over the T decode rows' buffer entries.

    q: (q_latent [T, H, L], q_rope [T, H, R]) or [T, H, L + R] (the forward's first T rows: decodes come first);
    kv_cache [num_blocks, block_size, L + R] holding this forward's fresh rows at ``slot_mapping`` [>= T];
    block_table [num_decodes, max_blocks] int32; out [T, H, L] (mutable)."""
    q_latent, q_rope = q if isinstance(q, tuple) else q.split([latent, q.shape[-1] - latent], dim=-1)
    num_tokens = q_latent.shape[0]
    slots = slot_mapping[:num_tokens].long()  # [T]; the cache's blocks may be strided (hybrid page alignment)
    fresh = kv_cache[slots // kv_cache.shape[1], slots % kv_cache.shape[1]]  # [T, L + R]
    tree_mla_attention(q_latent, q_rope, fresh[:, :latent], fresh[:, latent:], kv_cache, block_table,
                       buffers.row_index[:num_tokens], buffers.row_req[:num_tokens],
                       buffers.row_context_len[:num_tokens], buffers.row_path[:num_tokens], scale, out)
