"""Laying trees over vLLM's flattened batch: rows, positions, paths, stash, fallbacks."""
from __future__ import annotations

import numpy as np

from ubtree_vllm.vllm.tree_plan import PAD_PARENT, RequestTree, build_plan
from vllm_batches import DRAFTS, NUM_COMPUTED, NUM_SCHEDULED, PARENTS, QUERY_START_LOC, REQ_IDS, make_batch


def test_plan_layout():
    plan = make_batch().plan
    assert plan.root_rows.tolist() == [0, 10, 11]
    assert plan.root_positions.tolist() == [37, 4, 3]
    assert plan.num_nodes.tolist() == [6, 1, 4]
    assert plan.is_tree.tolist() == [True, False, True]
    assert plan.max_nodes == 6 and plan.max_depth == 3
    assert plan.parents[0].tolist() == PARENTS["r0"]
    assert plan.parents[1].tolist() == [-1] + [PAD_PARENT] * 5
    assert plan.tokens[0].tolist() == [100] + DRAFTS["r0"]
    assert plan.tokens[2].tolist() == [111] + DRAFTS["r2"] + [-1, -1]


def test_positions_are_root_position_plus_depth():
    rows, positions = make_batch().plan.positions()
    assert rows.tolist() == [0, 1, 2, 3, 4, 5, 11, 12, 13, 14]
    assert positions.tolist() == [37, 38, 38, 39, 39, 40, 3, 4, 4, 5]


def test_attention_rows_and_paths():
    plan = make_batch().plan
    assert plan.row_index.tolist() == [1, 2, 3, 4, 5, 12, 13, 14]
    assert plan.row_req.tolist() == [0] * 5 + [2] * 3
    assert plan.row_depth.tolist() == [1, 1, 2, 2, 3, 1, 1, 2]
    assert plan.row_path[4].tolist() == [0, 1, 3, 5]  # node 5 -> 3 -> 1 -> root
    assert plan.row_path[7].tolist() == [11, 13, 14, -1]  # r2 node 3 -> 2 -> root
    assert plan.stash_rows.tolist() == [0, 1, 2, 3, 4, 5, 11, 12, 13, 14]
    assert plan.stash_offset.tolist() == [0, -1, 6]


def trees():
    return {r: RequestTree(draft_tokens=DRAFTS[r], parents=np.array(PARENTS[r]),
                           depth=np.array([0, 1, 1, 2, 2, 3][: len(PARENTS[r])] if r == "r0" else [0, 1, 1, 2]))
            for r in PARENTS}


def test_drafts_that_are_not_ours_are_verified_as_a_chain():
    drafts = dict(DRAFTS, r0=[0, 0, 0, 0, 0])  # e.g. vLLM zeroed the drafts
    plan = build_plan(REQ_IDS, QUERY_START_LOC, NUM_SCHEDULED, NUM_COMPUTED, np.arange(15), drafts, trees())
    assert plan.parents[0].tolist() == [-1, 0, 1, 2, 3, 4]
    assert plan.depth[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert plan.is_tree.tolist() == [False, False, True]
    assert plan.max_depth == 5


def test_truncated_drafts_are_a_prefix_tree():
    drafts = {"r0": DRAFTS["r0"][:2], "r2": DRAFTS["r2"][:1]}
    num_scheduled = np.array([3, 5, 2])
    query_start_loc = np.array([0, 3, 8, 10])
    plan = build_plan(REQ_IDS, query_start_loc, num_scheduled, NUM_COMPUTED, np.arange(10), drafts, trees())
    assert plan.parents[0].tolist() == [-1, 0, 0]
    assert plan.is_tree.tolist() == [True, False, False]  # r2's prefix [-1, 0] is a chain
    assert plan.row_index.tolist() == [1, 2]


def test_in_cache_commit_reads_the_slot_mapping_of_the_tree_attention_groups():
    """A hybrid target's KV cache groups hold its recurrent layers too: the in-cache KV commit takes the slot
    mapping of the group holding the tree attention layers, and refuses layers spread over several groups."""
    import types

    import pytest

    from ubtree_vllm.vllm.runner import UBTreeRunnerMixin

    def runner(groups, attention):
        return types.SimpleNamespace(
            kv_cache_config=types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(layer_names=g)
                                                                   for g in groups]),
            _tree_attention_layers=[types.SimpleNamespace(layer_name=name) for name in attention])

    gdn, attn = ["layers.0.linear_attn", "layers.2.linear_attn"], ["layers.1.self_attn", "layers.3.self_attn"]
    assert UBTreeRunnerMixin._tree_attention_group(runner([gdn, attn], attn)) == 1
    assert UBTreeRunnerMixin._tree_attention_group(runner([attn], attn)) == 0
    with pytest.raises(NotImplementedError, match="found them in 2"):
        UBTreeRunnerMixin._tree_attention_group(runner([attn[:1], attn[1:]], attn))
