"""The frozen target's outputs of each training sample, kept on the device across epochs.

The target forward is the largest share of a training step's GPU time (the H200 profile of
scripts/gpu/profile_train_step.py), and it depends only on the sample: a sample seen again
(the next epoch, other anchors) needs the same features and final hidden states. The cache
keeps them for every sample it has room for, in two flat device buffers of
`capacity_tokens` rows; a batch whose samples are all cached skips the target forward, and a
batch with some cached runs the target on the others only (:meth:`TargetCache.split`). When the
data outgrows the cache the second case is the common one (the trainer logs both counts).

Bookkeeping is on the host (sample index -> first row, length), so a lookup costs one
host-to-device copy of the row index and one gather, and never reads the device.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class TargetCache:
    def __init__(self, capacity_bytes: float, feature_dim: int, hidden_dim: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        row_bytes = (feature_dim + hidden_dim) * torch.empty((), dtype=dtype).element_size()
        self.capacity_tokens = int(capacity_bytes // row_bytes)
        if self.capacity_tokens < 1:
            raise ValueError(f"target_cache_gb={capacity_bytes / 2**30:g} holds no token of {row_bytes} bytes")
        self.device = device
        # [capacity, F] and [capacity, H], filled front to back
        self.features = torch.empty((self.capacity_tokens, feature_dim), dtype=dtype, device=device)
        self.final = torch.empty((self.capacity_tokens, hidden_dim), dtype=dtype, device=device)
        self.rows: dict[int, tuple[int, int]] = {}  # sample -> (first row, length)
        self.used = 0

    def __len__(self) -> int:
        return len(self.rows)

    def split(self, samples: Sequence[int]) -> tuple[list[int], list[int]]:
        """(batch rows whose sample is cached, the other rows), each ascending."""
        cached = [int(s) in self.rows for s in samples]
        return [row for row, c in enumerate(cached) if c], [row for row, c in enumerate(cached) if not c]

    def lookup(self, samples: Sequence[int], width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(features [B, width, F], final hidden [B, width, H]) of the samples, or None unless all are cached.

        Positions at or past a sample's length repeat its last row (the caller masks them)."""
        entries = [self.rows.get(int(s)) for s in samples]
        if any(e is None for e in entries):
            return None
        first = np.array([e[0] for e in entries], dtype=np.int64)[:, None]
        last = np.array([e[1] - 1 for e in entries], dtype=np.int64)[:, None]
        index = torch.from_numpy((first + np.minimum(np.arange(width)[None, :], last)).ravel()).to(self.device)
        num = len(entries)
        return (self.features.index_select(0, index).view(num, width, -1),
                self.final.index_select(0, index).view(num, width, -1))

    def store(self, samples: Sequence[int], lengths: Sequence[int], features: torch.Tensor,
              final: torch.Tensor) -> None:
        """Keep rows [0, lengths[i]) of features/final [B, T, .] for every new sample that still fits."""
        for row, (sample, length) in enumerate(zip(samples, lengths)):
            sample, length = int(sample), int(length)
            if sample in self.rows or self.used + length > self.capacity_tokens:
                continue
            self.features[self.used:self.used + length] = features[row, :length]
            self.final[self.used:self.used + length] = final[row, :length]
            self.rows[sample] = (self.used, length)
            self.used += length


def cached_target_outputs(cache: TargetCache, target: Any, samples: Sequence[int], batch: Any,
                          lengths: Sequence[int]) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """The target's outputs of a batch (features [B, T, F], final hidden [B, T, H]) and how many of its samples the
    cache held: the cache's rows for those, the target (``target.forward(input_ids, valid)``, as ``drafter_loss``
    calls it) for the others, which are stored; interleaved back into batch order. ``batch`` is on the device
    (``input_ids``, ``lengths`` [B]); ``lengths`` are its host lengths. Call it under the loss's autocast."""
    hit, miss = cache.split(samples)
    width = batch.input_ids.shape[1]
    if not miss:
        return cache.lookup(samples, width), len(hit)
    ids, lens = batch.input_ids, batch.lengths
    if hit:  # only the rows the cache lacks
        rows = torch.tensor(miss, dtype=torch.long).to(ids.device)
        ids, lens = ids.index_select(0, rows), lens.index_select(0, rows)
    valid = torch.arange(width, device=ids.device)[None, :] < lens[:, None]
    fresh = target.forward(ids, valid)  # [m, T, F], [m, T, H]
    cache.store([samples[r] for r in miss], [lengths[r] for r in miss], *fresh)
    if not hit:
        return fresh, 0
    kept = cache.lookup([samples[r] for r in hit], width)
    assert kept is not None  # store() never evicts
    order = torch.tensor(hit + miss, dtype=torch.long).argsort().to(ids.device)  # batch row -> row of the stack
    return tuple(torch.cat([k.to(f.dtype), f]).index_select(0, order) for k, f in zip(kept, fresh)), len(hit)
