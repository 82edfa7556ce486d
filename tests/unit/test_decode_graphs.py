"""Tree-step CUDA-graph sizes (ubtree_vllm/vllm/decode_graphs.py) on a real vLLM CompilationConfig."""
from __future__ import annotations

from types import SimpleNamespace

from vllm.config import CompilationConfig
from vllm.config.compilation import CUDAGraphMode

from ubtree_vllm.vllm.decode_graphs import budget_ranges, decode_graph_sizes, request_counts, widen_decode_graph_sizes

VLLM_TOKEN_GRID = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]  # vLLM 0.32's default sizes up to 512


def test_request_counts_follow_vllms_grid():
    assert request_counts(1) == [1]
    assert request_counts(3) == [1, 2, 3]
    assert request_counts(32) == [1, 2, 4, 8, 16, 24, 32]
    assert request_counts(300)[-6:] == [240, 248, 256, 272, 288, 300]
    assert request_counts(0) == []


def test_decode_sizes_cover_every_request_count_up_to_the_token_budget():
    sizes = decode_graph_sizes(VLLM_TOKEN_GRID, query_len=65, max_num_seqs=32, max_num_batched_tokens=16384)
    assert set(VLLM_TOKEN_GRID) <= set(sizes) and sizes == sorted(set(sizes))
    assert [s for s in sizes if s > 512] == [520, 1040, 1560, 2080]  # 8, 16, 24, 32 requests of 65 tokens
    capped = decode_graph_sizes(VLLM_TOKEN_GRID, query_len=65, max_num_seqs=1024, max_num_batched_tokens=1000)
    assert capped[-1] == 15 * 65  # 1000 // 65 requests fit one step


def engine_config(sizes, mode=CUDAGraphMode.FULL_AND_PIECEWISE, max_num_seqs=32, query_len=65, schedule=None):
    compilation = CompilationConfig(cudagraph_mode=mode, cudagraph_capture_sizes=list(sizes),
                                    max_cudagraph_capture_size=max(sizes, default=0))
    spec = SimpleNamespace(num_speculative_tokens=query_len - 1, num_speculative_tokens_per_batch_size=schedule)
    return SimpleNamespace(compilation_config=compilation, uniform_decode_query_len=query_len, speculative_config=spec,
                           scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs, max_num_batched_tokens=16384))


def test_a_budget_schedule_adds_each_entrys_step_sizes():
    """1-8 requests verify 65 tokens each, 9-16 verify 33, 17-32 verify 17: each range gets its own sizes."""
    schedule = [(1, 8, 65), (9, 16, 33), (17, 32, 17)]
    sizes = decode_graph_sizes(VLLM_TOKEN_GRID, query_len=65, max_num_seqs=32, max_num_batched_tokens=16384,
                               schedule=schedule)
    assert {16 * 33, 24 * 17, 32 * 17} <= set(sizes)  # 528, 408, 544: every range's top count exactly
    only = decode_graph_sizes([], query_len=65, max_num_seqs=32, max_num_batched_tokens=16384, schedule=schedule)
    assert 8 * 33 not in only and 16 * 17 not in only  # counts outside an entry's range add nothing of it
    capped = decode_graph_sizes([], query_len=65, max_num_seqs=32, max_num_batched_tokens=300, schedule=[(1, 32, 17)])
    assert max(capped) <= 300 and 17 * 17 in capped  # 300 // 17 = 17 requests fit one step


def test_widen_reads_vllms_budget_schedule_and_the_draft_query_length():
    config = engine_config(VLLM_TOKEN_GRID, schedule=[[1, 8, 64], [9, 16, 32], [17, 32, 16]])
    assert widen_decode_graph_sizes(config, draft_query_len=17) is True
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert {8 * 65, 16 * 33, 32 * 17} <= set(sizes)  # B' + 1 tokens per request in each range
    assert 2 * 17 in sizes and 31 * 17 not in sizes  # the draft's 17 tokens per request on vLLM's request grid
    plain = engine_config(VLLM_TOKEN_GRID)
    widen_decode_graph_sizes(plain)
    assert 32 * 17 not in plain.compilation_config.cudagraph_capture_sizes  # pinned B, V1 runner: only 1 + B


