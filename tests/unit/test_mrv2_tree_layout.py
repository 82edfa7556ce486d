"""MRV2 device tree layout (``ubtree_vllm.vllm.mrv2.tree_layout``, torch form) against loop references and
V1's build_plan, on the random batches of ``tests/mrv2_batches.py`` (the Triton forms: tests/triton).
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from mrv2_batches import SEEDS, Batch, Request, random_acceptance, random_batch, run_layout_with

from ubtree_vllm.triton_ops.reference import kv_path_commit_reference
from ubtree_vllm.vllm.mrv2.tree_layout import commit_pairs, lay_out_tree_rows, linearise_rows
from ubtree_vllm.vllm.tree_plan import RequestTree, build_plan


def ancestors(parents: list[int], node: int) -> list[int] | None:
    """Root->node path (node indices), or None when the chain hits a padding node."""
    path = [node]
    while path[-1] != 0:
        parent = parents[path[-1]]
        if parent < 0:
            return None
        path.append(parent)
    return path[::-1]


def reference_layout(batch: Batch, m_cap: int, cover_rows: bool = False) -> dict[str, list]:
    """Loop twin of lay_out_tree_rows: entries by logits row, and the positions after it."""
    width = batch.max_depth + 1
    out = {"row_index": [-1] * m_cap, "row_req": [None] * m_cap, "row_context_len": [None] * m_cap,
           "row_path": [[-1] * width for _ in range(m_cap)],
           "positions": batch.tensors()["positions"].tolist()}
    logits_row = 0
    for b, r in enumerate(batch.reqs):
        for j in range(1, r.num_logits):  # roots never get an entry
            path = ancestors(batch.parents[r.slot], j)
            m = logits_row + j
            if path is None or len(path) > width:
                if cover_rows:  # a non-tree node: [root, self]
                    out["row_index"][m] = r.root_row + j
                    out["row_req"][m] = b
                    out["row_context_len"][m] = r.root_pos
                    out["row_path"][m] = [r.root_row, r.root_row + j] + [-1] * (width - 2)
                continue
            out["row_index"][m] = r.root_row + j
            out["row_req"][m] = b
            out["row_context_len"][m] = r.root_pos
            out["row_path"][m] = [r.root_row + a for a in path] + [-1] * (width - len(path))
            out["positions"][r.root_row + j] = r.root_pos + len(path) - 1
        logits_row += r.num_logits
    return out


def run_layout(batch: Batch, m_cap: int, cover_rows: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    return run_layout_with(lay_out_tree_rows, batch, m_cap, cover_rows=cover_rows)


@pytest.mark.parametrize("cover_rows", [False, True])
def test_layout_matches_loop_reference(cover_rows):
    num_tree_rows = num_cut = 0
    for seed in SEEDS:
        batch = random_batch(seed)
        m_cap = batch.num_tokens + 4
        bufs, positions = run_layout(batch, m_cap, cover_rows)
        want = reference_layout(batch, m_cap, cover_rows)
        assert bufs["row_index"].tolist() == want["row_index"], seed
        assert positions.tolist() == want["positions"], seed
        assert bufs["row_path"].tolist() == want["row_path"], seed
        tree = [m for m in range(m_cap) if want["row_index"][m] >= 0]
        for name in ("row_req", "row_context_len"):
            assert [bufs[name][m].item() for m in tree] == [want[name][m] for m in tree], (seed, name)
        num_tree_rows += len(tree)
        num_cut += sum(r.num_logits - 1 for r in batch.reqs) - len(tree)
    if cover_rows:  # every draft row has an entry
        assert num_tree_rows > 100 and num_cut == 0
    else:  # trees were laid out, and padding was left out
        assert num_tree_rows > 100 and num_cut > 5


def test_layout_small_example():
    # a prefill (3 rows, slot 1); parents [-1, 0, 0, 1, -2] truncated to 4 nodes (slot 0); a chain of
    # depth 4 > max_depth (slot 2), whose node 4 is left to causal attention
    chain = ([-1, 0, 1, 2, 3], [0, 1, 2, 3, 4])
    batch = Batch(num_nodes=5, max_depth=3,
                  reqs=[Request(1, 0, 3, 1, 0), Request(0, 3, 4, 4, 10), Request(2, 7, 5, 5, 20)],
                  parents=[[-1, 0, 0, 1, -2]] + [chain[0]] * 7, depths=[[0, 1, 1, 2, 0]] + [chain[1]] * 7,
                  num_tokens=12, padded_tokens=13)
    bufs, positions = run_layout(batch, 11)
    assert positions.tolist() == [0, 1, 2, 10, 11, 11, 12, 20, 21, 22, 23, 24, 0]
    assert bufs["row_index"].tolist() == [-1, -1, 4, 5, 6, -1, 8, 9, 10, -1, -1]
    tree = [2, 3, 4, 6, 7, 8]
    assert bufs["row_req"][tree].tolist() == [1, 1, 1, 2, 2, 2]
    assert bufs["row_context_len"][tree].tolist() == [10, 10, 10, 20, 20, 20]
    assert bufs["row_path"][tree].tolist() == [[3, 4, -1, -1], [3, 5, -1, -1], [3, 4, 6, -1],
                                               [7, 8, -1, -1], [7, 8, 9, -1], [7, 8, 9, 10]]
    assert (bufs["row_path"][[0, 1, 5, 9, 10]] == -1).all()
    # cover_rows: every draft row has an entry, the roots (and the prefill's last row, a root) none; the node past
    # max_depth attends to its context, its root and itself; positions as before
    bufs, covered_positions = run_layout(batch, 11, cover_rows=True)
    assert covered_positions.tolist() == positions.tolist()
    assert bufs["row_index"].tolist() == [-1, -1, 4, 5, 6, -1, 8, 9, 10, 11, -1]
    assert [bufs["row_req"][m].item() for m in (2, 3, 4, 6, 7, 8, 9)] == [1, 1, 1, 2, 2, 2, 2]
    assert [bufs["row_context_len"][m].item() for m in (2, 3, 4, 6, 7, 8, 9)] == [10, 10, 10, 20, 20, 20, 20]
    assert bufs["row_path"].tolist() == [[-1, -1, -1, -1], [-1, -1, -1, -1], [3, 4, -1, -1], [3, 5, -1, -1],
                                         [3, 4, 6, -1], [-1, -1, -1, -1], [7, 8, -1, -1], [7, 8, 9, -1],
                                         [7, 8, 9, 10], [7, 11, -1, -1], [-1, -1, -1, -1]]


def test_layout_matches_build_plan():
    """Against V1's host plan, on the requests it lays out as trees (no padding among the scheduled nodes)."""
    num_compared = 0
    for seed in SEEDS:
        batch = random_batch(seed)
        bufs, positions = run_layout(batch, batch.num_tokens)
        req_ids = [f"r{b}" for b in range(len(batch.reqs))]
        drafts, trees = {}, {}
        for req_id, r in zip(req_ids, batch.reqs):
            tokens = [1000 * r.slot + j for j in range(1, batch.num_nodes)]
            parents = batch.parents[r.slot]
            if r.num_logits > 1:
                drafts[req_id] = tokens[:r.num_logits - 1]
                if min(parents[1:r.num_logits]) >= 0:
                    trees[req_id] = RequestTree(tokens, np.array(parents), np.array(batch.depths[r.slot]))
        plan = build_plan(req_ids, np.array([r.query_start for r in batch.reqs] + [batch.num_tokens]),
                          np.array([r.num_scheduled for r in batch.reqs]),
                          np.array([r.num_computed for r in batch.reqs]), np.arange(batch.num_tokens),
                          drafts, trees)
        entry = {row: m for m, row in enumerate(bufs["row_index"].tolist()) if row >= 0}
        for k, row in enumerate(plan.row_index.tolist()):
            m = entry[row]
            assert bufs["row_req"][m] == plan.row_req[k] and bufs["row_context_len"][m] == plan.row_context_len[k]
            # build_plan's path width follows the step's deepest request (chains included)
            want = plan.row_path[k].tolist() + [-1] * batch.max_depth
            assert bufs["row_path"][m].tolist() == want[:batch.max_depth + 1], seed
            assert max(want[batch.max_depth + 1:]) == -1
        rows, values = plan.positions()
        assert positions[rows].tolist() == values.tolist(), seed
        num_compared += len(plan.row_index)
    assert num_compared > 50


