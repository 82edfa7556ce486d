"""The prompt-lookup branch in Triton: every batch row's chain in two launches (the fused form of
``tree.lookup.lookup_continuation`` over MRV2's token history: ~10 torch kernels per n-gram length,
each over the whole history buffer), and its injection into the candidate lattice in one.

Row b reads request slot ``slots[b]``: its history is ``token_ids[slot, :length]`` with
``length = min(total_len[slot], L)``, ending at the anchor. For n = ``MAX_N`` down to ``MIN_N``, a
start p matches when ``length >= n + 1``, ``p + n < length`` (a token follows the match) and
``token_ids[slot, p:p + n]`` equals the history's last n tokens. The longest matching n wins, and
among its matches the latest p; the chain is the up to ``gamma`` tokens from ``p + n`` (0 past the
history), ``chain_len`` how many there are (0: nothing matched).

1. ``_lookup_scan_kernel``, grid ``(R, cdiv(L, BLOCK_L))``: each block of start positions scores its
   matches ``n * (L + 1) + p + 1`` (longer n first, then later p; 0 for none) and writes its maximum
   to ``scratch[b, block]``; blocks past the history write 0 without reading it. A block reads each of its
   history tokens once (into a device-memory stage: MRV2 keeps the history in pinned host memory).
2. ``_lookup_finalize_kernel``, grid ``(R,)``: the row's best score, decoded into (n, p), then the
   chain gathered from the history.
3. ``_inject_chain_kernel``, grid ``(R, gamma)`` (launcher :func:`inject_chain_lattice`, the fused form of
   ``tree.lookup.inject_chain``: ~35 small torch kernels): program (b, d) writes depth d's candidates with the
   chain token in its slot, and the edges into depth d (the root's at d = 0) with the chain's edges raised to
   ``edge_logprob`` and a replaced slot's other edges at the dtype's minimum.

The launchers read no device value (the scan's grid depends on the buffer's width L, not on the
lengths), so they are safe inside a CUDA-graph capture. Test oracles: ``tree.lookup.lookup_continuation`` over the
gathered rows and ``tree.lookup.inject_chain`` (``tests/triton/test_lookup_chain.py``). The scan scores
matches as vLLM 0.32's n-gram speculator does (``v1/worker/gpu/spec_decode/ngram``), written for the lookup
branch's contract.
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
    def _lookup_scan_kernel(token_ids_ptr, stride_tok, total_len_ptr, slots_ptr, scratch_ptr, stride_scratch,
                            stage_ptr, width, MIN_N: tl.constexpr, MAX_N: tl.constexpr, MAX_N_PAD: tl.constexpr,
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
        # The block's tokens and the MAX_N after it, read from the history once (vLLM keeps it in pinned host
        # memory, read over the bus, for every method but n-gram) into this program's stage in device memory,
        # where the shifted reads below hit the cache; -2 past the history (-1 pads the suffix: never equal).
        offs_l = tl.arange(0, BLOCK_L)
        start = blk * BLOCK_L + offs_l  # [BLOCK_L]
        stage = stage_ptr + (b * tl.num_programs(1) + blk) * (BLOCK_L + MAX_N_PAD)
        tl.store(stage + offs_l, tl.load(row + start, mask=start < length, other=-2))
        halo = blk * BLOCK_L + BLOCK_L + offs_s
        tl.store(stage + BLOCK_L + offs_s, tl.load(row + halo, mask=halo < length, other=-2))
        tl.debug_barrier()
        best = tl.zeros([BLOCK_L], tl.int64)
        for n in tl.static_range(MIN_N, MAX_N + 1):
            match = start + n < length  # a token follows the match (so length >= n + 1: the suffix exists)
            for j in tl.static_range(0, n):
                want = tl.sum(tl.where(offs_s == MAX_N - n + j, suffix, 0), axis=0)  # history[length - n + j]
                tok = tl.load(stage + offs_l + j)
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

    @triton.jit
    def _chain_slot(cand_ptr, stride_cand_d, chain_ptr, chain_len, d, offs_k, K: tl.constexpr):
        """Depth d's chain slot: (candidate row [K_PAD] int64, chain token, slot, on, replaced) with slot the
        candidate equal to the chain token, else K - 1; on: the chain reaches depth d; replaced: on and not
        proposed (the slot's token is the chain's)."""
        row = tl.load(cand_ptr + d * stride_cand_d + offs_k, mask=offs_k < K, other=-1)
        token = tl.load(chain_ptr + d)
        hit = (row == token) & (offs_k < K)
        first = tl.min(tl.where(hit, offs_k, K), axis=0)  # candidates are distinct within a depth
        present = first < K
        slot = tl.where(present, first, K - 1)
        on = d < chain_len
        return row, token, slot, on, on & (first >= K)

    @triton.jit
    def _inject_chain_kernel(cand_ptr, stride_cand_n, stride_cand_d, root_ptr, stride_root_n, trans_ptr,
                             stride_trans_n, stride_trans_d, stride_trans_a, chain_ptr, stride_chain_n, chain_len_ptr,
                             out_tokens_ptr, out_root_ptr, out_trans_ptr, edge_logprob, neg_inf,
                             GAMMA: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        d = tl.program_id(1)
        offs_k = tl.arange(0, K_PAD)
        in_k = offs_k < K
        cand = cand_ptr + b * stride_cand_n
        chain = chain_ptr + b * stride_chain_n
        chain_len = tl.load(chain_len_ptr + b)
        row, token, slot, on, replaced = _chain_slot(cand, stride_cand_d, chain, chain_len, d, offs_k, K)
        mine = (offs_k == slot) & on  # [K_PAD] the chain token's slot at this depth
        tl.store(out_tokens_ptr + (b * GAMMA + d) * K + offs_k, tl.where(mine, token, row), mask=in_k)
        if d == 0:  # the root's edges: the chain's first edge raised (or set, into a replaced slot)
            root = tl.load(root_ptr + b * stride_root_n + offs_k, mask=in_k, other=0.0)
            root_edge = tl.where(replaced, edge_logprob, tl.maximum(root, edge_logprob))
            tl.store(out_root_ptr + b * K + offs_k, tl.where(mine, root_edge, root), mask=in_k)
        else:  # edges from depth d - 1 (slot a) into depth d (slot b): trans[:, d - 1]
            _, _, prev_slot, _, prev_replaced = _chain_slot(cand, stride_cand_d, chain, chain_len, d - 1,
                                                            offs_k, K)
            src = offs_k[:, None] == prev_slot  # [K_PAD, 1]
            dst = offs_k[None, :] == slot  # [1, K_PAD]
            in_tile = in_k[:, None] & in_k[None, :]
            trans = tl.load(trans_ptr + b * stride_trans_n + (d - 1) * stride_trans_d + offs_k[:, None] * stride_trans_a
                            + offs_k[None, :], mask=in_tile, other=0.0)
            cut = (dst & replaced) | (src & prev_replaced)  # a replaced slot keeps only the chain's edges
            fresh = replaced | prev_replaced
            chain_edge = tl.where(fresh, edge_logprob, tl.maximum(trans, edge_logprob))
            out = tl.where(src & dst & on, chain_edge, tl.where(cut, neg_inf, trans))
            tl.store(out_trans_ptr + ((b * (GAMMA - 1) + d - 1) * K + offs_k[:, None]) * K + offs_k[None, :], out,
                     mask=in_tile)


def inject_chain_lattice(
        # [N, gamma, K] int64 candidates (distinct within a depth)
        cand_tokens: torch.Tensor,
        # [N, K] / [N, gamma - 1, K, K] float32 edge log-probs (unit last-dim stride; views allowed)
        root_logp: torch.Tensor, trans_logp: torch.Tensor,
        # [N, gamma] int64 chain tokens, [N] int64 valid lengths
        chain: torch.Tensor, chain_len: torch.Tensor,
        edge_logprob: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``tree.lookup.inject_chain`` in one launch: (tokens, root_logp, trans_logp), new contiguous tensors of the
    inputs' shapes; the inputs are not modified."""
    if edge_logprob > 0.0:
        raise ValueError(f"edge_logprob must be <= 0 (a log-probability), got {edge_logprob}")
    num_reqs, gamma, top_k = cand_tokens.shape
    assert cand_tokens.dtype == torch.int64 and cand_tokens.stride(2) == 1, (
        f"cand_tokens must be int64 with a unit last-dim stride, got {cand_tokens.dtype} "
        f"strides {cand_tokens.stride()}")
    assert root_logp.shape == (num_reqs, top_k) and trans_logp.shape == (num_reqs, max(gamma - 1, 0), top_k, top_k), (
        f"root_logp must be [N, K], trans_logp [N, gamma - 1, K, K]; got {tuple(root_logp.shape)}, "
        f"{tuple(trans_logp.shape)}")
    for name, t in (("root_logp", root_logp), ("trans_logp", trans_logp)):
        assert t.dtype == torch.float32 and t.stride(-1) == 1, (
            f"{name} must be float32 with a unit last-dim stride, got {t.dtype} strides {t.stride()}")
    assert chain.shape == (num_reqs, gamma) and chain.stride(1) == 1 and chain_len.shape == (num_reqs,), (
        f"chain must be [N, gamma] (unit last-dim stride), chain_len [N]; got {tuple(chain.shape)}, "
        f"{tuple(chain_len.shape)}")
    for name, t in (("root_logp", root_logp), ("trans_logp", trans_logp), ("chain", chain),
                    ("chain_len", chain_len)):
        assert t.device == cand_tokens.device, f"{name} is on {t.device}, cand_tokens on {cand_tokens.device}"
    tokens = torch.empty((num_reqs, gamma, top_k), dtype=torch.long, device=cand_tokens.device)
    root = torch.empty((num_reqs, top_k), dtype=torch.float32, device=cand_tokens.device)
    trans = torch.empty((num_reqs, max(gamma - 1, 0), top_k, top_k), dtype=torch.float32, device=cand_tokens.device)
    if num_reqs == 0:
        return tokens, root, trans
    if triton is None:
        raise RuntimeError("inject_chain_lattice needs Triton, which is not installed (use tree.lookup.inject_chain)")
    trans_in = trans_logp if gamma > 1 else root_logp.new_empty((num_reqs, 1, top_k, top_k))
    _inject_chain_kernel[(num_reqs, gamma)](
        cand_tokens, cand_tokens.stride(0), cand_tokens.stride(1), root_logp, root_logp.stride(0),
        trans_in, trans_in.stride(0), trans_in.stride(1), trans_in.stride(2), chain, chain.stride(0), chain_len,
        tokens, root, trans, float(edge_logprob), torch.finfo(torch.float32).min,
        GAMMA=gamma, K=top_k, K_PAD=triton.next_power_of_2(top_k))
    return tokens, root, trans


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
    max_n_pad = triton.next_power_of_2(max_n)
    stage = torch.empty((num_rows, num_blocks, BLOCK_L + max_n_pad), dtype=token_ids.dtype, device=device)
    _lookup_scan_kernel[(num_rows, num_blocks)](
        token_ids, token_ids.stride(0), total_len, slots, scratch, scratch.stride(0), stage, width,
        MIN_N=min_n, MAX_N=max_n, MAX_N_PAD=max_n_pad, BLOCK_L=BLOCK_L)
    _lookup_finalize_kernel[(num_rows,)](
        token_ids, token_ids.stride(0), total_len, slots, scratch, scratch.stride(0), chain, chain_len, width,
        num_blocks, GAMMA=gamma, GAMMA_PAD=triton.next_power_of_2(gamma),
        BLOCKS_PAD=triton.next_power_of_2(num_blocks))
    return chain, chain_len
