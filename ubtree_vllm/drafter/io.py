"""Drafter folders: `config.json` (drafter/config.py) + `model.safetensors`.

Tensor names: the proposer's weights use vLLM's DFlash names at the top level (`fc.weight`,
`hidden_norm.weight`, `layers.N...`, `norm.weight`); the selector's live under `selector.`.
The target's embedding and LM head are never stored.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ubtree_vllm.drafter.config import WEIGHTS_FILE, DrafterConfig
from ubtree_vllm.drafter.proposer import UBTreeDrafter

_BACKBONE = "backbone."


def drafter_state_dict(drafter: UBTreeDrafter, dtype: torch.dtype | None = torch.bfloat16) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in drafter.state_dict().items():
        key = name[len(_BACKBONE):] if name.startswith(_BACKBONE) else name
        t = tensor.detach()
        out[key] = (t.to(dtype) if dtype is not None and t.is_floating_point() else t).contiguous().cpu()
    return out


def save_drafter(drafter: UBTreeDrafter, directory: str | Path, dtype: torch.dtype | None = torch.bfloat16) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    drafter.cfg.save(path)
    save_file(drafter_state_dict(drafter, dtype), str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    return path


def load_drafter(directory: str | Path, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> UBTreeDrafter:
    """Load a drafter folder; raises FileNotFoundError / ValueError naming what is wrong."""
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"drafter folder not found: {path}")
    cfg = DrafterConfig.load(path)
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"drafter folder {path} has no {WEIGHTS_FILE}")
    tensors = load_file(str(weights))
    state = {(k if k.startswith("selector.") else _BACKBONE + k): v for k, v in tensors.items()}
    drafter = UBTreeDrafter(cfg)
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"drafter weights in {weights} do not match its config: missing {sorted(missing)}, "
                         f"unexpected {sorted(unexpected)}")
    return drafter.to(device=device, dtype=dtype).eval()
