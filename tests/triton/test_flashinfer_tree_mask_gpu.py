"""FlashInfer's paged prefill with a custom mask against the tree-attention torch twin (issue 19, step one of a
FlashInfer tree backend): every tree row attends to its request's committed context and its own root -> node path.

GPU only. FlashInfer compiles its prefill kernel on first use (nvcc and ninja, FLASHINFER_* environment); where it
cannot, the test skips and says why, so a device without a CUDA toolkit reports that rather than a pass.
"""
from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device (FlashInfer)", allow_module_level=True)
flashinfer = pytest.importorskip("flashinfer")

from ubtree_vllm.triton_ops.reference import tree_attention_reference
from ubtree_vllm.triton_ops.tree_attention_inputs import TreeAttentionInputs, make_inputs, path_to

# (committed context length, parents of the tree's nodes, root first), as in test_tree_attention.py
REQUESTS = [(0, [-1, 0, 0, 1]), (5, [-1, 0, 1, 2, 0, 4]), (37, [-1, 0, 0, 0]), (70, [-1, 0, 1])]


def tree_mask(context_len: int, parents: list[int]) -> torch.Tensor:
    """[n, context_len + n] bool: every node sees the whole context and its ancestors-or-self."""
    n = len(parents)
    mask = torch.zeros(n, context_len + n, dtype=torch.bool)
    mask[:, :context_len] = True
    for node in range(n):
        mask[node, [context_len + a for a in path_to(parents, node)]] = True
    return mask


def write_tree_rows_to_cache(case: TreeAttentionInputs) -> None:
    """The forward's fresh K/V rows at their linear slots (context + node), as vLLM's cache writer leaves them."""
    block_size = case.key_cache.shape[1]
    for req, (context_len, parents) in enumerate(REQUESTS):
        root = int(case.query_start_loc[req])
        for node in range(len(parents)):
            pos = context_len + node
            block = int(case.block_table[req, pos // block_size])
            case.key_cache[block, pos % block_size] = case.key[root + node]
            case.value_cache[block, pos % block_size] = case.value[root + node]


def flashinfer_tree_attention(case: TreeAttentionInputs) -> torch.Tensor:
    """[T, H, D] every row through BatchPrefillWithPagedKVCacheWrapper with the trees' custom mask (NHD pages)."""
    block_size = case.key_cache.shape[1]
    kv_lens = [context_len + len(parents) for context_len, parents in REQUESTS]
    pages = [-(-n // block_size) for n in kv_lens]
    kv_indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).int()
    kv_indices = torch.cat([case.block_table[r, :p].cpu() for r, p in enumerate(pages)]).int()
    last_page_len = torch.tensor([n - (p - 1) * block_size for n, p in zip(kv_lens, pages)], dtype=torch.int32)
    mask = torch.cat([tree_mask(c, parents).flatten() for c, parents in REQUESTS])
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    try:
        wrapper.plan(case.query_start_loc.cpu(), kv_indptr, kv_indices, last_page_len, case.query.shape[1],
                     case.key.shape[1], case.query.shape[2], block_size, custom_mask=mask.cuda(),
                     sm_scale=case.scale, q_data_type=case.query.dtype, kv_data_type=case.key_cache.dtype)
        return wrapper.run(case.query, (case.key_cache.contiguous(), case.value_cache.contiguous()))
    except (RuntimeError, OSError) as error:  # JIT: no nvcc / ninja / CUDA headers on this machine
        pytest.skip(f"FlashInfer cannot build or run its prefill kernel here: {error}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 2, 64), (4, 4, 128)])
def test_flashinfer_custom_mask_equals_tree_attention(dtype, num_heads, num_kv_heads, head_size):
    case = make_inputs(REQUESTS, device="cuda", dtype=dtype, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       head_size=head_size, block_size=16, prefill_rows=0)
    write_tree_rows_to_cache(case)
    got = flashinfer_tree_attention(case)
    ref = tree_attention_reference(*case.args(), torch.full_like(case.query, float("nan")))
    rows = case.row_index.long()  # every non-root node of every tree
    torch.testing.assert_close(got[rows], ref[rows], atol=2e-2, rtol=2e-2)
