"""The runner's batched feature commit: each request's committed rows land at their positions.

r0 (37 context tokens) verifies a 6-node tree and accepts root -> 1 -> 3 -> 5; r1 is a
5-token prefill chunk; r2 (3 context tokens) accepts node 2 only. The store must then hold,
per request, the forward's rows of the prefix, the root and the accepted nodes, in path
order, at consecutive positions -- and nothing after them.
"""
from __future__ import annotations

import types

import numpy as np
import torch

from ubtree_vllm.verify.accept import AcceptResult
from ubtree_vllm.vllm.features import ContextFeatureStore
from ubtree_vllm.vllm.runner import UBTreeRunnerMixin
from vllm_batches import QUERY_START_LOC, REQ_IDS, make_batch

F = 4


def fake_runner(store: ContextFeatureStore, accept: AcceptResult | None):
    return types.SimpleNamespace(
        _features=store, _accept=accept, query_start_loc=types.SimpleNamespace(np=QUERY_START_LOC),
        input_batch=types.SimpleNamespace(req_ids=REQ_IDS))


def test_commit_writes_prefix_root_and_accepted_path_at_their_positions():
    plan = make_batch().plan
    features = torch.arange(15 * F, dtype=torch.float32).view(15, F)  # row r holds r * F .. r * F + 3
    store = ContextFeatureStore(F, torch.float32, torch.device("cpu"), initial_capacity=8, initial_slots=1)
    store.write("r0", 40, torch.full((3, F), -1.0))  # stale positions past the new end must become invalid
    accept = AcceptResult(accepted_path=torch.tensor([[0, 1, 3, 5], [0, -1, -1, -1], [0, 2, -1, -1]]),
                          num_accepted=torch.tensor([3, 0, 1]), output_tokens=torch.zeros(3, 4, dtype=torch.long),
                          last_node=torch.tensor([5, 0, 2]))
    UBTreeRunnerMixin._commit_features(fake_runner(store, accept), None, plan, features)
    expected = {  # request -> {position: forward row}
        "r0": {37: 0, 38: 1, 39: 3, 40: 5},  # root at 37, then the path nodes
        "r1": {p: 6 + p for p in range(5)},  # the prefill chunk
        "r2": {3: 11, 4: 13},  # root at 3, then node 2
    }
    got, valid = store.gather(REQ_IDS, [45, 45, 45])
    for i, req in enumerate(REQ_IDS):
        assert np.nonzero(valid[i].numpy())[0].tolist() == sorted(expected[req]), req
        for pos, row in expected[req].items():
            assert torch.equal(got[i, pos], features[row]), (req, pos)


def test_commit_without_acceptance_and_slot_reuse():
    plan = make_batch().plan
    features = torch.randn(15, F)
    store = ContextFeatureStore(F, torch.float32, torch.device("cpu"), initial_capacity=4, initial_slots=1)
    UBTreeRunnerMixin._commit_features(fake_runner(store, None), None, plan, features)
    _, valid = store.gather(REQ_IDS, [40, 40, 40])
    assert valid.sum(dim=1).tolist() == [1, 5, 1]  # roots only (r0, r2), the whole chunk (r1)
    store.drop("r1")
    _, valid = store.gather(["new"], [10])  # an unknown request reads the invalid scratch slot
    assert not valid.any()
    assert store.slots_of(["new"]) == [store._slots["new"]] and not store.valid[store._slots["new"]].any()
