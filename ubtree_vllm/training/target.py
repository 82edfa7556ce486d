"""The frozen target inside training: drafter features and target logits at chosen rows.

The trainer never stores target hidden states (see training/data.py); it runs this
wrapper once per batch under `torch.no_grad()`.

Feature contract (shared with the reference decoder and vLLM's DFlash): for target layer
id i the feature is HF `hidden_states[i + 1]`, the pre-norm output of decoder layer i;
the drafter input is their concatenation over `DrafterConfig.target_layer_ids`.
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn


class FrozenTarget:
    """An HF causal LM with every parameter frozen.

    Only the base model runs (no full-vocabulary logits); target logits are computed
    afterwards for the few rows and candidate tokens the loss needs.
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]) -> None:
        model.eval().requires_grad_(False)
        self.model = model
        self.layer_ids = tuple(layer_ids)
        text = model.config.get_text_config()
        num_layers = text.num_hidden_layers
        bad = [i for i in self.layer_ids if not 0 <= i < num_layers - 1]
        if bad:
            raise ValueError(f"target_layer_ids {list(self.layer_ids)} out of range: the target has {num_layers} "
                             f"layers, so ids must be in [0, {num_layers - 2}]")
        head = model.get_output_embeddings()
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise NotImplementedError(f"target LM head {type(head).__name__} is not a bias-free nn.Linear; "
                                      f"candidate-only target logits need one")
        if getattr(text, "logit_scale", None) not in (None, 1.0):
            raise NotImplementedError("targets with a logit_scale are not supported by the trainer")
        self.head_weight = head.weight  # [V, H]
        self.softcap = getattr(text, "final_logit_softcapping", None)
        self.vocab_size = text.vocab_size

    @classmethod
    def from_pretrained(cls, path: str | Path, layer_ids: Sequence[int], device: torch.device,
                        dtype: torch.dtype) -> FrozenTarget:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
        return cls(model, layer_ids)

    @property
    def config(self):
        return self.model.config

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One causal pass over right-padded rows.

        input_ids [B, T] int64; valid [B, T] bool (False on padding).
        Returns features [B, T, len(layer_ids) * H] and the final-normed hidden state [B, T, H].
        """
        out = self.model.base_model(input_ids=input_ids, attention_mask=valid.long(), output_hidden_states=True,
                                    use_cache=False)
        features = torch.cat([out.hidden_states[i + 1] for i in self.layer_ids], dim=-1)
        return features, out.last_hidden_state

    def final_norm_weight(self) -> torch.Tensor | None:
        """[H] weight of the target's final RMSNorm (the drafter's final norm starts from it), or None."""
        norm = getattr(self.model.base_model, "norm", None)
        weight = getattr(norm, "weight", None)
        return weight.detach() if isinstance(weight, torch.Tensor) and weight.ndim == 1 else None

    @torch.no_grad()
    def feature_square_sums(self, input_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Per-channel sum of squared features over the valid positions: ([F] float64, positions)."""
        features, _ = self.forward(input_ids, valid)
        rows = features[valid].double()
        return rows.pow(2).sum(0), int(rows.shape[0])

    @torch.no_grad()
    def candidate_logits(self, final_hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Target logits of `tokens` only: final_hidden [M, H], tokens [M, K] -> [M, K] float32.

        Equal to gathering the full LM-head logits at `tokens`, at K/V of the cost.
        """
        w = self.head_weight[tokens]  # [M, K, H]
        logits = torch.bmm(w, final_hidden.to(w.dtype)[:, :, None]).squeeze(-1).float()
        if self.softcap:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits
