"""Tiny targets and drafters saved to disk for the vLLM tests (random or hand-built weights).

* :func:`save_tiny_llama`        -- random tiny Llama (optionally with a real tokenizer).
* :func:`save_tiny_qwen`         -- random tiny Qwen2 / Qwen3 (the other supported architectures).
* :func:`save_tiny_qwen3_next`   -- random tiny bf16 Qwen3-Next (Gated DeltaNet + full attention + MoE).
* :func:`save_tiny_falcon_h1`    -- random tiny fp32 Falcon-H1 (attention + Mamba2 in parallel).
* :func:`save_tiny_deepseek_v2`  -- random tiny fp32 DeepSeek-V2 (multi-head latent attention + MoE).
* :func:`save_tiny_deepseek_v3`  -- random tiny fp32 DeepSeek-V3 (multi-head latent attention, q LoRA).
* :func:`save_tiny_ling`         -- a tiny Ling-3.0 config (Kimi Delta Attention + MLA + MoE), weights drawn by vLLM:
  load it with ``load_format=SCALED_DUMMY_FORMAT`` (:func:`register_scaled_dummy_loader`).
* :func:`save_untrained_drafter` -- a UBTree drafter folder with random weights for a target.
* :func:`save_copy_pair`         -- a hand-built target whose greedy continuation of token t
  is perm(t), perm(perm(t)), ... and a drafter whose *weights* make it propose exactly
  that chain: it exercises the production path end to end with long acceptances.
"""
from __future__ import annotations

import shutil
import zlib
from pathlib import Path

import torch
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.io import save_drafter
from ubtree_vllm.drafter.proposer import UBTreeDrafter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def save_tiny_llama(path: Path, *, vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 4,
                    num_heads: int = 2, num_kv_heads: int = 1, init_range: float = 0.1, seed: int = 0,
                    tokenizer_from: Path | None = None, **overrides: object) -> Path:
    """A random fp32 Llama; with ``tokenizer_from`` it also gets that folder's tokenizer files."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads,
                      num_key_value_heads=num_kv_heads, max_position_embeddings=1024,
                      tie_word_embeddings=False, initializer_range=init_range, **overrides)
    LlamaForCausalLM(cfg).float().save_pretrained(path)
    if tokenizer_from is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).is_file():
                shutil.copy(Path(tokenizer_from) / name, Path(path) / name)
    return Path(path)


def save_untrained_drafter(target: Path, path: Path, *, block_size: int = 4, top_k: int = 16,
                           seed: int = 0, **overrides: object) -> Path:
    """A drafter folder for ``target`` with random weights (lossless tests, not acceptance)."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(AutoConfig.from_pretrained(target), Path(target).name, block_size=block_size,
                                   top_k=top_k, num_layers=1, selector_rank=16, **overrides)
    return save_drafter(UBTreeDrafter(cfg), path, dtype=torch.float32)


@torch.no_grad()
def save_tiny_qwen(path: Path, family: str, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """A random fp32 Qwen2 or Qwen3 (family "qwen2" / "qwen3"): hidden 64, 3 layers, head_dim 32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[family]
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                     tie_word_embeddings=False, initializer_range=0.1)
    model_cls(cfg).float().save_pretrained(path)
    return Path(path)


@torch.no_grad()
def save_tiny_qwen3_next(path: Path, *, vocab_size: int = 512, seed: int = 0, moe: bool = True,
                         linear_key_heads: int = 1) -> Path:
    """A random bf16 Qwen3-Next: hidden 64, layers linear / full / linear / full, 4 experts (top 2); when not ``moe``,
    one expert (top 1), so no routing can flip with the batch shape (vLLM 0.32's Qwen3-Next refuses a model without
    MoE layers: "No Qwen3Next layer found", H100, 2026-12-06); ``linear_key_heads`` Gated DeltaNet key heads and
    twice as many value heads (2 shards over two tensor-parallel ranks; 1, the default, does not).

    bf16 and 128-dim linear heads because vLLM's CPU GDN kernels accept nothing else."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3NextConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                          layer_types=["linear_attention", "full_attention"] * 2, linear_num_key_heads=linear_key_heads,
                          linear_num_value_heads=2 * linear_key_heads, linear_key_head_dim=128, linear_value_head_dim=128,
                          linear_conv_kernel_dim=4, num_experts=4 if moe else 1, num_experts_per_tok=2 if moe else 1,
                          moe_intermediate_size=64, shared_expert_intermediate_size=64, max_position_embeddings=1024,
                          tie_word_embeddings=False, initializer_range=0.1)
    Qwen3NextForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return Path(path)


