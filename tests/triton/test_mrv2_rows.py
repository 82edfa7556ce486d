"""triton_ops.tree_layout and triton_ops.accepted_rows against their torch forms (``vllm.mrv2.tree_layout``,
themselves checked against Python loops in tests/unit/test_mrv2_tree_layout.py), on the random MRV2 batches
of tests/mrv2_batches.py plus serving-sized ones (gamma = 16, B = 64).

Without CUDA the kernels run under the Triton interpreter on CPU tensors; the torch forms always run on the
CPU (on CUDA tensors ``vllm.mrv2.tree_layout`` dispatches to these kernels).
"""
from __future__ import annotations

import random

import pytest
import torch
from mrv2_batches import SEEDS, Batch, Request, random_acceptance, random_batch, random_tree, run_layout_with

from ubtree_vllm.triton_ops.accepted_rows import accepted_commit_pairs, accepted_row_permutation
from ubtree_vllm.triton_ops.node_inputs import node_inputs
from ubtree_vllm.triton_ops.tree_layout import tree_layout
from ubtree_vllm.vllm.mrv2.rejection_sampler import gather_node_inputs
from ubtree_vllm.vllm.mrv2.tree_layout import commit_pairs, lay_out_tree_rows, linear_logits_positions_, linearise_rows

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def serving_batch(seed: int) -> Batch:
    """Up to 5 requests with B = 64 draft slots and depth <= 16 (the serving shape), some truncated."""
    rng = random.Random(seed)
    num_nodes, max_depth, max_reqs = 65, 16, 8
    trees = [random_tree(rng, num_nodes, max_depth) for _ in range(max_reqs)]
    reqs, start = [], 0
    for slot in rng.sample(range(max_reqs), rng.randint(1, 5)):
        num_logits = rng.choice([1, rng.randint(2, num_nodes), num_nodes])
        leading = rng.choice([0, 0, 3])
        reqs.append(Request(slot, start, leading + num_logits, num_logits, rng.randint(0, 4000)))
        start += leading + num_logits
    return Batch(num_nodes, max_depth, reqs, [t[0] for t in trees], [t[1] for t in trees], start, start + 5)


def batches():
    yield from (random_batch(seed) for seed in SEEDS)
    yield from (serving_batch(seed) for seed in range(12))


@pytest.mark.parametrize("device", DEVICES)
def test_tree_layout_matches_torch(device):
    num_tree_rows = 0
    for k, batch in enumerate(batches()):
        for m_cap in (batch.num_tokens, batch.padded_tokens + 70):
            want_bufs, want_pos = run_layout_with(lay_out_tree_rows, batch, m_cap)
            got_bufs, got_pos = run_layout_with(tree_layout, batch, m_cap, device)
            assert got_pos.tolist() == want_pos.tolist(), k
            for name, want in want_bufs.items():
                assert got_bufs[name].tolist() == want.tolist(), (k, name)
            num_tree_rows += int((want_bufs["row_index"] >= 0).sum())
    assert num_tree_rows > 500


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("whole_tree,stale", [(False, False), (True, True)])
def test_accepted_rows_match_torch(device, whole_tree, stale):
    num_moves = 0
    for k, batch in enumerate(batches()):
        t = batch.tensors()
        accepted_path, num_accepted = random_acceptance(batch, random.Random(k), whole_tree, stale)
        slot_mapping = torch.randperm(4 * batch.padded_tokens, generator=torch.Generator().manual_seed(k))
        slot_mapping = slot_mapping[:batch.padded_tokens]
        args = (t["logits_indices"], t["cu_num_logits"], accepted_path, num_accepted, batch.max_depth)
        on_device = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        want = commit_pairs(slot_mapping, *args)
        got = accepted_commit_pairs(slot_mapping.to(device), *on_device)
        for name, w, g in zip(("src", "dst", "moves"), want, got):
            assert g.dtype == w.dtype and g.cpu().tolist() == w.tolist(), (k, name)
        want_perm = linearise_rows(batch.padded_tokens, *args)
        got_perm = accepted_row_permutation(batch.padded_tokens, *on_device)
        assert got_perm.dtype == torch.int64 and got_perm.cpu().tolist() == want_perm.tolist(), k
        # with positions: the same permutation, and the logits rows' linear positions restored in place
        tree_positions = t["positions"] + torch.randint(0, 3, t["positions"].shape, generator=torch.Generator())
        want_pos = tree_positions.clone()
        linear_logits_positions_(want_pos, t["logits_indices"], t["expanded_local_pos"])
        got_pos = tree_positions.to(device)
        got_perm = accepted_row_permutation(batch.padded_tokens, *on_device, positions=got_pos)
        assert got_perm.cpu().tolist() == want_perm.tolist() and got_pos.cpu().tolist() == want_pos.tolist(), k
        num_moves += int(want[2].sum())
    assert num_moves > 30


def test_launchers_check_their_contract():
    batch = random_batch(0)
    t = batch.tensors()
    m_cap = batch.num_tokens
    bufs = [torch.zeros(m_cap, dtype=torch.int64) for _ in range(3)]
    path = torch.zeros(m_cap, batch.max_depth + 1, dtype=torch.int64)
    with pytest.raises(AssertionError, match="positions"):
        tree_layout(t["positions"].int(), t["logits_indices"], t["cu_num_logits"], t["expanded_idx_mapping"],
                    t["expanded_local_pos"], t["tree_parents"], t["tree_depth"], batch.max_depth, *bufs, path)
    with pytest.raises(AssertionError, match="out_row_path"):
        tree_layout(t["positions"], t["logits_indices"], t["cu_num_logits"], t["expanded_idx_mapping"],
                    t["expanded_local_pos"], t["tree_parents"], t["tree_depth"], batch.max_depth + 1, *bufs, path)
    accepted_path, num_accepted = random_acceptance(batch, random.Random(0), False, False)
    with pytest.raises(AssertionError, match="num_accepted"):
        accepted_row_permutation(batch.num_tokens, t["logits_indices"], t["cu_num_logits"], accepted_path,
                                 num_accepted[:0], batch.max_depth)


@pytest.mark.parametrize("device", DEVICES)
def test_node_inputs_match_torch(device):
    """Token and position of every logits row (placeholders -1 for drafts of a prefilling request)."""
    gen = torch.Generator().manual_seed(0)
    num_placeholders = 0
    for k, batch in enumerate(batches()):
        t = batch.tensors()
        input_ids = torch.randint(0, 49152, (batch.padded_tokens,), generator=gen, dtype=torch.int32)
        prefill_len = torch.randint(0, 4000, (len(batch.parents),), generator=gen, dtype=torch.int32)
        args = (input_ids, t["positions"], t["logits_indices"].int(), t["expanded_idx_mapping"].int(),
                t["expanded_local_pos"], prefill_len)
        want_token, want_pos = gather_node_inputs(*args)  # CPU tensors: the torch form
        got_token, got_pos = node_inputs(*(a.to(device) for a in args))
        assert (got_token.dtype, got_pos.dtype) == (torch.int32, torch.int64)
        assert got_token.tolist() == want_token.tolist() and got_pos.tolist() == want_pos.tolist(), k
        num_placeholders += int((want_token < 0).sum())
    assert num_placeholders > 50
