"""Unigram proposer: a DFlash-style block drafter in plain PyTorch.

One forward predicts all gamma block positions. The query block of a request is
`[anchor, mask * gamma]` at positions `anchor_pos .. anchor_pos + gamma`; the anchor is the
last committed token (not yet seen by the target) and block slot i > 0 predicts the token
at `anchor_pos + i`. Every layer attends, non-causally, to
  * the context: target features of all committed positions before the anchor,
    fused as `hidden_norm(fc(concat(layer features)))` and projected by the layer's own
    k/v projections (+ k-norm + RoPE at the context positions), and
  * the block's own tokens.
The embedding and LM head are the target's, frozen and not stored here.

Weight names follow vLLM's `DFlashQwen3ForCausalLM` (`layers.N.self_attn.q_proj`, `fc`,
`hidden_norm`, `norm`), so the proposer part has the DFlash checkpoint layout.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ubtree_vllm.drafter.config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotary tables. positions [...] int64 -> cos, sin [..., head_dim] float32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., heads, head_dim]; cos/sin [..., head_dim] broadcast over heads."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[..., None, :] + rotated.float() * sin[..., None, :]).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, H] -> k, v [..., T, kv_heads, head_dim] (k normed and rotated)."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx_k: torch.Tensor,
                ctx_v: torch.Tensor, ctx_mask: torch.Tensor) -> torch.Tensor:
        """Attention split into a context part and an in-block part, merged in one softmax.

        x:        [N, nb, S, H] block hidden states (nb blocks of S tokens per sequence)
        cos/sin:  [N, nb, S, head_dim] rotary tables at the block positions
        ctx_k/ctx_v: [N, L, kv_heads, head_dim] context keys/values (shared by the nb blocks)
        ctx_mask: [N, nb, L] bool, True where the block may see the context position
        Each block sees its visible context and all S tokens of its own block (non-causal),
        nothing of other blocks, so the cost is linear in nb (no [nb*S, nb*S] mask).
        Returns [N, nb, S, H].
        """
        num_seqs, nb, block_len, _ = x.shape
        kvh, hd = self.num_kv_heads, self.head_dim
        group = self.num_heads // kvh
        q = apply_rope(self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, hd))), cos, sin)
        k, v = self.project_kv(x, cos, sin)  # [N, nb, S, kvh, hd]
        q = q.unflatten(3, (kvh, group)) * hd ** -0.5  # [N, nb, S, kvh, g, hd]
        ctx_k, ctx_v = ctx_k.to(q.dtype), ctx_v.to(q.dtype)
        s_ctx = torch.einsum("nbskgd,nlkd->nkgbsl", q, ctx_k)  # [N, kvh, g, nb, S, L]
        s_blk = torch.einsum("nbskgd,nbtkd->nkgbst", q, k)  # [N, kvh, g, nb, S, S]
        s_ctx = s_ctx.masked_fill(~ctx_mask[:, None, None, :, None, :], float("-inf"))
        probs = torch.softmax(torch.cat([s_ctx, s_blk], dim=-1), dim=-1, dtype=torch.float32).to(v.dtype)
        ctx_len = ctx_k.shape[1]
        out = (torch.einsum("nkgbsl,nlkd->nbskgd", probs[..., :ctx_len], ctx_v)
               + torch.einsum("nkgbst,nbtkd->nbskgd", probs[..., ctx_len:], v))
        return self.o_proj(out.flatten(-3))


class DraftMLP(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DraftAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = DraftMLP(cfg)

    def forward(self, x, cos, sin, ctx_k, ctx_v, ctx_mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, ctx_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def context_visibility(ctx_pos: torch.Tensor, ctx_valid: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
    """Which context positions each block sees: the valid ones strictly before its anchor.

    ctx_pos/ctx_valid: [N, L]; anchor_pos: [N, nb]. Returns [N, nb, L] bool.
    """
    return ctx_valid[:, None, :] & (ctx_pos[:, None, :] < anchor_pos[:, :, None])


class DFlashBackbone(nn.Module):
    """The block drafter without embedding and LM head."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(cfg.num_features, cfg.hidden_size, bias=False)
        # [F] per-channel scale of the target features before `fc` (training standardises the few
        # huge channels). Not saved: drafter/io.py folds it into fc.weight, so exported folders
        # keep the DFlash layout and load with scale 1.
        self.register_buffer("feature_scale", torch.ones(cfg.num_features), persistent=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, block_embeds: torch.Tensor, block_pos: torch.Tensor, ctx_features: torch.Tensor,
                ctx_pos: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """
        block_embeds: [N, nb, S, H] embedded query blocks (S = gamma + 1)
        block_pos:    [N, nb, S] int64 positions (block_pos[..., 0] is the anchor position)
        ctx_features: [N, L, F] concatenated target features; ctx_pos/ctx_valid: [N, L]
        Returns the final-normed hidden states [N, nb, S, H].
        """
        cfg = self.cfg
        ctx_mask = context_visibility(ctx_pos, ctx_valid, block_pos[:, :, 0])
        features = ctx_features.to(self.fc.weight.dtype) * self.feature_scale.to(self.fc.weight.dtype)
        ctx = self.hidden_norm(self.fc(features))  # [N, L, H]
        ctx_cos, ctx_sin = rope_cos_sin(ctx_pos, cfg.head_dim, cfg.rope_theta)
        cos, sin = rope_cos_sin(block_pos, cfg.head_dim, cfg.rope_theta)  # [N, nb, S, hd]
        x = block_embeds
        for layer in self.layers:
            ctx_k, ctx_v = layer.self_attn.project_kv(ctx, ctx_cos, ctx_sin)
            x = layer(x, cos, sin, ctx_k, ctx_v, ctx_mask)
        return self.norm(x)