def test_with_a_schedule_the_full_budget_sizes_are_only_those_it_verifies_at():
    """The default-like schedule verifies 65 tokens per request only for 1-8 requests: no 16 x 65 graph (MRV2 would
    capture it once per query length of the schedule); a gap and the tail carry the entry before them, as vLLM's
    scheduler looks budgets up."""
    config = engine_config(VLLM_TOKEN_GRID, max_num_seqs=64, schedule=[[1, 8, 64], [9, 16, 32], [17, 32, 16]])
    assert widen_decode_graph_sizes(config, draft_query_len=17) is True
    sizes = config.compilation_config.cudagraph_capture_sizes
    assert {8 * 65, 16 * 33, 32 * 17, 64 * 17} <= set(sizes)  # the tail (33-64 requests) carries 16: 17 tokens
    assert not {16 * 65, 24 * 65, 32 * 65, 64 * 65, 24 * 33, 64 * 33} & set(sizes)
    assert config.compilation_config.max_cudagraph_capture_size == 64 * 17 == sizes[-1]
    gap = engine_config(VLLM_TOKEN_GRID, schedule=[[1, 4, 64], [17, 32, 16]])
    widen_decode_graph_sizes(gap)
    assert {8 * 65, 16 * 65, 32 * 17} <= set(gap.compilation_config.cudagraph_capture_sizes)  # 5-16 carry 64
    assert 24 * 65 not in gap.compilation_config.cudagraph_capture_sizes
    assert budget_ranges([(1, 4, 64), (17, 32, 16)], 64, 40) == [(1, 16, 64), (17, 40, 16)]
    assert budget_ranges([(1, 8, 80), (9, 9, 32)], 64, 12) == [(1, 8, 64), (9, 12, 32)]  # capped at the pinned B


def test_widen_updates_sizes_and_max_in_place_once():
    config = engine_config(VLLM_TOKEN_GRID)
    assert widen_decode_graph_sizes(config) is True
    compilation = config.compilation_config
    assert compilation.max_cudagraph_capture_size == 2080 == compilation.cudagraph_capture_sizes[-1]
    assert 1040 in compilation.cudagraph_capture_sizes and 512 in compilation.cudagraph_capture_sizes
    assert widen_decode_graph_sizes(config) is False  # already wide: nothing to add


def test_widen_is_a_no_op_without_graphs():
    for config in (engine_config([]), engine_config(VLLM_TOKEN_GRID, mode=CUDAGraphMode.NONE)):
        before = list(config.compilation_config.cudagraph_capture_sizes)
        assert widen_decode_graph_sizes(config) is False
        assert config.compilation_config.cudagraph_capture_sizes == before


def test_a_tree_step_that_cannot_fit_fails_naming_the_largest_value_that_fits():
    import pytest

    from ubtree_vllm.vllm.decode_graphs import check_tree_steps_fit

    def config(max_tokens=16384, schedule=None, max_num_seqs=32, sizes=VLLM_TOKEN_GRID):
        c = engine_config(sizes, max_num_seqs=max_num_seqs, schedule=schedule)
        c.scheduler_config.max_num_batched_tokens = max_tokens
        return c

    check_tree_steps_fit(config(schedule=[[1, 8, 64], [9, 32, 16]]), graph_sizes_chosen=False)  # 520 and 544 fit
    with pytest.raises(ValueError, match="num_speculative_tokens = 64: .* max_num_batched_tokens is 48; the largest "
                                         "num_speculative_tokens that fits is 47"):
        check_tree_steps_fit(config(max_tokens=48), graph_sizes_chosen=False)
    with pytest.raises(ValueError, match=r"entry \[9, 32, 16\]: 32 requests verify 544 tokens .* max_num_batched_tokens "
                                         r"is 512; the largest budget that fits 32 requests is 15"):
        check_tree_steps_fit(config(max_tokens=512, schedule=[[1, 4, 64], [9, 32, 16]]), graph_sizes_chosen=False)
    with pytest.raises(ValueError, match=r"the largest last batch size that fits budget 64 is 7"):
        check_tree_steps_fit(config(max_tokens=512, schedule=[[1, 600, 64]], max_num_seqs=1024),
                             graph_sizes_chosen=False)
    # the budget policy's default schedule is left to vLLM's scheduler, which truncates the drafts to the token budget
    # (a prefix of the rank-ordered nodes, the best smaller tree); the pinned B is still checked
    check_tree_steps_fit(config(max_tokens=512, schedule=[[1, 4, 64], [9, 32, 16]]), graph_sizes_chosen=False,
                         default_schedule=True)
    with pytest.raises(ValueError, match="num_speculative_tokens = 64: .* the largest num_speculative_tokens"):
        check_tree_steps_fit(config(max_tokens=48, schedule=[[1, 4, 64]]), graph_sizes_chosen=False,
                             default_schedule=True)
    # a range the scheduler never reaches (first > max_num_seqs) is not checked
    check_tree_steps_fit(config(max_tokens=600, schedule=[[1, 8, 64], [64, 256, 64]]), graph_sizes_chosen=False)
    # graph sizes the user chose: the steps must fit the largest captured graph too (else they run without graphs)
    chosen = config(schedule=[[1, 8, 64], [9, 32, 16]])
    check_tree_steps_fit(chosen, graph_sizes_chosen=False)
    with pytest.raises(ValueError, match=r"entry \[1, 8, 64\]: 8 requests verify 520 tokens .* "
                                         r"max_cudagraph_capture_size is 512; the largest budget that fits 8 requests is 63"):
        check_tree_steps_fit(chosen, graph_sizes_chosen=True)
