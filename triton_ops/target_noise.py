"""The verification's own Gumbel noise on the drafter's scores (coupled drafting, docs/design/mrv2.md §11).

Model Runner V2 draws the target's token at a tree node with vLLM's ``gumbel_sample``: the argmax of
``logits / T + G(seed, pos, v)``, where ``G`` is a Gumbel variate hashed from the request's seed, the
position of the row that draws and the token id (vLLM 0.32 ``v1/worker/gpu/sample/gumbel.py``: murmur3 of
(seed, pos, token) -> a uniform u -> ``-log(-log1p(-u))``, or with ``use_fp64`` two hashes -> an fp64 uniform ->
``-log(-log u)``). The noise is known before the draw, so the drafter can rank its candidates by the same
perturbed scores the target will be ranked by: ``vocab_top_k`` keeps the top K of ``logp / T + G`` for a row of
temperature ``T > 0`` (of ``logp`` itself for ``T = 0``). What the target emits does not change (every output
token is still the target's own draw with that noise, as in non-speculative decoding), only which candidates
the tree holds; a drafter close to the target then holds the target's draw far more often than its top-K.

Keys: a candidate for the token at position P is drawn by the row at P - 1, so ``pos`` is P - 1, as vLLM's DFlash
sampler keys its drafts (``sample_pos - 1``). This module reimplements vLLM's hash (the kernel and
:func:`~ubtree_vllm.triton_ops.reference.gumbel_noise_reference` must reproduce vLLM's draws bit for bit, or the
coupling is lost; a lost coupling costs acceptance, never correctness): ``tests/triton/test_target_noise.py``
checks the argmax against vLLM's own ``gumbel_sample``.

This module holds the noise's ``@triton.jit`` functions; ``vocab_top_k`` calls them.
"""
from __future__ import annotations

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    @triton.jit
    def _rotl32(value, shift: tl.constexpr):
        return (value << shift) | (value >> (32 - shift))

    @triton.jit
    def _mix(h, key):
        key *= 0xCC9E2D51
        key = _rotl32(key, 15)
        key *= 0x1B873593
        h ^= key
        h = _rotl32(h, 13)
        return h * 5 + 0xE6546B64

    @triton.jit
    def _fmix32(h):
        h ^= h >> 16
        h *= 0x85EBCA6B
        h ^= h >> 13
        h *= 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _hash32(seed, pos, offset, domain: tl.constexpr):
        seed = seed.to(tl.int64)
        pos = pos.to(tl.int64)
        offset = offset.to(tl.uint32)
        h = (seed ^ seed).to(tl.uint32)
        h ^= domain
        h = _mix(h, (seed & 0xFFFFFFFF).to(tl.uint32))
        h = _mix(h, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32))
        h = _mix(h, (pos & 0xFFFFFFFF).to(tl.uint32))
        h = _mix(h, offset)
        return _fmix32(h ^ 16)

    @triton.jit
    def _gumbel32(seed, pos, offset):
        random32 = _hash32(seed, pos, offset, 0)
        hi16 = (random32 >> 16).to(tl.int32)
        lo16 = (random32 & 0xFFFF).to(tl.int32)
        u = hi16.to(tl.float32) * 1.52587890625e-05 + (lo16.to(tl.float32) + 0.5) * 2.3283064365386963e-10
        poly = 1.0 / 8.0
        poly = 1.0 / 7.0 + u * poly
        poly = 1.0 / 6.0 + u * poly
        poly = 1.0 / 5.0 + u * poly
        poly = 1.0 / 4.0 + u * poly
        poly = 1.0 / 3.0 + u * poly
        poly = 1.0 / 2.0 + u * poly
        poly = 1.0 + u * poly
        series = -u * poly
        direct = tl.log(tl.maximum(1.0 - u, 5.960464477539063e-08))
        return -tl.log(-tl.where(u < 0.25, series, direct))

    @triton.jit
    def _gumbel64(seed, pos, offset):
        lo = _hash32(seed, pos, offset, 0).to(tl.uint64)
        hi = _hash32(seed, pos, offset, 0x9E3779B9).to(tl.uint64)
        random53 = ((hi << 32) | lo) >> 11
        u = (random53.to(tl.float64) + 0.5) * 1.1102230246251565e-16
        u = tl.where(u == 1.0, u - 1.1102230246251565e-16, u)
        return -tl.log(-tl.log(u))
