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

from ubtree_vllm.bench.flashinfer_tree import plan_tree_prefill
from ubtree_vllm.triton_ops.reference import tree_attention_reference
from ubtree_vllm.triton_ops.tree_attention_inputs import TreeAttentionInputs, make_inputs

# (committed context length, parents of the tree's nodes, root first), as in test_tree_attention.py
REQUESTS = [(0, [-1, 0, 0, 1]), (5, [-1, 0, 1, 2, 0, 4]), (37, [-1, 0, 0, 0]), (70, [-1, 0, 1])]


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
    """[T, H, D] every row through FlashInfer's paged prefill with the trees' custom mask (bench/flashinfer_tree.py)."""
    try:
        wrapper, _ = plan_tree_prefill(case, REQUESTS)
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
