"""``tree_attention: "flash_exact"``: every row of a tree step computed by FlashAttention 3 as plain decoding would.

Greedy agreement with plain decoding in bf16 (issue 19, ``docs/design/mrv2.md`` §13): a chain verification is exact
because each of its rows goes through the FlashAttention 3 decode kernel with the same key tiles, in the same order
and split the same way, as the one-row decode of that position; the tree rows of the Triton kernel are not. Here,
in a uniform decode step (Model Runner V2's covered layout: row m is entry m of the row buffers), every row becomes
a *virtual sequence* of its own with ``q_len`` 1, the sequence plain decoding would attend over at that position,
and one FA3 call computes them all, in place:

* a request's root (its first row) attends to its committed context and itself: the request's own pages, ``L + 1``
  keys (vLLM wrote the root's K/V at slot L before attention);
* a tree row at depth d attends to ``L + d + 1`` keys: the request's full pages (the first ``L // block_size``),
  then ``pages_per_row`` private *scratch pages* holding the request's last partial page of committed K/V
  (``L % block_size`` tokens) followed by the K/V of the row's root -> row path (this forward's fresh rows);
* padding rows get no keys;
* the scratch pages lie past the blocks vLLM's scheduler hands out (:func:`engine_scratch_pages`: the engine core
  gives the scheduler that many fewer blocks, the runner's KV cache keeps them), a run of ``pages_per_row`` per row
  of the widest step of up to :data:`EXACT_ROWS_MAX_REQUESTS` requests, plus a dump page the copy lists point
  unused entries at (the copy kernel skips those copies); wider steps take the Triton kernel's rows
  (:meth:`ScratchPages.serves`);
* FA3's scheduler metadata gets, per virtual sequence, the split count plain decoding's step would give that
  position (:func:`plain_split_counts`: a batch of the step's requests at their roots' lengths, the row's own
  request at the row's), not the one a batch of 65 sequences per request would get. At batch 1 that is the row
  decoded alone.

Per forward (first layer; shared by the others through ``TreeForwardState.step_cache``): :func:`virtual_rows_by_kernel`
builds the tables, the copy indices and plain decoding's split counts in one launch (its torch form:
:func:`virtual_rows` and :func:`plain_split_counts`), :func:`pinned_scheduler_metadata` the metadata. Per layer, after vLLM wrote this
forward's K/V into the cache: :func:`copy_rows_to_scratch` fills the scratch pages and :func:`attend_rows_exactly`
makes the FA3 call. Fixed shapes, no host read of a device value: captured in the FULL graphs of uniform decode steps.

Exact at batch 1 under FULL CUDA graphs (vLLM's split cap ``max_num_splits``); with several requests in flight it
matches plain decoding's split counts whenever the other requests' key-block counts are their roots', and plain
decoding's own batch then differs anyway (requests finish at other steps). GPU only (FlashAttention 3, head sizes 64
and 128); the layout (its torch form, and the kernel against it) and the copies (one Triton launch,
``triton_ops/scratch_rows.py``) are tested on the CPU against a paged reference (``tests/unit/test_exact_rows.py``),
the FA3 call against FA3's lone decode on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

FA3_MAX_SPLITS = 32  # vLLM's attention_config.flash_attn_max_num_splits_for_cuda_graph default
# The scratch is sized for the widest uniform decode step of up to this many requests (8 x 65 rows at B = 64): any
# covered step of at most that many rows gets exact rows, a wider one the Triton kernel's. Plain decoding's own split
# counts depend on the whole batch, so exactness is a small-batch property anyway, and scratch for every row of the
# widest step (up to max_num_seqs x (1 + B')) would take a large share of the KV cache.
EXACT_ROWS_MAX_REQUESTS = 8
FA3_DECODE_BLOCK_N = {64: 192, 128: 128}  # head size -> key block of FA3's one-warpgroup decode tile


def fa3_split_counts(seq_lens: torch.Tensor, head_size: int, num_kv_heads: int, num_sms: int, alone: bool,
                     max_splits: int = FA3_MAX_SPLITS) -> torch.Tensor:
    """[N] int32: FA3's split count per one-query-row sequence, each decoded alone (``alone``) or all in one batch,
    in the scheduler's own fp32 arithmetic (vLLM's flash-attention, ``hopper/flash_prepare_scheduler.cu``,
    ``prepare_varlen_num_blocks_kernel``): per sequence n = ceil(keys / block_n) key blocks; blocks_per_sm =
    ceil(total * 1.1 * kv_heads / num_sms), total the batch's blocks (one query block per sequence); splits =
    clamp(ceil(n / blocks_per_sm), 1, max_splits). block_n is the one-warpgroup decode tile's key width
    (``hopper/tile_size.h``)."""
    n_blocks = key_blocks(seq_lens, head_size)
    total = n_blocks if alone else n_blocks.sum().expand_as(n_blocks)
    return splits_for(n_blocks, total, num_kv_heads, num_sms, max_splits)


def key_blocks(seq_lens: torch.Tensor, head_size: int) -> torch.Tensor:
    """[N] int64 FA3 key blocks of each one-query-row sequence (its decode tile's key width)."""
    if head_size not in FA3_DECODE_BLOCK_N:
        raise ValueError(f"head_size {head_size}: FA3's decode tile is known here for {sorted(FA3_DECODE_BLOCK_N)}")
    block_n = FA3_DECODE_BLOCK_N[head_size]
    return (seq_lens.long() + block_n - 1) // block_n


def splits_for(n_blocks: torch.Tensor, total_blocks: torch.Tensor, num_kv_heads: int, num_sms: int,
               max_splits: int) -> torch.Tensor:
    """[N] int32 the scheduler's split count of sequences of ``n_blocks`` key blocks in a batch of ``total_blocks``,
    in its fp32 arithmetic (an empty batch counts as one block per SM)."""
    work = (total_blocks.to(torch.float32) * torch.tensor(1.1, dtype=torch.float32) * float(num_kv_heads)
            / float(num_sms))
    blocks_per_sm = torch.ceil(work).long().clamp(min=1)
    return ((n_blocks + blocks_per_sm - 1) // blocks_per_sm).clamp(1, max_splits).to(torch.int32)


def decode_scheduler_metadata(seq_lens: torch.Tensor, max_seqlen_k: int, num_heads: int, num_kv_heads: int,
                              head_size: int, dtype: torch.dtype, block_size: int, num_splits: int,
                              cu_seqlens_q: torch.Tensor | None = None) -> torch.Tensor:
    """FA3's scheduler metadata (``get_scheduler_metadata``) for a batch of one-query-row paged sequences of
    ``seq_lens`` [N] int32 keys, as FA3 would compute it itself (GPU only); ``cu_seqlens_q`` [N + 1] = 0..N, built
    here unless the caller has it."""
    from vllm.vllm_flash_attn import get_scheduler_metadata

    batch = seq_lens.shape[0]
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=seq_lens.device)
    return get_scheduler_metadata(
        batch_size=batch, max_seqlen_q=1, max_seqlen_k=max_seqlen_k, num_heads_q=num_heads,
        num_heads_kv=num_kv_heads, headdim=head_size, cache_seqlens=seq_lens, qkv_dtype=dtype,
        cu_seqlens_q=cu_seqlens_q, page_size=block_size, causal=True, num_splits=num_splits)


def num_sms(device: torch.device) -> int:
    """The SM count FA3's scheduler divides the work by."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_count_slice(batch: int) -> slice:
    """Where FA3's metadata tensor holds the per-sequence split counts: after round_up(batch, 4) prepare_seqlen_q
    (``hopper/flash_api.cpp``)."""
    rounded = -(-batch // 4) * 4
    return slice(rounded, rounded + batch)


@dataclass(frozen=True)
class ScratchPages:
    """The KV cache pages the virtual sequences use: ``pages_per_row`` per row-buffer entry below ``max_entries``,
    from ``first_page``, then the dump page."""

    first_page: int
    pages_per_row: int
    max_entries: int

    @property
    def dump_page(self) -> int:
        return self.first_page + self.max_entries * self.pages_per_row

    @property
    def num_pages(self) -> int:
        return self.max_entries * self.pages_per_row + 1

    def serves(self, num_tokens: int) -> bool:
        """A covered forward of ``num_tokens`` rows (the padded count, the same at a FULL graph's capture and replay)
        gets exact rows; a wider one, the Triton kernel's."""
        return num_tokens <= self.max_entries


def pages_per_row(block_size: int, path_width: int) -> int:
    """Scratch pages one virtual sequence needs: a committed tail of up to ``block_size - 1`` tokens, then a path of
    up to ``path_width`` (the row buffers' path width, gamma + 1)."""
    return -(-(block_size - 1 + path_width) // block_size)


def max_covered_entries(budget: int, schedule: tuple[tuple[int, int, int], ...] | None, max_num_seqs: int,
                        max_num_batched_tokens: int) -> int:
    """The most token rows a uniform decode step of this engine can have, i.e. row-buffer entries a covered step
    uses: ``n * (1 + B'(n))`` at most over the request counts n the scheduler can form (``max_num_seqs``), B'(n) the
    load-adaptive schedule's budget (B without one), capped by the scheduler's token budget."""
    if schedule is None:
        rows = max_num_seqs * (1 + budget)
    else:
        rows = max((min(last, max_num_seqs) * (1 + nodes) for first, last, nodes in schedule if first <= max_num_seqs),
                   default=0)
    return max(1, min(rows, max_num_batched_tokens))


def scratch_pages(first_page: int, block_size: int, path_width: int, max_entries: int) -> ScratchPages:
    return ScratchPages(first_page=first_page, pages_per_row=pages_per_row(block_size, path_width),
                        max_entries=max_entries)


def engine_scratch_pages(vllm_config: Any, first_page: int = 0) -> ScratchPages:
    """The scratch pages of a ``"flash_exact"`` engine, from ``first_page``: computed alike by the engine core, which
    keeps them from the scheduler (patch ``engine_core_kv_cache_configs``), and by the runner, which uses them (the row
    buffers' path width is gamma + 1)."""
    from ubtree_vllm.vllm.config import from_vllm_config

    config = from_vllm_config(vllm_config)
    scheduler = vllm_config.scheduler_config
    max_entries = max_covered_entries(config.tree.tree_budget, config.budget_schedule,
                                      min(scheduler.max_num_seqs, EXACT_ROWS_MAX_REQUESTS),
                                      scheduler.max_num_batched_tokens)
    return scratch_pages(first_page, vllm_config.cache_config.block_size, config.tree.block_size + 1, max_entries)


@dataclass
class VirtualRows:
    """One covered forward's virtual sequences: one per row (T = the forward's padded row count; row m is entry m of
    the row buffers, Model Runner V2's covered layout)."""

    # [T] bool: row m is a tree row (from the row buffers) / a request's root (from the attention metadata)
    tree: torch.Tensor
    root: torch.Tensor
    # [T + 1] int32 0..T (q_len 1 each); [T] int32 keys per sequence (0 for padding rows)
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    # [T, W + pages_per_row] int32 pages per sequence (W = the request block tables' width)
    block_table: torch.Tensor
    # [T] int64 batch index of each row's request (0 for padding rows); the batch's request count (host)
    request: torch.Tensor
    num_reqs: int
    # committed tail copies [T * (block_size - 1)]: page / offset read, page / offset written (unused: the dump page)
    tail_src: tuple[torch.Tensor, torch.Tensor]
    tail_dst: tuple[torch.Tensor, torch.Tensor]
    # path copies [T * P]: the forward row read, page / offset written
    path_rows: torch.Tensor
    path_dst: tuple[torch.Tensor, torch.Tensor]
    # [T] int32 plain decoding's FA3 split count per sequence: the kernel form computes it (pinned_scheduler_metadata
    # reads it); the torch form leaves None (plain_split_counts computes it from the rows)
    split_counts: torch.Tensor | None = None
    # the page the copies of unused entries target (host; nothing reads it, so those copies are skipped); -1: none
    dump_page: int = -1


def plain_split_counts(rows: VirtualRows, head_size: int, num_kv_heads: int, num_sms: int,
                       max_splits: int) -> torch.Tensor:
    """[T] int32 FA3 splits per virtual sequence, as plain decoding's step would split it: the scheduler's rule
    (:func:`fa3_split_counts`) over a batch of this step's requests, each at its root's length but the row's own
    request, at the row's length. At batch 1 that is the row decoded alone; with several requests it is plain
    decoding's count whenever the other requests' key blocks are those of their roots (their lengths then differ by
    the few tokens of a round)."""
    blocks = key_blocks(rows.seq_lens, head_size)  # [T]
    root_blocks = torch.where(rows.root, blocks, 0)
    per_request = torch.zeros(rows.num_reqs, dtype=torch.long, device=blocks.device).index_add_(
        0, rows.request, root_blocks)  # [R] each request's root blocks
    total = root_blocks.sum() - per_request[rows.request] + blocks  # [T]
    return splits_for(blocks, total, num_kv_heads, num_sms, max_splits)


def virtual_rows(
        # [T] int the row buffers' entries, one per row of a covered forward (root-first paths, -1 padded / unused)
        row_index: torch.Tensor, row_req: torch.Tensor, row_context_len: torch.Tensor,
        # [T, P]
        row_path: torch.Tensor,
        # [R, W] int32 the requests' pages; [R + 1] int32 their first rows; [R] int32 their keys including this
        # forward's rows (FlashAttention's metadata; padded requests: first row T, 0 keys)
        block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
        scratch: ScratchPages, block_size: int) -> VirtualRows:
    """The virtual sequences of a covered forward's rows (module docstring). Fixed-shape torch ops only."""
    num_rows, path_width = row_path.shape
    device = row_index.device
    pages = scratch.pages_per_row
    row = torch.arange(num_rows, device=device)  # [T]
    tree = (row_index >= 0) & (row < scratch.max_entries)  # [T]

    # the roots: request r's first row, attending to its committed context and itself
    num_reqs = seq_lens.shape[0]
    first_row = query_start_loc[:-1].long().clamp(max=num_rows)  # [R]; padded requests land on the dump row T
    query_len = (query_start_loc[1:] - query_start_loc[:-1]).long()  # [R]
    # [R] a padded request (no keys) has no root: it must not count in the batch's key blocks (split counts)
    root_keys = torch.where(seq_lens > 0, seq_lens.long() - query_len + 1, 0).clamp(min=0)
    root_len = torch.zeros(num_rows + 1, dtype=torch.long, device=device).index_copy_(
        0, first_row, root_keys)[:num_rows]  # [T]
    root = (root_len > 0) & ~tree  # [T]
    root_req = torch.zeros(num_rows + 1, dtype=torch.long, device=device).index_copy_(
        0, first_row, torch.arange(num_reqs, device=device))[:num_rows]  # [T]

    context = row_context_len.long().clamp(min=0)  # [T]
    request = torch.where(tree, row_req.long().clamp(min=0), root_req)  # [T]
    path_len = (row_path >= 0).sum(dim=1)  # [T]
    full, tail = context // block_size, context % block_size  # [T]
    first = scratch.first_page + row * pages  # [T] the row's first scratch page (past max_entries: unused)

    width = block_table.shape[1]
    column = torch.arange(width + pages, device=device)[None, :]  # [1, W + pages]
    own = torch.nn.functional.pad(block_table[request].long(), (0, pages))  # [T, W + pages]
    private = first[:, None] + (column - full[:, None])
    tree_table = torch.where(column < full[:, None], own, torch.where(column < (full + pages)[:, None], private, 0))
    table = torch.where(tree[:, None], tree_table, torch.where(root[:, None], own, 0)).to(torch.int32)

    dump = scratch.dump_page * block_size
    offset = torch.arange(block_size - 1, device=device)[None, :]  # [1, bs - 1]
    tail_ok = tree[:, None] & (offset < tail[:, None])  # [T, bs - 1]
    tail_page = block_table[request, full.clamp(max=width - 1)].long()  # [T] the page holding the committed tail
    tail_src = torch.where(tail_ok, tail_page[:, None] * block_size + offset, 0).flatten()
    tail_dst = torch.where(tail_ok, first[:, None] * block_size + offset, dump).flatten()

    step = torch.arange(path_width, device=device)[None, :]  # [1, P]
    path_ok = tree[:, None] & (row_path >= 0)  # [T, P]
    path_rows = torch.where(path_ok, row_path.long(), 0).flatten()
    path_dst = torch.where(path_ok, first[:, None] * block_size + tail[:, None] + step, dump).flatten()

    def paged(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return slots // block_size, slots % block_size

    keys = torch.where(tree, context + path_len, torch.where(root, root_len, 0)).to(torch.int32)
    return VirtualRows(
        tree=tree, root=root, cu_seqlens_q=torch.arange(num_rows + 1, dtype=torch.int32, device=device),
        seq_lens=keys, block_table=table, request=request, num_reqs=num_reqs,
        tail_src=paged(tail_src), tail_dst=paged(tail_dst), path_rows=path_rows, path_dst=paged(path_dst),
        dump_page=scratch.dump_page)


def virtual_rows_by_kernel(
        # as :func:`virtual_rows`
        row_index: torch.Tensor, row_req: torch.Tensor, row_context_len: torch.Tensor, row_path: torch.Tensor,
        block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
        scratch: ScratchPages, block_size: int,
        # FA3's split rule (:func:`plain_split_counts`): the layer's head size and KV heads, the GPU's SMs, the cap
        head_size: int, num_kv_heads: int, sms: int, max_splits: int) -> VirtualRows:
    """:func:`virtual_rows` and :func:`plain_split_counts` in one launch (``triton_ops/virtual_rows.py``, tested
    against them): what the FULL graphs of covered steps replay."""
    from ubtree_vllm.triton_ops.virtual_rows import virtual_rows_kernel

    if head_size not in FA3_DECODE_BLOCK_N:
        raise ValueError(f"head_size {head_size}: FA3's decode tile is known here for {sorted(FA3_DECODE_BLOCK_N)}")
    out = virtual_rows_kernel(row_index, row_req, row_context_len, row_path, block_table, query_start_loc, seq_lens,
                              scratch.first_page, scratch.pages_per_row, scratch.max_entries, scratch.dump_page,
                              block_size, FA3_DECODE_BLOCK_N[head_size], num_kv_heads, sms, max_splits)
    return VirtualRows(
        tree=out["tree"], root=out["root"], cu_seqlens_q=out["cu_seqlens_q"], seq_lens=out["seq_lens"],
        block_table=out["block_table"], request=out["request"], num_reqs=seq_lens.shape[0],
        tail_src=(out["tail_src_page"], out["tail_src_slot"]), tail_dst=(out["tail_dst_page"], out["tail_dst_slot"]),
        path_rows=out["path_rows"], path_dst=(out["path_dst_page"], out["path_dst_slot"]),
        split_counts=out["split_counts"], dump_page=scratch.dump_page)


def copy_rows_to_scratch(
        # [num_blocks, block_size, H_kv, D] one layer's paged cache views (may be strided), mutated
        key_cache: torch.Tensor, value_cache: torch.Tensor,
        # [T, H_kv, D] the layer's fresh K/V of this forward
        key: torch.Tensor, value: torch.Tensor, rows: VirtualRows) -> None:
    """Fill every tree row's scratch pages: its request's committed tail, then its path's fresh K/V (one launch,
    ``triton_ops/scratch_rows.py``); the copies of unused entries, all onto the dump page, are not made."""
    from ubtree_vllm.triton_ops.scratch_rows import scratch_rows

    scratch_rows(key_cache, value_cache, key, value, *rows.tail_src, *rows.tail_dst, rows.path_rows, *rows.path_dst,
                 skip_dst_page=rows.dump_page)


def pinned_scheduler_metadata(rows: VirtualRows, max_seq_len: int, num_heads: int, num_kv_heads: int,
                              head_size: int, dtype: torch.dtype, block_size: int, num_splits: int) -> torch.Tensor:
    """FA3's scheduler metadata for the virtual sequences, their split counts replaced by plain decoding's (the
    layout's ``split_counts``, :func:`virtual_rows_by_kernel`; GPU only)."""
    if rows.split_counts is None:
        raise ValueError("pinned_scheduler_metadata needs the layout's split counts: lay out with "
                         "virtual_rows_by_kernel")
    metadata = decode_scheduler_metadata(rows.seq_lens, max_seq_len, num_heads, num_kv_heads, head_size, dtype,
                                         block_size, num_splits, cu_seqlens_q=rows.cu_seqlens_q)
    metadata[split_count_slice(rows.seq_lens.shape[0])] = rows.split_counts
    return metadata


def attend_rows_exactly(
        # [T, H, D] the forward's queries; [num_blocks, block_size, H_kv, D] the layer's cache views
        query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        # [T, H, D] mutable: every row is written (padding rows: FlashAttention's output for no keys)
        output: torch.Tensor, rows: VirtualRows, scale: float, max_seq_len: int,
        scheduler_metadata: torch.Tensor | None, num_splits: int) -> None:
    """One FA3 call over every row's virtual sequence (after :func:`copy_rows_to_scratch`), in place."""
    from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    flash_attn_varlen_func(
        q=query, k=canonicalize_singleton_dim_strides(key_cache), v=canonicalize_singleton_dim_strides(value_cache),
        out=output, cu_seqlens_q=rows.cu_seqlens_q, max_seqlen_q=1, seqused_k=rows.seq_lens, max_seqlen_k=max_seq_len,
        softmax_scale=scale, causal=True, block_table=rows.block_table, scheduler_metadata=scheduler_metadata,
        fa_version=3, num_splits=num_splits)


# Key blocks of the sequences the layout check hands FA3's scheduler: unsorted, so that split counts stored in any
# other order than the batch's would show
_LAYOUT_PROBE_BLOCKS = (3, 40, 1, 20, 7)


def check_scheduler_metadata_layout(device: torch.device, num_heads: int, num_kv_heads: int, head_size: int,
                                    dtype: torch.dtype, block_size: int, num_splits: int = FA3_MAX_SPLITS) -> None:
    """NotImplementedError unless this FlashAttention build's scheduler metadata holds the per-sequence split counts
    where :func:`pinned_scheduler_metadata` writes them, in batch order, with the values :func:`fa3_split_counts`
    predicts for a probe batch (GPU only; at engine start, outside any graph). Another FA3 build could lay the
    metadata out otherwise, and pinned counts written elsewhere would compute wrong rows."""
    lens = torch.tensor([blocks * FA3_DECODE_BLOCK_N[head_size] for blocks in _LAYOUT_PROBE_BLOCKS],
                        dtype=torch.int32, device=device)
    batch = lens.shape[0]
    metadata = decode_scheduler_metadata(lens, int(lens.max()), num_heads, num_kv_heads, head_size, dtype, block_size,
                                         num_splits)
    predicted = fa3_split_counts(lens, head_size, num_kv_heads, num_sms(device), alone=False, max_splits=num_splits)
    found = metadata[split_count_slice(batch)].tolist()  # SYNC: once, at engine start
    if found != predicted.tolist():
        raise NotImplementedError(
            f"tree_attention 'flash_exact': this FlashAttention 3 build's scheduler metadata does not hold the split "
            f"counts where flash_exact pins them (positions {split_count_slice(batch).start}.. of "
            f"{metadata.shape[0]}: {found}, predicted {predicted.tolist()}); use another tree_attention")


def check_exact_rows_layer(impl: Any) -> None:
    """NotImplementedError unless ``impl`` (a tree-aware FLASH_ATTN impl) can serve ``"flash_exact"``: FA3, a head
    size whose decode tile is known here, and none of the FlashAttention features plain decoding's call passes and
    :func:`attend_rows_exactly` does not (a sliding window, ALiBi, a logits soft cap, attention sinks, a quantized
    KV cache and its scales)."""
    version = getattr(impl, "vllm_flash_attn_version", None)
    if version != 3:
        raise NotImplementedError(f"tree_attention 'flash_exact' needs FlashAttention 3 (Hopper); this layer runs "
                                  f"FlashAttention {version}")
    if impl.head_size not in FA3_DECODE_BLOCK_N:
        raise NotImplementedError(f"tree_attention 'flash_exact' supports head sizes {sorted(FA3_DECODE_BLOCK_N)} "
                                  f"(FA3's decode tile known here), got {impl.head_size}")
    features = {"a sliding window": tuple(getattr(impl, "sliding_window", (-1, -1)) or (-1, -1)) != (-1, -1),
                "ALiBi": getattr(impl, "alibi_slopes", None) is not None,
                "a logits soft cap": bool(getattr(impl, "logits_soft_cap", 0)),
                "attention sinks": getattr(impl, "sinks", None) is not None,
                "a quantized KV cache": str(getattr(impl, "kv_cache_dtype", "auto")).startswith("fp8")}
    used = [name for name, on in features.items() if on]
    if used:
        raise NotImplementedError(f"tree_attention 'flash_exact' computes plain attention over paged bf16/fp16 keys; "
                                  f"this layer uses {', '.join(used)}")


def serves_exact_rows_by_default(*, mrv2: bool, capability_major: int | None, dtype: torch.dtype, head_size: int,
                                 attention_backend: str | None, kv_cache_dtype: str,
                                 sliding_window: int | None) -> bool:
    """Whether ``tree_attention: "auto"`` (the default) takes ``"flash_exact"``, from what the engine arguments tell
    before any model loads: Model Runner V2, a Hopper GPU (FlashAttention 3), a bf16 or fp16 target of a head size
    whose FA3 decode tile is known here, FLASH_ATTN (unset or chosen), no quantized KV cache, no sliding window. What
    only the loaded layers tell (:func:`check_exact_rows_layer`) makes the runner fall back to "triton"."""
    return (mrv2 and capability_major == 9 and dtype in (torch.bfloat16, torch.float16)
            and head_size in FA3_DECODE_BLOCK_N and attention_backend in (None, "auto", "FLASH_ATTN")
            and not str(kv_cache_dtype).startswith("fp8") and not sliding_window)
