"""The drafter's top K per row of a vocabulary, in one read of the logits (no full-vocabulary output).

The drafter keeps, per block position, the K tokens of largest score, where the score is the log-prob
``logp = logit - lse`` (T = 0) or the coupled score ``logp / T + G(seed, pos, v)`` (T > 0, ``target_noise``).
``lse`` is one constant per row, so ranking by ``logit`` (or ``logit / T + G``) keeps the same tokens. Each
program takes one (row, vocabulary block): the block's log-sum-exp partials (max, sum of exp) and its top K_PAD
by that score (``tl.topk`` over keys that pack the score's order-preserving bits above the token id). A small merge
in torch combines a row's blocks (its lse; the top K of blocks x K_PAD entries) and subtracts lse.

What it replaces: a float32 [R, V] log-softmax, a float32 [R, V] coupled-score copy and a full-vocabulary
``torch.topk`` (at 64 requests, gamma 16 and SmolLM2's 49152 tokens, R x V is 50 M entries per step).
Exactly the reference's tokens wherever the K-th and (K+1)-th scores are not within float32 rounding of each other
(the scores are the same sums in another order); a near tie picks either token, which changes a draft, never an
output (the verification decides every token).

The launcher reads no device value.
"""
from __future__ import annotations

import torch

from ubtree_vllm.triton_ops.reference import vocab_top_k_reference

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl

    from ubtree_vllm.triton_ops.target_noise import _gumbel32, _gumbel64
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

BLOCK = 2048  # vocabulary entries per program (a power of two, tl.topk's hypercube)


