"""triton_ops.kv_path_commit against its torch twin and against the runner's gather-then-scatter commit.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (tests/conftest.py
sets ``TRITON_INTERPRET=1``); the interpreter reads the layers' caches through the same
pointer table as the GPU.
"""
from __future__ import annotations

import pytest
import torch

from ubtree_vllm.triton_ops.kv_path_commit import kv_cache_pointers, kv_path_commit
from ubtree_vllm.triton_ops.reference import kv_path_commit_reference

# the interpreter (CPU tensors) only where there is no GPU: with CUDA, Triton launches real kernels
DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def random_pairs(num_reqs: int, num_depths: int, num_slots: int, gen: torch.Generator):
    """(src, dst, moves) of Q requests whose accepted paths are parents-first (node index >= depth)."""
    slots = torch.randperm(num_slots, generator=gen)
    src, dst, moves, used = [], [], [], 0
    for _ in range(num_reqs):
        nodes = int(torch.randint(1, 3 * num_depths, (1,), generator=gen))
        req_slots = slots[used:used + nodes + 1]  # slot of the root (row 0) and of every node
        used += nodes + 1
        accepted = int(torch.randint(0, min(num_depths, nodes) + 1, (1,), generator=gen))
        # a strictly increasing chain of node indices with path[d] >= d
        chain = sorted(torch.randperm(nodes, generator=gen)[:accepted].add(1).tolist())
        path = [0] + chain
        for d in range(1, num_depths + 1):
            node = path[d] if d <= accepted else 0
            src.append(int(req_slots[node]))
            dst.append(int(req_slots[min(d, nodes)]))
            moves.append(d <= accepted and node != d)
    return torch.tensor(src), torch.tensor(dst), torch.tensor(moves)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_reqs,num_depths,heads,elems,block_size", [(1, 4, 2, 16, 4), (5, 6, 3, 32, 16),
                                                                      (3, 16, 8, 256, 16)])
def test_matches_reference(device, dtype, num_reqs, num_depths, heads, elems, block_size):
    if dtype == torch.bfloat16 and device == "cpu":
        pytest.skip("the interpreter runs fp32; bf16 on CUDA")
    gen = torch.Generator().manual_seed(num_reqs * 100 + num_depths)
    num_blocks = (num_reqs * (3 * num_depths + 1)) // block_size + 2
    src, dst, moves = random_pairs(num_reqs, num_depths, num_blocks * block_size, gen)
    while not bool(moves.any()):  # a case that moves nothing would not test the kernel
        src, dst, moves = random_pairs(num_reqs, num_depths, num_blocks * block_size, gen)
    # a non-contiguous cache layout: [num_blocks, H_kv, block_size, E] viewed from [num_blocks, block_size, H_kv, E]
    caches = [torch.randn(num_blocks, block_size, heads, elems, generator=gen).to(dtype).to(device).transpose(1, 2)
              for _ in range(3)]
    expected = [c.clone() for c in caches]
    kv_path_commit_reference(expected, src, dst, moves, num_depths)
    kv_path_commit(kv_cache_pointers(caches), caches[0], src.to(device), dst.to(device), moves.to(device),
                   num_depths)
    for got, want in zip(caches, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_reference_equals_gather_then_scatter():
    """Depth-ascending pair-by-pair copies == all gathers of a layer before its scatter (the torch commit)."""
    gen = torch.Generator().manual_seed(7)
    block_size, num_depths = 4, 6
    src, dst, moves = random_pairs(6, num_depths, 40 * block_size, gen)
    cache = torch.randn(40, 2, block_size, 8, generator=gen)
    sequential = cache.clone()
    kv_path_commit_reference([sequential], src, dst, moves, num_depths)
    dst_eff = torch.where(moves, dst, src)
    rows = cache[src // block_size, :, src % block_size]
    cache[dst_eff // block_size, :, dst_eff % block_size] = rows
    torch.testing.assert_close(cache, sequential, rtol=0, atol=0)


def test_rejects_bad_inputs():
    cache = torch.zeros(4, 2, 4, 8)
    ptrs = kv_cache_pointers([cache])
    idx = torch.zeros(6, dtype=torch.int64)
    with pytest.raises(AssertionError, match="Q x 4 depths"):
        kv_path_commit(ptrs, cache, idx, idx, idx.bool(), 4)
    with pytest.raises(AssertionError, match="share a layout"):
        kv_cache_pointers([cache, torch.zeros(4, 2, 4, 16)])
