"""The frozen target's outputs of each training sample, kept on the device across epochs.

The target forward is the largest share of a training step's GPU time (the H200 profile of
scripts/gpu/profile_train_step.py), and it depends only on the sample: a sample seen again
(the next epoch, other anchors) needs the same features and final hidden states. The cache
keeps them for every sample it has room for, in two flat device buffers of
`capacity_tokens` rows; a batch whose samples are all cached skips the target forward.

Bookkeeping is on the host (sample index -> first row, length), so a lookup costs one
host-to-device copy of the row index and one gather, and never reads the device.
"""
from __future__ import annotations

from collections.abc import Sequence

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
