"""Batches of similar lengths, so a step pads less.

The trainer right-pads each batch to its longest sample (losses.collate), and the frozen target and the drafter's
context attention run over the padding too. With ``length_pool_batches = N`` > 1 the trainer draws N batches'
samples at once from its data order (the same samples, in the same windows of N * batch_size, as without pooling),
sorts them by length, cuts them into N batches and runs those in an order shuffled by (seed, pool). So every sample
is still seen once per pass, and only the grouping within a window changes.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

# seed offset of the pools' batch order (apart from the epoch permutations' seeds, data.epoch_permutation)
_POOL_SEED_OFFSET = 2_000_003


class LengthPools:
    """Hands out batches of ``batch_size`` indices, ``batches_per_pool`` at a time from one length-sorted pool.

    ``length(i)``: the tokens sample i will have in its batch (after truncation). The pending batches of the current
    pool and the pool count are the state (:meth:`state_dict`), saved with each checkpoint so a resume continues the
    same order."""

    def __init__(self, length: Callable[[int], int], batch_size: int, batches_per_pool: int, seed: int) -> None:
        if batch_size < 1 or batches_per_pool < 1:
            raise ValueError(f"batch_size and batches_per_pool must be >= 1, got {batch_size}, {batches_per_pool}")
        self.length, self.batch_size, self.batches_per_pool, self.seed = length, batch_size, batches_per_pool, seed
        self.pending: list[list[int]] = []
        self.pools = 0

    def next_batch(self, draw: Callable[[int], list[int]]) -> list[int]:
        """The next batch; when the pool is spent, ``draw(batch_size * batches_per_pool)`` gives the next pool's
        samples (the caller's data order at the pool's first step)."""
        if not self.pending:
            pool = sorted(draw(self.batch_size * self.batches_per_pool), key=lambda i: (self.length(i), i))
            batches = [pool[k:k + self.batch_size] for k in range(0, len(pool), self.batch_size)]
            g = torch.Generator().manual_seed(self.seed * 7919 + _POOL_SEED_OFFSET * (self.pools + 1))
            self.pending = [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]
            self.pools += 1
        return self.pending.pop(0)

    def state_dict(self) -> dict[str, Any]:
        return {"pending": [list(b) for b in self.pending], "pools": self.pools}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.pending, self.pools = [list(b) for b in state["pending"]], int(state["pools"])
