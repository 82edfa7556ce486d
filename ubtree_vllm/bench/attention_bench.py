"""`ubtree bench microbench --which tree-attention-vs-flash`: our tree kernel against vLLM's FlashAttention.

One verification step of one request on a Qwen3-8B attention layer (32 query heads, 8 KV
heads, head size 128, bf16, KV page size 16) over a committed context of C tokens, the
65 new tokens being the root and a 64-node draft tree (depth <= 16, the drafter's block size):

  tree_attention_ms   `triton_ops.tree_attention` computing the 64 non-root tree rows
                      (context through the block table + ancestors-or-self among the fresh
                      K/V), exactly the launch `vllm/attention/flash.py` adds per layer
  flash_attention_ms  `vllm.vllm_flash_attn.flash_attn_varlen_func` over the same 65 query
                      rows, causal, reading context + new tokens from the paged cache
                      (`block_table`, `seqused_k` = C + 65), called with the arguments
                      vLLM 0.32's `FlashAttentionImpl.forward` passes for a bf16 cache with
                      no window / soft cap / ALiBi / sinks; FA version from
                      `fa_utils.get_flash_attn_version(head_size=128)`
  tree_attention_over_flash  their ratio. The UBTree CUDA backend runs both (FlashAttention
                      over every row, then the tree rows overwritten), so a tree layer's
                      attention costs about (1 + ratio) x FlashAttention's.
  flash_merge_ms      tree_attention "flash_merge" for the same rows: FlashAttention over the 65 rows'
                      committed context alone (`vllm/attention/flash.py:flash_context_attention`),
                      then the kernel adding each tree row's path (`context_out` / `context_lse`)
  flash_merge_over_flash  its ratio to flash_attention_ms (the layer then costs about 1 + this)
  flashinfer_custom_mask_ms  FlashInfer's paged prefill over all 65 rows in one call with the tree's custom mask
                      (bench/flashinfer_tree.py: each row the context and its root -> node path), the whole
                      layer's attention in one launch (issue 19's alternative to FlashAttention + the Triton kernel)
  flashinfer_custom_mask_over_flash  its ratio to flash_attention_ms (the layer costs about this)
  flashinfer_plan_ms  host time of FlashInfer's `plan` for that step (once per step, shared by the layers;
                      serving would pay it every step, from host-known K/V lengths)

The tree is random (`triton_ops.tree_attention_inputs.random_parents`, window 12 = the
default beam width); the inputs are those of the kernel tests (`make_inputs`), standard
normal. Each kernel is timed on the device alone (bench/timing.py `time_launches`: CUDA
graph replays, median). Neither launch writes the new K/V into the cache (vLLM does that
before attention in both cases). If FlashAttention cannot be imported or called, only the
Triton time is recorded and the notes say why; likewise FlashInfer (it compiles its kernel on
first use, which needs a CUDA toolkit).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

TREE_NODES = 64
MAX_DEPTH = 16
PARENT_WINDOW = 12


@dataclass(frozen=True)
class AttentionShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype


QWEN3_8B_ATTENTION = AttentionShape("qwen3-8b", num_heads=32, num_kv_heads=8, head_size=128, block_size=16,
                                    dtype=torch.bfloat16)


@dataclass(frozen=True)
class AttentionTiming:
    """Medians of one context length; flash_ms is None when FlashAttention was unavailable."""

    context_len: int
    tree_ms: float
    flash_ms: float | None
    flash_error: str | None
    clock: str
    merge_ms: float | None = None  # tree_attention "flash_merge"; None with flash_ms
    flashinfer_ms: float | None = None  # FlashInfer custom-mask prefill; None when it could not run
    flashinfer_plan_ms: float | None = None  # its host plan time
    flashinfer_error: str | None = None


def bench_parents(seed: int = 0) -> list[int]:
    """The bench tree's parents, root first: TREE_NODES random nodes, depth <= MAX_DEPTH, window PARENT_WINDOW."""
    from ubtree_vllm.triton_ops.tree_attention_inputs import random_parents

    return random_parents(TREE_NODES, MAX_DEPTH, PARENT_WINDOW, torch.Generator().manual_seed(seed))


