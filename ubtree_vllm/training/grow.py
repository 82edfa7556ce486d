"""Growing a trained drafter deeper without losing what it learnt.

A new backbone layer starts as a copy of the last layer with its two residual outputs
(`self_attn.o_proj`, `mlp.down_proj`) zeroed: the layer adds nothing to the residual stream, so
the grown drafter computes the same function as the one it grew from, and training then moves
the new layer away from the identity (the zeroed outputs get gradients at once, the rest after).
This lets a drafter trained over many slices gain capacity without a fresh start.
"""
from __future__ import annotations

import dataclasses

import torch

from ubtree_vllm.drafter.proposer import UBTreeDrafter


def grow_layers(drafter: UBTreeDrafter, extra: int) -> UBTreeDrafter:
    """A drafter with `extra` more backbone layers, equal in function to `drafter` (module docstring)."""
    if extra < 1:
        raise ValueError(f"grow_layers must be >= 1, got {extra}")
    old = drafter.cfg.num_layers
    grown = UBTreeDrafter(dataclasses.replace(drafter.cfg, num_layers=old + extra))
    grown.to(device=drafter.backbone.fc.weight.device, dtype=drafter.backbone.fc.weight.dtype)
    missing, unexpected = grown.load_state_dict(drafter.state_dict(), strict=False)
    new_prefixes = tuple(f"backbone.layers.{i}." for i in range(old, old + extra))
    if unexpected or any(not k.startswith(new_prefixes) for k in missing):
        raise ValueError(f"cannot grow the drafter: unexpected {sorted(unexpected)}, missing {sorted(missing)}")
    grown.backbone.feature_scale.copy_(drafter.backbone.feature_scale)
    last = drafter.backbone.layers[old - 1].state_dict()
    with torch.no_grad():
        for layer in grown.backbone.layers[old:]:
            layer.load_state_dict(last)
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    if drafter._embed_weight is not None and drafter._lm_head_weight is not None:
        grown.bind_target(drafter._embed_weight, drafter._lm_head_weight)
    grown.train(drafter.training)
    return grown
