"""The prompt-lookup branch's chain of every batch row in two launches (the fused form of
``tree.lookup.lookup_continuation`` over MRV2's token history: ~10 torch kernels per n-gram length,
each over the whole history buffer).

Row b reads request slot ``slots[b]``: its history is ``token_ids[slot, :length]`` with
``length = min(total_len[slot], L)``, ending at the anchor. For n = ``MAX_N`` down to ``MIN_N``, a
start p matches when ``length >= n + 1``, ``p + n < length`` (a token follows the match) and
``token_ids[slot, p:p + n]`` equals the history's last n tokens. The longest matching n wins, and
among its matches the latest p; the chain is the up to ``gamma`` tokens from ``p + n`` (0 past the
history), ``chain_len`` how many there are (0: nothing matched).

1. ``_lookup_scan_kernel``, grid ``(R, cdiv(L, BLOCK_L))``: each block of start positions scores its
   matches ``n * (L + 1) + p + 1`` (longer n first, then later p; 0 for none) and writes its maximum
   to ``scratch[b, block]``; blocks past the history write 0 without reading it.
2. ``_lookup_finalize_kernel``, grid ``(R,)``: the row's best score, decoded into (n, p), then the
   chain gathered from the history.

The launcher reads no device value (the grid depends on the buffer's width L, not on the lengths),
so it is safe inside a CUDA-graph capture. Test oracle: ``tree.lookup.lookup_continuation`` over the
gathered rows (``tests/triton/test_lookup_chain.py``). Same scoring as vLLM 0.32's n-gram speculator
(``v1/worker/gpu/spec_decode/ngram``), written for the lookup branch's contract.
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

BLOCK_L = 1024  # start positions per scan program

if triton is not None:
    @triton.jit
    def _lookup_scan_kernel(token_ids_ptr, stride_tok, total_len_ptr, slots_ptr, scratch_ptr, stride_scratch, width,
                            MIN_N: tl.constexpr, MAX_N: tl.constexpr, MAX_N_PAD: tl.constexpr,
                            BLOCK_L: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1).to(tl.int64)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        length = tl.minimum(tl.load(total_len_ptr + slot).to(tl.int64), width)
        out = scratch_ptr + b * stride_scratch + blk
        if blk * BLOCK_L + MIN_N >= length:  # no start of this block has a token after a MIN_N-match
            tl.store(out, tl.zeros([], tl.int64))
            return
        row = token_ids_ptr + slot * stride_tok
        # the history's last MAX_N tokens, suffix[i] = history[length - MAX_N + i]
        offs_s = tl.arange(0, MAX_N_PAD)
        suffix_pos = length - MAX_N + offs_s
        suffix = tl.load(row + suffix_pos, mask=(offs_s < MAX_N) & (suffix_pos >= 0), other=-1)
        start = blk * BLOCK_L + tl.arange(0, BLOCK_L)  # [BLOCK_L]
        best = tl.zeros([BLOCK_L], tl.int64)
        for n in tl.static_range(MIN_N, MAX_N + 1):
            match = start + n < length  # a token follows the match (so length >= n + 1: the suffix exists)
            for j in tl.static_range(0, n):
                want = tl.sum(tl.where(offs_s == MAX_N - n + j, suffix, 0), axis=0)  # history[length - n + j]
                tok = tl.load(row + start + j, mask=match, other=0)
                match = match & (tok == want)
            best = tl.maximum(best, tl.where(match, n * (width + 1) + start + 1, 0))  # n ascending: later n wins
        tl.store(out, tl.max(best, axis=0))

    @triton.jit
    def _lookup_finalize_kernel(token_ids_ptr, stride_tok, total_len_ptr, slots_ptr, scratch_ptr, stride_scratch,
                                chain_ptr, chain_len_ptr, width, num_blocks,
                                GAMMA: tl.constexpr, GAMMA_PAD: tl.constexpr, BLOCKS_PAD: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        length = tl.minimum(tl.load(total_len_ptr + slot).to(tl.int64), width)
        offs_blk = tl.arange(0, BLOCKS_PAD)
        score = tl.max(tl.load(scratch_ptr + b * stride_scratch + offs_blk, mask=offs_blk < num_blocks, other=0),
                       axis=0)
        offs_d = tl.arange(0, GAMMA_PAD)
        found = (score + offs_d * 0) > 0  # [GAMMA_PAD], one value: the interpreter masks with vectors only
        n = (score - 1) // (width + 1)
        end = tl.where(found, score - 1 - n * (width + 1) + n, 0)  # the match's start + n: the chain's first index
        idx = end + offs_d
        valid = found & (offs_d < GAMMA) & (idx < length)
        chain = tl.load(token_ids_ptr + slot * stride_tok + idx, mask=valid, other=0).to(tl.int64)
        tl.store(chain_ptr + b * GAMMA + offs_d, chain, mask=offs_d < GAMMA)
        tl.store(chain_len_ptr + b, tl.sum(valid.to(tl.int64), axis=0))


def lookup_chain_rows(
        # [max_num_reqs, L] int32/int64 token history per request slot (MRV2's all_token_ids; may be a row view)
        token_ids: torch.Tensor,
        # [max_num_reqs] int32/int64 history length per slot (prompt + output, the anchor included)
        total_len: torch.Tensor,
        # [R] int64 the batch rows' slots (each < max_num_reqs)
        slots: torch.Tensor, gamma: int, min_n: int, max_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(chain [R, gamma] int64, chain_len [R] int64); see the module docstring."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    assert token_ids.dim() == 2 and token_ids.stride(1) == 1, (
        f"token_ids must be [max_num_reqs, L] with a unit last-dim stride, got {tuple(token_ids.shape)} "
        f"strides {token_ids.stride()}")
    assert total_len.shape == (token_ids.shape[0],), (
        f"total_len must be [{token_ids.shape[0]}], got {tuple(total_len.shape)}")
    assert slots.dim() == 1, f"slots must be [R], got {tuple(slots.shape)}"
    for name, t in (("token_ids", token_ids), ("total_len", total_len), ("slots", slots)):
        assert not t.is_floating_point(), f"{name} must be an integer tensor, got {t.dtype}"
        assert t.device == token_ids.device, f"{name} is on {t.device}, token_ids on {token_ids.device}"
    num_rows, width = slots.shape[0], token_ids.shape[1]
    device = token_ids.device
    chain = torch.empty((num_rows, gamma), dtype=torch.long, device=device)
    chain_len = torch.empty((num_rows,), dtype=torch.long, device=device)
    if num_rows == 0:
        return chain, chain_len
    if triton is None:
        raise RuntimeError("lookup_chain_rows needs Triton, which is not installed "
                           "(use tree.lookup.lookup_continuation)")
    num_blocks = triton.cdiv(width, BLOCK_L)
    scratch = torch.empty((num_rows, num_blocks), dtype=torch.long, device=device)
    _lookup_scan_kernel[(num_rows, num_blocks)](
        token_ids, token_ids.stride(0), total_len, slots, scratch, scratch.stride(0), width,
        MIN_N=min_n, MAX_N=max_n, MAX_N_PAD=triton.next_power_of_2(max_n), BLOCK_L=BLOCK_L)
    _lookup_finalize_kernel[(num_rows,)](
        token_ids, token_ids.stride(0), total_len, slots, scratch, scratch.stride(0), chain, chain_len, width,
        num_blocks, GAMMA=gamma, GAMMA_PAD=triton.next_power_of_2(gamma),
        BLOCKS_PAD=triton.next_power_of_2(num_blocks))
    return chain, chain_len
