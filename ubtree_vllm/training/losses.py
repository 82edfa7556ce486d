"""Tree-native drafter objective: the proposer's own distillation loss at full weight, and the
selector's renormalized KL over the proposer's top-K.

Per batch of right-padded sequences (prompt + target-generated response):

1. Target pass (frozen, no grad): features of every position and the final hidden state.
2. Anchors: up to `blocks_per_seq` distinct positions a per sequence, uniform over the
   response region `prompt_len <= a <= len - 2` (so every block has >= 1 label). Block a is
   `[x_a, mask * gamma]`; it sees the target features of positions < a (the anchor is not
   yet processed by the target at inference, see drafter/proposer.py) and predicts
   `x_{a+1} .. x_{a+gamma}`. Depths past the sequence end are masked. All blocks of a
   sequence run in one drafter forward whose attention is split into a context part and an
   in-block part (drafter/model.py), so hundreds of anchors per sequence cost linearly.
3. Proposer (training/head_loss.py, chunked through the target's LM head):
   `proposer_kl` * KL(target's teacher-forced distribution at a+d-1 || proposer at depth d)
   + `beta` * CE on the label x_{a+d}. The KL is the low-variance signal on T_train = 1
   samples (the target's own distribution, not one draw of it).
4. Selector: at depth d the K candidates are the top-K of the proposer log-probs, scored by
   `selector.edge_logprobs` with the TRUE previous token x_{a+d-1} (x_a for d = 1) as the
   single predecessor: q_d(. | x_{a+d-1}) over the K candidates. The teacher p_d is the
   target's distribution at a+d-1 renormalized over the same K candidates.
   Loss `kl`: KL(p_d || q_d); `hard_ce`: -log q_d(x_{a+d}) at depths whose label is among
   the K. With `detach_selector` (the recipe) the selector sees the proposer's outputs
   detached, so it learns to reorder a proposer that trains on its own objective; without
   it (the joint ablation) its loss also flows into the proposer.
5. total = proposer terms + selector loss, each a weighted mean over labelled depths with
   weight exp(-(d - 1) / loss_decay) (DFlash's position decay) or 1 when loss_decay is None.

The original joint recipe is `proposer_kl=0, beta=0.1, detach_selector=False`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function

from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.training.head_loss import DEFAULT_CHUNK_ROWS, head_loss
from ubtree_vllm.training.target import FrozenTarget

SELECTOR_LOSSES = ("kl", "hard_ce")


@dataclass(frozen=True)
class LossConfig:
    selector_loss: str = "kl"
    # Weight of the proposer's hard-label CE.
    beta: float = 0.1
    # DFlash-style position decay constant (e.g. 7); None weighs all depths equally.
    loss_decay: float | None = 7.0
    blocks_per_seq: int = 256
    # Weight of the proposer's KL to the target's teacher-forced distribution.
    proposer_kl: float = 1.0
    # The selector trains on detached proposer outputs (False: the joint ablation).
    detach_selector: bool = True
    # Rows per LM-head chunk (memory: three [rows, vocab] buffers in the head's dtype on the fused
    # CUDA path, about seven float32 ones on the torch path).
    head_chunk_rows: int = DEFAULT_CHUNK_ROWS

    def __post_init__(self) -> None:
        if self.selector_loss not in SELECTOR_LOSSES:
            raise ValueError(f"selector_loss must be one of {SELECTOR_LOSSES}, got {self.selector_loss!r}")
        for name in ("beta", "proposer_kl"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.head_chunk_rows < 1:
            raise ValueError(f"head_chunk_rows must be >= 1, got {self.head_chunk_rows}")
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
    # CPU copies of lengths / prompt_lens (the anchor draw reads them without a device sync)
    host_lengths: torch.Tensor | None = None
    host_prompt_lens: torch.Tensor | None = None

    def host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(lengths, prompt_lens) on the CPU: the host copies, or (a sync) the tensors themselves."""
        return (self.host_lengths if self.host_lengths is not None else self.lengths.cpu(),
                self.host_prompt_lens if self.host_prompt_lens is not None else self.prompt_lens.cpu())

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device, non_blocking=True), self.lengths.to(device, non_blocking=True),
                     self.prompt_lens.to(device, non_blocking=True), *self.host())


