"""Tree-native drafter objective: renormalized KL on the selector + beta * proposer CE.

Per batch of right-padded sequences (prompt + target-generated response):

1. Target pass (frozen, no grad): features of every position and the final hidden state.
2. Anchors: up to `blocks_per_seq` distinct positions a per sequence, uniform over the
   response region `prompt_len <= a <= len - 2` (so every block has >= 1 label). Block a is
   `[x_a, mask * gamma]`; it sees the target features of positions < a (the anchor is not
   yet processed by the target at inference, see drafter/proposer.py) and predicts
   `x_{a+1} .. x_{a+gamma}`. Depths past the sequence end are masked. All blocks of a
   sequence run in one drafter forward with a block-diagonal mask.
3. Proposer: log-softmax of the target LM head on each depth's hidden state; CE on the label.
4. Selector: the K proposer candidates at depth d (top-K of the proposer log-probs; the
   selection is detached, their log-prob values are not) are scored by
   `selector.edge_logprobs` with the TRUE previous token x_{a+d-1} as the single
   predecessor (x_a for d = 1): q_d(. | x_{a+d-1}) over the K candidates.
   The target's next-token distribution at position a+d-1 (teacher forced on the data),
   renormalized over the same K candidates, is p_d. Loss `kl`: KL(p_d || q_d).
   Loss `hard_ce`: -log q_d(x_{a+d}), only at depths whose label is among the K.
5. total = selector loss + beta * CE, each a weighted mean over valid depths with weight
   exp(-(d - 1) / loss_decay) (DFlash's position decay) or 1 when loss_decay is None.

Renormalizing over K needs the target's logits at the K candidates only, so the target's
full-vocabulary logits are never materialized.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.training.target import FrozenTarget

SELECTOR_LOSSES = ("kl", "hard_ce")


@dataclass(frozen=True)
class LossConfig:
    selector_loss: str = "kl"
    beta: float = 0.1
    # DFlash-style position decay constant (e.g. 7); None weighs all depths equally.
    loss_decay: float | None = None
    blocks_per_seq: int = 32

    def __post_init__(self) -> None:
        if self.selector_loss not in SELECTOR_LOSSES:
            raise ValueError(f"selector_loss must be one of {SELECTOR_LOSSES}, got {self.selector_loss!r}")
        if not self.beta >= 0.0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.loss_decay is not None and not self.loss_decay > 0:
            raise ValueError(f"loss_decay must be > 0 or null, got {self.loss_decay}")
        if self.blocks_per_seq < 1:
            raise ValueError(f"blocks_per_seq must be >= 1, got {self.blocks_per_seq}")


@dataclass
class Batch:
    """Right-padded sequences."""

    # [B, T] int64 token ids (padding: 0)
    input_ids: torch.Tensor
    # [B] int64 real lengths
    lengths: torch.Tensor
    # [B] int64 prompt lengths (the response starts here)
    prompt_lens: torch.Tensor

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.lengths.to(device), self.prompt_lens.to(device))


def collate(samples: Sequence[tuple[torch.Tensor, int]], max_seq_len: int) -> Batch:
    """Samples (ids [T_i], prompt_len) -> Batch, each truncated to `max_seq_len` tokens."""
    lengths = [min(len(ids), max_seq_len) for ids, _ in samples]
    input_ids = torch.zeros((len(samples), max(lengths)), dtype=torch.long)
    for row, ((ids, _), n) in enumerate(zip(samples, lengths)):
        input_ids[row, :n] = ids[:n]
    return Batch(input_ids, torch.tensor(lengths, dtype=torch.long),
                 torch.tensor([p for _, p in samples], dtype=torch.long))


def sample_anchors(lengths: torch.Tensor, prompt_lens: torch.Tensor, width: int, blocks_per_seq: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct uniform anchors in each row's response region.

    lengths/prompt_lens [B] (CPU); `generator` is a CPU generator, so the draw does not
    depend on the device. Returns anchor_pos [B, nb] int64 (ascending within the valid
    ones) and block_valid [B, nb] bool, nb = min(blocks_per_seq, width).
    """
    pos = torch.arange(width)
    allowed = (pos >= prompt_lens[:, None]) & (pos <= lengths[:, None] - 2)  # [B, T]
    scores = torch.rand((len(lengths), width), generator=generator).masked_fill(~allowed, -1.0)
    num_blocks = min(blocks_per_seq, width)
    top, idx = scores.topk(num_blocks, dim=1)
    valid = top >= 0
    # Valid anchors first, ascending; invalid slots point at position 0.
    idx = torch.where(valid, idx, width + idx)
    idx, order = idx.sort(dim=1)
    valid = valid.gather(1, order)
    return torch.where(valid, idx, 0), valid


@dataclass
class LossOutput:
    loss: torch.Tensor
    # Detached scalar tensors (no host sync until the trainer logs them).
    metrics: dict[str, torch.Tensor]
    # [gamma] proposer top-1 accuracy per depth (NaN where a depth had no label)
    top1_by_depth: torch.Tensor
    # label positions scored in this batch
    num_tokens: torch.Tensor


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp(min=1e-12)


