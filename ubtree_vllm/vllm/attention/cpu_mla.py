"""CPU_MLA with tree rows: vLLM's CPU multi-head latent attention, the new tokens masked by the tree.

vLLM's CPU MLA (DeepSeek-V2/V3 targets) decodes one-token rows with its C++ kernel and sends every request with
more than one query row -- a UBTree step's root and drafts -- through the prefill path (``forward_mha`` in
``model_executor/layers/attention/mla_attention.py``): attention over the committed context, gathered from the
latent cache in chunks, merged by log-sum-exp with dense causal attention over the step's new tokens
(``CPU_SDPA_MLA``, fp32 scores). A tree changes only the second part: node j may see the new tokens on its
root -> j path, not every earlier row. So this backend keeps vLLM's context part and merge, and gives the
new-token part an ancestor mask for tree requests (:func:`masked_ragged_attention`: vLLM's ragged-SDPA arithmetic
with an explicit mask, so a chain-shaped request computes what vLLM computes).

For the KV commit each layer stashes the tree requests' fresh latent rows (``kv_c_normed``, ``k_pe``); the
runner replays the accepted ones through vLLM's own cache writer (:meth:`TreeCPUMLAImpl.ubtree_write_kv`).
"""
from __future__ import annotations

from typing import Any

import torch
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl

from ubtree_vllm.vllm.attention.state import tree_forward_state
from ubtree_vllm.vllm.tree_plan import DeviceTrees


class TreeCPUMLABackend(CPUMLABackend):
    """CPU_MLA whose impl applies the ancestor mask to tree rows (name kept: CPU_MLA)."""

    @staticmethod
    def get_impl_cls() -> type["TreeCPUMLAImpl"]:
        return TreeCPUMLAImpl


def new_token_mask(trees: DeviceTrees, query_start_loc: torch.Tensor, row_offset: int) -> torch.Tensor:
    """[T, Q] bool: row i of the step's multi-token rows may see new token ``start(i) + j`` of its own request.

    query_start_loc: [R + 1] the multi-token requests' row offsets (local rows, T = query_start_loc[-1], Q the
    longest request); row_offset: global row of local row 0. Causal for every row but the tree rows, which see
    their root -> self path only (``trees.row_path``, global rows, -1 padded).
    """
    device = query_start_loc.device
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    num_rows, width = int(query_start_loc[-1]), int(lens.max())  # SYNC: host-side CPU backend (no device)
    row_start = torch.repeat_interleave(starts, lens)  # [T]
    col = torch.arange(width, device=device)[None, :]
    local = torch.arange(num_rows, device=device)
    allowed = col <= (local - row_start)[:, None]  # causal within the request
    rows = trees.row_index - row_offset  # [N] local rows of the tree rows
    allowed[rows] = False
    path = trees.row_path  # [N, D + 1]
    on_path = path >= 0
    tree_rows = rows[:, None].expand_as(path)[on_path]
    allowed[tree_rows, (path - row_offset)[on_path] - row_start[tree_rows]] = True
    return allowed


