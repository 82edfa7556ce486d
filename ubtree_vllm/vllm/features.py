"""Per-request buffer of the target features the drafter conditions on.

The drafter reads, for every committed position p < anchor_pos of a request, the
concatenated aux hidden states of the target layers ``drafter.target_layer_ids`` at p
(vLLM's eagle3/dflash aux-hidden-state capture of the same layers). After each step the
runner writes the committed rows -- prompt chunks, the root, and the accepted tree nodes
in path order -- at their positions (:meth:`ContextFeatureStore.write`), so the next
round is conditioned on exactly the accepted tokens.

Positions that were never computed by this engine (a prefix-cache hit skips them) stay
invalid and are masked out of the drafter's context: the drafts may get worse, the
output cannot change (verification is lossless). Writing at ``start`` invalidates
everything after the written rows (recompute after preemption starts over).

This is the correctness-first store of the V1 path (memory ~ context x features per
request); the fast path keeps the fused context in the drafter's own KV cache instead.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Buffer:
    # [capacity, F] features by position
    features: torch.Tensor
    # [capacity] bool, True where the position holds a feature of this request
    valid: torch.Tensor


class ContextFeatureStore:
    """Features of committed positions, by request id."""

    def __init__(self, num_features: int, dtype: torch.dtype, device: torch.device,
                 initial_capacity: int = 256) -> None:
        self.num_features = num_features
        self.dtype = dtype
        self.device = device
        self.initial_capacity = initial_capacity
        self._buffers: dict[str, _Buffer] = {}

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._buffers

    def _ensure(self, req_id: str, length: int) -> _Buffer:
        buf = self._buffers.get(req_id)
        capacity = 0 if buf is None else buf.features.shape[0]
        if length <= capacity:
            return buf  # type: ignore[return-value]
        new_capacity = max(self.initial_capacity, capacity * 2, length)
        grown = _Buffer(
            features=torch.zeros((new_capacity, self.num_features), dtype=self.dtype, device=self.device),
            valid=torch.zeros(new_capacity, dtype=torch.bool, device=self.device))
        if buf is not None:
            grown.features[:capacity] = buf.features
            grown.valid[:capacity] = buf.valid
        self._buffers[req_id] = grown
        return grown

    def write(self, req_id: str, start: int, rows: torch.Tensor) -> None:
        """Store rows [k, F] at positions start .. start + k - 1; later positions become invalid."""
        end = start + rows.shape[0]
        buf = self._ensure(req_id, end)
        buf.features[start:end] = rows.to(self.dtype)
        buf.valid[start:end] = True
        buf.valid[end:] = False

    def drop(self, req_id: str) -> None:
        self._buffers.pop(req_id, None)

    def gather(self, req_ids: list[str], lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Context of each request: positions 0 .. lengths[i] - 1, right-padded.

        Returns features [N, L, F] and valid [N, L] bool, L = max(lengths) (at least 1).
        """
        width = max([1, *lengths])
        features = torch.zeros((len(req_ids), width, self.num_features), dtype=self.dtype, device=self.device)
        valid = torch.zeros((len(req_ids), width), dtype=torch.bool, device=self.device)
        for i, (req_id, length) in enumerate(zip(req_ids, lengths)):
            buf = self._buffers.get(req_id)
            if buf is None or length <= 0:
                continue
            n = min(length, buf.features.shape[0])
            features[i, :n] = buf.features[:n]
            valid[i, :n] = buf.valid[:n]
        return features, valid