def drafter_loss(drafter: UBTreeDrafter, target: FrozenTarget, batch: Batch, cfg: LossConfig,
                 generator: torch.Generator) -> LossOutput:
    """The training objective of one batch (module docstring). `batch` is on the drafter's device."""
    input_ids, lengths = batch.input_ids, batch.lengths
    dev = input_ids.device
    num_seqs, width = input_ids.shape
    gamma, top_k = drafter.cfg.block_size, drafter.cfg.top_k

    positions = torch.arange(width, device=dev).expand(num_seqs, -1)  # [B, T]
    valid_tok = positions < lengths[:, None]
    features, final_hidden = target.forward(input_ids, valid_tok)  # [B, T, F], [B, T, H]

    anchor_pos, block_valid = sample_anchors(lengths.cpu(), batch.prompt_lens.cpu(), width, cfg.blocks_per_seq,
                                             generator)
    anchor_pos, block_valid = anchor_pos.to(dev), block_valid.to(dev)  # [B, nb]
    num_blocks = anchor_pos.shape[1]
    anchor = input_ids.gather(1, anchor_pos)
    hidden = drafter.block_hidden(anchor, anchor_pos, features, positions, valid_tok)  # [B, nb, gamma, H]

    depth = torch.arange(1, gamma + 1, device=dev)
    label_pos = anchor_pos[:, :, None] + depth  # [B, nb, gamma]
    row_valid = block_valid[:, :, None] & (label_pos < lengths[:, None, None])
    label_pos = label_pos.clamp(max=width - 1)
    labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)
    prev = input_ids.gather(1, (label_pos - 1).flatten(1)).view_as(label_pos)  # x_{a+d-1}

    num_rows = num_seqs * num_blocks
    hidden = hidden.reshape(num_rows, gamma, -1)
    rows = row_valid.flatten().nonzero().squeeze(1)  # [M] flat (block, depth) rows with a label
    row_depth = rows % gamma  # 0-based depth
    row_labels = labels.flatten()[rows]

    # Proposer (full-vocabulary log-probs only at labelled rows).
    logp = torch.log_softmax(drafter.proposer_logits(hidden.flatten(0, 1)[rows]), dim=-1)  # [M, V] f32
    ce_rows = -logp.gather(1, row_labels[:, None]).squeeze(1)
    cand = logp.detach().topk(top_k, dim=-1).indices  # [M, K] the selection is not differentiated
    cand_logp = logp.gather(1, cand)  # [M, K] with grad

    # Selector over the K candidates, true predecessor (P = 1), every depth of every block.
    cand_full = torch.zeros((num_rows * gamma, top_k), dtype=torch.long, device=dev).index_copy(0, rows, cand)
    logp_full = torch.zeros((num_rows * gamma, top_k), dtype=cand_logp.dtype, device=dev).index_put(
        (rows,), cand_logp)
    log_q = drafter.selector.edge_logprobs(prev.reshape(num_rows, gamma, 1), cand_full.view(num_rows, gamma, top_k),
                                           logp_full.view(num_rows, gamma, top_k), hidden, drafter.embed_weight)
    log_q = log_q.reshape(num_rows * gamma, top_k)[rows]  # [M, K]

    # Target at position a + d - 1, renormalized over the candidates.
    seq_of_row = rows // (num_blocks * gamma)
    target_rows = final_hidden[seq_of_row, label_pos.flatten()[rows] - 1]  # [M, H]
    log_p = torch.log_softmax(target.candidate_logits(target_rows, cand), dim=-1)  # [M, K]
    kl_rows = (log_p.exp() * (log_p - log_q)).sum(-1)
    hit = cand == row_labels[:, None]  # [M, K]
    in_topk = hit.any(-1)
    hard_rows = -(log_q * hit).sum(-1)

    weights = torch.ones_like(ce_rows) if cfg.loss_decay is None else torch.exp(-row_depth.float() / cfg.loss_decay)
    ce = _weighted_mean(ce_rows, weights)
    kl = _weighted_mean(kl_rows, weights)
    hard = _weighted_mean(hard_rows, weights * in_topk)
    selector = kl if cfg.selector_loss == "kl" else hard
    loss = selector + cfg.beta * ce

    with torch.no_grad():
        correct = (logp.argmax(-1) == row_labels).float()
        count = torch.zeros(gamma, device=dev).index_add_(0, row_depth, torch.ones_like(correct))
        top1_by_depth = torch.zeros(gamma, device=dev).index_add_(0, row_depth, correct) / count
        sel_correct = (cand.gather(1, log_q.argmax(-1, keepdim=True)).squeeze(1) == row_labels).float()
        # Greedy chain acceptance proxy: 1 + leading correct top-1 depths, over full blocks.
        correct_full = torch.zeros(num_rows * gamma, device=dev).index_copy(0, rows, correct).view(num_rows, gamma)
        full = row_valid.view(num_rows, gamma).all(-1)
        leading = correct_full.cumprod(dim=1).sum(1)
        metrics = {
            "loss": loss.detach(), "ce": ce.detach(), "kl": kl.detach(), "hard_ce": hard.detach(),
            "top1": correct.mean(), "topk_hit": in_topk.float().mean(), "selector_top1": sel_correct.mean(),
            "chain_tau": 1.0 + (leading * full).sum() / full.sum().clamp(min=1),
        }
    return LossOutput(loss, metrics, top1_by_depth, torch.tensor(rows.numel()))


def make_generator(seed: int, step: int) -> torch.Generator:
    """The anchor-sampling generator of one step: a function of (seed, step) only."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))

