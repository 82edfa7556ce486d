"""Bigram selector: scores transitions between adjacent block candidates.

Deep codebooks: two bias-free MLPs map the frozen target embedding of a token to a rank-r
predecessor code phi(a) and successor code psi(b). At serving time both are precomputed
into vocabulary-wide tables [V, r], so scoring is a gather plus one matmul.

For block depth d (1-based) with proposer hidden state h_d and candidate b, predecessor a:
    pair_d(a, b) = phi(a)^T diag(u_d) psi(b),          u_d = hidden_proj(h_d)   [r]
    s_d(a, b)    = alpha_d * logp_d(b) + beta_d * pair_d(a, b)
    log q_d(b | a) = log_softmax_b s_d(a, b)   over the K candidates at depth d
with logp_d the proposer's full-vocabulary log-probability and (alpha_d, beta_d) learned
per depth. Depth 1's predecessor is the anchor (the tree root).
"""
from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F


class CodebookMLP(nn.Module):
    """Bias-free two-layer MLP: embedding [.., H] -> code [.., r]."""

    def __init__(self, hidden_size: int, inner: int, rank: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden_size, inner, bias=False)
        self.down = nn.Linear(inner, rank, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.up(x)))


class BigramSelector(nn.Module):
    def __init__(self, hidden_size: int, inner: int, rank: int, block_size: int) -> None:
        super().__init__()
        self.pred_codebook = CodebookMLP(hidden_size, inner, rank)
        self.succ_codebook = CodebookMLP(hidden_size, inner, rank)
        self.hidden_proj = nn.Linear(hidden_size, rank, bias=False)
        # [gamma] per-depth mixing weights for proposer log-probs and pair scores.
        self.unary_weight = nn.Parameter(torch.ones(block_size))
        self.pair_weight = nn.Parameter(torch.ones(block_size))
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---- codebook lookup --------------------------------------------------------------
    def precompute_tables(self, embed_weight: torch.Tensor) -> None:
        """Cache phi/psi for the whole vocabulary (serving). Invalidated by `train()`."""
        with torch.no_grad():
            e = embed_weight.to(self.hidden_proj.weight.dtype)
            self._tables = (self.pred_codebook(e), self.succ_codebook(e))

    def train(self, mode: bool = True) -> "BigramSelector":
        if mode:
            self._tables = None
        return super().train(mode)

    def _codes(self, which: int, tokens: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Codes of `tokens` [...] -> [..., r] from codebook `which` (0 = phi, 1 = psi).

        Serving reads the precomputed table. Training runs the MLP over the whole vocabulary
        (a batch looks up far more tokens than the vocabulary holds, and a fixed-size table
        needs no `unique`, which syncs with the host) and gathers with index_select, whose
        backward is an index_add rather than advanced indexing's sort.
        """
        if self._tables is not None and not self.training:
            return self._tables[which][tokens]
        mlp = self.pred_codebook if which == 0 else self.succ_codebook
        table = mlp(embed_weight.to(self.hidden_proj.weight.dtype))  # [V, r]
        return table.index_select(0, tokens.flatten()).view(*tokens.shape, -1)

    # ---- scoring ---------------------------------------------------------------------
    def edge_logprobs(self, pred_tokens: torch.Tensor, cand_tokens: torch.Tensor, cand_logp: torch.Tensor,
                      hidden: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Normalized transition log-probs log q_d(b | a) for every (a, b) pair.

        pred_tokens: [N, D, P] predecessors at each scored depth
        cand_tokens: [N, D, K] candidates at that depth; cand_logp [N, D, K] their proposer log-probs
        hidden:      [N, D, H] proposer hidden state at that depth
        Depth index 0 is block depth 1; D <= gamma.
        Returns [N, D, P, K] float32, each row a log-distribution over the K candidates.
        """
        num_depths = cand_tokens.shape[1]
        phi = self._codes(0, pred_tokens, embed_weight)  # [N, D, P, r]
        psi = self._codes(1, cand_tokens, embed_weight)  # [N, D, K, r]
        u = self.hidden_proj(hidden.to(self.hidden_proj.weight.dtype))  # [N, D, r]
        # One diagonal-weighted batched matmul for all depths and pairs.
        pair = torch.matmul(phi * u[:, :, None, :], psi.transpose(-1, -2)).float()  # [N, D, P, K]
        alpha = self.unary_weight[:num_depths].float()[None, :, None, None]
        beta = self.pair_weight[:num_depths].float()[None, :, None, None]
        scores = alpha * cand_logp.float()[:, :, None, :] + beta * pair
        return torch.log_softmax(scores, dim=-1)

    def score_tree_edges(self, anchor: torch.Tensor, cand_tokens: torch.Tensor, cand_logp: torch.Tensor,
                         hidden: torch.Tensor, embed_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """All K + (gamma - 1) K^2 edges of the candidate lattice, in one matmul.

        anchor [N]; cand_tokens/cand_logp [N, gamma, K]; hidden [N, gamma, H].
        Returns root_logp [N, K] (anchor -> depth 1) and trans_logp [N, gamma - 1, K, K]
        (trans_logp[:, d, a, b] = log q(depth d+2 candidate b | depth d+1 candidate a)).
        """
        top_k = cand_tokens.shape[2]
        # Depth 1's predecessor row is the anchor, broadcast to K rows so all depths share one matmul.
        pred = torch.cat([anchor[:, None, None].expand(-1, 1, top_k), cand_tokens[:, :-1]], dim=1)
        logp = self.edge_logprobs(pred, cand_tokens, cand_logp, hidden, embed_weight)  # [N, gamma, K, K]
        return logp[:, 0, 0], logp[:, 1:]
