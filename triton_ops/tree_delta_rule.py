"""Gated delta rule over a draft tree: every node's recurrent state starts from its parent's.

The linear-attention layers of hybrid targets (Gated DeltaNet in Qwen3-Next / Qwen3.5, Kimi
Delta Attention in Ling-3.0 / Kimi) keep one state S [Dk, Dv] per head. Along a chain, token t
updates it as (fla's fused recurrent form, q and k already normalised by the caller)

    S   = exp(g_t) * S                  g_t [H] (GDN: one decay per head) or [H, Dk] (KDA: per key channel)
    u   = beta_t * (v_t - S^T k_t)      the delta-rule correction [Dv]
    S   = S + k_t u^T
    o_t = scale * S^T q_t

With ``delta=False`` the correction is dropped (u = beta_t * v_t): the selective-state-space
update of Mamba2 layers in the same form (k = B_t, v = x_t, q = C_t, g_t = dt_t * A per head,
beta_t = dt_t; the layer adds its D * x skip itself).

Over a tree, node t reads the state *after its parent* (``parents[n, t]``; -1 = the committed
state ``initial_state`` before the tree's root), so every root->node path sees exactly the
chain recurrence of its own tokens and nothing of its siblings. The per-node states are
returned: after acceptance, the accepted path's deepest node's state is the one to commit
(rejected branches leave no trace).

One program per (request, head, Dv tile); nodes in order (parents first: ``parents[n, t] < t``),
each node's state tile written to ``node_states`` and re-read by its children. The launcher
reads no device value. Torch twin: ``reference.tree_gated_delta_rule_reference``. The cheaper
form, which keeps no per-node state: :mod:`ubtree_vllm.triton_ops.tree_delta_rule_paths`.
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
    def delta_rule_step(state, k_ptr, v_ptr, g_ptr, beta_ptr, tok, ok, ov, mk, mv, DK: tl.constexpr,
                        DV: tl.constexpr, PER_CHANNEL_GATE: tl.constexpr, DELTA: tl.constexpr):
        """The state tile [BK, BV] after token row ``tok`` (module docstring's update; float32)."""
        k = tl.load(k_ptr + tok * DK + ok, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + tok * DV + ov, mask=mv, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok).to(tl.float32)
        if PER_CHANNEL_GATE:
            g = tl.load(g_ptr + tok * DK + ok, mask=mk, other=0.0).to(tl.float32)
            state = state * tl.exp(g)[:, None]
        else:
            state = state * tl.exp(tl.load(g_ptr + tok).to(tl.float32))
        if DELTA:
            u = beta * (v - tl.sum(state * k[:, None], axis=0))  # [BV]
        else:
            u = beta * v
        return state + k[:, None] * u[None, :]

    @triton.jit
    def _tree_delta_rule_kernel(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, parents_ptr, h0_ptr, o_ptr, hs_ptr, scale,
            T, H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
            PER_CHANNEL_GATE: tl.constexpr, DELTA: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        iv = tl.program_id(2).to(tl.int64)
        ok = tl.arange(0, BK)
        ov = iv * BV + tl.arange(0, BV)
        mk, mv = ok < DK, ov < DV
        mkv = mk[:, None] & mv[None, :]
        state_off = ok[:, None] * DV + ov[None, :]  # [BK, BV] inside one [DK, DV] state
        h0 = tl.load(h0_ptr + (n * H + h) * DK * DV + state_off, mask=mkv, other=0.0).to(tl.float32)
        for t in range(T):
            tok = (n * T + t) * H + h
            parent = tl.load(parents_ptr + n * T + t).to(tl.int64)
            # node 0's row when there is no parent: possibly unwritten, and discarded by the select below
            prev = tl.load(hs_ptr + ((n * T + tl.maximum(parent, 0)) * H + h) * DK * DV + state_off,
                           mask=mkv, other=0.0)
            state = tl.where(parent >= 0, prev, h0)
            state = delta_rule_step(state, k_ptr, v_ptr, g_ptr, beta_ptr, tok, ok, ov, mk, mv, DK, DV,
                                    PER_CHANNEL_GATE, DELTA)
            q = tl.load(q_ptr + tok * DK + ok, mask=mk, other=0.0).to(tl.float32)
            o = tl.sum(state * q[:, None], axis=0) * scale
            tl.store(o_ptr + tok * DV + ov, o.to(o_ptr.dtype.element_ty), mask=mv)
            tl.store(hs_ptr + tok * DK * DV + state_off, state, mask=mkv)
            tl.debug_barrier()  # a child's program lanes re-read this state tile


def launch_meta(dk: int, dv: int, num_heads: int, per_channel: bool, delta: bool = True) -> dict[str, object]:
    """Compile-time parameters of the kernel (shared with compile_check)."""
    bk = triton.next_power_of_2(dk)
    return {"H": num_heads, "DK": dk, "DV": dv, "BK": bk, "BV": min(triton.next_power_of_2(dv), max(16, 8192 // bk)),
            "PER_CHANNEL_GATE": per_channel, "DELTA": delta}


def tree_gated_delta_rule(
        # [N, T, H, Dk] queries and keys of the tree nodes (normalised as the layer wants)
        q: torch.Tensor, k: torch.Tensor,
        # [N, T, H, Dv] values
        v: torch.Tensor,
        # [N, T, H] log-decay per head (GDN) or [N, T, H, Dk] per key channel (KDA); <= 0
        g: torch.Tensor,
        # [N, T, H] delta-rule step sizes
        beta: torch.Tensor,
        # [N, T] int parent node of each node, -1 = the committed state; parents[n, t] < t
        parents: torch.Tensor,
        # [N, H, Dk, Dv] committed states (float32)
        initial_state: torch.Tensor,
        scale: float,
        # False: no delta-rule correction (the Mamba2 form, module docstring)
        delta: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (o [N, T, H, Dv] in v's dtype, node_states [N, T, H, Dk, Dv] float32). See the module docstring."""
    check_tree_delta_shapes(q, k, v, g, beta, parents, initial_state)
    num_reqs, num_nodes, num_heads, dk = q.shape
    dv = v.shape[-1]
    per_channel = g.dim() == 4
    o = torch.empty_like(v)
    node_states = torch.zeros((num_reqs, num_nodes, num_heads, dk, dv), dtype=torch.float32, device=q.device)
    if num_reqs * num_nodes == 0:
        return o, node_states
    meta = launch_meta(dk, dv, num_heads, per_channel, delta)
    grid = (num_reqs, num_heads, triton.cdiv(dv, meta["BV"]))
    _tree_delta_rule_kernel[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
        parents.to(torch.int64).contiguous(), initial_state.float().contiguous(), o, node_states, float(scale),
        num_nodes, **meta)
    return o, node_states


def check_tree_delta_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            parents: torch.Tensor, initial_state: torch.Tensor) -> None:
    """ValueError naming the arguments whose shapes disagree (both tree delta-rule forms take the same)."""
    num_reqs, num_nodes, num_heads, dk = q.shape
    dv = v.shape[-1]
    per_channel = g.dim() == 4
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"beta {tuple(beta.shape)}")
    if g.shape != (q.shape if per_channel else q.shape[:3]):
        raise ValueError(f"g must be [N, T, H] or [N, T, H, Dk], got {tuple(g.shape)}")
    if parents.shape != (num_reqs, num_nodes) or initial_state.shape != (num_reqs, num_heads, dk, dv):
        raise ValueError(f"parents {tuple(parents.shape)} / initial_state {tuple(initial_state.shape)} do not fit "
                         f"N={num_reqs}, T={num_nodes}, H={num_heads}, Dk={dk}, Dv={dv}")


def commit_tree_state(node_states: torch.Tensor, accepted_node: torch.Tensor, state_cache: torch.Tensor,
                      cache_slot: torch.Tensor) -> None:
    """Write each request's accepted state into the layer's state cache, no host read.

    node_states [N, T, H, Dk, Dv] (the kernel's); accepted_node [N] deepest accepted node (>= 0: the
    root is always accepted); state_cache [S, H, Dk, Dv] (mutated); cache_slot [N] the request's slot.
    Rejected branches leave no trace: only the accepted node's state is written."""
    rows = torch.arange(node_states.shape[0], device=node_states.device)
    state_cache[cache_slot.long()] = node_states[rows, accepted_node.long()].to(state_cache.dtype)