def depths_to_commit(r: Request, path: list[int], num_accepted: int) -> range:
    """Depths 1..k of the accepted nodes that are rows of the request (node indices grow with depth)."""
    return range(1, 1 + sum(1 for node in path[1:num_accepted + 1] if node < r.num_logits))


def acceptance_cases(whole_tree: bool, stale: bool):
    """Per seed: (seed, batch, its tensors, accepted_path, num_accepted, [(request, path, depths to commit)])."""
    for seed in SEEDS:
        batch = random_batch(seed)
        accepted_path, num_accepted = random_acceptance(batch, random.Random(seed), whole_tree, stale)
        commits = [(r, path, depths_to_commit(r, path, k))
                   for r, path, k in zip(batch.reqs, accepted_path.tolist(), num_accepted.tolist())]
        yield seed, batch, batch.tensors(), accepted_path, num_accepted, commits


ACCEPTANCE = pytest.mark.parametrize("whole_tree,stale", [(False, False), (True, False), (False, True),
                                                         (True, True)])


@ACCEPTANCE
def test_commit_pairs_move_accepted_kv_to_depth_slots(whole_tree, stale):
    num_moves = 0
    for seed, batch, t, accepted_path, num_accepted, commits in acceptance_cases(whole_tree, stale):
        block_size, heads, elems = 4, 2, 3
        num_blocks = batch.padded_tokens // block_size + 3
        gen = torch.Generator().manual_seed(seed)
        slot_mapping = torch.randperm(num_blocks * block_size, generator=gen)[:batch.padded_tokens]
        cache = torch.randn(num_blocks, heads, block_size, elems, generator=gen)

        want, want_moves = cache.clone(), []
        for r, path, depths in commits:
            want_moves += [d in depths and path[d] != d for d in range(1, batch.max_depth + 1)]
            src = [int(slot_mapping[r.root_row + path[d]]) for d in depths]
            rows = [cache[s // block_size, :, s % block_size].clone() for s in src]
            for d, kv in zip(depths, rows):
                dst = int(slot_mapping[r.root_row + d])
                want[dst // block_size, :, dst % block_size] = kv

        src, dst, moves = commit_pairs(slot_mapping, t["logits_indices"], t["cu_num_logits"], accepted_path,
                                       num_accepted, batch.max_depth)
        assert src.shape == dst.shape == moves.shape == (len(batch.reqs) * batch.max_depth,)
        assert src.dtype == dst.dtype == torch.int64 and moves.tolist() == want_moves, seed
        got = [cache.clone()]
        kv_path_commit_reference(got, src, dst, moves, batch.max_depth)
        torch.testing.assert_close(got[0], want, rtol=0, atol=0)
        num_moves += int(moves.sum())
    assert num_moves > 10


@ACCEPTANCE
def test_linearise_rows_puts_accepted_path_at_depth_rows(whole_tree, stale):
    num_moved = 0
    for seed, batch, t, accepted_path, num_accepted, commits in acceptance_cases(whole_tree, stale):
        want = list(range(batch.padded_tokens))
        for r, path, depths in commits:
            for d in depths:
                want[r.root_row + d] = r.root_row + path[d]
        perm = linearise_rows(batch.padded_tokens, t["logits_indices"], t["cu_num_logits"], accepted_path,
                              num_accepted, batch.max_depth)
        assert perm.dtype == torch.int64 and perm.tolist() == want, seed
        num_moved += int((perm != torch.arange(batch.padded_tokens)).sum())
    assert num_moved > 10


@pytest.mark.parametrize("seed", [0, 1])
def test_no_device_value_reaches_the_host(seed):
    """On the meta device no op can read a tensor's values: the functions must still run."""
    batch = random_batch(seed)
    t = {name: v.to("meta") for name, v in batch.tensors().items()}
    accepted_path, num_accepted = random_acceptance(batch, random.Random(seed), whole_tree=True, stale=True)
    accepted_path, num_accepted = accepted_path.to("meta"), num_accepted.to("meta")
    m_cap, width = batch.num_tokens, batch.max_depth + 1
    bufs = [torch.empty(m_cap, dtype=torch.int64, device="meta") for _ in range(3)]
    lay_out_tree_rows(t["positions"], t["logits_indices"], t["cu_num_logits"], t["expanded_idx_mapping"],
                      t["expanded_local_pos"], t["tree_parents"], t["tree_depth"], batch.max_depth, *bufs,
                      torch.empty(m_cap, width, dtype=torch.int64, device="meta"))
    slot_mapping = torch.empty(batch.padded_tokens, dtype=torch.int64, device="meta")
    src, _, _ = commit_pairs(slot_mapping, t["logits_indices"], t["cu_num_logits"], accepted_path, num_accepted,
                             batch.max_depth)
    perm = linearise_rows(batch.padded_tokens, t["logits_indices"], t["cu_num_logits"], accepted_path,
                          num_accepted, batch.max_depth)
    assert src.shape == (len(batch.reqs) * batch.max_depth,) and perm.shape == (batch.padded_tokens,)
