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

Recurrent (GDN) layers read :attr:`TreeForwardState.step_plan` instead: every UBTree step, chains
included, runs their tree form (:mod:`ubtree_vllm.vllm.recurrent.gdn_cpu`), and each records where it left the
step's per-node states in :attr:`TreeForwardState.linear_stash` for the commit
(:mod:`ubtree_vllm.vllm.recurrent.commit`).
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ubtree_vllm.vllm.tree_plan import DeviceTrees, TreeStepPlan


@dataclass
class StashedLayer:
    """Fresh K/V of one attention layer for the plan's stash rows."""

    # the vLLM Attention (or MLAAttention) module (gives impl, kv_cache and scales at commit time)
    layer: Any
    # [num_stash, num_kv_heads, head_size] the layer's key / value rows (MLA: kv_c_normed [num_stash, L] and
    # k_pe [num_stash, 1, R])
    key: torch.Tensor
    value: torch.Tensor
    # [num_stash] int64 KV slot each stash row was written to this step
    slots: torch.Tensor


@dataclass
class RowBuffers:
    """Tree rows of the step in fixed-size device buffers, for CUDA-graph-captured attention.

    A captured launch reads entries 0 .. num_tokens - 1 of every replay; the step's tree
    rows fill the front, every other entry has row_index -1 (skipped by the kernel).
    """

    # [max_tokens] int64 global row of the entry, -1 unused
    row_index: torch.Tensor
    # [max_tokens] int64 request index; committed context length
    row_req: torch.Tensor
    row_context_len: torch.Tensor
    # [max_tokens, path_width] int64 root-first path rows, -1 padded
    row_path: torch.Tensor
    # entries 0 .. filled - 1 hold the last step's rows (reset to -1 by the next fill)
    filled: int = 0
    # The step's entries cover every row of the forward but the roots (Model Runner V2's ``cover_rows`` layout in a
    # uniform decode step, tree_attention "triton_stock_roots"), so the stock kernel runs over the roots alone
    # (attention/tree_rows.py). Set per step.
    covers_forward: bool = False
    # Every FULL CUDA graph captured against these buffers replays such steps (Model Runner V2 with that mode: FULL
    # graphs are uniform decode steps unless the mixed mode is FULL), so captures make the roots-only call too. Set
    # once by the runner.
    full_graphs_covered: bool = False

    @classmethod
    def empty(cls, max_tokens: int, path_width: int, device: torch.device) -> "RowBuffers":
        def full(*shape: int) -> torch.Tensor:
            return torch.full(shape, -1, dtype=torch.int64, device=device)

        return cls(row_index=full(max_tokens), row_req=full(max_tokens), row_context_len=full(max_tokens),
                   row_path=full(max_tokens, path_width))


class TreeForwardState:
    """What the attention impls need to know about the forward in flight."""

    def __init__(self) -> None:
        self._plan: TreeStepPlan | None = None
        self._trees: DeviceTrees | None = None
        self._in_forward = False
        self.stash: dict[str, StashedLayer] = {}
        # The UBTree step whose target forward is in flight, with or without tree rows (None outside it)
        self.step_plan: TreeStepPlan | None = None
        # recurrent layer name -> where its tree forward left the step's per-node states (until the next begin): a
        # recurrent.commit.LinearStepLayer (recurrent/ builds them and imports this module, so not named here)
        self.linear_stash: dict[str, Any] = {}
        # Per-step scratch shared by the layers of one forward (e.g. virtual block tables).
        self.step_cache: dict[Any, Any] = {}

    def begin(self, plan: TreeStepPlan, device: torch.device, row_buffers: RowBuffers | None = None) -> None:
        """Publish ``plan`` for the next forward; drops the previous step's stash.

        ``row_buffers``: the engine's fixed-size row buffers (CUDA-graph-captured attention),
        refilled with this step's tree rows.
        """
        self.stash.clear()
        self.linear_stash.clear()
        self.step_cache.clear()
        self.step_plan = plan
        self._plan = plan if plan.has_tree_rows else None
        self._trees = plan.to_device(device) if self._plan is not None else None
        self._in_forward = self._plan is not None
        if row_buffers is not None:
            fill_row_buffers(row_buffers, plan)

    def begin_device_rows(self) -> None:
        """The next forward has tree rows laid out on the device (Model Runner V2: the row buffers
        were filled by ``mrv2.tree_layout``; there is no host plan and nothing is stashed)."""
        self.stash.clear()
        self.linear_stash.clear()
        self.step_cache.clear()
        self.step_plan = None
        self._plan, self._trees = None, None
        self._in_forward = True

    @property
    def has_tree_rows(self) -> bool:
        """The forward in flight has tree rows (False outside the forward)."""
        return self._in_forward

    def end_forward(self) -> None:
        """The target forward is over: attention goes back to stock behaviour."""
        self._in_forward = False
        self.step_plan = None
        self.step_cache.clear()

    def active_plan(self) -> tuple[TreeStepPlan, DeviceTrees] | None:
        if not self._in_forward:
            return None
        assert self._plan is not None and self._trees is not None
        return self._plan, self._trees

    def stash_layer(self, layer: Any, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
                    key_row_offset: int = 0) -> None:
        """Keep ``key/value/slot_mapping`` rows of the plan's stash rows for the KV commit.

        slot_mapping is indexed by global row; key/value by global row - ``key_row_offset`` (an MLA layer's
        multi-token part starts after the one-row requests)."""
        assert self._trees is not None
        rows = self._trees.stash_rows
        local = rows - key_row_offset
        self.stash[layer.layer_name] = StashedLayer(layer=layer, key=key[local], value=value[local],
                                                    slots=slot_mapping[rows].to(torch.int64))


