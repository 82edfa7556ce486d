"""The per-process hand-over between the UBTree runner and the tree-aware attention impls.

vLLM's ``CommonAttentionMetadata`` has no field for a tree, so the runner publishes the
step's :class:`~ubtree_vllm.vllm.tree_plan.TreeStepPlan` here right before the target
forward (:meth:`TreeForwardState.begin`) and withdraws it right after
(:meth:`TreeForwardState.end_forward`). Attention impls consult :meth:`active_plan`:
``None`` means "behave exactly like the stock backend" -- which is what every other
engine, every dummy/profile run and every step without trees sees.

During a tree forward each attention layer also stashes the fresh K/V (and the slots)
of the tree requests' rows (:meth:`stash_layer`), because the KV cache layout is
backend-specific (CPU_ATTN even tiles it per ISA) while the backend's own
``do_kv_cache_update`` can write any rows anywhere. :mod:`ubtree_vllm.vllm.kv_commit`
replays the accepted rows from the stash into their committed slots after sampling. The
stash lives until the next :meth:`begin`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ubtree_vllm.vllm.tree_plan import DeviceTrees, TreeStepPlan


@dataclass
class StashedLayer:
    """Fresh K/V of one attention layer for the plan's stash rows."""

    # the vLLM Attention module (gives impl, kv_cache and scales at commit time)
    layer: Any
    # [num_stash, num_kv_heads, head_size] the layer's key / value rows
    key: torch.Tensor
    value: torch.Tensor
    # [num_stash] int64 KV slot each stash row was written to this step
    slots: torch.Tensor


class TreeForwardState:
    """What the attention impls need to know about the forward in flight."""

    def __init__(self) -> None:
        self._plan: TreeStepPlan | None = None
        self._trees: DeviceTrees | None = None
        self._in_forward = False
        self.stash: dict[str, StashedLayer] = {}
        # [num_stash] int64 KV slots of the stash rows, for backends that commit in the cache
        # (recorded once per step by the first tree-aware layer; see kv_commit).
        self.stash_slots: torch.Tensor | None = None
        # Per-step scratch shared by the layers of one forward (e.g. virtual block tables).
        self.step_cache: dict[Any, Any] = {}

    def begin(self, plan: TreeStepPlan, device: torch.device) -> None:
        """Publish ``plan`` for the next forward; drops the previous step's stash."""
        self.stash.clear()
        self.stash_slots = None
        self.step_cache.clear()
        self._plan = plan if plan.has_tree_rows else None
        self._trees = plan.to_device(device) if self._plan is not None else None
        self._in_forward = self._plan is not None

    def end_forward(self) -> None:
        """The target forward is over: attention goes back to stock behaviour."""
        self._in_forward = False
        self.step_cache.clear()

    def active_plan(self) -> tuple[TreeStepPlan, DeviceTrees] | None:
        if not self._in_forward:
            return None
        assert self._plan is not None and self._trees is not None
        return self._plan, self._trees

    def stash_layer(self, layer: Any, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Keep ``key/value/slot_mapping`` rows of the plan's stash rows for the KV commit."""
        assert self._trees is not None
        rows = self._trees.stash_rows
        self.stash[layer.layer_name] = StashedLayer(layer=layer, key=key[rows], value=value[rows],
                                                    slots=slot_mapping[rows].to(torch.int64))

    def record_stash_slots(self, slot_mapping: torch.Tensor) -> None:
        """Keep the stash rows' KV slots once per step (the in-cache commit reads K/V there)."""
        assert self._trees is not None
        if self.stash_slots is None:
            self.stash_slots = slot_mapping[self._trees.stash_rows].to(torch.int64)


_STATE = TreeForwardState()


def tree_forward_state() -> TreeForwardState:
    """The process-wide hand-over object (one engine runs a forward at a time per process)."""
    return _STATE


def begin_tree_rows(impl: Any, layer: Any, key: torch.Tensor | None, value: torch.Tensor | None,
                    attn_metadata: Any, stash: bool = True) -> tuple[TreeStepPlan, DeviceTrees] | None:
    """Shared prologue of the tree-aware attention impls, run after the stock forward.

    Returns the active (plan, trees) when this layer must recompute tree rows, after stashing
    the layer's fresh K/V for the KV commit (``stash=False``: only the stash rows' slots, once
    per step, for backends whose commit reads the cache); None when the step has no trees (or
    the layer is not a decoder self-attention layer). KV-sharing layers are refused: tree rows
    need each layer's own K/V.
    """
    state = tree_forward_state()
    active = state.active_plan()
    from vllm.v1.attention.backend import AttentionType

    if active is None or attn_metadata is None or impl.attn_type != AttentionType.DECODER:
        return None
    if key is None or impl.kv_sharing_target_layer_name is not None:
        raise NotImplementedError("ubtree tree attention needs each layer's own K/V "
                                  "(KV-sharing layers are not supported)")
    if stash:
        state.stash_layer(layer, key, value, attn_metadata.slot_mapping)
    else:
        state.record_stash_slots(attn_metadata.slot_mapping)
    return active