def collate(samples: Sequence[tuple[torch.Tensor, int]], max_seq_len: int) -> Batch:
    """Samples (ids [T_i], prompt_len) -> Batch, each truncated to `max_seq_len` tokens."""
    lengths = [min(len(ids), max_seq_len) for ids, _ in samples]
    input_ids = torch.zeros((len(samples), max(lengths)), dtype=torch.long)
    for row, ((ids, _), n) in enumerate(zip(samples, lengths)):
        input_ids[row, :n] = ids[:n]
    host_lengths = torch.tensor(lengths, dtype=torch.long)
    host_prompt_lens = torch.tensor([p for _, p in samples], dtype=torch.long)
    return Batch(input_ids.pin_memory() if torch.cuda.is_available() else input_ids, host_lengths,
                 host_prompt_lens, host_lengths, host_prompt_lens)


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
    # label positions scored in this batch (a device scalar: reading it syncs)
    num_tokens: torch.Tensor
    # the target's (features [B, T, F], final hidden [B, T, H]) of this batch, no grad
    target_outputs: tuple[torch.Tensor, torch.Tensor]


def _weighted_mean(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return (values * weights).sum() / weights.sum().clamp(min=1e-12)


def drafter_loss(drafter: UBTreeDrafter, target: FrozenTarget, batch: Batch, cfg: LossConfig,
                 generator: torch.Generator, fused_head: bool | None = None,
                 target_outputs: tuple[torch.Tensor, torch.Tensor] | None = None) -> LossOutput:
    """The training objective of one batch (module docstring). `batch` is on the drafter's device;
    `fused_head` picks the LM-head loss path (training/head_loss.py; default: fused on CUDA);
    `target_outputs` (features [B, T, F], final hidden [B, T, H], e.g. from training/target_cache.py)
    stand in for the target forward of this batch."""
    input_ids, lengths = batch.input_ids, batch.lengths
    dev = input_ids.device
    num_seqs, width = input_ids.shape
    gamma, top_k = drafter.cfg.block_size, drafter.cfg.top_k

    positions = torch.arange(width, device=dev).expand(num_seqs, -1)  # [B, T]
    valid_tok = positions < lengths[:, None]
    with record_function("loss.target_forward"):
        if target_outputs is None:
            features, final_hidden = target.forward(input_ids, valid_tok)  # [B, T, F], [B, T, H]
        else:
            features, final_hidden = target_outputs

    anchor_pos, block_valid = sample_anchors(*batch.host(), width, cfg.blocks_per_seq, generator)
    anchor_pos, block_valid = anchor_pos.to(dev), block_valid.to(dev)  # [B, nb]
    num_blocks = anchor_pos.shape[1]
    anchor = input_ids.gather(1, anchor_pos)
    with record_function("loss.drafter_blocks"):
        hidden = drafter.block_hidden(anchor, anchor_pos, features, positions, valid_tok)  # [B, nb, gamma, H]

    depth = torch.arange(1, gamma + 1, device=dev)
    label_pos = anchor_pos[:, :, None] + depth  # [B, nb, gamma]
    row_valid = block_valid[:, :, None] & (label_pos < lengths[:, None, None])
    label_pos = label_pos.clamp(max=width - 1)
    labels = input_ids.gather(1, label_pos.flatten(1)).view_as(label_pos)
    prev = input_ids.gather(1, (label_pos - 1).flatten(1)).view_as(label_pos)  # x_{a+d-1}

    # Every (block, depth) row is scored, M = B * nb * gamma (a static shape: no device -> host sync);
    # rows without a label weigh 0.
    num_rows = num_seqs * num_blocks
    hidden = hidden.reshape(num_rows, gamma, -1)
    valid = row_valid.flatten()  # [M]
    valid_f = valid.float()
    row_depth = torch.arange(gamma, device=dev).repeat(num_rows)  # [M] 0-based depth
    row_labels = labels.flatten()
    decay = torch.ones_like(valid_f) if cfg.loss_decay is None else torch.exp(-row_depth.float() / cfg.loss_decay)
    weights = decay * valid_f
    seq_of_row = torch.arange(num_seqs, device=dev).repeat_interleave(num_blocks * gamma)
    target_rows = final_hidden[seq_of_row, label_pos.flatten() - 1]  # [M, H] target at a + d - 1
    row_hidden = hidden.flatten(0, 1)  # [M, H]

    # Proposer: KL to the target + beta * CE, chunked through the LM head.
    with record_function("loss.head"):
        head = head_loss(row_hidden, drafter.lm_head_weight, target_rows, row_labels, weights, cfg.proposer_kl,
                         cfg.beta, top_k, target.softcap, cfg.head_chunk_rows, lse_grad=not cfg.detach_selector,
                         fused=fused_head if cfg.detach_selector else False)
    cand = head.cand  # [M, K] the selection is never differentiated
    if cfg.detach_selector:
        cand_logp, sel_hidden = head.cand_logp, hidden.detach()
    else:  # log q at the candidates, differentiable through the proposer (joint ablation)
        w = drafter.lm_head_weight[cand].to(row_hidden.dtype)  # [M, K, H]
        cand_logp = torch.bmm(w, row_hidden[:, :, None]).squeeze(-1).float() - head.lse[:, None]
        sel_hidden = hidden

    with record_function("loss.selector"):
        # Selector over the K candidates, true predecessor (P = 1), every depth of every block.
        log_q = drafter.selector.edge_logprobs(prev.reshape(num_rows, gamma, 1), cand.view(num_rows, gamma, top_k),
                                               cand_logp.view(num_rows, gamma, top_k), sel_hidden,
                                               drafter.embed_weight)
        log_q = log_q.reshape(num_rows * gamma, top_k)  # [M, K]

        # Target at position a + d - 1, renormalized over the candidates.
        log_p = torch.log_softmax(target.candidate_logits(target_rows, cand), dim=-1)  # [M, K]
        kl_rows = (log_p.exp() * (log_p - log_q)).sum(-1)
        hit = cand == row_labels[:, None]  # [M, K]
        in_topk = hit.any(-1)
        hard_rows = -(log_q * hit).sum(-1)

    weight_sum = weights.sum().clamp(min=1e-12)
    proposer = head.loss / weight_sum
    kl = _weighted_mean(kl_rows, weights)
    hard = _weighted_mean(hard_rows, weights * in_topk)
    selector = kl if cfg.selector_loss == "kl" else hard
    loss = proposer + selector

    with torch.no_grad():
        correct = (head.top1 == row_labels).float() * valid_f  # [M], 0 on rows without a label
        count = valid_f.view(num_rows, gamma).sum(0)
        top1_by_depth = correct.view(num_rows, gamma).sum(0) / count  # NaN where a depth had no label
        sel_correct = (cand.gather(1, log_q.argmax(-1, keepdim=True)).squeeze(1) == row_labels).float()
        # Greedy chain acceptance proxy: 1 + leading correct top-1 depths, over full blocks.
        full = row_valid.view(num_rows, gamma).all(-1)
        leading = correct.view(num_rows, gamma).cumprod(dim=1).sum(1)
        num_labels = valid_f.sum()
        metrics = {
            "loss": loss.detach(), "ce": _weighted_mean(head.ce_rows, weights), "kl": kl.detach(),
            "proposer_kl": _weighted_mean(head.kl_rows, weights), "hard_ce": hard.detach(),
            "top1": correct.sum() / num_labels, "topk_hit": (in_topk.float() * valid_f).sum() / num_labels,
            "selector_top1": (sel_correct * valid_f).sum() / num_labels,
            "chain_tau": 1.0 + (leading * full).sum() / full.sum().clamp(min=1),
        }
    return LossOutput(loss, metrics, top1_by_depth, valid.sum(), (features, final_hidden))


def make_generator(seed: int, step: int) -> torch.Generator:
    """The anchor-sampling generator of one step: a function of (seed, step) only."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))

