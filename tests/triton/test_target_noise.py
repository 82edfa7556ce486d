"""triton_ops.target_noise: the coupling it exists for -- the noise is vLLM's own, so the kernel's top 1 of
``logits / T + noise`` (``vocab_top_k``) is vLLM's ``gumbel_sample`` draw, and so is the reference noise's argmax.

Without CUDA the kernel and vLLM's kernel run under the Triton interpreter (tests/conftest.py sets
TRITON_INTERPRET=1; vLLM's module re-executed with the real triton, tests/vllm/vllm_triton_kernels.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kernel_device import CUDA, DEVICE
from ubtree_vllm.triton_ops.reference import gumbel_noise_reference, hash32_reference
from ubtree_vllm.triton_ops.vocab_top_k import vocab_top_k_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))


def vllm_gumbel_module():
    """vLLM's MRV2 sampling kernels: the real module on CUDA, an interpreted copy on the CPU."""
    import vllm.v1.worker.gpu.sample.gumbel as gumbel

    if CUDA:
        return gumbel
    from vllm_triton_kernels import interpreted

    return interpreted(gumbel)


def batch(num_rows: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 3
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.5] * num_rows)[:num_rows]
    seeds = torch.randint(-(2 ** 62), 2 ** 62, (num_rows,), generator=gen)  # both 32-bit halves of the seed used
    pos = torch.randint(0, 40000, (num_rows,), generator=gen)
    return [t.to(DEVICE) for t in (logits, temperature, seeds, pos)]


def test_hash_reference_is_murmur3_of_the_three_words():
    """Known-answer values of the reference hash (MurmurHash3 x86_32 over the four 32-bit words seed_lo, seed_hi,
    pos, token with vLLM's seed-0 start and length 16), computed by an independent byte-level implementation."""
    def murmur3_bytes(data: bytes, seed: int = 0) -> int:
        c1, c2, h = 0xCC9E2D51, 0x1B873593, seed
        for i in range(0, len(data), 4):
            k = int.from_bytes(data[i:i + 4], "little")
            k = (k * c1) & 0xFFFFFFFF
            k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
            k = (k * c2) & 0xFFFFFFFF
            h ^= k
            h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
            h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
        h ^= len(data)
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    for seed, pos, token in ((0, 0, 0), (12345, 77, 49151), (2 ** 40 + 3, 2 ** 31 + 5, 7), (-5, 1, 2)):
        words = [seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF, pos & 0xFFFFFFFF, token & 0xFFFFFFFF]
        want = murmur3_bytes(b"".join(w.to_bytes(4, "little") for w in words))
        got = hash32_reference(torch.tensor(seed), torch.tensor(pos), torch.tensor(token))
        assert int(got) == want, (seed, pos, token)


@pytest.mark.parametrize("use_fp64", [False, True])
def test_argmax_of_the_coupled_scores_is_vllms_draw(use_fp64):
    """The same noise as vLLM's verification: argmax(logits / T + G) is the token vLLM's gumbel_sample draws at
    that seed and position (the drafter's top 1 under a perfect proposer), and the reference noise agrees."""
    gumbel = vllm_gumbel_module()
    num_rows, vocab = 24, 2500
    logits, temperature, seeds, pos = batch(num_rows, vocab, seed=11)
    temperature = temperature.clamp(min=0.5)  # every row samples
    rows = torch.arange(num_rows, device=DEVICE)
    vllm_draw = gumbel.gumbel_sample(logits, rows, temperature, seeds, pos, apply_temperature=True,
                                     is_drafting=False, use_fp64=use_fp64)
    ours = vocab_top_k_kernel(logits, 1, temperature, seeds, pos, use_fp64)[0][:, 0]  # the kernel's noise
    assert torch.equal(ours, vllm_draw)
    noise = gumbel_noise_reference(seeds.cpu()[:, None], pos.cpu()[:, None], torch.arange(vocab)[None], use_fp64)
    scaled = logits.cpu() / temperature.cpu()[:, None]  # vLLM divides in fp32, then adds the noise
    reference = ((scaled.double() if use_fp64 else scaled) + noise).argmax(-1)
    assert torch.equal(reference, vllm_draw.cpu())
