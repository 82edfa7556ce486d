"""CUDA-graph sizes for tree verification steps of every batch size up to ``max_num_seqs``.

A UBTree decode step verifies ``1 + B`` tokens per request (65 at B = 64). vLLM 0.32 sizes
its graphs by tokens and, unless the user chose sizes, caps them at 512 tokens
(``VllmConfig._set_cudagraph_sizes``: "larger uniform decode batches fall back to eager
execution"), so with B = 64 every step of more than 7 requests ran without graphs, target
and drafter alike. :func:`widen_decode_graph_sizes` adds one capture size per request count
of vLLM's own request-count grid (1, 2, 4, 8, 16, ..., 248, then steps of 16), in tokens
``n * (1 + B)``, up to ``min(max_num_seqs, max_num_batched_tokens // (1 + B))`` requests.
vLLM's token grid below 512 (mixed prefill/decode batches) is kept as it is; batches
between two sizes are padded up to the next one, as vLLM always does.

The UBTree worker applies it before building its model runner, when the engine-args
rewrite found no user choice of ``cudagraph_capture_sizes`` / ``max_cudagraph_capture_size``
(``UBTreeVllmConfig.wide_decode_graphs``). The V1 runner and Model Runner V2 both read the
widened list (MRV2's manager rounds each size up to a multiple of the query length; these
already are multiples).
"""
from __future__ import annotations

from typing import Any


def request_counts(max_reqs: int) -> list[int]:
    """vLLM's request-count capture grid (``VllmConfig._set_cudagraph_sizes``) up to ``max_reqs``."""
    counts = [n for n in (1, 2, 4) if n <= max_reqs]
    counts += list(range(8, min(max_reqs + 1, 256), 8))
    counts += list(range(256, max_reqs + 1, 16))
    return sorted(set(counts + ([max_reqs] if max_reqs >= 1 else [])))


def decode_graph_sizes(capture_sizes: list[int], query_len: int, max_num_seqs: int,
                       max_num_batched_tokens: int) -> list[int]:
    """``capture_sizes`` plus ``n * query_len`` for the request-count grid, sorted, deduplicated.

    The widest added size is the largest uniform decode batch the scheduler can build:
    ``min(max_num_seqs, max_num_batched_tokens // query_len)`` requests."""
    max_reqs = min(max_num_seqs, max_num_batched_tokens // query_len)
    return sorted(set(capture_sizes) | {n * query_len for n in request_counts(max_reqs)})


def widen_decode_graph_sizes(vllm_config: Any) -> bool:
    """Add the decode sizes to ``vllm_config.compilation_config`` in place; True if it changed.

    No-op without CUDA graphs (enforce_eager, cudagraph_mode NONE, empty size list)."""
    compilation = vllm_config.compilation_config
    if not compilation.cudagraph_capture_sizes or not compilation.cudagraph_mode:
        return False
    scheduler = vllm_config.scheduler_config
    sizes = decode_graph_sizes(compilation.cudagraph_capture_sizes, vllm_config.uniform_decode_query_len,
                               scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    if sizes == sorted(compilation.cudagraph_capture_sizes):
        return False
    compilation.cudagraph_capture_sizes = sizes
    compilation.max_cudagraph_capture_size = sizes[-1]
    compilation.post_init_cudagraph_sizes()  # recomputes compile_sizes; asserts the max is the last size
    return True
