"""Drafter folders: `config.json` (drafter/config.py) + `model.safetensors`.

Tensor names: the proposer's weights use vLLM's DFlash names at the top level (`fc.weight`,
`hidden_norm.weight`, `layers.N...`, `norm.weight`); the selector's live under `selector.`.
The target's embedding and LM head are never stored. The backbone's feature scale (a
training-time standardisation of the target features) is folded into `fc.weight`, so a
saved folder computes the same function with scale 1.

vLLM's built-in `"method": "dflash"` (`DFlashQwen3ForCausalLM.load_weights`) prefixes
every tensor name except `lm_head*` with `model.` and hands them to `AutoWeightsLoader`,
which raises on names with no matching module, so the `selector.*` tensors of a UBTree
folder make it fail. `export_dflash_proposer` therefore writes a second folder with the
proposer tensors only (serving uses it on Model Runner V2, the bench for `dflash-chain`);
its config is the same HF dict minus the `ubtree` block. Neither folder ships an embedding
or LM head: vLLM's DFlash then shares the target's, exactly like our proposer.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ubtree_vllm.drafter.config import CONFIG_FILE, WEIGHTS_FILE, DrafterConfig
from ubtree_vllm.drafter.proposer import UBTreeDrafter

_BACKBONE = "backbone."
META_FILE = "ubtree_meta.json"
SELECTOR_PREFIX = "selector."


def folded_state_dict(drafter: UBTreeDrafter) -> dict[str, torch.Tensor]:
    """`drafter.state_dict()` with the feature scale folded into `backbone.fc.weight` [H, F]."""
    state = dict(drafter.state_dict())
    scale = drafter.backbone.feature_scale
    state["backbone.fc.weight"] = state["backbone.fc.weight"] * scale.to(state["backbone.fc.weight"].dtype)[None, :]
    return state


def drafter_state_dict(drafter: UBTreeDrafter, dtype: torch.dtype | None = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors of a drafter folder (feature scale folded, folder names, `dtype`, CPU)."""
    out = {}
    for name, tensor in folded_state_dict(drafter).items():
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


def training_totals(drafter_dir: str | Path | None) -> dict[str, int]:
    """``{"cumulative_label_rows", "cumulative_distinct_tokens"}`` behind a drafter folder, from its
    ``ubtree_meta.json`` (zeros for None or a folder without training metadata). Drafters from before the
    cumulative counts: their ``tokens_seen``, and every response token of their dataset as trained on."""
    if not drafter_dir:
        return {"cumulative_label_rows": 0, "cumulative_distinct_tokens": 0}
    meta_path = Path(drafter_dir) / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    training, data = meta.get("training", {}), meta.get("data", {})
    rows = training.get("cumulative_label_rows", training.get("tokens_seen", 0))
    distinct = training.get("cumulative_distinct_tokens", data.get("num_response_tokens", data.get("num_tokens", 0)))
    return {"cumulative_label_rows": int(rows), "cumulative_distinct_tokens": int(distinct)}


def export_dflash_proposer(drafter_dir: str | Path, out_dir: str | Path) -> Path:
    """Copy the proposer part of a UBTree drafter folder into a vLLM `dflash` folder."""
    src, dst = Path(drafter_dir), Path(out_dir)
    cfg = DrafterConfig.load(src)  # validates the source
    hf = cfg.to_hf_dict()
    hf.pop("ubtree")
    tensors = load_file(str(src / WEIGHTS_FILE))
    proposer = {k: v for k, v in tensors.items() if not k.startswith(SELECTOR_PREFIX)}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / CONFIG_FILE).write_text(json.dumps(hf, indent=2) + "\n")
    save_file(proposer, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    (dst / META_FILE).write_text(json.dumps({
        "source": str(src), "contents": "proposer (DFlash backbone) only; for vLLM speculative method 'dflash'",
        "num_speculative_tokens": cfg.block_size, "target": cfg.target_name}, indent=2) + "\n")
    return dst
