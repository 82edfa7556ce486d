"""Coupled drafting: the tree ranks its candidates under the target's own sampling noise (docs/design/mrv2.md §11).

At temperature T > 0, Model Runner V2 verifies a node by drawing the target's token ``argmax_v logits(v) / T +
G(seed, pos, v)`` with noise hashed from the request's seed and the drawing row's position
(``triton_ops/target_noise.py``), and accepts the child holding that token. The noise is a function of
(seed, position, token) alone, so it is known when the tree is drafted, and every branch at one depth meets the
same noise. A drafter whose log-probs ``logp_d`` approximate the target's then finds the target's draw among
the top K of ``logp_d / T + G_d`` far more often than among the top K of ``logp_d``: with ``logp_d`` equal to
the target's, the top 1 is the draw itself.

Lossless by construction: the drafts change which tokens the tree offers, never which token the target emits at
a position (its own draw with its own noise, the one non-speculative decoding makes with the same seed).

* candidates: the top K of ``logp_d / T + G_d`` per depth (``logp_d`` itself at T = 0, so greedy drafting is
  unchanged bit for bit; one pass over the logits, triton_ops/vocab_top_k.py);
* edges: the selector's normalised log-probs ``log q_d(b | a)`` become ``log_softmax_b(w * log q_d(b | a) / T +
  G_d(b))`` over the K candidates, so the beam and the pruning prefer the branches the noise favours.

The edge weight ``w`` (``UBTreeConfig.coupled_edge_weight``): were ``q`` the target's distribution, ``w = 1`` would
make an edge the exact probability that the target's draw takes it. The shipped selector's ``q`` is flatter than the
target's (it must hedge over paths it cannot see), so at ``w = 1`` the noise outweighs it, and the CPU ceiling
(``ubtree eval-tau --ceiling --coupled-edge-weights``, the same noise draws for every ``w``) scores trees drafted at
``w`` = 1.25 above those at 1 on all three sets (config.DEFAULT_COUPLED_EDGE_WEIGHT). The candidates (the top K of
``logp / T + G``) do not depend on ``w``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ubtree_vllm.triton_ops.vocab_top_k import vocab_top_k


@dataclass
class CoupledNoise:
    """Where the target's draws for one tree per request will take their noise."""

    # [N] float: the request's temperature (0: greedy, no coupling)
    temperature: torch.Tensor
    # [N] int64: the request's sampling seed (vLLM MRV2's sampling_states.seeds)
    seeds: torch.Tensor
    # [N, gamma] int: the position of the row that draws depth d's token (anchor position + d - 1)
    key_pos: torch.Tensor
    # vLLM's use_fp64_gumbel: which of its two noise forms the target's sampler draws
    use_fp64: bool = False


def coupled_candidates(
        # [N, gamma, V] proposer logits (any float dtype; log-probs give the same candidates)
        logits: torch.Tensor, top_k: int, noise: CoupledNoise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens [N, gamma, K] int64, their log-probs [N, gamma, K] float32, their noise ``G_d`` [N, gamma, K]
    float32, 0 at T = 0): the top K of the coupled scores per depth (module docstring). Fixed shapes, no host read."""
    num_reqs, gamma, vocab = logits.shape
    temperature = noise.temperature[:, None].expand(num_reqs, gamma).reshape(-1)
    seeds = noise.seeds[:, None].expand(num_reqs, gamma).reshape(-1)
    tokens, cand_logp, top_scores = vocab_top_k(logits.reshape(num_reqs * gamma, vocab), top_k, temperature, seeds,
                                                noise.key_pos.reshape(-1), noise.use_fp64)  # [N * gamma, K] each
    shape = (num_reqs, gamma, top_k)
    tokens, cand_logp, top_scores = tokens.view(shape), cand_logp.view(shape), top_scores.view(shape)
    temp = noise.temperature.float()[:, None, None]
    cand_noise = torch.where(temp > 0, top_scores - cand_logp / torch.where(temp > 0, temp, 1.0), 0.0)
    return tokens, cand_logp, cand_noise


def couple_edges(
        # [N, K] root -> depth-1 and [N, gamma - 1, K, K] depth d+1 -> d+2 normalised edge log-probs (the selector's)
        root_logp: torch.Tensor, trans_logp: torch.Tensor,
        # [N, gamma, K] the candidates' noise (coupled_candidates), [N] temperatures
        cand_noise: torch.Tensor, temperature: torch.Tensor,
        # w > 0, the selector's weight against the noise (module docstring)
        weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The edges under the target's noise: ``log_softmax(w * logq / T + G)`` over each edge row's K children where
    T > 0; unchanged where T = 0. Shapes as given."""
    temp = temperature.float()
    scale = weight / torch.where(temp > 0, temp, 1.0)  # [N]
    root = torch.log_softmax(root_logp.float() * scale[:, None] + cand_noise[:, 0], dim=-1)
    trans = torch.log_softmax(trans_logp.float() * scale[:, None, None, None] + cand_noise[:, 1:, None, :], dim=-1)
    coupled = temp > 0
    return (torch.where(coupled[:, None], root, root_logp.float()),
            torch.where(coupled[:, None, None, None], trans, trans_logp.float()))
