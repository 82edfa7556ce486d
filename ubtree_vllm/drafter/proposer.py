"""UBTree drafter = unigram proposer (DFlash backbone + target LM head) + bigram selector.

`draft_tree` is the whole drafting stage of a round: one backbone forward, top-K per
depth, one selector matmul, and the beam/prune tree construction (no neural compute).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.coupling import CoupledNoise, couple_edges, coupled_candidates
from ubtree_vllm.drafter.model import DFlashBackbone
from ubtree_vllm.selector.bigram import BigramSelector
from ubtree_vllm.tree.lookup import inject_lookup_chain, lookup_continuation
from ubtree_vllm.tree.search import construct_tree
from ubtree_vllm.tree.topology import DraftTree
from ubtree_vllm.triton_ops.vocab_top_k import vocab_top_k
from ubtree_vllm.types import DraftContext


def context_history(ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's token history for the lookup branch: its committed context tokens, then the anchor.

    ctx.tokens [N, L]: row r holds the committed tokens at positions 0 .. anchor_pos[r] - 1 (the
    DraftContext layout; ctx.valid may cover only part of them, e.g. the feature rows kept).
    Returns history [N, L + 1] int64 and its length [N] = anchor_pos + 1.
    """
    length = ctx.anchor_pos.long().clamp(max=ctx.tokens.shape[1])  # [N]
    history = torch.cat([ctx.tokens.long(), torch.zeros_like(ctx.anchor[:, None]).long()], dim=1)
    history.scatter_(1, length[:, None], ctx.anchor[:, None].long())
    return history, length + 1


@dataclass
class Candidates:
    """Top-K proposer candidates for each of the gamma block depths."""

    # [N, gamma, K] int64, sorted by proposer log-prob (descending; coupled: by the coupled score)
    tokens: torch.Tensor
    # [N, gamma, K] float32 full-vocabulary log-probs of those tokens
    logp: torch.Tensor
    # [N, gamma, H] proposer hidden state at each depth (input of the selector)
    hidden: torch.Tensor
    # coupled drafting (drafter/coupling.py): [N, gamma, K] the target's noise at each candidate, and [N]
    # temperatures; None: ranked by log-prob alone
    noise: torch.Tensor | None = None
    temperature: torch.Tensor | None = None


