"""Typed containers passed between pipeline stages (shapes in comments)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftContext:
    """What a drafter sees at the start of a round, for N requests.

    Context rows use one layout for every buffer: request n's committed tokens occupy
    rows 0 .. len_n - 1 at positions 0 .. len_n - 1; later rows are padding.
    """

    # [N] int64 the root token (last committed, not yet processed by the target)
    anchor: torch.Tensor
    # [N] int64 its position (= number of tokens the target has processed)
    anchor_pos: torch.Tensor
    # [N, L, F] target features of the committed tokens (layers concatenated)
    features: torch.Tensor
    # [N, L] int64 positions of the context rows
    positions: torch.Tensor
    # [N, L] bool which context rows are real
    valid: torch.Tensor
    # [N, L] int64 committed token ids of the context rows (for oracle and n-gram drafters)
    tokens: torch.Tensor
