"""Target-side token sampling, exactly as non-speculative decoding does it.

Tree acceptance draws the target's token at every tree node with this function, and the
non-speculative baseline uses the same function, so both emit tokens from one and the same
distribution. Semantics follow vLLM's sampler: temperature scaling, then min_p, then top-k, then top-p
(keep the smallest most-probable set with mass >= top_p), then one categorical draw;
temperature 0 is argmax of the raw logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ubtree_vllm.config import SamplingConfig


@dataclass
class SamplingTensors:
    """Per-request sampling parameters as tensors (no host sync when used)."""

    # [N] float32; 0 means greedy
    temperature: torch.Tensor
    # [N] int64; <= 0 disables top-k
    top_k: torch.Tensor
    # [N] float32 in (0, 1]
    top_p: torch.Tensor
    # [N] float32 in [0, 1] (0 disables), or None: no request uses min_p
    min_p: torch.Tensor | None = None

    @classmethod
    def from_configs(cls, configs: list[SamplingConfig], device: torch.device | str) -> "SamplingTensors":
        return cls(
            temperature=torch.tensor([c.temperature for c in configs], dtype=torch.float32, device=device),
            top_k=torch.tensor([c.top_k for c in configs], dtype=torch.long, device=device),
            top_p=torch.tensor([c.top_p for c in configs], dtype=torch.float32, device=device),
        )


def processed_probs(logits: torch.Tensor, params: SamplingTensors) -> torch.Tensor:
    """Sampling distribution after temperature, top-k and top-p.

    logits: [N, n, V] (n tree nodes per request); params broadcast per request.
    Returns [N, n, V] float32 probabilities (rows of greedy requests are irrelevant).
    """
    vocab = logits.shape[-1]
    temp = torch.where(params.temperature > 0, params.temperature, torch.ones_like(params.temperature))
    scaled = logits.float() / temp[:, None, None]
    if params.min_p is not None:  # vLLM's min_p after temperature: tokens below min_p x the top probability
        probs = scaled.softmax(dim=-1)
        floor = probs.amax(dim=-1, keepdim=True) * params.min_p[:, None, None]
        scaled = scaled.masked_fill(probs < floor, float("-inf"))
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)
    k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), vocab)
    keep = rank[None, None, :] < k[:, None, None]
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs_sorted = sorted_logits.softmax(dim=-1)
    # Mass strictly before each rank; a token is kept while that mass is < top_p (the top-1 always is).
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    keep = keep & (mass_before < params.top_p[:, None, None])
    sorted_logits = sorted_logits.masked_fill(~keep, float("-inf"))
    probs = torch.zeros_like(scaled).scatter_(-1, order, sorted_logits.softmax(dim=-1))
    return probs


def sample_tokens(logits: torch.Tensor, params: SamplingTensors, generator: torch.Generator | None) -> torch.Tensor:
    """One independent draw per row. logits [N, n, V] -> tokens [N, n] int64."""
    greedy = logits.argmax(dim=-1)
    probs = processed_probs(logits, params)
    # Exponential race: argmax p / E with E ~ Exp(1) is a categorical draw from p.
    noise = torch.empty_like(probs).exponential_(1.0, generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(params.temperature[:, None] > 0, sampled, greedy)
