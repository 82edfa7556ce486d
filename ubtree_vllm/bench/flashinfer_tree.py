"""FlashInfer's paged prefill with a tree's custom mask: every row of a request's verification (root and tree nodes)
in one call, each row attending to the committed context and its own root -> node path (issue 19's FlashInfer
alternative to the Triton tree kernel; measured by ``tree-attention-vs-flash``, checked by
``tests/triton/test_flashinfer_tree_mask_gpu.py``).

Layout: the requests' rows are contiguous (root first, parents-first nodes), their fresh K/V already in the paged
cache after the committed context, as vLLM writes them before attention; the cache is two NHD tensors
``[num_pages, page_size, H_kv, D]``. FlashInfer plans on the host from exact per-request K/V lengths and packs the
mask request by request (``qo_len x kv_len`` bits), so :func:`plan_tree_prefill` takes host values; serving would
have to plan every step from host-known lengths (docs/design/mrv2.md §12). GPU only: FlashInfer compiles its
prefill kernel on first use.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ubtree_vllm.triton_ops.tree_attention_inputs import path_to

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


def tree_mask(context_len: int, parents: Sequence[int]) -> torch.Tensor:
    """[n, context_len + n] bool: row j (node j, root first) sees the whole context and its ancestors-or-self."""
    n = len(parents)
    mask = torch.zeros(n, context_len + n, dtype=torch.bool)
    mask[:, :context_len] = True
    for node in range(n):
        mask[node, [context_len + a for a in path_to(parents, node)]] = True
    return mask


def paged_kv_layout(block_table: torch.Tensor, kv_lens: Sequence[int],
                    page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_indptr [R + 1], kv_indices [pages], last_page_len [R]) int32 on the host for FlashInfer's plan: request r's
    first cdiv(kv_lens[r], page_size) blocks of ``block_table[r]``."""
    pages = [-(-n // page_size) for n in kv_lens]
    kv_indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32)
    kv_indices = torch.cat([block_table[r, :p].cpu() for r, p in enumerate(pages)]).to(torch.int32)
    last_page_len = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages)],
                                 dtype=torch.int32)
    return kv_indptr, kv_indices, last_page_len


def tree_prefill_plan_args(inputs: Any, requests: Sequence[tuple[int, Sequence[int]]], *,
                           device: torch.device | str = "cuda") -> dict[str, Any]:
    """The arguments of FlashInfer's ``plan`` for the rows of ``requests`` = [(committed context length, parents root
    first)] in ``inputs`` (a ``TreeAttentionInputs`` without prefill rows: the requests' rows are all of
    ``inputs.query``): host index arrays, the packed mask's bits on ``device``."""
    if int(inputs.query_start_loc[0]) != 0:
        raise ValueError("the FlashInfer tree prefill takes inputs whose rows are all the requests' (prefill_rows=0)")
    page_size = inputs.key_cache.shape[1]
    kv_lens = [context_len + len(parents) for context_len, parents in requests]
    kv_indptr, kv_indices, last_page_len = paged_kv_layout(inputs.block_table, kv_lens, page_size)
    return dict(qo_indptr=inputs.query_start_loc.cpu().to(torch.int32), paged_kv_indptr=kv_indptr,
                paged_kv_indices=kv_indices, paged_kv_last_page_len=last_page_len,
                num_qo_heads=inputs.query.shape[1], num_kv_heads=inputs.key.shape[1],
                head_dim_qk=inputs.query.shape[2], page_size=page_size,
                custom_mask=torch.cat([tree_mask(c, parents).flatten() for c, parents in requests]).to(device),
                sm_scale=inputs.scale, q_data_type=inputs.query.dtype, kv_data_type=inputs.key_cache.dtype)


def plan_tree_prefill(inputs: Any, requests: Sequence[tuple[int, Sequence[int]]], *,
                      device: torch.device | str = "cuda") -> tuple[Any, dict[str, Any]]:
    """(a ``flashinfer.BatchPrefillWithPagedKVCacheWrapper`` planned with them, :func:`tree_prefill_plan_args`): the
    arguments come back so a caller can plan again without rebuilding the mask. Raises what FlashInfer raises when
    it cannot build or run its kernel here."""
    import flashinfer

    args = tree_prefill_plan_args(inputs, requests, device=device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device), "NHD")
    wrapper.plan(**args)
    return wrapper, args
