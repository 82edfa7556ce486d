"""triton_ops.tree_layout, triton_ops.accepted_rows and triton_ops.node_inputs against their torch forms (``vllm.mrv2.tree_layout``,
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

from ubtree_vllm.triton_ops.accepted_rows import commit_accepted_paths
from ubtree_vllm.triton_ops.kv_path_commit import kv_cache_pointers
from ubtree_vllm.triton_ops.node_inputs import node_inputs
from ubtree_vllm.triton_ops.reference import kv_path_commit_reference
from ubtree_vllm.triton_ops.tree_layout import tree_layout
from ubtree_vllm.vllm.mrv2.rejection_sampler import gather_node_inputs
from ubtree_vllm.vllm.mrv2.tree_layout import commit_pairs, lay_out_tree_rows, linearise_rows

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
@pytest.mark.parametrize("cover_rows", [False, True])
def test_tree_layout_matches_torch(device, cover_rows):
    num_tree_rows = 0
    for k, batch in enumerate(batches()):
        for m_cap in (batch.num_tokens, batch.padded_tokens + 70):
            want_bufs, want_pos = run_layout_with(lay_out_tree_rows, batch, m_cap, cover_rows=cover_rows)
            got_bufs, got_pos = run_layout_with(tree_layout, batch, m_cap, device, cover_rows=cover_rows)
            assert got_pos.tolist() == want_pos.tolist(), k
            for name, want in want_bufs.items():
                assert got_bufs[name].tolist() == want.tolist(), (k, name)
            num_tree_rows += int((want_bufs["row_index"] >= 0).sum())
    assert num_tree_rows > 500


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("whole_tree,stale", [(False, False), (True, True)])
def test_commit_accepted_paths_matches_torch(device, whole_tree, stale):
    """One launch == commit_pairs + kv_path_commit_reference (every layer) + linearise_rows with positions."""
    num_moves = 0
    heads, elems, block_size = 2, 8, 4
    for k, batch in enumerate(batches()):
        t = batch.tensors()
        accepted_path, num_accepted = random_acceptance(batch, random.Random(k), whole_tree, stale)
        gen = torch.Generator().manual_seed(k)
        num_slots = 4 * batch.padded_tokens
        slot_mapping = torch.randperm(num_slots, generator=gen)[:batch.padded_tokens]
        args = (t["logits_indices"], t["cu_num_logits"], accepted_path, num_accepted, batch.max_depth)
        on_device = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)
        # [num_blocks, H_kv, block_size, E] viewed from [num_blocks, block_size, H_kv, E], as vLLM's FLASH_ATTN
        num_blocks = num_slots // block_size + 1
        caches = [torch.randn(num_blocks, block_size, heads, elems, generator=gen).to(device).transpose(1, 2)
                  for _ in range(3)]
        want_caches = [c.cpu().clone() for c in caches]
        src, dst, moves = commit_pairs(slot_mapping, *args)
        kv_path_commit_reference(want_caches, src, dst, moves, batch.max_depth)
        tree_positions = t["positions"] + torch.randint(0, 3, t["positions"].shape, generator=gen)
        want_pos = tree_positions.clone()
        want_perm = linearise_rows(batch.padded_tokens, *args, positions=want_pos,
                                   expanded_local_pos=t["expanded_local_pos"])
        got_pos = tree_positions.to(device)
        got_perm = commit_accepted_paths(kv_cache_pointers(caches), caches[0], slot_mapping.to(device),
                                         batch.padded_tokens, *on_device, positions=got_pos)
        assert got_perm.dtype == torch.int64 and got_perm.cpu().tolist() == want_perm.tolist(), k
        assert got_pos.cpu().tolist() == want_pos.tolist(), k
        for got, want in zip(caches, want_caches):
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
        # without positions: the same moves and permutation, positions untouched
        caches = [c.cpu().clone().to(device) for c in want_caches]
        untouched = tree_positions.to(device)
        perm = commit_accepted_paths(kv_cache_pointers(caches), caches[0], slot_mapping.to(device),
                                     batch.padded_tokens, *on_device)
        assert perm.cpu().tolist() == want_perm.tolist() and torch.equal(untouched.cpu(), tree_positions), k
        num_moves += int(moves.sum())
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
    cache = torch.zeros(4, 2, 4, 8)
    slot_mapping = torch.arange(batch.padded_tokens)
    with pytest.raises(AssertionError, match="num_accepted"):
        commit_accepted_paths(kv_cache_pointers([cache]), cache, slot_mapping, batch.num_tokens, t["logits_indices"],
                              t["cu_num_logits"], accepted_path, num_accepted[:0], batch.max_depth)
    with pytest.raises(AssertionError, match="kv cache"):
        commit_accepted_paths(kv_cache_pointers([cache]), cache[0], slot_mapping, batch.num_tokens,
                              t["logits_indices"], t["cu_num_logits"], accepted_path, num_accepted, batch.max_depth)


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
