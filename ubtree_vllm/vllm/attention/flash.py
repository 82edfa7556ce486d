"""FLASH_ATTN with tree rows (CUDA): stock FlashAttention, then one Triton launch for tree rows.

FlashAttention computes every row causally (with ``tree_attention: "triton_stock_roots"``, in a uniform
decode step, only the roots: :meth:`TreeFlashAttentionImpl._stock_roots`, ``tree_rows.rows_covered``); the rows
of non-root tree nodes are then overwritten by :func:`ubtree_vllm.triton_ops.tree_attention`, one launch per layer
(:mod:`ubtree_vllm.vllm.attention.tree_rows`, shared with TRITON_ATTN). Each
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

``tree_attention: "flash_merge"`` (``ubtree_context_from_flash``): a second FlashAttention call, not
causal, with each request's committed context length as ``seqused_k`` (its tokens before this
step's rows; FlashAttention reads the cache in place) and ``return_softmax_lse``, attends every row
to its context with the kernel plain decoding uses; the Triton launch then adds only each tree row's
path rows, starting from that partial (``tree_attention(context_out=, context_lse=)``). Same
shapes and no host read, so it is captured in the same graphs. The context lengths are computed once
per forward, by its first tree layer, and shared by the others (``TreeForwardState.step_cache``, keyed
by the forward's metadata object): four elementwise launches per forward, not per layer.

``tree_attention: "flash_exact"`` (Model Runner V2, FlashAttention 3): in uniform decode steps one FlashAttention 3
call computes every row, each a sequence of its own (a root over its request's pages, a tree row over scratch pages
holding its context tail and path), split as plain decoding would split it (:meth:`_exact_rows`,
``exact_rows.py``): every row gets plain decoding's bits at batch 1.

``tree_attention: "flashinfer"`` (Model Runner V2): in uniform decode steps of up to 8 requests one FlashInfer paged
prefill call computes every row under a custom mask (:meth:`TreeFlashAttentionImpl._flashinfer_rows`,
``flashinfer_rows.py``); larger steps take ``"triton_stock_roots"``'s path.

The KV commit of accepted paths copies inside this cache
(:func:`ubtree_vllm.vllm.kv_commit.commit_accepted_paths_in_cache`), so nothing is stashed.

Sliding windows, soft caps, ALiBi, sinks and KV-sharing layers are refused at construction
(not implemented for tree rows); fp8 KV caches are refused by the UBTree engine config.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backends.flash_attn import (FlashAttentionBackend, FlashAttentionImpl,
                                                   FlashAttentionMetadata)

from ubtree_vllm.vllm.attention.state import RowBuffers, tree_forward_state
from ubtree_vllm.vllm.attention.tree_rows import TreeRowsImpl, cache_views, rows_covered


class TreeFlashAttentionBackend(FlashAttentionBackend):
    """FLASH_ATTN whose impl applies the ancestor mask to tree rows (name kept: FLASH_ATTN)."""

    @staticmethod
    def get_impl_cls() -> type["TreeFlashAttentionImpl"]:
        return TreeFlashAttentionImpl


class TreeFlashAttentionImpl(TreeRowsImpl, FlashAttentionImpl):
    """Stock FlashAttention, then tree rows recomputed by the Triton tree-attention kernel."""

    # tree_attention "flash_merge": the context part from FlashAttention (module docstring); set by the bind
    ubtree_context_from_flash: bool = False

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: Any, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        if self.ubtree_flashinfer is not None and attn_metadata is not None and self._flashinfer_rows(
                query, kv_cache, attn_metadata, output):
            return output
        return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                               output_block_scale)

    def _flashinfer_rows(self, query: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: FlashAttentionMetadata,
                         output: torch.Tensor) -> bool:
        """"flashinfer": every row of a covered uniform decode step it serves by one FlashInfer call (planned before
        the forward by the runner); True when it wrote ``output``. An eager forward without trees may be the warm-up
        of a FULL graph's capture: it plans that shape (``FlashInferTreeRows.plan_warmup``) and computes stock."""
        rows, buffers = self.ubtree_flashinfer, self.ubtree_row_buffers
        capturing = torch.cuda.is_current_stream_capturing()
        if buffers is None:
            return False
        if not (tree_forward_state().has_tree_rows or capturing):
            rows.plan_warmup(attn_metadata, buffers.row_index, buffers.row_path)
            return False
        num_reqs, q = attn_metadata.seq_lens.shape[0], attn_metadata.max_query_len
        if not (rows_covered(buffers, attn_metadata) and rows.serves(num_reqs, q)):
            return False  # TreeRowsImpl.forward: FlashAttention for the roots, the Triton kernel for the rest
        key_cache, value_cache = cache_views(kv_cache, self.head_size)
        rows.run(query, key_cache, value_cache, output, num_reqs, q)
        return True

    def _stock_roots(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     attn_metadata: FlashAttentionMetadata, output: torch.Tensor) -> None:
        """The roots alone of a uniform decode step (``q`` rows per request: request i's root is row ``i * q``), each
        attending to its first ``seq_lens[i] - q + 1`` tokens with ``q_len`` 1: the call plain decoding makes at that
        position, so the roots' logits keep its numerics. Strided views of ``query`` / ``output`` (no copy); the
        lengths are computed once per forward and shared by its layers (``TreeForwardState.step_cache``)."""
        from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
        from vllm.vllm_flash_attn import flash_attn_varlen_func

        q = attn_metadata.max_query_len
        num_reqs = attn_metadata.seq_lens.shape[0]
        if num_reqs * q > query.shape[0]:
            raise RuntimeError(f"ubtree: {num_reqs} requests x {q} rows exceed the forward's {query.shape[0]} rows; "
                               "tree_attention 'triton_stock_roots' needs a uniform decode step")
        step = tree_forward_state().step_cache
        cached = step.get(_ROOT_LENS)
        if cached is not None and cached[0] is attn_metadata:
            cu_seqlens_q, root_lens = cached[1]
        else:
            cu_seqlens_q = torch.arange(num_reqs + 1, dtype=torch.int32, device=query.device)  # [R + 1]
            root_lens = root_context_lens(attn_metadata.seq_lens, q)  # [R]
            step[_ROOT_LENS] = (attn_metadata, (cu_seqlens_q, root_lens))
        roots = slice(0, num_reqs * q, q)
        flash_attn_varlen_func(
            q=query[roots], k=canonicalize_singleton_dim_strides(key_cache),
            v=canonicalize_singleton_dim_strides(value_cache), out=output[roots], cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=1, seqused_k=root_lens, max_seqlen_k=attn_metadata.max_seq_len, softmax_scale=self.scale,
            causal=True, block_table=attn_metadata.block_table, fa_version=self.vllm_flash_attn_version,
            num_splits=attn_metadata.max_num_splits)

    def _exact_rows(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                    value_cache: torch.Tensor, attn_metadata: FlashAttentionMetadata, output: torch.Tensor,
                    buffers: RowBuffers) -> None:
        """"flash_exact": every row's virtual sequence (built once per forward, shared by its layers through
        ``TreeForwardState.step_cache``), the tree rows' scratch pages filled from this layer's cache and fresh K/V,
        then one FlashAttention 3 call over them all, in place (``attention/exact_rows.py``)."""
        from ubtree_vllm.vllm.attention.exact_rows import (attend_rows_exactly, copy_rows_to_scratch, num_sms,
                                                           pinned_scheduler_metadata, virtual_rows_by_kernel)

        num_tokens, block_size = query.shape[0], key_cache.shape[1]
        num_splits = attn_metadata.max_num_splits  # vLLM's cap under CUDA graphs, as plain decoding's call
        step = tree_forward_state().step_cache
        cached = step.get(_EXACT_ROWS)
        if cached is not None and cached[0] is attn_metadata:
            rows, metadata = cached[1]
        else:
            # eager steps' split counts are FlashAttention's own (below): the kernel's then go unused
            sms = num_sms(query.device) if num_splits > 0 else 1
            rows = virtual_rows_by_kernel(buffers.row_index[:num_tokens], buffers.row_req[:num_tokens],
                                          buffers.row_context_len[:num_tokens], buffers.row_path[:num_tokens],
                                          attn_metadata.block_table, attn_metadata.query_start_loc,
                                          attn_metadata.seq_lens, self.ubtree_exact_scratch, block_size,
                                          self.head_size, self.num_kv_heads, sms, max(num_splits, 1))
            # eager steps (num_splits 0) leave the split counts to FlashAttention, as plain decoding's eager call does
            metadata = (pinned_scheduler_metadata(rows, attn_metadata.max_seq_len, self.num_heads, self.num_kv_heads,
                                                  self.head_size, query.dtype, block_size, num_splits)
                        if num_splits > 0 else None)
            step[_EXACT_ROWS] = (attn_metadata, (rows, metadata))
        copy_rows_to_scratch(key_cache, value_cache, key, value, rows)
        attend_rows_exactly(query, key_cache, value_cache, output, rows, self.scale, attn_metadata.max_seq_len,
                            metadata, num_splits)

    def _tree_context(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      attn_metadata: FlashAttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """"flash_merge": the context part by FlashAttention's context-only call; "triton": none."""
        if not self.ubtree_context_from_flash:
            return None, None
        return self._context_part(query, key_cache, value_cache, attn_metadata)

    def _context_part(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      attn_metadata: FlashAttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`flash_context_attention` of the forward's first ``num_actual_tokens`` rows over this layer's
        cache views ``[num_blocks, block_size, H_kv, D]``, the rest of the call as ``FlashAttentionImpl.forward``
        makes it."""
        from vllm.utils.torch_utils import canonicalize_singleton_dim_strides

        num_tokens = attn_metadata.num_actual_tokens
        # The forward's first tree layer computes the lengths (captured in its graph like the rest); the others
        # reuse them. Keyed by the metadata object, which every layer of the forward shares and each forward
        # builds anew, on top of the runners clearing step_cache before every target forward.
        step = tree_forward_state().step_cache
        cached = step.get(_CONTEXT_LENS)
        if cached is not None and cached[0] is attn_metadata:
            context_lens = cached[1]
        else:
            context_lens = committed_context_lens(attn_metadata.query_start_loc, attn_metadata.seq_lens)
            step[_CONTEXT_LENS] = (attn_metadata, context_lens)
        return flash_context_attention(
            query[:num_tokens], canonicalize_singleton_dim_strides(key_cache),
            canonicalize_singleton_dim_strides(value_cache), attn_metadata.query_start_loc, context_lens,
            attn_metadata.max_query_len, attn_metadata.max_seq_len, attn_metadata.block_table, self.scale,
            self.vllm_flash_attn_version, attn_metadata.max_num_splits)


_CONTEXT_LENS = "flash_merge_context_lens"  # step_cache key: (metadata, [R] int32) of the forward in flight
_ROOT_LENS = "stock_roots_lens"  # step_cache key: (metadata, ([R + 1], [R]) int32) of the forward in flight
_EXACT_ROWS = "flash_exact_rows"  # step_cache key: (metadata, (VirtualRows, FA3 metadata)) of the forward in flight


def root_context_lens(
        # [R] int32 each request's tokens including this forward's q rows (0 for a padded request)
        seq_lens: torch.Tensor, q: int) -> torch.Tensor:
    """[R] int32 tokens each root attends to: its committed context and itself, ``seq_lens - q + 1`` (>= 0)."""
    return (seq_lens - (q - 1)).clamp(min=0).to(torch.int32)


def committed_context_lens(
        # [R + 1] int32 first row of each request; [R] int32 its tokens including this forward's rows
        query_start_loc: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[R] int32 tokens of each request before this forward's rows (its committed context), >= 0."""
    return (seq_lens - (query_start_loc[1:] - query_start_loc[:-1])).clamp(min=0).to(torch.int32)


def flash_context_attention(
        # [n, H, D] the forward's rows (request i's are query_start_loc[i] .. query_start_loc[i + 1] - 1)
        query: torch.Tensor,
        # [num_blocks, block_size, H_kv, D] the layer's paged cache views
        key_cache: torch.Tensor, value_cache: torch.Tensor,
        # [R + 1] int32 first row of each request; [R] int32 its committed context (committed_context_lens)
        query_start_loc: torch.Tensor, context_lens: torch.Tensor,
        max_query_len: int, max_seq_len: int,
        # [R, max_blocks] int32
        block_table: torch.Tensor, scale: float, fa_version: int, num_splits: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row attended to its request's committed context alone (its first ``context_lens`` tokens), by
    FlashAttention, not causal: (out [n, H, D] normalised, lse [H, n] fp32 natural log-sum-exp,
    +inf for a row with no context). Device ops only (capturable). The ``context_out`` / ``context_lse`` of
    :func:`ubtree_vllm.triton_ops.tree_attention`."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    out = torch.empty_like(query)
    out, lse = flash_attn_varlen_func(
        q=query, k=key_cache, v=value_cache, out=out, cu_seqlens_q=query_start_loc, max_seqlen_q=max_query_len,
        seqused_k=context_lens, max_seqlen_k=max_seq_len, softmax_scale=scale, causal=False, block_table=block_table,
        return_softmax_lse=True, fa_version=fa_version, num_splits=num_splits)
    return out, lse
