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

With a load-adaptive budget (``num_speculative_tokens_per_batch_size``, entries ``(first, last,
B')``), a step of n requests verifies ``1 + B'(n)`` tokens per request, B'(n) as vLLM's scheduler
looks it up (``build_dynamic_sd_schedule_lookup``: a gap or the tail past the last entry carries the
entry before it), so the sizes are ``n * (1 + B'(n))`` for the grid's request counts (and each
range's last count): without them, MRV2 rounds the ``n * (1 + B)`` sizes up to multiples of
``1 + B'`` and 32 requests of 17 tokens ran in the graph of 62 requests (1054 tokens, not 544).
The full-budget sizes ``n * (1 + B)`` are then added only for the request counts whose budget is B:
MRV2 captures one FULL graph per size and per query length of the schedule, so every size nobody
verifies at costs as many captures as the schedule has lengths (at B = 64, the default schedule and
16,384 batched tokens: sizes up to 16,380 tokens for 252 requests of 65, which the schedule never forms).

Model Runner V2's draft (vLLM's DFlash query forward, ``1 + gamma`` tokens per request) takes
its graphs from the same list, so on MRV2 ``n * (1 + gamma)`` joins too (``draft_query_len``);
with B = 64 its 32-request step otherwise ran in the 62-request graph as well.

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
                       max_num_batched_tokens: int,
                       schedule: list[tuple[int, int, int]] | None = None, full_budget: bool = True) -> list[int]:
    """``capture_sizes`` plus ``n * query_len`` for the request-count grid, sorted, deduplicated.

    The widest added size is the largest uniform decode batch the scheduler can build:
    ``min(max_num_seqs, max_num_batched_tokens // query_len)`` requests. ``schedule``: the
    load-adaptive budget's ``(first, last, entry query length)`` entries; each adds
    ``n * entry_len`` for the grid's counts in ``[first, last]`` and ``last`` itself, within
    the same two limits. ``full_budget=False``: no ``n * query_len`` besides the schedule's (its
    entries then name every request count's query length)."""
    max_reqs = min(max_num_seqs, max_num_batched_tokens // query_len)
    sizes = set(capture_sizes) | ({n * query_len for n in request_counts(max_reqs)} if full_budget else set())
    for first, last, entry_len in schedule or ():
        top = min(last, max_num_seqs, max_num_batched_tokens // entry_len)
        sizes |= {n * entry_len for n in request_counts(top) if n >= first}
    return sorted(sizes)


def budget_ranges(schedule: list[tuple[int, int, int]], budget: int, max_num_seqs: int) -> list[tuple[int, int, int]]:
    """The budget per request count as vLLM's scheduler looks it up, as ``(first, last, B')`` ranges covering
    ``1..max_num_seqs`` (vLLM's ``build_dynamic_sd_schedule_lookup``: gaps and the tail carry the entry before,
    each B' capped at the pinned ``budget``)."""
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    dense = build_dynamic_sd_schedule_lookup([list(e) for e in schedule], vllm_max_batch_size=max_num_seqs,
                                             vllm_num_speculative_tokens=budget)  # [max_num_seqs + 1], index 0 unused
    ranges: list[tuple[int, int, int]] = []
    for n in range(1, max_num_seqs + 1):
        if ranges and ranges[-1][2] == dense[n]:
            ranges[-1] = (ranges[-1][0], n, dense[n])
        else:
            ranges.append((n, n, dense[n]))
    return ranges


def _tree_steps(vllm_config: Any) -> tuple[int, list[tuple[int, int, int]]]:
    """(tokens a request's tree step verifies besides its B drafts, the budget schedule's (first, last, B')
    entries: vLLM's ``num_speculative_tokens_per_batch_size``, empty when B is pinned)."""
    spec = vllm_config.speculative_config
    schedule = getattr(spec, "num_speculative_tokens_per_batch_size", None) or ()
    return (vllm_config.uniform_decode_query_len - spec.num_speculative_tokens,
            [(first, last, budget) for first, last, budget in schedule])


def widen_decode_graph_sizes(vllm_config: Any, draft_query_len: int | None = None) -> bool:
    """Add the decode sizes to ``vllm_config.compilation_config`` in place; True if it changed.

    ``draft_query_len``: ``1 + gamma`` where the draft's graphs read the same list (MRV2), else None.
    No-op without CUDA graphs (enforce_eager, cudagraph_mode NONE, empty size list)."""
    compilation = vllm_config.compilation_config
    if not compilation.cudagraph_capture_sizes or not compilation.cudagraph_mode:
        return False
    scheduler = vllm_config.scheduler_config
    query_len = vllm_config.uniform_decode_query_len  # 1 + B
    sampled, schedule = _tree_steps(vllm_config)
    if schedule:  # every request count's budget, as the scheduler picks it
        schedule = budget_ranges(schedule, query_len - sampled, scheduler.max_num_seqs)
    entries = [(first, last, budget + sampled) for first, last, budget in schedule]
    if draft_query_len is not None:
        entries.append((1, scheduler.max_num_seqs, draft_query_len))
    sizes = decode_graph_sizes(compilation.cudagraph_capture_sizes, query_len, scheduler.max_num_seqs,
                               scheduler.max_num_batched_tokens, entries, full_budget=not schedule)
    if sizes == sorted(compilation.cudagraph_capture_sizes):
        return False
    compilation.cudagraph_capture_sizes = sizes
    compilation.max_cudagraph_capture_size = sizes[-1]
    compilation.post_init_cudagraph_sizes()  # recomputes compile_sizes; asserts the max is the last size
    return True


def check_tree_steps_fit(vllm_config: Any, graph_sizes_chosen: bool, default_schedule: bool = False) -> None:
    """ValueError, naming the field and the largest value that fits, when a tree step cannot fit the engine.

    A step of n requests at budget B' verifies ``n * (1 + B')`` tokens. It must fit the scheduler's token
    budget (``max_num_batched_tokens``): one request at the pinned B, and each schedule range at its last
    batch size (capped at ``max_num_seqs``). When the user chose the CUDA-graph sizes
    (``graph_sizes_chosen``: they are not widened), the same steps must also fit
    ``max_cudagraph_capture_size``, or they would run without graphs. Called by the UBTree workers before
    they build anything. ``default_schedule``: the schedule is the budget policy's default, not the user's; its
    ranges are not checked (vLLM's scheduler truncates each request's drafts to what the token budget holds, a
    prefix, which is the best smaller tree)."""
    scheduler = vllm_config.scheduler_config
    budget = vllm_config.speculative_config.num_speculative_tokens
    sampled, schedule = _tree_steps(vllm_config)
    compilation = vllm_config.compilation_config
    limits = [("max_num_batched_tokens", scheduler.max_num_batched_tokens)]
    if graph_sizes_chosen and compilation.cudagraph_mode and compilation.cudagraph_capture_sizes:
        limits.append(("max_cudagraph_capture_size", compilation.max_cudagraph_capture_size))
    for field, limit in limits:
        if sampled + budget > limit:
            raise ValueError(f"speculative_config.num_speculative_tokens = {budget}: one request's tree step "
                             f"verifies {sampled + budget} tokens but {field} is {limit}; the largest "
                             f"num_speculative_tokens that fits is {limit - sampled}")
        for first, last, entry_budget in () if default_schedule else schedule:
            if first > scheduler.max_num_seqs:
                continue  # the scheduler never forms that batch
            n = min(last, scheduler.max_num_seqs)
            if n * (entry_budget + sampled) <= limit:
                continue
            entry = f"speculative_config.num_speculative_tokens_per_batch_size entry [{first}, {last}, {entry_budget}]"
            largest = limit // n - sampled
            fix = (f"the largest budget that fits {n} requests is {largest}" if largest >= 1 else
                   f"the largest last batch size that fits budget {entry_budget} is {limit // (entry_budget + sampled)}")
            raise ValueError(f"{entry}: {n} requests verify {n * (entry_budget + sampled)} tokens per step but "
                             f"{field} is {limit}; {fix}")
