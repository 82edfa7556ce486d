"""Causal depthwise conv1d over a draft tree: each node's window is built from its ancestors.

The short convolutions in front of the linear-attention layers of hybrid targets (GDN, KDA,
Mamba2) mix the last W inputs of a channel: along a chain
``out_t[c] = act(bias[c] + sum_j weight[c, j] * x_{t - (W - 1) + j}[c])``. Over a tree, the
inputs before node t are its parent, grandparent, ... and, past the root, the committed window
``conv_state [N, C, W - 1]`` (oldest first, vLLM's layout), so a node never sees a sibling's
input. After acceptance, :func:`tree_conv_window` gives the window to commit: the last W - 1
inputs along the accepted path.

One program per (request, channel tile); nodes in order, ancestors walked W - 1 steps. The
launcher reads no device value. Torch twin: ``reference.tree_causal_conv1d_reference``.
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    @triton.jit
    def _tree_conv_kernel(x_ptr, parents_ptr, state_ptr, w_ptr, b_ptr, out_ptr, T, C: tl.constexpr,
                          W: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        oc = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
        mc = oc < C
        bias = tl.load(b_ptr + oc, mask=mc, other=0.0).to(tl.float32) if HAS_BIAS else tl.zeros([BC], tl.float32)
        for t in range(T):
            acc = bias + tl.load(w_ptr + oc * W + (W - 1), mask=mc, other=0.0).to(tl.float32) * tl.load(
                x_ptr + (n * T + t) * C + oc, mask=mc, other=0.0).to(tl.float32)
            node = t + 0 * n  # int64 ancestor being read; -1 once the walk has left the tree
            past = 0 * n  # steps taken past the root: the committed window's input W - 1 - past is read
            for j in tl.static_range(1, W):
                outside = node < 0
                parent = tl.load(parents_ptr + n * T + tl.maximum(node, 0)).to(tl.int64)
                up = tl.where(outside, node, parent)
                past = tl.where(outside, past + 1, tl.where(up < 0, 1, past))
                node = up
                in_tree = node >= 0
                # both candidates are valid addresses; the select keeps the one the walk is at
                xv = tl.load(x_ptr + (n * T + tl.maximum(node, 0)) * C + oc, mask=mc, other=0.0)
                sv = tl.load(state_ptr + (n * C + oc) * (W - 1) + tl.maximum(W - 1 - past, 0), mask=mc, other=0.0)
                inp = tl.where(in_tree, xv.to(tl.float32), sv.to(tl.float32))
                acc += tl.load(w_ptr + oc * W + (W - 1 - j), mask=mc, other=0.0).to(tl.float32) * inp
            if SILU:
                acc = acc * tl.sigmoid(acc)
            tl.store(out_ptr + (n * T + t) * C + oc, acc.to(out_ptr.dtype.element_ty), mask=mc)


def launch_meta(channels: int, width: int, has_bias: bool, activation: str | None) -> dict[str, object]:
    """Compile-time parameters of the kernel (shared with compile_check)."""
    return {"C": channels, "W": width, "BC": min(triton.next_power_of_2(channels), 256), "HAS_BIAS": has_bias,
            "SILU": activation == "silu"}


def tree_causal_conv1d(
        # [N, T, C] inputs of the tree nodes
        x: torch.Tensor,
        # [N, T] int parent node, -1 = the committed window; parents[n, t] < t
        parents: torch.Tensor,
        # [N, C, W - 1] committed inputs before the root, oldest first
        conv_state: torch.Tensor,
        # [C, W] depthwise weights (weight[:, W - 1] multiplies the node's own input); bias [C] or None
        weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = "silu") -> torch.Tensor:
    """out [N, T, C] in x's dtype (module docstring); activation None or "silu"."""
    num_reqs, num_nodes, channels = x.shape
    width = weight.shape[1]
    if activation not in (None, "silu"):
        raise ValueError(f"activation must be None or 'silu', got {activation!r}")
    if weight.shape != (channels, width) or conv_state.shape != (num_reqs, channels, width - 1) or width < 2:
        raise ValueError(f"weight {tuple(weight.shape)} / conv_state {tuple(conv_state.shape)} do not fit "
                         f"x {tuple(x.shape)} with a window W >= 2")
    if parents.shape != (num_reqs, num_nodes):
        raise ValueError(f"parents must be [N, T] = {(num_reqs, num_nodes)}, got {tuple(parents.shape)}")
    out = torch.empty_like(x)
    if num_reqs * num_nodes == 0:
        return out
    meta = launch_meta(channels, width, bias is not None, activation)
    grid = (num_reqs, triton.cdiv(channels, meta["BC"]))
    _tree_conv_kernel[grid](x.contiguous(), parents.to(torch.int64).contiguous(), conv_state.contiguous(),
                            weight.contiguous(), bias.contiguous() if bias is not None else weight, out, num_nodes,
                            **meta)
    return out


def tree_conv_window(x: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor,
                     node: torch.Tensor) -> torch.Tensor:
    """The committed window after node ``node [N]`` (-1: nothing accepted): the last W - 1 inputs of the
    root->node path, preceded by the old window where the path is shorter. -> [N, C, W - 1], oldest first.

    A fixed number of gathers (W - 1 steps up the tree), no host read: the commit of the conv state."""
    num_reqs, _, channels = x.shape
    keep = conv_state.shape[2]
    cols = []
    cur = node.to(torch.int64).clone()
    past = (cur < 0).long()  # steps past the root: the old window's input keep - past is read
    rows = torch.arange(num_reqs, device=x.device)
    for _ in range(keep):  # newest first
        in_tree = cur >= 0
        from_x = x[rows, cur.clamp(min=0)]  # [N, C]
        from_state = conv_state[rows, :, (keep - past).clamp(0, keep - 1)]  # [N, C]
        cols.append(torch.where(in_tree[:, None], from_x, from_state))
        up = torch.where(in_tree, parents.to(torch.int64)[rows, cur.clamp(min=0)], cur)
        past = torch.where(in_tree, torch.where(up < 0, 1, past), past + 1)
        cur = up
    return torch.stack(cols[::-1], dim=2)