def masked_ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start_loc: torch.Tensor,
                            allowed: torch.Tensor, scale: float,
                            return_softmax_lse: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of each request's new tokens to its new tokens under ``allowed`` (:func:`new_token_mask`).

    q: [T, H, Dqk]; k: [T, H, Dqk]; v: [T, H, Dv]; returns out [T, H, Dv] (v's dtype) and, if asked, the
    natural-log LSE [H, T]. The arithmetic of vLLM's ``CPUSDPAMLAPrefillBackend._ragged_sdpa``: fp32 scores,
    -inf where not allowed, fp32 softmax, one matmul with v per request.
    """
    out_chunks: list[torch.Tensor] = []
    lse_chunks: list[torch.Tensor] = []
    bounds = query_start_loc.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        q_r = q[start:end].transpose(0, 1).float()  # [H, S, Dqk]
        k_r = k[start:end].transpose(0, 1).float()
        v_r = v[start:end].transpose(0, 1).float()  # [H, S, Dv]
        scores = torch.matmul(q_r, k_r.transpose(-2, -1)) * scale  # [H, S, S]
        scores.masked_fill_(~allowed[start:end, :end - start].unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        out_chunks.append(torch.matmul(probs, v_r).transpose(0, 1).to(v.dtype))  # [S, H, Dv]
        if return_softmax_lse:
            lse_chunks.append(torch.logsumexp(scores, dim=-1))  # [H, S]
    out = torch.cat(out_chunks, dim=0)
    if not return_softmax_lse:
        return out
    return out, torch.cat(lse_chunks, dim=1)


class _TreeMaskedPrefill:
    """vLLM's CPU MLA prefill backend for one ``forward_mha`` call, its new-token part under a tree mask."""

    def __init__(self, stock: Any, allowed: torch.Tensor) -> None:
        self._stock = stock
        self._allowed = allowed

    def __getattr__(self, name: str) -> Any:  # the context chunks and the rest: vLLM's backend
        return getattr(self._stock, name)

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, return_softmax_lse: bool,
                               out: torch.Tensor | None = None,
                               output_scale: torch.Tensor | None = None) -> Any:
        if output_scale is not None:
            raise NotImplementedError("ubtree tree attention (CPU MLA) has no fused FP8 output")
        result = masked_ragged_attention(q, k, v, self._stock._prefill_metadata.query_start_loc, self._allowed,
                                         self._stock.scale, return_softmax_lse)
        if out is not None and not return_softmax_lse:
            out.copy_(result)
            return out
        return result


class TreeCPUMLAImpl(CPUMLAImpl):
    """Stock CPU MLA; in a step with tree rows the multi-token rows attend their new tokens under the tree mask."""

    # Checked by the UBTree runner after model load.
    ubtree_tree_aware = True

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: Any, k_scale: torch.Tensor,
                    output: torch.Tensor, output_scale: torch.Tensor | None = None) -> None:
        """q [T, H, Dqk], kv_c_normed [T, L], k_pe [T, 1, R]: the step's multi-token rows (global rows
        ``num_decode_tokens ..``); output [T, H * Dv]."""
        state = tree_forward_state()
        active = state.active_plan()
        if active is None:
            return super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale,
                                       output, output_scale)
        _, trees = active
        offset = attn_metadata.num_decode_tokens
        prefill = attn_metadata.prefill
        allowed = state.step_cache.get("cpu_mla_mask")
        if allowed is None:  # once per forward, shared by its layers
            # Every tree request has more than one row, so its rows are all here (vLLM orders one-row requests
            # first).
            if int(trees.stash_rows.min()) < offset:  # SYNC: CPU tensors (host-side backend)
                raise RuntimeError("ubtree: a tree request's rows reached CPU MLA's one-row decode path")
            allowed = new_token_mask(trees, prefill.query_start_loc, offset)
            state.step_cache["cpu_mla_mask"] = allowed
        state.stash_layer(self.ubtree_layer, kv_c_normed, k_pe, attn_metadata.slot_mapping, key_row_offset=offset)
        stock = prefill.prefill_backend
        prefill.prefill_backend = _TreeMaskedPrefill(stock, allowed)
        try:
            super().forward_mha(q, kv_c_normed, k_pe, kv_c_and_k_pe_cache, attn_metadata, k_scale, output,
                                output_scale)
        finally:
            prefill.prefill_backend = stock

    def ubtree_write_kv(self, layer: Any, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                        slots: torch.Tensor) -> None:
        """The KV commit's writer: latent rows [N, L] / [N, 1, R] to ``slots`` [N] (-1 skipped)."""
        self.do_kv_cache_update(kv_c_normed, k_pe, layer.kv_cache, slots, self.kv_cache_dtype, layer._k_scale)
