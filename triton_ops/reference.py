"""Pure-torch twins of the Triton launchers: the test oracles (one Python loop per row).

Each function takes exactly the arguments of its launcher in ``triton_ops/<op>.py`` and
writes the same outputs. They read device values on the host (``.tolist()``) and loop in
Python, so they are for tests and debugging only, never for the decode path.
"""
from __future__ import annotations

import torch


def _context_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor, req: int,
                context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Committed context tokens 0 .. context_len - 1 of request ``req`` read through its block table:
    (key, value), each [context_len, H_kv, D] in the cache dtype."""
    pos = torch.arange(context_len, device=key_cache.device)  # [c]
    block_ids = block_table[req, pos // key_cache.shape[1]].long()  # [c]
    slots = pos % key_cache.shape[1]
    return key_cache[block_ids, slots], value_cache[block_ids, slots]


def tree_attention_reference(
        # [T, H, D] query rows of the forward
        query: torch.Tensor,
        # [T, H_kv, D] the layer's fresh key / value rows of the forward
        key: torch.Tensor, value: torch.Tensor,
        # [num_blocks, block_size, H_kv, D] paged cache views (may be non-contiguous)
        key_cache: torch.Tensor, value_cache: torch.Tensor,
        # [num_reqs, max_blocks] int32/int64 block ids per request
        block_table: torch.Tensor,
        # [M] int global row of each tree row to compute; -1 = skip the entry
        row_index: torch.Tensor,
        # [M] int request (row of block_table) of each tree row
        row_req: torch.Tensor,
        # [M] int committed context length of the row's request
        row_context_len: torch.Tensor,
        # [M, P] int global rows of the root->row path (ancestors-or-self), -1 padded
        row_path: torch.Tensor,
        scale: float,
        # [T, H, D] mutable: rows row_index are overwritten, the others untouched
        out: torch.Tensor) -> torch.Tensor:
    """Row r: ``out[row_index[r]] = softmax(q K^T * scale) V`` over context + path, fp32 math.

    K/V of row r = context tokens 0 .. row_context_len[r] - 1 of request row_req[r] (read
    through its block table) followed by ``key/value[row_path[r, j]]`` for every
    ``row_path[r, j] >= 0``. Query head h reads kv head ``h // (H // H_kv)``. A row with
    nothing to attend to gets zeros; entries with row_index -1 are skipped. Returns ``out``.
    """
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    group = num_heads // num_kv_heads
    rows = zip(row_index.tolist(), row_req.tolist(), row_context_len.tolist(), row_path.tolist())
    for row, req, context_len, path in rows:
        if row < 0:
            continue
        context_k, context_v = _context_kv(key_cache, value_cache, block_table, req, context_len)  # [c, H_kv, D]
        path_rows = torch.tensor([p for p in path if p >= 0], dtype=torch.long, device=key.device)
        # [c + depth + 1, H, D] fp32, kv heads repeated over their query-head group
        k = torch.cat([context_k, key[path_rows]]).float()
        v = torch.cat([context_v, value[path_rows]]).float()
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if k.shape[0] == 0:
            out[row] = 0
            continue
        scores = torch.einsum("hd,nhd->hn", query[row].float(), k) * scale  # [H, n]
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(out.dtype)
    return out


def context_attention_reference(
        # [T, H, D] query rows of the forward
        query: torch.Tensor,
        # [num_blocks, block_size, H_kv, D] paged cache views
        key_cache: torch.Tensor, value_cache: torch.Tensor,
        # [num_reqs, max_blocks] block ids per request
        block_table: torch.Tensor,
        # [M] global row / request / committed context length of each tree row (-1 row: skipped)
        row_index: torch.Tensor, row_req: torch.Tensor, row_context_len: torch.Tensor,
        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tree row's attention over its committed context alone, as FlashAttention returns it with the
    context lengths as ``seqused_k`` and ``return_softmax_lse``: (out [T, H, D] in the query dtype, normalised;
    lse [H, T] fp32 natural log-sum-exp of the scaled scores, +inf where a row has no context, as
    FlashAttention reports it). Rows that are no tree row hold zeros and lse +inf. The ``context_out`` /
    ``context_lse`` inputs of :func:`ubtree_vllm.triton_ops.tree_attention`."""
    num_heads, num_kv_heads = query.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    lse = torch.full((num_heads, query.shape[0]), float("inf"), dtype=torch.float32, device=query.device)
    for row, req, context_len in zip(row_index.tolist(), row_req.tolist(), row_context_len.tolist()):
        if row < 0 or context_len == 0:
            continue
        k, v = (t.float().repeat_interleave(group, dim=1)  # [c, H, D]
                for t in _context_kv(key_cache, value_cache, block_table, req, context_len))
        scores = torch.einsum("hd,nhd->hn", query[row].float(), k) * scale  # [H, c]
        out[row] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), v).to(out.dtype)
        lse[:, row] = torch.logsumexp(scores, dim=-1)
    return out, lse


