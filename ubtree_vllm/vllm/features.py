"""Buffer of the target features the drafter conditions on, for all requests in one tensor.

The drafter reads, for every committed position p < anchor_pos of a request, the
concatenated aux hidden states of the target layers ``drafter.target_layer_ids`` at p
(vLLM's eagle3/dflash aux-hidden-state capture of the same layers). After each step the
runner writes the committed rows -- prompt chunks, the root, and the accepted tree nodes
in path order -- at their positions (:meth:`ContextFeatureStore.write_rows`), so the next
round is conditioned on exactly the accepted tokens.

Layout: ``features [S + 1, C, F]`` and ``valid [S + 1, C]``, one slot (row) per live
request, position-major; slot S is a scratch row that absorbs masked writes. A write and
a gather are a fixed number of kernels for the whole batch (no per-request device work):
the host only maps request ids to slots. Both dimensions grow by doubling (reallocate and
copy) when a new request or a longer context needs it.

Positions that were never computed by this engine (a prefix-cache hit skips them) stay
invalid and are masked out of the drafter's context: the drafts may get worse, the
output cannot change (verification is lossless). A write covering positions
``start .. end - 1`` of a request invalidates its positions >= end (recompute after
preemption starts over).

Memory ~ live requests x longest context x features; the fast path keeps the fused
context in the drafter's own paged KV cache instead (docs/design/mrv2.md).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class ContextFeatureStore:
    """Features of committed positions, by request id."""

    def __init__(self, num_features: int, dtype: torch.dtype, device: torch.device,
                 initial_capacity: int = 256, initial_slots: int = 4) -> None:
        self.num_features = num_features
        self.dtype = dtype
        self.device = device
        self._slots: dict[str, int] = {}
        self._free: list[int] = []
        self._allocate(initial_slots, initial_capacity)

    def _allocate(self, num_slots: int, capacity: int) -> None:
        """(Re)allocate to num_slots live slots + the scratch slot, keeping the stored rows."""
        features = torch.zeros((num_slots + 1, capacity, self.num_features), dtype=self.dtype, device=self.device)
        valid = torch.zeros((num_slots + 1, capacity), dtype=torch.bool, device=self.device)
        old = getattr(self, "features", None)
        if old is not None:
            keep_slots, keep_cap = min(old.shape[0] - 1, num_slots), min(old.shape[1], capacity)
            features[:keep_slots, :keep_cap] = old[:keep_slots, :keep_cap]
            valid[:keep_slots, :keep_cap] = self.valid[:keep_slots, :keep_cap]
            self._free += list(range(old.shape[0] - 1, num_slots))
        else:
            self._free = list(range(num_slots))
        self.features, self.valid = features, valid

    @property
    def num_slots(self) -> int:
        return self.features.shape[0] - 1

    @property
    def capacity(self) -> int:
        return self.features.shape[1]

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._slots

    def slots_of(self, req_ids: Sequence[str]) -> list[int]:
        """Slot of each request, assigning free slots (and growing) for new ones."""
        # SYNC: host loop over request ids (dict lookups, no device read); `valid[slot] = False`
        # is a device write only when a request joins.
        new = [r for r in dict.fromkeys(req_ids) if r not in self._slots]
        if len(new) > len(self._free):
            self._allocate(max(2 * self.num_slots, self.num_slots + len(new) - len(self._free)), self.capacity)
        for req_id in new:
            slot = self._slots[req_id] = self._free.pop(0)
            self.valid[slot] = False  # a reused slot starts empty
        return [self._slots[r] for r in req_ids]

    def reserve(self, length: int) -> None:
        """Make positions 0 .. length - 1 addressable (host-side check; grows by doubling)."""
        if length > self.capacity:
            self._allocate(self.num_slots, max(2 * self.capacity, length))

    def write_rows(self, slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor,
                   keep: torch.Tensor | None = None) -> None:
        """Store rows at (slot, position) pairs in one kernel: slots/positions [R] int64, rows [R, F].

        keep [R] bool (optional): False drops the row (it goes to the scratch slot). Positions
        must be < capacity (:meth:`reserve`). Validity is set by :meth:`set_valid_range`.
        """
        if keep is not None:
            slots = torch.where(keep, slots, self.num_slots)
        self.features[slots, positions] = rows.to(self.dtype)

    def set_valid_range(self, req_slots: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor) -> None:
        """Request q wrote positions starts[q] .. ends[q] - 1 of slot req_slots[q] (int64 [Q] each):
        those become valid, positions >= ends[q] invalid, earlier ones unchanged."""
        pos = torch.arange(self.capacity, device=self.device)  # [C]
        old = self.valid[req_slots]  # [Q, C]
        self.valid[req_slots] = (old & (pos < starts[:, None])) | ((pos >= starts[:, None]) & (pos < ends[:, None]))

    def write(self, req_id: str, start: int, rows: torch.Tensor) -> None:
        """Store rows [k, F] of one request at positions start .. start + k - 1; later positions become invalid."""
        end = start + rows.shape[0]
        self.reserve(end)
        slot = self.slots_of([req_id])[0]
        count = rows.shape[0]

        def t(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        self.write_rows(t([slot] * count), t(list(range(start, end))), rows)
        self.set_valid_range(t([slot]), t([start]), t([end]))

    def drop(self, req_id: str) -> None:
        slot = self._slots.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)

    def slot_or_scratch(self, req_ids: Sequence[str]) -> list[int]:
        """Slot of each request; the (always invalid) scratch slot for requests without one."""
        # SYNC: host loop over request ids (dict lookups, no device read).
        return [self._slots.get(r, self.num_slots) for r in req_ids]

    def gather_slots(self, slots: torch.Tensor, lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions 0 .. width - 1 of each slot (slots/lengths [N] int64 on the device, width >= lengths):
        features [N, width, F] and valid [N, width] bool, positions >= lengths[i] invalid."""
        self.reserve(width)
        features = self.features[slots, :width]
        valid = self.valid[slots, :width] & (torch.arange(width, device=self.device)[None, :] < lengths[:, None])
        return features, valid

    def gather(self, req_ids: Sequence[str], lengths: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Context of each request: positions 0 .. lengths[i] - 1, right-padded.

        Returns features [N, L, F] and valid [N, L] bool, L = max(lengths) (at least 1).
        """
        slots = torch.tensor(self.slot_or_scratch(req_ids), dtype=torch.long, device=self.device)
        lengths_t = torch.tensor(list(lengths), dtype=torch.long, device=self.device)
        return self.gather_slots(slots, lengths_t, max([1, *lengths]))
