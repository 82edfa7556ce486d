"""Drafter architecture and its binding to one target model.

The on-disk form is a HF-style `config.json`: Qwen3 fields for the DFlash backbone (so
vLLM's `DFlashQwen3ForCausalLM` can read the proposer part) plus a `dflash_config` block
and a `ubtree` block with everything UBTree adds (target identity, gamma, K, selector rank).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True)
class DrafterConfig:
    """Shape of the unigram proposer (DFlash backbone) and the bigram selector."""

    # Identity and shape of the target this drafter serves.
    target_name: str
    vocab_size: int
    hidden_size: int
    target_num_layers: int
    # Target layers whose outputs (HF hidden_states[id + 1]) condition the drafter.
    target_layer_ids: tuple[int, ...]
    # Block drafting: gamma draft depths; the query block is [anchor, mask * gamma].
    block_size: int = 16
    mask_token_id: int = 0
    top_k: int = 64
    # Backbone (Qwen3-style decoder layers, non-causal inside the block).
    num_layers: int = 2
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    intermediate_size: int = 1536
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    # Bigram selector: codebook rank r and the hidden width of its two MLPs.
    selector_rank: int = 64
    selector_hidden: int = 576
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ValueError(f"block_size (gamma) must be >= 2, got {self.block_size}")
        if not 1 <= self.top_k <= self.vocab_size:
            raise ValueError(f"top_k must be in [1, {self.vocab_size}] (the vocabulary size), got {self.top_k}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.target_num_layers - 1]
        if bad:
            raise ValueError(
                f"target_layer_ids must be in [0, {self.target_num_layers - 2}] (the target's layers except the "
                f"last, whose HF hidden state is post-norm), got {list(self.target_layer_ids)}"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"mask_token_id must be in [0, {self.vocab_size - 1}], got {self.mask_token_id}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def num_features(self) -> int:
        """Width of the concatenated target features fed to `fc`."""
        return self.hidden_size * len(self.target_layer_ids)

    def check_target(self, *, vocab_size: int, hidden_size: int, num_layers: int) -> None:
        """Raise ValueError naming each field where the target does not match this drafter."""
        problems = []
        if vocab_size != self.vocab_size:
            problems.append(f"vocab_size: drafter {self.vocab_size}, target {vocab_size}")
        if hidden_size != self.hidden_size:
            problems.append(f"hidden_size: drafter {self.hidden_size}, target {hidden_size}")
        if num_layers != self.target_num_layers:
            problems.append(f"num_hidden_layers: drafter expects {self.target_num_layers}, target has {num_layers}")
        if problems:
            raise ValueError("drafter does not match the target: " + "; ".join(problems))

    def check_hf_target(self, hf_config: Any) -> None:
        text = getattr(hf_config, "get_text_config", lambda: hf_config)()
        self.check_target(vocab_size=text.vocab_size, hidden_size=text.hidden_size,
                          num_layers=text.num_hidden_layers)

    # ---- on-disk form -------------------------------------------------------------------
    def to_hf_dict(self) -> dict[str, Any]:
        return {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "block_size": self.block_size + 1,
            "dflash_config": {"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
            "ubtree": {
                "target": self.target_name,
                "target_num_layers": self.target_num_layers,
                "block_size": self.block_size,
                "top_k": self.top_k,
                "selector_rank": self.selector_rank,
                "selector_hidden": self.selector_hidden,
                **self.extra,
            },
        }

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        if "ubtree" not in d or "dflash_config" not in d:
            raise ValueError("not a UBTree drafter config: config.json needs 'ubtree' and 'dflash_config' blocks")
        u = dict(d["ubtree"])
        known = {"target", "target_num_layers", "block_size", "top_k", "selector_rank", "selector_hidden"}
        return cls(
            target_name=u["target"],
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            target_num_layers=u["target_num_layers"],
            target_layer_ids=tuple(d["dflash_config"]["target_layer_ids"]),
            block_size=u["block_size"],
            mask_token_id=d["dflash_config"]["mask_token_id"],
            top_k=u["top_k"],
            num_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"],
            num_key_value_heads=d["num_key_value_heads"],
            head_dim=d["head_dim"],
            intermediate_size=d["intermediate_size"],
            rms_norm_eps=d["rms_norm_eps"],
            rope_theta=d["rope_theta"],
            max_position_embeddings=d["max_position_embeddings"],
            selector_rank=u["selector_rank"],
            selector_hidden=u["selector_hidden"],
            extra={k: v for k, v in u.items() if k not in known},
        )

    def save(self, directory: str | Path) -> None:
        path = Path(directory) / CONFIG_FILE
        path.write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> "DrafterConfig":
        path = Path(directory) / CONFIG_FILE
        if not path.is_file():
            raise FileNotFoundError(f"drafter folder {directory} has no {CONFIG_FILE}")
        return cls.from_hf_dict(json.loads(path.read_text()))

    @classmethod
    def for_target(cls, hf_config: Any, target_name: str, **overrides: Any) -> "DrafterConfig":
        """A drafter shaped like the target: same head geometry, layers spread over its depth."""
        text = getattr(hf_config, "get_text_config", lambda: hf_config)()
        n = text.num_hidden_layers
        # Up to 5 evenly spaced taps over layers 1 .. n-2 (never the post-norm last layer).
        allowed = list(range(1, n - 1)) or [0]
        num_taps = min(5, len(allowed))
        layer_ids = tuple(sorted({allowed[round(i * (len(allowed) - 1) / max(1, num_taps - 1))] for i in range(num_taps)}))
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        values: dict[str, Any] = dict(
            target_name=target_name,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            target_num_layers=n,
            target_layer_ids=layer_ids,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=text.num_key_value_heads,
            head_dim=head_dim,
            intermediate_size=text.intermediate_size,
            # NemotronH (Mamba2 hybrids) names it layer_norm_epsilon
            rms_norm_eps=float(getattr(text, "rms_norm_eps", None) or getattr(text, "layer_norm_epsilon", 1e-6)),
            rope_theta=float(getattr(text, "rope_theta", None) or (getattr(text, "rope_parameters", None) or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=text.max_position_embeddings,
            selector_hidden=text.hidden_size,
        )
        values.update(overrides)
        if "top_k" not in overrides:
            values["top_k"] = min(values.get("top_k", 64), text.vocab_size)
        return cls(**values)

    def replace(self, **changes: Any) -> "DrafterConfig":
        return dataclasses.replace(self, **changes)