def tree_mla_attention_reference(q_latent, q_rope, kv_latent, k_rope, kv_cache, block_table, row_index, row_req,
                                 row_context_len, row_path, scale, out):
    """Twin of ``tree_mla_attention``: row r's heads attend, fp32, to the latent context of its request
    (``kv_cache[..., :L]`` with RoPE keys ``kv_cache[..., L:]``) then its path's fresh rows; returns ``out``."""
    latent = q_latent.shape[-1]
    block_size = kv_cache.shape[1]
    rows = zip(row_index.tolist(), row_req.tolist(), row_context_len.tolist(), row_path.tolist())
    for row, req, context_len, path in rows:
        if row < 0:
            continue
        pos = torch.arange(context_len, device=kv_cache.device)
        cached = kv_cache[block_table[req, pos // block_size].long(), pos % block_size].float()  # [c, L + R]
        path_rows = torch.tensor([p for p in path if p >= 0], dtype=torch.long, device=kv_latent.device)
        c = torch.cat([cached[:, :latent], kv_latent[path_rows].float()])  # [n, L]
        kr = torch.cat([cached[:, latent:], k_rope[path_rows].float()])  # [n, R]
        if c.shape[0] == 0:
            out[row] = 0
            continue
        scores = (q_latent[row].float() @ c.T + q_rope[row].float() @ kr.T) * scale  # [H, n]
        out[row] = (scores.softmax(dim=-1) @ c).to(out.dtype)
    return out


def kv_path_commit_reference(
        # the layers' caches, each [num_blocks, H_kv, block_size, E] (mutated)
        kv_caches: list[torch.Tensor],
        # [Q * D] int64 source / destination slot per (request, depth), depth-major within a request
        src_slot: torch.Tensor, dst_slot: torch.Tensor,
        # [Q * D] bool: copy this pair
        moves: torch.Tensor,
        num_depths: int) -> None:
    """Twin of :func:`ubtree_vllm.triton_ops.kv_path_commit.kv_path_commit`: pairs one by one, depths ascending."""
    for cache in kv_caches:
        block_size = cache.shape[2]
        for src, dst, move in zip(src_slot.tolist(), dst_slot.tolist(), moves.tolist()):
            if move:
                cache[dst // block_size, :, dst % block_size] = cache[src // block_size, :, src % block_size].clone()


def scratch_rows_reference(
        # [num_blocks, block_size, H_kv, D] one layer's key / value cache views (mutated)
        key_cache: torch.Tensor, value_cache: torch.Tensor,
        # [T, H_kv, D] the layer's fresh key / value rows
        key: torch.Tensor, value: torch.Tensor,
        # [num_tail] page / slot read and page / slot written per tail copy
        tail_src_page: torch.Tensor, tail_src_slot: torch.Tensor, tail_dst_page: torch.Tensor,
        tail_dst_slot: torch.Tensor,
        # [num_path] fresh row read and page / slot written per path copy
        path_row: torch.Tensor, path_dst_page: torch.Tensor, path_dst_slot: torch.Tensor,
        # copies written to this page are not made; -1: every copy is made
        skip_dst_page: int = -1) -> None:
    """Twin of :func:`ubtree_vllm.triton_ops.scratch_rows.scratch_rows`: the copies one by one, tails first."""
    tails = zip(tail_src_page.tolist(), tail_src_slot.tolist(), tail_dst_page.tolist(), tail_dst_slot.tolist())
    for src_page, src_slot, dst_page, dst_slot in tails:
        if dst_page == skip_dst_page:
            continue
        for cache in (key_cache, value_cache):
            cache[dst_page, dst_slot] = cache[src_page, src_slot].clone()
    for row, dst_page, dst_slot in zip(path_row.tolist(), path_dst_page.tolist(), path_dst_slot.tolist()):
        if dst_page != skip_dst_page:
            key_cache[dst_page, dst_slot] = key[row]
            value_cache[dst_page, dst_slot] = value[row]


def tree_prefill_mask_reference(
        # [R_pad] int32 tokens per request including its q rows (0: padding)
        seq_lens: torch.Tensor,
        # [T] int64 g for a tree row with a path, else -1; [T, P] int64 root-first global rows, -1 padded
        row_index: torch.Tensor, row_path: torch.Tensor,
        q: int,
        # [R_pad] int32 planned pages; [R_pad + 1] int64 byte offsets of the mask segments
        kv_pages: torch.Tensor, mask_offsets: torch.Tensor,
        page_size: int,
        # [>= mask_offsets[-1]] uint8 (mutated: the segments only)
        out_mask: torch.Tensor,
        *, max_kv_len: int | None = None) -> None:
    """Twin of :func:`ubtree_vllm.triton_ops.tree_prefill_mask.tree_prefill_mask`: each request's ``[q, kv_len]``
    visibility as a bool matrix, packed little bit order into its segment. ``max_kv_len``, where given, is checked
    to bound every request's keys (the launcher's grid needs that)."""
    offsets, paths = mask_offsets.tolist(), row_path.tolist()
    tree_rows = row_index.tolist()
    weights = 1 << torch.arange(8)  # [8] little bit order
    for r, (seq_len, pages) in enumerate(zip(seq_lens.tolist(), kv_pages.tolist())):
        kv_len, ctx = pages * page_size, max(seq_len - q, 0)
        assert offsets[r + 1] - offsets[r] == q * kv_len // 8, f"request {r}: segment of {q} x {kv_len} bits"
        assert max_kv_len is None or kv_len <= max_kv_len, f"request {r}: {kv_len} keys > max_kv_len {max_kv_len}"
        visible = torch.zeros(q, kv_len, dtype=torch.bool)
        for i in range(q):
            g = r * q + i
            if i == 0 or tree_rows[g] < 0:
                visible[i, :ctx + 1] = True  # the context and the row's own key
                continue
            visible[i, :ctx] = True
            for node in paths[g]:
                j = node - r * q
                if node >= 0 and 0 <= j < q and ctx + j < kv_len:
                    visible[i, ctx + j] = True
        packed = (visible.view(-1, 8).long() * weights).sum(1).to(torch.uint8)  # [q * kv_len / 8]
        out_mask[offsets[r]:offsets[r + 1]] = packed.to(out_mask.device)


def paged_kv_indices_reference(
        # [R_rows, max_blocks] int32 pages (requests past R_rows are padding)
        block_table: torch.Tensor,
        # [R_pad] int32 pages per request; [R_pad + 1] int32 cumulative
        kv_pages: torch.Tensor, kv_indptr: torch.Tensor,
        # [>= kv_indptr[-1]] int32 (mutated)
        out_indices: torch.Tensor,
        max_pages: int) -> None:
    """Twin of :func:`ubtree_vllm.triton_ops.tree_prefill_mask.paged_kv_indices`: request by request, the first
    ``kv_pages[r]`` ids of its table row, 0 past the table (rows or columns) and for a negative id."""
    table = block_table.tolist()
    for r, (pages, start) in enumerate(zip(kv_pages.tolist(), kv_indptr.tolist())):
        assert pages <= max_pages, f"request {r}: {pages} pages > max_pages {max_pages}"
        row = table[r] if r < len(table) else []
        ids = [max(row[j], 0) if j < len(row) else 0 for j in range(pages)]
        out_indices[start:start + pages] = torch.tensor(ids, dtype=out_indices.dtype)


def gated_delta_rule_chain_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                     beta: torch.Tensor, state: torch.Tensor, scale: float, delta: bool = True
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The chain recurrence of one sequence (fla's fused recurrent form; delta=False: Mamba2's), float32.

    q/k [L, H, Dk], v [L, H, Dv], g [L, H] or [L, H, Dk], beta [L, H], state [H, Dk, Dv].
    Returns (o [L, H, Dv], states [L, H, Dk, Dv] after each token)."""
    state = state.float().clone()
    outs, states = [], []
    for t in range(q.shape[0]):
        decay = g[t].float().exp()
        state = state * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
        correction = torch.einsum("hkv,hk->hv", state, k[t].float()) if delta else 0.0
        u = beta[t].float()[:, None] * (v[t].float() - correction)
        state = state + k[t].float()[:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[t].float()) * scale)
        states.append(state.clone())
    return torch.stack(outs), torch.stack(states)


def tree_gated_delta_rule_reference(q, k, v, g, beta, parents, initial_state, scale, delta=True):
    """Twin of :func:`ubtree_vllm.triton_ops.tree_delta_rule.tree_gated_delta_rule`: node by node, each
    starting from its parent's state (or the committed one). Same arguments and outputs."""
    num_reqs, num_nodes = parents.shape
    o = torch.empty_like(v)
    states = torch.empty((*q.shape[:3], q.shape[3], v.shape[3]), dtype=torch.float32, device=q.device)
    for n in range(num_reqs):
        for t, parent in enumerate(parents[n].tolist()):
            start = initial_state[n] if parent < 0 else states[n, parent]
            out, after = gated_delta_rule_chain_reference(q[n, t:t + 1], k[n, t:t + 1], v[n, t:t + 1],
                                                          g[n, t:t + 1], beta[n, t:t + 1], start, scale, delta)
            o[n, t], states[n, t] = out[0].to(o.dtype), after[0]
    return o, states


def tree_causal_conv1d_reference(x, parents, conv_state, weight, bias=None, activation="silu"):
    """Twin of :func:`ubtree_vllm.triton_ops.tree_conv.tree_causal_conv1d`: each node's window gathered by
    walking its ancestors on the host, then the chain formula. Same arguments and output."""
    num_reqs, num_nodes, _ = x.shape
    width = weight.shape[1]
    out = torch.empty_like(x)
    for n in range(num_reqs):
        par = parents[n].tolist()
        for t in range(num_nodes):
            path, node = [], t
            while node >= 0 and len(path) < width:
                path.append(x[n, node].float())
                node = par[node]
            window = [conv_state[n, :, i].float() for i in range(width - 1)] + path[::-1]
            window = torch.stack(window[-width:], dim=1)  # [C, W] oldest first
            y = (window * weight.float()).sum(1) + (bias.float() if bias is not None else 0.0)
            out[n, t] = (torch.nn.functional.silu(y) if activation == "silu" else y).to(out.dtype)
    return out


def head_loss_rows_reference(logits, teacher_logits, labels, row_weight, kl_weight, ce_weight, softcap=None,
                             grad_dtype=None):
    """``head_loss_rows``: the proposer loss's per-row softmax statistics and d loss / d logits (float32 math)."""
    s = logits.float()
    t = teacher_logits.float()
    if softcap:
        t = softcap * torch.tanh(t / softcap)
    lse_q, lse_p = torch.logsumexp(s, -1), torch.logsumexp(t, -1)
    log_q, log_p = s - lse_q[:, None], t - lse_p[:, None]
    p = log_p.exp()
    kl = (p * (log_p - log_q)).sum(-1)
    ce = lse_q - s.gather(1, labels[:, None].long()).squeeze(1)
    onehot = torch.nn.functional.one_hot(labels.long(), s.shape[1]).float()
    g = row_weight[:, None] * ((kl_weight + ce_weight) * log_q.exp() - kl_weight * p - ce_weight * onehot)
    stats = torch.stack([lse_q, kl, ce, lse_p], dim=1)
    return g.to(grad_dtype or logits.dtype), stats, s.argmax(-1)


def tree_penalties_reference(logits, expanded_idx_mapping, local_pos, node_tokens, parents, repetition, frequency,
                             presence, prompt_mask, output_counts, max_depth):
    """Twin of :func:`ubtree_vllm.triton_ops.tree_penalties.tree_penalties`: per row, the request's output counts
    plus the tokens of the nodes on its path (root excluded), then vLLM's penalty rule. In place, same arguments."""
    vocab = logits.shape[1]
    bits = torch.arange(32, device=prompt_mask.device)
    for m in range(logits.shape[0]):
        state, node = int(expanded_idx_mapping[m]), int(local_pos[m])
        rep, freq, pres = float(repetition[state]), float(frequency[state]), float(presence[state])
        if rep == 1.0 and freq == 0.0 and pres == 0.0:
            continue
        counts = output_counts[state].clone()
        root, hops = m - node, 0
        while node > 0 and hops < max_depth:
            token = int(node_tokens[root + node])
            if token >= 0:
                counts[token] += 1
            node, hops = int(parents[state, node]), hops + 1
        in_prompt = ((prompt_mask[state][:, None] >> bits) & 1).flatten()[:vocab].bool()
        seen = counts > 0
        row = logits[m].float()
        scale = torch.where(in_prompt | seen, torch.tensor(rep), torch.tensor(1.0))
        row = torch.where(row > 0, row / scale, row * scale)
        logits[m] = row - freq * counts - pres * seen.float()


def tree_bad_words_reference(logits, expanded_idx_mapping, local_pos, node_tokens, parents, depth, word_tokens,
                             word_offsets, num_words, all_token_ids, prompt_len, total_len, max_num_words):
    """Twin of :func:`ubtree_vllm.triton_ops.tree_bad_words.tree_bad_words`: per row, the sequence outputs + path
    (root excluded) built on the host, then vLLM's rule (ban a word's last token where the sequence ends with its
    other tokens). In place, same arguments."""
    del depth, max_num_words  # the path walk gives both
    for m in range(logits.shape[0]):
        state, node = int(expanded_idx_mapping[m]), int(local_pos[m])
        root, path = m - node, []
        while node > 0:
            path.append(int(node_tokens[root + node]))
            node = int(parents[state, node])
        outputs = all_token_ids[state, int(prompt_len[state]):int(total_len[state])].tolist()
        sequence = outputs + path[::-1]
        offsets = word_offsets[state].tolist()
        for w in range(int(num_words[state])):
            word = word_tokens[state, offsets[w]:offsets[w + 1]].tolist()
            prefix = word[:-1]
            if len(prefix) <= len(sequence) and sequence[len(sequence) - len(prefix):] == prefix:
                logits[m, word[-1]] = float("-inf")


# ---- target_noise / vocab_top_k: vLLM's keyed Gumbel noise, the coupled scores, the top K (CPU path, oracles) ---

_MASK32 = 0xFFFFFFFF
_MIN_ONE_MINUS = 5.960464477539063e-08  # vLLM's floor of 1 - u in the fp32 log


def _rotl(x: torch.Tensor, shift: int) -> torch.Tensor:
    return ((x << shift) | (x >> (32 - shift))) & _MASK32


def _mix_ref(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = (key * 0xCC9E2D51) & _MASK32
    key = _rotl(key, 15)
    key = (key * 0x1B873593) & _MASK32
    h = h ^ key
    h = _rotl(h, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _fmix_ref(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _MASK32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def hash32_reference(seed: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor, domain: int = 0) -> torch.Tensor:
    """vLLM's murmur3 of (seed, pos, offset) in int64 arithmetic (each value kept in [0, 2^32)); broadcasts."""
    seed, pos, offset = seed.long(), pos.long(), offset.long()
    h = torch.full(torch.broadcast_shapes(seed.shape, pos.shape, offset.shape), domain & _MASK32, dtype=torch.int64,
                   device=offset.device)
    h = _mix_ref(h, seed & _MASK32)
    h = _mix_ref(h, (seed >> 32) & _MASK32)
    h = _mix_ref(h, pos & _MASK32)
    h = _mix_ref(h, offset & _MASK32)
    return _fmix_ref(h ^ 16)


def gumbel_noise_reference(seed: torch.Tensor, pos: torch.Tensor, offset: torch.Tensor,
                           use_fp64: bool = False) -> torch.Tensor:
    """The Gumbel variate vLLM's ``gumbel_noised_argmax`` adds for token ``offset`` (float32; float64 with
    ``use_fp64``). Torch's log may differ from Triton's in the last bit."""
    if use_fp64:
        lo = hash32_reference(seed, pos, offset)
        hi = hash32_reference(seed, pos, offset, domain=0x9E3779B9)
        random53 = (hi << 21) | (lo >> 11)  # ((hi << 32) | lo) >> 11 without leaving int64
        u = (random53.double() + 0.5) * 1.1102230246251565e-16
        u = torch.where(u == 1.0, u - 1.1102230246251565e-16, u)
        return -torch.log(-torch.log(u))
    random32 = hash32_reference(seed, pos, offset)
    hi16, lo16 = (random32 >> 16).float(), (random32 & 0xFFFF).float()
    u = hi16 * 1.52587890625e-05 + (lo16 + 0.5) * 2.3283064365386963e-10
    poly = torch.full_like(u, 1.0 / 8.0)
    for c in (1.0 / 7.0, 1.0 / 6.0, 1.0 / 5.0, 1.0 / 4.0, 1.0 / 3.0, 1.0 / 2.0, 1.0):
        poly = c + u * poly
    series = -u * poly
    direct = torch.log(torch.clamp(1.0 - u, min=_MIN_ONE_MINUS))
    return -torch.log(-torch.where(u < 0.25, series, direct))


def coupled_scores_reference(logp: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, pos: torch.Tensor,
                             use_fp64: bool = False) -> torch.Tensor:
    """[N, V] float32: ``logp / T + G(seed, pos, v)`` where ``T > 0``, ``logp`` where ``T = 0`` (the scores whose top K
    ``vocab_top_k`` keeps; its kernel ranks by the same order without writing them)."""
    vocab = torch.arange(logp.shape[-1], device=logp.device)
    noise = gumbel_noise_reference(seeds[:, None], pos[:, None], vocab[None, :], use_fp64).float()  # [N, V]
    temp = temperature.float()[:, None]
    coupled = logp.float() / torch.where(temp > 0, temp, torch.ones_like(temp)) + noise
    return torch.where(temp > 0, coupled, logp.float())


def vocab_top_k_reference(logits: torch.Tensor, top_k: int, temperature: torch.Tensor | None = None,
                          seeds: torch.Tensor | None = None, pos: torch.Tensor | None = None,
                          use_fp64: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch form of ``vocab_top_k.vocab_top_k`` (same arguments): a float32 log-softmax over the whole vocabulary,
    the coupled scores where a temperature is given, a full-vocabulary top K."""
    logp = torch.log_softmax(logits, dim=-1, dtype=torch.float32)  # [R, V]
    scores = logp if temperature is None else coupled_scores_reference(logp, temperature, seeds, pos, use_fp64)
    top_scores, tokens = torch.topk(scores, top_k, dim=-1)
    return tokens, logp.gather(-1, tokens), top_scores
