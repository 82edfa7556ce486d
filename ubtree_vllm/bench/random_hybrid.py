"""`ubtree bench random-hybrid`: a random-weight hybrid target and an untrained drafter, to measure forking.

Issue 17 asks for the round time and speedup of a hybrid target under tree verification with weights that make the
figure show the cost of forking recurrent states per node, not draft quality. This writes such a pair:

* ``<out>/random-<family>``: a random bf16 hybrid in a family's HF class, shaped like a small member of it
  (:data:`SHAPES`), with the default target's tokenizer and chat template (so ``bench e2e`` can use the chat
  datasets); random models' greedy continuations soon repeat, which the prompt-lookup branch (method
  ``ubtree-lookup``) accepts, so long accepted paths and their state commits are exercised too;
* ``<out>/random-<family>-drafter``: an untrained one-layer drafter for it (gamma 16, K 16).

Issue 17 also asks for vLLM's chain speculation on the same model: the Qwen3-Next config declares one MTP layer,
which ``bench e2e --methods ...,mtp --load-format dummy`` runs (every engine of that invocation on vLLM's random
weights, which the records' target names; the saved weights have no MTP tensors).

Run ``ubtree bench e2e --target <out>/random-<family> --drafter <out>/random-<family>-drafter`` with
``UBTREE_CUDA_HYBRIDS=1`` on CUDA; ``bench e2e`` turns prefix caching off for every engine of a recurrent hybrid
(UBTree refuses it there; ar and ngram get the same setting).
"""
from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

# family -> (transformers config / model class names, config fields); hidden 1024, bf16
SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Qwen3-Next: three Gated DeltaNet layers per full-attention layer, MoE MLPs; one MTP layer in the config (the HF
    # class saves no weights for it: `bench e2e --methods mtp` runs it with --load-format dummy)
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(mtp_num_hidden_layers=1,
        hidden_size=1024, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
        + ["full_attention"], linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=512, shared_expert_intermediate_size=512)),
    # NemotronH: Mamba2 and attention layers, each followed by an MLP layer
    "nemotron-h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        hidden_size=1024, num_hidden_layers=8, hybrid_override_pattern="M-M*-M-", mamba_num_heads=16,
        mamba_head_dim=64, ssm_state_size=128, n_groups=1, conv_kernel=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, intermediate_size=2048)),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def save_random_hybrid(out: Path, family: str, tokenizer_from: Path, seed: int = 0) -> tuple[Path, Path]:
    """(target, drafter) folders under ``out`` for ``family`` (a key of :data:`SHAPES`); the target's vocabulary is
    the tokenizer's."""
    import torch
    import transformers
    from transformers import AutoConfig

    from ubtree_vllm.drafter.config import DrafterConfig
    from ubtree_vllm.drafter.io import save_drafter
    from ubtree_vllm.drafter.proposer import UBTreeDrafter

    if family not in SHAPES:
        raise ValueError(f"family must be one of {sorted(SHAPES)}, got {family!r}")
    config_name, model_name, fields = SHAPES[family]
    tokenizer_config = AutoConfig.from_pretrained(tokenizer_from)
    target, drafter = out / f"random-{family}", out / f"random-{family}-drafter"
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(
        vocab_size=tokenizer_config.vocab_size, max_position_embeddings=4096, tie_word_embeddings=False,
        initializer_range=0.1, bos_token_id=tokenizer_config.bos_token_id, eos_token_id=tokenizer_config.eos_token_id,
        **fields)
    getattr(transformers, model_name)(config).to(torch.bfloat16).save_pretrained(target)
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_from) / name).is_file():
            shutil.copy(Path(tokenizer_from) / name, target / name)
    drafter_config = DrafterConfig.for_target(AutoConfig.from_pretrained(target), target.name, block_size=16,
                                              top_k=16, num_layers=1, selector_rank=16)
    save_drafter(UBTreeDrafter(drafter_config), drafter, dtype=torch.bfloat16)
    return target, drafter


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="folder to write random-<family> and random-<family>-drafter into")
    parser.add_argument("--family", default="qwen3-next", choices=sorted(SHAPES), help="hybrid family")
    parser.add_argument("--tokenizer-from", default="default",
                        help="folder whose tokenizer and chat template the target gets ('default': the default "
                             "target's)")
    parser.add_argument("--seed", type=int, default=0)


def run_cli(args: argparse.Namespace) -> int:
    from ubtree_vllm.training.data import resolve_target_path

    target, drafter = save_random_hybrid(Path(args.out), args.family, resolve_target_path(args.tokenizer_from),
                                         args.seed)
    print(f"target {target}\ndrafter {drafter}")
    return 0
