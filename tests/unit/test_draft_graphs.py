"""Draft-stage CUDA graphs: bucketing and padding leave every request's tree unchanged.

The padding contract is checked on the CPU with ``capture=False`` (same padded buffers,
eager run); the captured graphs themselves are checked on CUDA against eager drafting.
"""
from __future__ import annotations

import pytest
import torch

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.types import DraftContext
from ubtree_vllm.vllm.draft_graphs import DraftGraphs, bucket

VOCAB, HIDDEN = 97, 64
TREE = UBTreeConfig(tree_budget=12, beam_width=4, top_k=6, block_size=4)


def make_drafter(device: str) -> UBTreeDrafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(target_name="tiny", vocab_size=VOCAB, hidden_size=HIDDEN, target_num_layers=4,
                        target_layer_ids=(1, 2), block_size=4, top_k=6, num_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, intermediate_size=128, selector_rank=8,
                        selector_hidden=32)
    drafter = UBTreeDrafter(cfg).to(device)
    drafter.bind_target(torch.randn(VOCAB, HIDDEN, device=device), torch.randn(VOCAB, HIDDEN, device=device))
    return drafter.eval()


def context(lengths: list[int], num_features: int, device: str, seed: int) -> DraftContext:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    positions = torch.arange(width)[None, :].expand(len(lengths), -1)
    valid = positions < torch.tensor(lengths)[:, None]
    valid[0, 1] = False  # a hole (prefix-cache hit) stays masked
    return DraftContext(anchor=torch.randint(VOCAB, (len(lengths),), generator=gen).to(device),
                        anchor_pos=torch.tensor(lengths).to(device),
                        features=torch.randn(len(lengths), width, num_features, generator=gen).to(device),
                        positions=positions.to(device), valid=valid.to(device),
                        tokens=torch.zeros_like(positions).to(device))


def test_bucket():
    assert [bucket(n) for n in (1, 2, 3, 5, 16, 17)] == [1, 2, 4, 8, 16, 32]
    assert bucket(3, 256) == 256 and bucket(300, 256) == 512


def assert_same_trees(got, want):
    for name in ("tokens", "parents", "depth"):
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), name
    torch.testing.assert_close(got.scores.cpu(), want.scores.cpu(), atol=1e-4, rtol=1e-4)


def check_against_eager(device: str, capture: bool) -> DraftGraphs:
    drafter = make_drafter(device)
    graphs = DraftGraphs(drafter, TREE, torch.device(device), capture=capture)
    for seed, lengths in enumerate([[5], [9, 3, 20], [300, 7], [40, 41, 42]]):
        ctx = context(lengths, drafter.cfg.num_features, device, seed)
        with torch.no_grad():
            assert_same_trees(graphs(ctx), drafter.draft_tree(ctx, TREE))
    return graphs


def test_padded_buckets_give_the_unpadded_trees():
    graphs = check_against_eager("cpu", capture=False)
    # (1, 256), (4, 256), (2, 512) and (4, 256) again: three buckets.
    assert graphs.num_graphs == 3


@pytest.mark.gpu
def test_cuda_graphs_give_the_eager_trees():
    check_against_eager("cuda", capture=True)
