"""``tree_attention: "flashinfer"`` (Model Runner V2, FLASH_ATTN target): every row of a uniform decode tree step by
one FlashInfer paged-prefill call with a custom mask (issue 19's FlashInfer backend; docs/design/mrv2.md §12).

A uniform decode step of R requests has q = 1 + B rows each (row i of request r is global row ``r * q + i``; the
rows' fresh K/V already sit in the paged cache at the linear slots ``ctx + i``, as vLLM writes them). FlashInfer's
``BatchPrefillWithPagedKVCacheWrapper`` attends every row to its request's pages under a packed bit mask: a root sees
the committed context and itself, a tree row the context and its root -> row path
(:func:`ubtree_vllm.triton_ops.tree_prefill_mask.tree_prefill_mask`).

Host and device, per step, with no device value read on the host:

* **Plan** (host, before the forward: ``UBTreeModelRunnerV2._prepare_tree_attn``). FlashInfer schedules from host
  key lengths; MRV2's host knows them only as upper bounds (``seq_lens_cpu_upper_bound``: acceptance is on the
  device), so each request is planned over whole pages through its bound. Keys past a request's true length hold
  stale K/V; the mask, built on the device from the true lengths, switches them off. The schedule depends on the
  pages per request alone, so FlashInfer's ``plan`` runs only when they change.
* **Buffers** (device, same step): the page list from the block table (``paged_kv_indices``) and the mask, written
  into the wrapper's fixed buffers by two launches.
* **Attention** (every layer): ``wrapper.run`` over the step's rows, into the layer's output.

CUDA graphs: one wrapper per (requests, rows per request) in FlashInfer's CUDA-graph mode (fixed buffers, a fixed
batch size), so the FULL graphs MRV2 captures for uniform decode steps replay the call with each step's plan: the
plan before a replay rewrites the buffers the captured kernel reads. A graph is captured right after an eager warm-up
run of the same shape, which plans the wrapper (:meth:`FlashInferTreeRows.plan_warmup`); planning inside a capture
would record its host copies. Steps of more than :data:`MAX_REQS` requests take the Triton rows
(``"triton_stock_roots"``'s path), as ``"flash_exact"``'s do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ubtree_vllm.triton_ops.tree_prefill_mask import paged_kv_indices, tree_prefill_mask

MAX_REQS = 8  # uniform decode steps of at most this many requests attend through FlashInfer
WORKSPACE_BYTES = 128 << 20  # FlashInfer's float workspace (split-KV partials), shared by the wrappers


def flashinfer_available() -> bool:
    """FlashInfer imports here (vLLM 0.32's CUDA wheels depend on it; it compiles its prefill kernel on first use)."""
    import importlib.util

    return importlib.util.find_spec("flashinfer") is not None


@dataclass
class _Wrapper:
    """One FlashInfer wrapper in CUDA-graph mode and the buffers it reads (sized for ``max_pages`` per request)."""

    wrapper: Any
    kv_indices: torch.Tensor  # [R * max_pages] int32
    mask: torch.Tensor  # [R * q * max_pages * page_size / 8] uint8
    mask_indptr: torch.Tensor  # [R + 1] int32 byte offset of each request's mask
    qo_indptr: torch.Tensor  # [R + 1] int32 on the host: r * q
    # recorded after the last plan's copies: FlashInfer's plan stages its schedule in a page-locked host buffer and
    # copies it asynchronously, so the next plan of this wrapper must not overwrite that buffer before the copy ran
    planned_event: Any = None
    # the pages per request of the last plan: FlashInfer's schedule depends on nothing else that changes between
    # steps (rows per request and head shapes are fixed per wrapper), so a step with the same pages keeps it
    planned_pages: tuple[int, ...] | None = None


@dataclass(frozen=True)
class LayerShape:
    """What every target attention layer shares (checked at bind)."""

    num_qo_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    scale: float


class FlashInferTreeRows:
    """The runner's FlashInfer wrappers for uniform decode tree steps, planned once per step, run by every layer."""

    def __init__(self, device: torch.device, workspace: torch.Tensor, shape: LayerShape, page_size: int,
                 max_model_len: int, query_lens: frozenset[int]) -> None:
        """``query_lens``: the rows per request of the engine's tree steps (1 + each budget it verifies)."""
        if page_size % 8:
            raise NotImplementedError(f"tree_attention 'flashinfer' needs KV pages of a multiple of 8 tokens (each "
                                      f"mask row starts on a byte), got {page_size}")
        self.device, self.workspace, self.shape, self.page_size = device, workspace, shape, page_size
        self.max_pages = -(-max_model_len // page_size)
        self.query_lens = query_lens
        self._wrappers: dict[tuple[int, int], _Wrapper] = {}
        self.planned: tuple[int, int] | None = None  # (requests, rows per request) of the last plan
        self._warmup_metadata: Any = None  # the metadata object the last warm-up plan was made for

    def serves(self, num_reqs: int, q: int) -> bool:
        """A uniform decode step of ``num_reqs`` requests x ``q`` rows attends through FlashInfer."""
        return q > 1 and q in self.query_lens and 0 < num_reqs <= MAX_REQS

    def _wrapper(self, num_reqs: int, q: int) -> _Wrapper:
        key = (num_reqs, q)
        if key not in self._wrappers:
            import flashinfer

            int32 = dict(dtype=torch.int32, device=self.device)
            mask_bytes = num_reqs * q * self.max_pages * self.page_size // 8
            buffers = dict(qo_indptr_buf=torch.arange(num_reqs + 1, **int32) * q,
                           paged_kv_indptr_buf=torch.zeros(num_reqs + 1, **int32),
                           paged_kv_indices_buf=torch.zeros(num_reqs * self.max_pages, **int32),
                           paged_kv_last_page_len_buf=torch.zeros(num_reqs, **int32),
                           custom_mask_buf=torch.zeros(mask_bytes, dtype=torch.uint8, device=self.device),
                           mask_indptr_buf=torch.zeros(num_reqs + 1, **int32))
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", use_cuda_graph=True,
                                                                     **buffers)
            self._wrappers[key] = _Wrapper(wrapper, buffers["paged_kv_indices_buf"], buffers["custom_mask_buf"],
                                           buffers["mask_indptr_buf"],
                                           torch.arange(num_reqs + 1, dtype=torch.int32) * q)
        return self._wrappers[key]

    def plan(self, num_reqs: int, q: int,
             # [n <= num_reqs] host upper bounds of the requests' token counts, this step's rows included
             bounds: np.ndarray,
             # [num_reqs] int32 true token counts (0 past the n real requests)
             seq_lens: torch.Tensor,
             # the runner's RowBuffers entries: [T] int64 row, [T, P] int64 root-first path rows
             row_index: torch.Tensor, row_path: torch.Tensor,
             # [>= n, max_blocks] int32 the target's block table
             block_table: torch.Tensor) -> None:
        """Plan the (num_reqs, q) wrapper for this step (host) and fill its page list and mask (two launches)."""
        w = self._wrapper(num_reqs, q)
        page = self.page_size
        pages = np.ones(num_reqs, dtype=np.int64)  # a padding request: one page, key 0 visible (finite rows)
        pages[:len(bounds)] = np.clip(-(-np.asarray(bounds, dtype=np.int64) // page), 1, self.max_pages)
        kv_indptr = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(pages, out=kv_indptr[1:])
        mask_indptr = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(q * pages * page // 8, out=mask_indptr[1:])  # bytes: every mask row is pages * page bits
        pages_key = tuple(pages.tolist())
        if pages_key != w.planned_pages:
            self._plan_schedule(w, num_reqs, kv_indptr)
            w.planned_pages = pages_key
        # one host-to-device copy: pages, page offsets and mask offsets (pageable source: staged at the call)
        host = torch.from_numpy(np.concatenate([pages, kv_indptr, mask_indptr]))
        dev = host.to(self.device, non_blocking=True)  # [3 * num_reqs + 2] int64
        pages_dev, kv_indptr_dev = dev[:num_reqs].to(torch.int32), dev[num_reqs:2 * num_reqs + 1].to(torch.int32)
        mask_offsets = dev[2 * num_reqs + 1:]
        w.mask_indptr.copy_(mask_offsets)  # byte offsets: FlashInfer adds them to the mask's uint8 pointer
        # every step: the requests in the batch's rows and their true lengths change even where the pages do not
        paged_kv_indices(block_table, pages_dev, kv_indptr_dev, w.kv_indices, max_pages=int(pages.max()))
        tree_prefill_mask(seq_lens, row_index, row_path, q, pages_dev, mask_offsets, page, w.mask,
                          max_kv_len=int(pages.max()) * page)
        self.planned = (num_reqs, q)

    def _plan_schedule(self, w: _Wrapper, num_reqs: int, kv_indptr: np.ndarray) -> None:
        """FlashInfer's plan (host work, its schedule copied to the device) for pages ``kv_indptr`` [R + 1]."""
        if w.planned_event is not None:
            # SYNC: the previous plan's copy out of FlashInfer's page-locked schedule buffer (enqueued a step ago,
            # normally long done) must have run before this plan rewrites that buffer
            w.planned_event.synchronize()
        page, shape = self.page_size, self.shape
        w.wrapper.plan(qo_indptr=w.qo_indptr, paged_kv_indptr=torch.from_numpy(kv_indptr.astype(np.int32)),
                       paged_kv_indices=w.kv_indices[:int(kv_indptr[-1])],
                       paged_kv_last_page_len=torch.full((num_reqs,), page, dtype=torch.int32),
                       num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads, head_dim_qk=shape.head_size,
                       page_size=page, causal=False, sm_scale=shape.scale, q_data_type=shape.dtype,
                       kv_data_type=shape.dtype, non_blocking=True)
        if self.device.type == "cuda":
            w.planned_event = torch.cuda.Event()
            w.planned_event.record()

    def plan_warmup(self, attn_metadata: Any, row_index: torch.Tensor, row_path: torch.Tensor) -> None:
        """Before MRV2 captures a FULL graph it runs the same shape eagerly without trees: plan that shape's wrapper
        then (once per metadata object), from the metadata's lengths, so the capture records a planned call."""
        num_reqs, q = attn_metadata.seq_lens.shape[0], attn_metadata.max_query_len
        if attn_metadata is self._warmup_metadata or not self.serves(num_reqs, q):
            return
        if attn_metadata.num_actual_tokens > num_reqs * q:
            return  # not a uniform decode shape
        self._warmup_metadata = attn_metadata
        bounds = np.full(num_reqs, max(int(attn_metadata.max_seq_len), 1), dtype=np.int64)
        self.plan(num_reqs, q, bounds, attn_metadata.seq_lens, row_index, row_path, attn_metadata.block_table)

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, output: torch.Tensor,
            num_reqs: int, q: int) -> None:
        """Every row of the step's ``num_reqs * q`` rows into ``output`` (query [T, H, D]; caches [num_blocks,
        block_size, H_kv, D] views; output [T, H, D] mutable). RuntimeError if this shape was not planned last
        (outside a capture, where the replayed plan is the one made before the replay)."""
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        if self.planned != (num_reqs, q) and not capturing:
            raise RuntimeError(f"ubtree: tree_attention 'flashinfer' planned {self.planned} (requests, rows) but the "
                               f"forward has {(num_reqs, q)}")
        rows, w = num_reqs * q, self._wrappers.get((num_reqs, q))
        if w is None:
            raise RuntimeError(f"ubtree: tree_attention 'flashinfer' has no planned wrapper for {(num_reqs, q)} "
                               "(requests, rows); a capture's warm-up run plans it")
        w.wrapper.run(query[:rows], (key_cache, value_cache), out=output[:rows])