def tree_inputs(context_len: int, device: torch.device, shape: AttentionShape = QWEN3_8B_ATTENTION,
                seed: int = 0) -> Any:
    """`TreeAttentionInputs` of one request: C context tokens, root + TREE_NODES random tree nodes (bench_parents)."""
    from ubtree_vllm.triton_ops.tree_attention_inputs import make_inputs

    return make_inputs([(context_len, bench_parents(seed))], device=device, num_heads=shape.num_heads,
                       num_kv_heads=shape.num_kv_heads, head_size=shape.head_size, block_size=shape.block_size,
                       dtype=shape.dtype, extra_path_pad=0, index_dtype=torch.int32, prefill_rows=0, seed=seed)


def flash_launch(inputs: Any, out: torch.Tensor) -> Callable[[], Any]:
    """The FlashAttention call vLLM makes for these rows (raises ImportError where FA is absent)."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    fa_version = get_flash_attn_version(head_size=inputs.query.shape[2])
    num_tokens = inputs.query.shape[0]
    max_seq_len = int(inputs.seq_lens.max())

    def launch() -> Any:
        return flash_attn_varlen_func(
            q=inputs.query, k=inputs.key_cache, v=inputs.value_cache, out=out,  # out: mutable
            cu_seqlens_q=inputs.query_start_loc, max_seqlen_q=num_tokens,
            seqused_k=inputs.seq_lens, max_seqlen_k=max_seq_len,
            softmax_scale=inputs.scale, causal=True, alibi_slopes=None, window_size=[-1, -1],
            block_table=inputs.block_table, softcap=0.0, scheduler_metadata=None,
            fa_version=fa_version, num_splits=0)

    return launch


def time_tree_vs_flash(context_len: int, device: torch.device, iters: int, warmup: int,
                       seed: int = 0) -> AttentionTiming:
    """Median device time of both kernels at one context length (GPU only)."""
    from ubtree_vllm.bench.timing import time_launches
    from ubtree_vllm.triton_ops import tree_attention

    inputs = tree_inputs(context_len, device, seed=seed)
    tree_out = torch.empty_like(inputs.query)
    tree_times, clock = time_launches(lambda: tree_attention(*inputs.args(), tree_out), device, iters, warmup)
    flash_ms = merge_ms = error = None
    try:
        flash = flash_launch(inputs, torch.empty_like(inputs.query))
        flash()
        torch.cuda.synchronize(device)
    except Exception as exc:  # ImportError without FA; anything the extension raises on this GPU
        error = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
    else:
        flash_times, flash_clock = time_launches(flash, device, iters, warmup)
        flash_ms = statistics.median(flash_times)
        merge_times, _ = time_launches(merge_launch(inputs, torch.empty_like(inputs.query)), device, iters, warmup)
        merge_ms = statistics.median(merge_times)
        if flash_clock != clock:
            clock = f"Triton: {clock}; FlashAttention: {flash_clock}"
    fi_ms, fi_plan_ms, fi_error, fi_clock = time_flashinfer(inputs, context_len, seed, device, iters, warmup)
    if fi_clock is not None and fi_clock not in clock:
        clock = f"{clock}; FlashInfer: {fi_clock}"
    return AttentionTiming(context_len, statistics.median(tree_times), flash_ms, error, clock, merge_ms, fi_ms,
                           fi_plan_ms, fi_error)


def time_flashinfer(inputs: Any, context_len: int, seed: int, device: torch.device, iters: int,
                    warmup: int) -> tuple[float | None, float | None, str | None, str | None]:
    """(device ms of FlashInfer's custom-mask prefill over every row, host ms of its plan, None, clock label), or
    (None, None, why, None) where it cannot run."""
    import time

    from ubtree_vllm.bench.flashinfer_tree import plan_tree_prefill
    from ubtree_vllm.bench.timing import time_launches

    requests = [(context_len, bench_parents(seed))]
    try:
        wrapper, args = plan_tree_prefill(inputs, requests, device=device)
        caches = (inputs.key_cache.contiguous(), inputs.value_cache.contiguous())  # NHD pages
        out = torch.empty_like(inputs.query)
        launch = lambda: wrapper.run(inputs.query, caches, out=out)  # noqa: E731 (out: mutable)
        launch()
        torch.cuda.synchronize(device)
    except Exception as exc:  # ImportError; FlashInfer's JIT without a CUDA toolkit; anything its kernels raise
        return None, None, " ".join(f"{type(exc).__name__}: {exc}".split())[:300], None
    times, clock = time_launches(launch, device, iters, warmup)
    plans = []
    for _ in range(max(iters // 5, 3)):
        start = time.perf_counter()
        wrapper.plan(**args)
        plans.append(1000.0 * (time.perf_counter() - start))
    return statistics.median(times), statistics.median(plans), None, clock


def merge_launch(inputs: Any, out: torch.Tensor) -> Callable[[], Any]:
    """tree_attention "flash_merge" for these rows: FlashAttention over the committed context, the kernel the path."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    from ubtree_vllm.triton_ops import tree_attention
    from ubtree_vllm.vllm.attention.flash import committed_context_lens, flash_context_attention

    fa_version = get_flash_attn_version(head_size=inputs.query.shape[2])
    num_tokens, max_seq_len = inputs.query.shape[0], int(inputs.seq_lens.max())
    context_lens = committed_context_lens(inputs.query_start_loc, inputs.seq_lens)  # once per forward, as served

    def launch() -> Any:
        context_out, context_lse = flash_context_attention(
            inputs.query, inputs.key_cache, inputs.value_cache, inputs.query_start_loc, context_lens, num_tokens,
            max_seq_len, inputs.block_table, inputs.scale, fa_version)
        return tree_attention(*inputs.args(), out, context_out=context_out, context_lse=context_lse)  # out: mutable

    return launch


def attention_records(timings: Sequence[AttentionTiming], *, iters: int, warmup: int, hardware: str,
                      shape: AttentionShape = QWEN3_8B_ATTENTION) -> list[dict[str, Any]]:
    """Per context length: tree_attention_ms, and with FlashAttention flash_attention_ms and the ratio."""
    from ubtree_vllm.bench.timing import GRAPH_CLOCK

    records = []
    for t in timings:
        notes = (f"{shape.name} attention shape: {shape.num_heads} query heads, {shape.num_kv_heads} KV heads, "
                 f"head size {shape.head_size}, {str(shape.dtype).removeprefix('torch.')}, page size "
                 f"{shape.block_size}; context {t.context_len} tokens, 1 request; Triton tree_attention over "
                 f"{TREE_NODES} tree rows (random tree, depth <= {MAX_DEPTH}) vs FlashAttention varlen over "
                 f"{TREE_NODES + 1} causal query rows; median of {iters} samples after {warmup} warm-up ({t.clock})")
        if t.flash_ms is None:
            notes += f"; FlashAttention unavailable, only the Triton time recorded: {t.flash_error}"
        values = [("tree_attention_ms", t.tree_ms, "ms")]
        if t.flash_ms is not None:
            values += [("flash_attention_ms", t.flash_ms, "ms"),
                       ("tree_attention_over_flash", t.tree_ms / t.flash_ms, "x")]
        if t.merge_ms is not None:
            values += [("flash_merge_ms", t.merge_ms, "ms"), ("flash_merge_over_flash", t.merge_ms / t.flash_ms, "x")]
        if t.flashinfer_ms is not None:
            values.append(("flashinfer_custom_mask_ms", t.flashinfer_ms, "ms"))
            if t.flash_ms is not None:
                values.append(("flashinfer_custom_mask_over_flash", t.flashinfer_ms / t.flash_ms, "x"))
            values.append(("flashinfer_plan_ms", t.flashinfer_plan_ms, "ms"))
        else:
            notes += f"; FlashInfer's custom-mask prefill did not run: {t.flashinfer_error}"
        records += [{
            "kind": "microbench", "method": "ubtree", "target": f"{shape.name} (context {t.context_len})",
            "metric": metric, "value": round(value, 5), "unit": unit, "batch_size": 1,
            "tree_budget": TREE_NODES, "block_size": MAX_DEPTH, "cuda_graphs": GRAPH_CLOCK in t.clock, "hardware": hardware,
            "notes": notes,
        } for metric, value, unit in values]
    return records
