"""triton_ops.scratch_rows against its torch twin: flash_exact's tail and path copies into scratch pages, on a
FlashAttention cache's strided key / value views, with copies of unused entries piling onto one dump slot (made, or
skipped as flash_exact skips them), in lists whose length is no multiple of a program's copies.

Without CUDA the kernel runs under the Triton interpreter on CPU tensors (tests/conftest.py sets
``TRITON_INTERPRET=1``).
"""
from __future__ import annotations

import pytest
import torch

from kernel_device import DEVICE
from ubtree_vllm.triton_ops.reference import scratch_rows_reference
from ubtree_vllm.triton_ops.scratch_rows import launch_meta, scratch_rows


@pytest.mark.parametrize("skip_dump", [False, True], ids=["dump-made", "dump-skipped"])
@pytest.mark.parametrize("dtype,heads,head_size", [(torch.bfloat16, 3, 64), (torch.float32, 2, 48),
                                                   (torch.float16, 8, 128)])
def test_scratch_rows_matches_its_twin(dtype, heads, head_size, skip_dump):
    gen = torch.Generator().manual_seed(heads)
    num_blocks, block_size, rows = 12, 16, 9
    kv_cache = torch.randn(num_blocks, heads, block_size, 2 * head_size, generator=gen).to(dtype)
    qkv = torch.randn(rows, 4 * heads * head_size, generator=gen).to(dtype)  # fresh K/V: strided views of one tensor
    key = qkv[:, :heads * head_size].view(rows, heads, head_size)
    value = qkv[:, 2 * heads * head_size: 3 * heads * head_size].view(rows, heads, head_size)
    # tails: scheduler pages 0..7 -> scratch pages 8..10; unused copies onto the dump page 11, slot 0
    tail_src = torch.randint(0, 8 * block_size, (20,), generator=gen)
    tail_dst = torch.randperm(3 * block_size, generator=gen)[:20] + 8 * block_size
    tail_dst[15:] = 11 * block_size
    path_row = torch.randint(0, rows, (14,), generator=gen)
    path_dst = torch.randperm(3 * block_size, generator=gen)[:14] + 8 * block_size
    path_dst[10:] = 11 * block_size
    path_dst[:10] = torch.tensor([s for s in range(8 * block_size, 11 * block_size) if s not in tail_dst[:15]][:10])

    skip = {"skip_dst_page": 11} if skip_dump else {}
    assert launch_meta(heads, head_size)["COPIES"] > 1  # several copies per program, the last one partial

    def run(copy, cache):
        key_cache, value_cache = cache.transpose(1, 2).split(head_size, dim=-1)  # FlashAttentionImpl's views
        on = [t.to(cache.device) for t in (key, value, tail_src // block_size, tail_src % block_size,
                                            tail_dst // block_size, tail_dst % block_size, path_row,
                                            path_dst // block_size, path_dst % block_size)]
        copy(key_cache, value_cache, *on, **skip)  # every tensor on the cache's device (the twin runs on the CPU)
        return cache

    ref = run(scratch_rows_reference, kv_cache.clone())
    got = run(scratch_rows, kv_cache.clone().to(DEVICE)).cpu()
    assert torch.equal(got[:11], ref[:11])  # every page but the dump page, bit for bit
    assert torch.equal(got[:8], kv_cache[:8])  # the scheduler's pages untouched
    assert not torch.equal(got[8:11], kv_cache[8:11])  # the copies were made
    if skip_dump:  # no copy onto the skipped page
        assert torch.equal(got[11], kv_cache[11]) and torch.equal(ref[11], kv_cache[11])


def test_no_copies_is_a_no_op():
    cache = torch.randn(2, 1, 16, 8).to(DEVICE)
    key_cache, value_cache = cache.transpose(1, 2).split(4, dim=-1)
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    scratch_rows(key_cache, value_cache, torch.zeros(1, 1, 4, device=DEVICE), torch.zeros(1, 1, 4, device=DEVICE),
                 *(empty,) * 7)
