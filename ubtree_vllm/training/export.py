"""Exported drafter folders: the UBTree drafter with its training provenance, and its round-trip check.

`export_drafter` writes exactly what `drafter/io.py:load_drafter` (and the plugin) reads:
`config.json` (Qwen3 backbone fields + `dflash_config` + `ubtree` block) and
`model.safetensors` (bf16 by default), plus `ubtree_meta.json` with training provenance.
The proposer-only copy for vLLM's built-in `dflash` method is `drafter/io.py:export_dflash_proposer`
(serving uses it, and serving never imports training).
"""
from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import torch
from ubtree_vllm import __version__
from ubtree_vllm.drafter.io import META_FILE, drafter_state_dict, folded_state_dict, load_drafter, save_drafter
from ubtree_vllm.drafter.proposer import UBTreeDrafter


def export_drafter(drafter: UBTreeDrafter, directory: str | Path, provenance: dict[str, Any],
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write the drafter folder and `ubtree_meta.json` (provenance: data, objective, steps...)."""
    path = save_drafter(drafter, directory, dtype)
    meta = {
        "ubtree_vllm": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "dtype": str(dtype).removeprefix("torch."),
        "num_parameters": sum(p.numel() for p in drafter.parameters()),
        **provenance,
    }
    (path / META_FILE).write_text(json.dumps(meta, indent=2, default=str) + "\n")
    return path


def _rounded_copy(drafter: UBTreeDrafter, dtype: torch.dtype) -> UBTreeDrafter:
    """A float32 CPU drafter whose weights are `drafter`'s (feature scale folded) rounded to `dtype`."""
    copy = UBTreeDrafter(drafter.cfg)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).float().cpu()
             for k, v in folded_state_dict(drafter).items()}
    copy.load_state_dict(state)
    return copy


@torch.no_grad()
def check_round_trip(drafter: UBTreeDrafter, directory: str | Path, dtype: torch.dtype = torch.bfloat16,
                     num_ctx: int = 12, seed: int = 0) -> dict[str, float]:
    """Reload `directory` and require bit-identical outputs to the in-memory drafter.

    The in-memory drafter (bound to its target) is rounded to the export `dtype` first, so
    the check tests the file format, not bf16 rounding. Both run in float32 on the CPU on
    the same random context; proposer logits [1, gamma, V] and the selector's tree edge
    log-probs (root [1, K] and transitions [1, gamma - 1, K, K]) must be equal.
    Raises AssertionError naming the first mismatch; returns the compared magnitudes.
    """
    cfg = drafter.cfg
    embed = drafter.embed_weight.detach().float().cpu()
    head = drafter.lm_head_weight.detach().float().cpu()
    reference = _rounded_copy(drafter, dtype)
    loaded = load_drafter(directory, device="cpu", dtype=torch.float32)
    if loaded.cfg.to_hf_dict() != cfg.to_hf_dict():
        raise AssertionError(f"{directory}: config.json does not reproduce the drafter config")
    g = torch.Generator().manual_seed(seed)
    features = torch.randn((1, num_ctx, cfg.num_features), generator=g)
    positions = torch.arange(num_ctx)[None]
    valid = torch.ones((1, num_ctx), dtype=torch.bool)
    anchor = torch.randint(0, cfg.vocab_size, (1,), generator=g)
    anchor_pos = torch.tensor([num_ctx])
    results = []
    for model in (reference, loaded):
        model.bind_target(embed, head)
        model.eval()
        cands = model.propose(anchor, anchor_pos, features, positions, valid, cfg.top_k)
        logits = model.proposer_logits(cands.hidden)
        root, trans = model.selector.score_tree_edges(anchor, cands.tokens, cands.logp, cands.hidden, embed)
        results.append({"proposer_logits": logits, "root_edge_logp": root, "edge_logp": trans})
    for name, expected in results[0].items():
        if not torch.equal(expected, results[1][name]):
            diff = (expected - results[1][name]).abs().max().item()
            raise AssertionError(f"round trip of {directory}: {name} differs after reload (max |diff| {diff})")
    return {name: float(t.abs().max()) for name, t in results[0].items()}


def state_dict_nbytes(drafter: UBTreeDrafter, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of the exported weights at `dtype`."""
    return sum(t.numel() * t.element_size() for t in drafter_state_dict(drafter, dtype).values())
