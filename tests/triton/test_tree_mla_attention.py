"""triton_ops.tree_mla_attention against its torch twin (MLA's absorbed form over a draft tree).

The row plan (context through a shuffled block table, ancestors-or-self among the forward's rows)
is tree_attention's (``tree_attention_inputs.make_inputs``); the MLA tensors are the latent queries,
RoPE queries, the forward's latent / RoPE key rows and vLLM's MLA cache ``[blocks, block_size, L + R]``.
Without CUDA the kernel runs under the Triton interpreter on CPU tensors (tests/conftest.py).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from ubtree_vllm.triton_ops.reference import tree_mla_attention_reference
from ubtree_vllm.triton_ops.tree_attention_inputs import make_inputs, random_parents
from ubtree_vllm.triton_ops.tree_mla_attention import tree_mla_attention

from kernel_device import CUDA, DEVICE, assert_written_rows


# (committed context length, parents of its nodes, root first): empty context, partial block, several tiles
REQUESTS = [(0, [-1, 0, 0, 1]), (5, [-1, 0, 1, 2, 0, 4]), (37, [-1, 0, 0, 0]), (70, [-1, 0, 1])]


def mla_case(requests, num_heads, latent, rope, block_size, dtype, seed=0):
    plan = make_inputs(requests, device=DEVICE, num_heads=1, num_kv_heads=1, head_size=16, block_size=block_size,
                       seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    num_rows, num_blocks = plan.query.shape[0], plan.key_cache.shape[0]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    tensors = (randn(num_rows, num_heads, latent), randn(num_rows, num_heads, rope), randn(num_rows, latent),
               randn(num_rows, rope), randn(num_blocks, block_size, latent + rope))
    plan_args = (plan.block_table, plan.row_index, plan.row_req, plan.row_context_len, plan.row_path)
    return (*tensors, *plan_args, (latent + rope) ** -0.5)


def run_both(args):
    q_latent = args[0]
    out = torch.full_like(q_latent, float("nan"))
    ref = tree_mla_attention_reference(*args, out.clone())
    got = tree_mla_attention(*args, out)
    assert got is out
    return got, ref


@pytest.mark.parametrize("num_heads,latent,rope", [(4, 64, 16), (20, 512, 64)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_kernel_matches_reference(num_heads, latent, rope, block_size):
    """Head tiles (20 heads: a partial second tile), DeepSeek/Ling-sized latent (512 + 64), block sizes."""
    args = mla_case(REQUESTS, num_heads, latent, rope, block_size, torch.float32)
    got, ref = run_both(args)
    assert_written_rows(got, ref, args[6], atol=1e-4, rtol=1e-4)


def test_skipped_entries_deep_paths_and_random_trees():
    """row_index -1 entries are skipped (fixed-size graph launches); 40-node trees with paths 9 deep."""
    gen = torch.Generator().manual_seed(5)
    requests = [(ctx, random_parents(40, 9, 4, gen)) for ctx in (3, 90)]
    args = list(mla_case(requests, 8, 64, 16, 16, torch.float32, seed=2))
    row_index = args[6].clone()
    row_index[::3] = -1
    args[6] = row_index
    got, ref = run_both(tuple(args))
    assert_written_rows(got, ref, row_index, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not CUDA, reason="bf16 tensor cores need CUDA (the interpreter runs fp32)")
def test_bf16_on_cuda():
    args = mla_case(REQUESTS, 16, 512, 64, 64, torch.bfloat16)
    got, ref = run_both(args)
    assert_written_rows(got.float(), ref.float(), args[6], atol=2e-2, rtol=2e-2)


def test_reference_is_attention_over_the_node_path():
    """The twin itself: a node's row equals plain softmax attention over context + its root->node rows."""
    args = mla_case([(6, [-1, 0, 1, 0])], 2, 16, 16, 16, torch.float32)
    q_lat, q_rope, kv_lat, k_rope, cache, block_table, row_index, _, _, row_path, scale = args
    out = tree_mla_attention_reference(*args, torch.zeros_like(q_lat))
    entry = 1  # node 2: path root, node 1, node 2
    row = int(row_index[entry])
    path = [p for p in row_path[entry].tolist() if p >= 0]
    pos = torch.arange(6)
    cached = cache[block_table[0, pos // 16].long(), pos % 16]
    keys = torch.cat([torch.cat([cached[:, :16], kv_lat[path]]), torch.cat([cached[:, 16:], k_rope[path]])], dim=1)
    values = torch.cat([cached[:, :16], kv_lat[path]])
    queries = torch.cat([q_lat[row], q_rope[row]], dim=1)  # [H, L + R]
    want = torch.softmax(queries @ keys.T * scale, dim=-1) @ values
    assert len(path) == 3
    torch.testing.assert_close(out[row], want)