def bind_tree_layers(forward_context: Mapping[str, Any], row_buffers: RowBuffers,
                     exclude: Collection[str] = (), tree_attention: str = "triton",
                     exact_scratch: Any = None) -> list[Any]:
    """The engine's attention layers (names in ``exclude``, e.g. a draft model's, left out), each checked
    to run a tree-aware impl and bound to this engine's ``row_buffers`` and ``tree_attention`` mode
    (read by ``flash.py``; ``vllm.config.TREE_ATTENTION_MODES``); with ``"flash_exact"``, to the runner's
    ``exact_scratch`` pages (``exact_rows.ScratchPages``; None until the runner's KV cache holds them).

    RuntimeError when there is none or one runs a stock impl (it would answer tree rows wrongly).
    """
    from vllm.model_executor.layers.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layers = [m for name, m in forward_context.items()
              if isinstance(m, (Attention, MLAAttention)) and name not in exclude]
    stock = sorted({type(m.impl).__name__ for m in layers if not getattr(m.impl, "ubtree_tree_aware", False)})
    if not layers or stock:
        raise RuntimeError(f"method 'ubtree' needs its tree-aware attention backend, but the target's "
                           f"attention layers use {stock or 'no attention layers'}; was the backend "
                           "selected before the ubtree worker patches were applied?")
    if tree_attention != "triton" and not all(getattr(m.impl, "ubtree_context_from_flash", None) is not None
                                              for m in layers):
        raise RuntimeError(f"tree_attention {tree_attention!r} needs the CUDA FlashAttention tree backend; the "
                           f"target's attention layers use {sorted({type(m.impl).__name__ for m in layers})}")
    if tree_attention == "flash_exact":
        from ubtree_vllm.vllm.attention.exact_rows import check_exact_rows_layer

        for m in layers:
            check_exact_rows_layer(m.impl)
    for m in layers:
        m.impl.ubtree_row_buffers = row_buffers
        m.impl.ubtree_layer = m  # MLA impls stash their rows from forward_mha, which is not given the layer
        if tree_attention != "triton":
            m.impl.ubtree_context_from_flash = tree_attention == "flash_merge"
        # (cleared on a rebind in another mode: a runner falling back from flash_exact)
        m.impl.ubtree_exact_scratch = exact_scratch if tree_attention == "flash_exact" else None
        m.impl.ubtree_flashinfer = None  # "flashinfer": the runner binds its wrappers after this (it needs the group)
    return layers


def fill_row_buffers(buffers: RowBuffers, plan: TreeStepPlan) -> None:
    """Copy the step's tree rows to the front of ``buffers``; mark the previous step's tail unused."""
    num_rows, width = len(plan.row_index), buffers.row_path.shape[1]
    if num_rows > buffers.row_index.shape[0]:
        raise RuntimeError(f"ubtree: {num_rows} tree rows exceed the row buffers ({buffers.row_index.shape[0]})")
    if num_rows and int(plan.row_depth.max()) >= width:
        raise RuntimeError(f"ubtree: a tree row of depth {int(plan.row_depth.max())} exceeds the row "
                           f"buffers' path width {width}")
    if num_rows:
        # Device-to-device from the plan's one host-to-device copy (cached by to_device).
        trees = plan.to_device(buffers.row_index.device)
        cols = min(width, trees.row_path.shape[1])
        for dst, src in ((buffers.row_index, trees.row_index), (buffers.row_req, trees.row_req),
                         (buffers.row_context_len, trees.row_context_len)):
            dst[:num_rows].copy_(src)
        buffers.row_path[:num_rows, :cols].copy_(trees.row_path[:, :cols])
        buffers.row_path[:num_rows, cols:].fill_(-1)
    if buffers.filled > num_rows:
        buffers.row_index[num_rows:buffers.filled].fill_(-1)
    buffers.filled = num_rows


_STATE = TreeForwardState()


def tree_forward_state() -> TreeForwardState:
    """The process-wide hand-over object (one engine runs a forward at a time per process)."""
    return _STATE


def begin_tree_rows(impl: Any, layer: Any, key: torch.Tensor | None, value: torch.Tensor | None,
                    attn_metadata: Any) -> tuple[TreeStepPlan, DeviceTrees] | None:
    """Shared prologue of the stash-based tree-aware attention impls (CPU), run after the stock forward.

    Returns the active (plan, trees) when this layer must recompute tree rows, after stashing
    the layer's fresh K/V for the KV commit; None when the step has no trees (or the layer is
    not a decoder self-attention layer). KV-sharing layers are refused: tree rows need each
    layer's own K/V.
    """
    state = tree_forward_state()
    active = state.active_plan()
    from vllm.v1.attention.backend import AttentionType

    if active is None or attn_metadata is None or impl.attn_type != AttentionType.DECODER:
        return None
    if key is None or impl.kv_sharing_target_layer_name is not None:
        raise NotImplementedError("ubtree tree attention needs each layer's own K/V "
                                  "(KV-sharing layers are not supported)")
    state.stash_layer(layer, key, value, attn_metadata.slot_mapping)
    return active