if triton is not None:
    @triton.jit
    def _block_top_k_kernel(
            # [R, V] logits (row stride logits_stride), any float dtype
            logits_ptr, logits_stride, vocab_size,
            # [R] float temperature, int64 seed, int position of the drawing row (read only when HAS_NOISE)
            temperature_ptr, seeds_ptr, pos_ptr,
            # out: [R, NB, K_PAD] float32 block scores (logit or logit / T + G) and int32 token ids, best first
            top_score_ptr, top_token_ptr,
            # out: [R, NB] float32 the block's max logit and sum of exp(logit - max)
            block_max_ptr, block_sum_ptr,
            BLOCK: tl.constexpr, K_PAD: tl.constexpr, HAS_NOISE: tl.constexpr, USE_FP64: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        num_blocks = tl.num_programs(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < vocab_size
        x = tl.load(logits_ptr + row * logits_stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        x_max = tl.max(x, axis=0)  # -inf for a block of -inf logits: its sum is 0, its max weighs nothing in the merge
        x_sum = tl.sum(tl.where(mask, tl.exp(x - tl.where(x_max == float("-inf"), 0.0, x_max)), 0.0), axis=0)
        score = x
        if HAS_NOISE:
            temp = tl.load(temperature_ptr + row).to(tl.float32)
            if temp != 0.0:
                seed = tl.load(seeds_ptr + row)
                pos = tl.load(pos_ptr + row)
                if USE_FP64:
                    noise = _gumbel64(seed, pos, cols).to(tl.float32)
                else:
                    noise = _gumbel32(seed, pos, cols)
                score = x / temp + noise
        score = tl.where(mask, score, float("-inf"))
        # order-preserving int32 of a float32: non-negative floats keep their bits, negative ones flip all but the sign
        bits = score.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        keys = (ordered.to(tl.int64) << 32) | cols.to(tl.int64)  # cols < 2^31: the low word never carries a sign
        if K_PAD == 1:  # Triton 3.6's tl.topk cannot take k = 1 (it reshapes a scalar)
            top = tl.max(keys[None, :], axis=1)  # [1]
        else:
            top = tl.topk(keys, K_PAD)  # [K_PAD] best first
        top_ordered = (top >> 32).to(tl.int32)
        top_bits = tl.where(top_ordered >= 0, top_ordered, top_ordered ^ 0x7FFFFFFF)
        out = (row * num_blocks + blk) * K_PAD + tl.arange(0, K_PAD)
        tl.store(top_score_ptr + out, top_bits.to(tl.float32, bitcast=True))
        tl.store(top_token_ptr + out, (top & 0xFFFFFFFF).to(tl.int32))
        tl.store(block_max_ptr + row * num_blocks + blk, x_max)
        tl.store(block_sum_ptr + row * num_blocks + blk, x_sum)


def vocab_top_k(
        # [R, V] logits (any float dtype; log-probs give the same result)
        logits: torch.Tensor, top_k: int,
        # [R] float temperature (0: greedy, no noise), [R] int64 seed, [R] int position of the drawing row;
        # None: every row greedy
        temperature: torch.Tensor | None = None, seeds: torch.Tensor | None = None, pos: torch.Tensor | None = None,
        use_fp64: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [R, K] int64, their log-probs [R, K] float32, their scores [R, K] float32), best score first: the
    score is the log-prob where T = 0 and ``logp / T + G`` where T > 0 (module docstring). The kernel on CUDA, the
    torch twin (``reference.vocab_top_k_reference``) elsewhere (the interpreter would take seconds per block)."""
    if logits.is_cuda and triton is not None:
        return vocab_top_k_kernel(logits, top_k, temperature, seeds, pos, use_fp64)
    return vocab_top_k_reference(logits, top_k, temperature, seeds, pos, use_fp64)


def vocab_top_k_kernel(logits: torch.Tensor, top_k: int, temperature: torch.Tensor | None = None,
                       seeds: torch.Tensor | None = None, pos: torch.Tensor | None = None,
                       use_fp64: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`vocab_top_k` through the kernel (CUDA tensors, or CPU tensors under the Triton interpreter): one launch, then
    a [R, V / BLOCK x K_PAD] merge in torch."""
    num_rows, vocab = logits.shape
    assert 1 <= top_k <= vocab, f"top_k must be in [1, {vocab}], got {top_k}"
    has_noise = temperature is not None
    if has_noise:
        for name, t in (("temperature", temperature), ("seeds", seeds), ("pos", pos)):
            assert t is not None and t.shape == (num_rows,), f"{name} must be [R={num_rows}]"
            assert t.device == logits.device, f"{name} is on {t.device}, logits on {logits.device}"
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    k_pad = 1 << (top_k - 1).bit_length()
    block = max(BLOCK, k_pad)
    num_blocks = triton.cdiv(vocab, block)
    dev = logits.device
    top_score = torch.empty((num_rows, num_blocks * k_pad), dtype=torch.float32, device=dev)
    top_token = torch.empty((num_rows, num_blocks * k_pad), dtype=torch.int32, device=dev)
    block_max = torch.empty((num_rows, num_blocks), dtype=torch.float32, device=dev)
    block_sum = torch.empty((num_rows, num_blocks), dtype=torch.float32, device=dev)
    if num_rows:
        noise_args = (temperature.contiguous(), seeds.contiguous(), pos.contiguous()) if has_noise else (logits,) * 3
        _block_top_k_kernel[(num_rows, num_blocks)](
            logits, logits.stride(0), vocab, *noise_args, top_score, top_token, block_max, block_sum,
            BLOCK=block, K_PAD=k_pad, HAS_NOISE=has_noise, USE_FP64=use_fp64)
    # merge a row's blocks: lse [R, 1]; the top K of the block candidates
    row_max = block_max.amax(dim=-1, keepdim=True)
    lse = row_max + torch.log((block_sum * torch.exp(block_max - row_max)).sum(dim=-1, keepdim=True))
    best, where = torch.topk(top_score, top_k, dim=-1)  # [R, K]
    tokens = top_token.gather(-1, where).long()
    logp = logits.gather(-1, tokens).float() - lse
    if not has_noise:
        return tokens, logp, logp
    temp = temperature.float()[:, None]
    scores = torch.where(temp > 0, best - lse / torch.where(temp > 0, temp, 1.0), logp)
    return tokens, logp, scores
