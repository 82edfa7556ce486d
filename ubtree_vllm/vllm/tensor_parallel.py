"""Tensor parallelism on the V1 runner: every rank verifies the same trees and accepts the same nodes.

The drafter is small and replicated, not sharded (any TP size works for it; the target's own
sizes are vLLM's to check). What must agree across the TP ranks is what each rank does with
its shard of the target: the tree layout (attention masks, positions), the acceptance walk and
the KV commit. Both are made identical by construction, not by trusting identical arithmetic:

* trees are built once: the driver rank (TP rank 0, whose drafts vLLM's scheduler receives)
  drafts, and its trees (tokens, parents, depth) are broadcast to the other ranks, which keep
  them for the next step's layout instead of drafting themselves;
* the target's draw at every tree node (the tree sampler's one source of randomness at T > 0)
  is broadcast from the driver before the walk, so each rank accepts the same path.

Two small broadcasts per step over vLLM's TP group; with TP size 1 both are no-ops.
"""
from __future__ import annotations

from typing import Any

import torch

DRIVER = 0  # TP rank whose drafts the scheduler receives


def tp_group() -> Any | None:
    """vLLM's TP group coordinator when tensor parallelism is on, else None."""
    from vllm.distributed import get_tp_group
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if not model_parallel_is_initialized():  # a runner built outside a worker (tests)
        return None
    group = get_tp_group()
    return group if group.world_size > 1 else None


def is_driver(group: Any | None) -> bool:
    return group is None or group.rank_in_group == DRIVER


def from_driver(tensor: torch.Tensor, group: Any | None) -> torch.Tensor:
    """The driver rank's `tensor` on every rank (in place; contiguous, same shape and dtype on each rank)."""
    if group is None:
        return tensor
    tensor = tensor.contiguous()
    group.broadcast(tensor, src=DRIVER)
    return tensor


def full_vocab_rows(weight: torch.Tensor, vocab_size: int, group: Any | None) -> torch.Tensor:
    """The first `vocab_size` rows of a vocabulary-parallel weight (each rank holds a contiguous shard of the
    padded vocabulary, vLLM's VocabParallelEmbedding / ParallelLMHead): gathered once, at load."""
    if group is not None and weight.shape[0] < vocab_size:
        weight = group.all_gather(weight.contiguous(), dim=0)
    if weight.shape[0] < vocab_size:
        raise ValueError(f"the target's vocabulary weight has {weight.shape[0]} rows, fewer than the drafter's "
                         f"vocabulary ({vocab_size})")
    return weight[:vocab_size]


class RankDigest:
    """A running digest of what a rank verified (its trees and the tokens it accepted), host data only.

    Every rank of a TP group must end with the same digest; ``LLM.collective_rpc("ubtree_tp_digest")``
    (:class:`TPDigestRPC`) reads them, so a test (or an operator) can compare the ranks.
    """

    def __init__(self) -> None:
        import hashlib

        self._hash = hashlib.blake2b(digest_size=16)
        self.steps = 0

    def update(self, trees: Any, sampled: list[list[int]]) -> None:
        """trees: the step's [3, N, B + 1] int64 host array (tokens, parents, depth); sampled: vLLM's token lists."""
        self._hash.update(trees.tobytes())
        self._hash.update(repr(sampled).encode())
        self.steps += 1

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


class TPDigestRPC:
    """Worker mixin: (steps, digest) of the runner's :class:`RankDigest` for ``collective_rpc("ubtree_tp_digest")``."""

    def ubtree_tp_digest(self) -> tuple[int, str]:
        digest = self.model_runner.ubtree_tp_digest  # type: ignore[attr-defined]
        return digest.steps, digest.hexdigest()
