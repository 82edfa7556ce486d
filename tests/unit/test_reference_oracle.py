"""CPU checks of two GPU-test helpers (tests/vllm): the copying oracle's on-reference round bookkeeping and the wait
for GPU memory to settle before an engine starts."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "vllm"))

import gpu_memory  # noqa: E402
from vllm_oracle import ReferenceOracle  # noqa: E402

from ubtree_vllm.config import UBTreeConfig  # noqa: E402
from ubtree_vllm.types import DraftContext  # noqa: E402

VOCAB = 64
PROMPTS = [[1, 2, 3], [4, 5, 6, 7]]
CONTINUATIONS = [list(range(10, 30)), list(range(40, 48))]
TREE = UBTreeConfig(tree_budget=8, beam_width=3, top_k=4, block_size=4)


def context(rows: list[list[int]]) -> DraftContext:
    """A DraftContext whose row n has committed tokens + anchor ``rows[n]``."""
    width = max(len(r) for r in rows)
    tokens = torch.tensor([r[:-1] + [0] * (width - len(r) + 1) for r in rows])
    lengths = torch.tensor([len(r) - 1 for r in rows])
    valid = torch.arange(width)[None] < lengths[:, None]
    return DraftContext(anchor=torch.tensor([r[-1] for r in rows]), anchor_pos=lengths,
                        features=torch.zeros(len(rows), width, 1), positions=torch.arange(width).expand(len(rows), -1),
                        valid=valid, tokens=tokens)


def on_ref(i: int, length: int) -> list[int]:
    """Request i's committed tokens + anchor at ``length``, on its reference."""
    return (PROMPTS[i] + CONTINUATIONS[i])[:length]


# propose calls (rows in any order); comments give each round's committed tokens
CALLS = [
    [on_ref(0, 4), on_ref(1, 5)],
    [on_ref(0, 4)],  # another call in the same step: no round
    [on_ref(1, 8), on_ref(0, 7)],  # r0 +3, r1 +3
    [on_ref(0, 9), [60, 61, 62]],  # r0 +2; a row of no reference prompt: ignored
    [on_ref(0, 10)[:-1] + [63], on_ref(1, 9)],  # r0 +1 (ends off its reference), r1 +1
    [on_ref(0, 10)[:-1] + [63, 5, 5], on_ref(1, 12)],  # r0's round started off the reference: not counted; r1 +3
    [on_ref(1, 13)],  # r1's round started with no reference token left: not counted
    [on_ref(0, 4)],  # a later request for prompt 0: no round from the earlier one's last call
    [on_ref(0, 6)],  # +2
]


def test_on_reference_rounds_count_rounds_drafted_from_the_reference():
    oracle = ReferenceOracle(PROMPTS, CONTINUATIONS, TREE, vocab_size=VOCAB)
    assert oracle.on_reference_rounds()[0] == 0 and math.isnan(oracle.on_reference_rounds()[1])
    for rows in CALLS:
        oracle.propose(context(rows))
    committed = [3, 3, 2, 1, 1, 3, 2]
    assert oracle.on_reference_rounds() == (len(committed), sum(committed) / len(committed))
    assert oracle.calls == len(CALLS)


def test_bookkeeping_leaves_the_drafts_unchanged():
    recording, silent = (ReferenceOracle(PROMPTS, CONTINUATIONS, TREE, vocab_size=VOCAB, seed=5) for _ in range(2))
    silent._note_round = lambda sofar: None
    for rows in CALLS:
        a, b = recording.propose(context(rows)), silent.propose(context(rows))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)
    assert recording.trace and not silent.trace


def fake_cuda(monkeypatch, free_reads):
    """CUDA reported available, free memory read from ``free_reads``; returns the list of sleeps taken."""
    reads, sleeps = iter(free_reads), []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (next(reads), 80 << 30))
    monkeypatch.setattr(gpu_memory, "sleep", sleeps.append)
    return sleeps


def test_settle_gpu_memory_waits_until_two_reads_agree(monkeypatch):
    mib = 1 << 20
    sleeps = fake_cuda(monkeypatch, [100 * mib, 300 * mib, 300 * mib + mib // 2, 0])
    gpu_memory.settle_gpu_memory()
    assert sleeps == [0.5, 0.5]


def test_settle_gpu_memory_gives_up_after_max_reads(monkeypatch):
    sleeps = fake_cuda(monkeypatch, (k << 30 for k in range(100)))
    gpu_memory.settle_gpu_memory(max_reads=20)
    assert len(sleeps) == 20


def test_settle_gpu_memory_does_nothing_without_cuda(monkeypatch):
    sleeps = fake_cuda(monkeypatch, [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    gpu_memory.settle_gpu_memory()  # mem_get_info would raise StopIteration
    assert sleeps == []