def save_tiny_nemotron_h(path: Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """A random bf16 NemotronH (Mamba2 hybrid): hidden 256, layers mamba / mlp / attention / mlp ("M-*-"),
    8 Mamba heads of 64, state size 64, one group, conv width 4, fp32 SSM states (the HF default)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    cfg = NemotronHConfig(vocab_size=vocab_size, hidden_size=256, num_hidden_layers=4, hybrid_override_pattern="M-*-",
                          mamba_num_heads=8, mamba_head_dim=64, ssm_state_size=64, n_groups=1, conv_kernel=4,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                          max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.1)
    NemotronHForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path)
    return Path(path)


@torch.no_grad()
def save_tiny_deepseek_v2(path: Path, *, vocab_size: int = 512, seed: int = 0, nope_dim: int = 32,
                          v_dim: int = 32, moe: bool = True) -> Path:
    """A random fp32 DeepSeek-V2 (multi-head latent attention): hidden 128, 3 layers (dense MLPs but the last, a
    4-expert MoE; all dense when not ``moe``), 2 heads, no q LoRA, kv_lora_rank 512 + RoPE 64 (the CPU MLA kernel's
    only latent width), nope / v head dims ``nope_dim`` / ``v_dim`` (32; the H200 tests pass 128, the only ones
    vLLM's MLA prefill takes there)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=None,
                           kv_lora_rank=512, qk_nope_head_dim=nope_dim, qk_rope_head_dim=64, v_head_dim=v_dim,
                           first_k_dense_replace=2 if moe else 3, n_routed_experts=4, num_experts_per_tok=2,
                           n_shared_experts=1, n_group=1, topk_group=1,
                           max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.1,
                           rope_scaling=None)
    DeepseekV2ForCausalLM(cfg).float().save_pretrained(path)
    return Path(path)


@torch.no_grad()
def save_tiny_deepseek_v3(path: Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """A random fp32 DeepSeek-V3: as :func:`save_tiny_deepseek_v2` but with a q LoRA (rank 64) and dense MLPs (a
    tiny HF DeepSeek-V3 MoE saves its router bias under a name vLLM's loader does not map)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV3Config(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=64,
                           kv_lora_rank=512, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                           first_k_dense_replace=3, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                           n_group=2, topk_group=1, max_position_embeddings=1024, tie_word_embeddings=False,
                           initializer_range=0.1, rope_scaling=None)
    DeepseekV3ForCausalLM(cfg).float().save_pretrained(path)
    return Path(path)


def save_tiny_falcon_h1(path: Path, *, vocab_size: int = 512, seed: int = 0) -> Path:
    """A random fp32 Falcon-H1 (attention and Mamba2 side by side in every layer): hidden 128, 3 layers, 2 attention
    heads of 64 (1 KV head), 4 Mamba heads of 64, state size 16, one group, conv width 4."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    torch.manual_seed(seed)
    cfg = FalconH1Config(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=3, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, intermediate_size=256, mamba_d_ssm=256, mamba_n_heads=4,
                         mamba_d_head=64, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
                         max_position_embeddings=1024, tie_word_embeddings=False, initializer_range=0.1)
    FalconH1ForCausalLM(cfg).float().save_pretrained(path)
    return Path(path)


def save_tiny_ling(path: Path, *, vocab_size: int = 512) -> Path:
    """A tiny Ling-3.0 (``BailingMoeV3ForCausalLM``: Kimi Delta Attention and MLA layers alternating, MoE), config only:
    vLLM has no HF modeling class to write a checkpoint from, so its engines draw the weights themselves with
    ``load_format=SCALED_DUMMY_FORMAT`` (seeded: every engine of a test gets the same). Hidden 128, 4 layers
    (KDA / MLA twice), 2 heads of 64 (KDA), MLA kv_lora_rank 512 + RoPE 64 (FlashAttention MLA's latent width) and
    nope / v head dims 128 (the only ones vLLM's MLA prefill takes on the H200), 4 experts (top 2).
    Registers its config class (model type ``bailing_hybrid``) with transformers' AutoConfig in this process."""
    from vllm.transformers_utils.configs.bailing_moe_v3_vl import BailingMoeV3TextConfig

    register_ling_config()
    BailingMoeV3TextConfig(
        vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, num_experts=4, num_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=64, first_k_dense_replace=1, layer_group_size=2, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, no_kda_lora=True,
        kda_safe_gate=True, kda_lower_bound=-5.0, short_conv_kernel_size=4, pad_token_id=0,
        eos_token_id=1).save_pretrained(path)
    return Path(path)


# vLLM's "dummy" load format draws every weight, norm gains included, from U(-1e-3, 1e-3): each layer then adds
# ~1e-6 of the residual stream, so the logits are a function of the last token alone (a bigram map), and a test on
# such a model says nothing about the layers it means to check. This format draws weights a model computes with.
SCALED_DUMMY_FORMAT = "ubtree_test_scaled_dummy"


@torch.no_grad()
def scale_dummy_weights(model: torch.nn.Module, seed: int = 1234) -> None:
    """In place, seeded by each parameter's name (so every engine of a process draws the same): matrices (and
    stacked expert or conv weights) N(0, 1/fan_in) over their last dimension, norm gains 1, biases 0; other
    vectors (decay logs, dt biases) keep vLLM's dummy values."""
    for name, param in model.named_parameters():
        if not torch.is_floating_point(param):
            continue
        if param.dim() >= 2:
            generator = torch.Generator(device=param.device)
            generator.manual_seed(seed + zlib.crc32(name.encode()))
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=generator)
        elif "norm" in name:
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()


def register_scaled_dummy_loader() -> None:
    """vLLM's dummy loader followed by :func:`scale_dummy_weights`, as load format :data:`SCALED_DUMMY_FORMAT`
    (registered in this process: the engines must run in it, as the GPU tests' do)."""
    global _scaled_dummy_registered
    if _scaled_dummy_registered:
        return
    from vllm.model_executor.model_loader import register_model_loader
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    class ScaledDummyLoader(DummyModelLoader):
        def load_weights(self, model, model_config) -> None:
            super().load_weights(model, model_config)
            scale_dummy_weights(model)

    register_model_loader(SCALED_DUMMY_FORMAT)(ScaledDummyLoader)
    _scaled_dummy_registered = True


_scaled_dummy_registered = False


def assert_continuations_depend_on_context(continuations: list[list[int]], model: str, least: int = 2) -> None:
    """Some token is followed by different tokens in ``continuations`` (greedy outputs), ``least`` tokens at least:
    a model whose greedy next token is a function of the last token alone (vLLM's "dummy" weights) would let a
    tree test pass whatever its layers computed."""
    successors: dict[int, set[int]] = {}
    for tokens in continuations:
        for token, following in zip(tokens, tokens[1:]):
            successors.setdefault(token, set()).add(following)
    branching = sum(len(s) > 1 for s in successors.values())
    assert branching >= least, (
        f"{model}: greedy decoding follows each token by one fixed token ({branching} of {len(successors)} tokens "
        f"have several successors, {least} wanted), so its layers barely shape the output; give it weights that "
        "compute something (SCALED_DUMMY_FORMAT for a config-only model)")


def register_ling_config() -> None:
    """Ling-3.0's text config class under its model type (its checkpoints ship it as remote code)."""
    from transformers import AutoConfig
    from vllm.transformers_utils.configs.bailing_moe_v3_vl import BailingMoeV3TextConfig

    try:
        AutoConfig.register("bailing_hybrid", BailingMoeV3TextConfig)
    except ValueError:  # registered already in this process
        pass


def copy_permutation(vocab_size: int) -> list[int]:
    """The copy target's next-token map t -> (5t + 3) mod V (a bijection for even V)."""
    return [(5 * t + 3) % vocab_size for t in range(vocab_size)]


@torch.no_grad()
def save_copy_pair(target_path: Path, drafter_path: Path, *, vocab_size: int = 64, block_size: int = 4) -> tuple[Path, Path]:
    """Hand-built target (next token = perm(token)) and a drafter that copies it.

    Target: one-hot embeddings (hidden = vocab), attention and MLP outputs zeroed, so the
    final hidden state of token t is 8 e_t and the LM head P (P[perm(t), t] = 1) puts
    logit 8 on perm(t). Drafter: backbone outputs are zeroed too, so its hidden state is
    a constant; the selector's codebooks are phi(a) = e_a, psi(b) = e_{perm^-1(b)}, its
    per-depth unary weight is 0 and the pair weight makes b = perm(a) win by ~20 nats:
    the beam's best path is the target's greedy chain.
    """
    hidden = vocab_size
    perm = torch.tensor(copy_permutation(vocab_size))
    # P[perm(t), t] = 1
    p_matrix = torch.zeros(vocab_size, vocab_size).index_put_((perm, torch.arange(vocab_size)), torch.ones(vocab_size))
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=hidden, num_hidden_layers=3,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)
    target = LlamaForCausalLM(cfg).float()
    eye = torch.eye(vocab_size)
    target.model.embed_tokens.weight.copy_(eye)
    for layer in target.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    target.lm_head.weight.copy_(p_matrix)
    target.save_pretrained(target_path)

    dcfg = DrafterConfig.for_target(cfg, "copy-target", block_size=block_size, top_k=vocab_size, num_layers=1,
                                    selector_rank=vocab_size, selector_hidden=vocab_size)
    drafter = UBTreeDrafter(dcfg)
    for layer in drafter.backbone.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    gain = 10.0
    scale = torch.nn.functional.silu(torch.tensor(gain))
    sel = drafter.selector
    sel.pred_codebook.up.weight.copy_(gain * eye)
    sel.pred_codebook.down.weight.copy_(eye / scale)
    sel.succ_codebook.up.weight.copy_(gain * eye)
    # psi(b) = e_{perm^-1(b)}: down[perm^-1(b), b] = 1, i.e. down = P^T.
    sel.succ_codebook.down.weight.copy_(p_matrix.t() / scale)
    # The backbone's hidden state at every mask slot is norm(e_mask) = sqrt(V) e_mask.
    sel.hidden_proj.weight.zero_()
    sel.hidden_proj.weight[:, dcfg.mask_token_id] = 20.0 / vocab_size ** 0.5
    sel.unary_weight.zero_()
    sel.pair_weight.fill_(1.0)
    save_drafter(drafter, drafter_path, dtype=torch.float32)
    return Path(target_path), Path(drafter_path)