class UBTreeDrafter(nn.Module):
    """Trainable drafter parameters; the target's embedding and LM head are bound, not owned."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.backbone = DFlashBackbone(cfg)
        self.selector = BigramSelector(cfg.hidden_size, cfg.selector_hidden, cfg.selector_rank, cfg.block_size)
        self._embed_weight: torch.Tensor | None = None
        self._lm_head_weight: torch.Tensor | None = None

    # ---- binding to the target ---------------------------------------------------------
    def bind_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> None:
        """Share the target's frozen embedding [V, H] and LM head [V, H]."""
        for name, w in (("embedding", embed_weight), ("lm_head", lm_head_weight)):
            if tuple(w.shape) != (self.cfg.vocab_size, self.cfg.hidden_size):
                raise ValueError(f"target {name} has shape {tuple(w.shape)}, the drafter expects "
                                 f"({self.cfg.vocab_size}, {self.cfg.hidden_size}) (vocab_size, hidden_size)")
        self._embed_weight = embed_weight.detach()
        self._lm_head_weight = lm_head_weight.detach()
        if not self.selector.training:
            self.selector.precompute_tables(self._embed_weight)

    def bind_hf_target(self, target: nn.Module) -> None:
        self.cfg.check_hf_target(target.config)
        self.bind_target(target.get_input_embeddings().weight, target.get_output_embeddings().weight)

    @property
    def embed_weight(self) -> torch.Tensor:
        if self._embed_weight is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target() first")
        return self._embed_weight

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self._lm_head_weight is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target() first")
        return self._lm_head_weight

    def eval(self) -> "UBTreeDrafter":
        super().eval()
        if self._embed_weight is not None:
            self.selector.precompute_tables(self._embed_weight)
        return self

    # ---- proposer --------------------------------------------------------------------
    def block_hidden(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, ctx_features: torch.Tensor,
                     ctx_pos: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """Hidden states at the gamma mask slots of each block.

        anchor/anchor_pos: [N, nb]; ctx_features [N, L, F]; ctx_pos/ctx_valid [N, L].
        Returns [N, nb, gamma, H].
        """
        gamma = self.cfg.block_size
        num_seqs, nb = anchor.shape
        offsets = torch.arange(gamma + 1, device=anchor.device)
        block_pos = anchor_pos[:, :, None] + offsets  # [N, nb, gamma + 1]
        block_ids = torch.full((num_seqs, nb, gamma + 1), self.cfg.mask_token_id, dtype=torch.long, device=anchor.device)
        block_ids[:, :, 0] = anchor
        embeds = self.embed_weight[block_ids].to(self.backbone.fc.weight.dtype)
        hidden = self.backbone(embeds, block_pos, ctx_features, ctx_pos, ctx_valid)
        return hidden[:, :, 1:]

    def lm_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] in ``hidden``'s dtype with the target's LM head."""
        return torch.matmul(hidden, self.lm_head_weight.to(hidden.dtype).t())

    def proposer_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] float32 with the target's LM head."""
        return self.lm_head_logits(hidden).float()

    def propose(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, ctx_features: torch.Tensor,
                ctx_pos: torch.Tensor, ctx_valid: torch.Tensor, top_k: int,
                noise: CoupledNoise | None = None) -> Candidates:
        """One block forward for one block per request: anchor/anchor_pos [N]; ``noise``: coupled drafting."""
        hidden = self.block_hidden(anchor[:, None], anchor_pos[:, None], ctx_features, ctx_pos, ctx_valid)[:, 0]
        return self.top_k_candidates(hidden, top_k, noise)

    def top_k_candidates(self, hidden: torch.Tensor, top_k: int, noise: CoupledNoise | None = None) -> Candidates:
        """LM head + top-K over the block's hidden states [N, gamma, H] (timed by `ubtree bench microbench`); with
        ``noise``, the top K under the target's sampling noise (drafter/coupling.py)."""
        logits = self.lm_head_logits(hidden)  # [N, gamma, V] in hidden's dtype: read once, no float32 copy
        if noise is not None:
            cand_tokens, cand_logp, cand_noise = coupled_candidates(logits, top_k, noise)
            return Candidates(cand_tokens, cand_logp, hidden, cand_noise, noise.temperature)
        num_reqs, gamma, vocab = logits.shape
        # exact logit ties between distinct tokens change which K tokens are kept only at the K-th slot
        cand_tokens, cand_logp, _ = vocab_top_k(logits.reshape(num_reqs * gamma, vocab), top_k)
        cand_tokens, cand_logp = cand_tokens.view(num_reqs, gamma, top_k), cand_logp.view(num_reqs, gamma, top_k)
        return Candidates(cand_tokens, cand_logp, hidden)

    @torch.no_grad()
    def draft_tree(self, ctx: DraftContext, tree_cfg: UBTreeConfig, noise: CoupledNoise | None = None) -> DraftTree:
        """The drafting stage of one round: proposer -> selector -> tree search; with ``noise``, under the target's
        sampling noise (drafter/coupling.py)."""
        if tree_cfg.block_size != self.cfg.block_size:
            raise ValueError(f"block_size must equal the drafter's block size {self.cfg.block_size}, "
                             f"got {tree_cfg.block_size}")
        cands = self.propose(ctx.anchor, ctx.anchor_pos, ctx.features, ctx.positions, ctx.valid, tree_cfg.top_k,
                             noise)
        chain = None
        if tree_cfg.prompt_lookup:
            history, length = context_history(ctx)
            chain = lookup_continuation(history, length, tree_cfg.block_size, tree_cfg.lookup_min_n,
                                        tree_cfg.lookup_max_n)
        return self.tree_from_candidates(ctx.anchor, cands, tree_cfg, chain)

    def tree_from_candidates(self, anchor: torch.Tensor, cands: Candidates, tree_cfg: UBTreeConfig,
                             chain: tuple[torch.Tensor, torch.Tensor] | None = None) -> DraftTree:
        """Selector edge scores over the proposer's top-K, then the tree search: the drafting stage after
        the proposer (also run by the Model Runner V2 speculator after vLLM's DFlash forward). anchor [N];
        `chain` ([N, gamma] tokens, [N] lengths; tree/lookup.py) joins the lattice as a lookup branch."""
        root_logp, trans_logp = self.selector.score_tree_edges(anchor, cands.tokens, cands.logp, cands.hidden,
                                                               self.embed_weight)
        if cands.noise is not None:
            assert cands.temperature is not None, "coupled candidates carry their temperatures"
            root_logp, trans_logp = couple_edges(root_logp, trans_logp, cands.noise, cands.temperature,
                                                 tree_cfg.coupled_edge_weight)
        tokens = cands.tokens
        if chain is not None:
            tokens, root_logp, trans_logp = inject_lookup_chain(tokens, root_logp, trans_logp, *chain,
                                                                edge_logprob=tree_cfg.lookup_edge_logprob)
        return construct_tree(anchor, tokens, root_logp, trans_logp, tree_cfg)
