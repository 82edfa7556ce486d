"""The training objective's building blocks against plain-torch oracles: split block attention,
the chunked LM-head loss (value and gradient), and the feature-scale fold at export."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.io import load_drafter
from ubtree_vllm.drafter.model import DFlashBackbone, context_visibility
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.training.export import check_round_trip, export_drafter
from ubtree_vllm.training.head_loss import head_loss, head_loss_reference


def tiny_config(**changes) -> DrafterConfig:
    values = dict(target_name="tiny", vocab_size=50, hidden_size=32, num_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, intermediate_size=48, target_num_layers=6,
                  target_layer_ids=(1, 3), block_size=4, top_k=5, selector_rank=4, mask_token_id=3)
    values.update(changes)
    return DrafterConfig(**values)


def dense_backbone(backbone: DFlashBackbone, embeds, block_pos, features, ctx_pos, ctx_valid) -> torch.Tensor:
    """Oracle: one SDPA per layer over [context, every block's tokens] with a block-diagonal mask."""
    from ubtree_vllm.drafter.model import apply_rope, rope_cos_sin

    cfg = backbone.cfg
    num_seqs, nb, block_len, hidden = embeds.shape
    sees_ctx = context_visibility(ctx_pos, ctx_valid, block_pos[:, :, 0])[:, :, None].expand(-1, -1, block_len, -1)
    block_id = torch.arange(nb).repeat_interleave(block_len)
    sees_block = (block_id[:, None] == block_id[None, :]).expand(num_seqs, -1, -1)
    mask = torch.cat([sees_ctx.flatten(1, 2), sees_block], dim=2)  # [N, nb*S, L + nb*S]
    ctx = backbone.hidden_norm(backbone.fc(features * backbone.feature_scale))
    ctx_cos, ctx_sin = rope_cos_sin(ctx_pos, cfg.head_dim, cfg.rope_theta)
    cos, sin = rope_cos_sin(block_pos.flatten(1), cfg.head_dim, cfg.rope_theta)
    x = embeds.flatten(1, 2)
    for layer in backbone.layers:
        attn = layer.self_attn
        ctx_k, ctx_v = attn.project_kv(ctx, ctx_cos, ctx_sin)
        h = layer.input_layernorm(x)
        q = apply_rope(attn.q_norm(attn.q_proj(h).unflatten(-1, (attn.num_heads, attn.head_dim))), cos, sin)
        k, v = attn.project_kv(h, cos, sin)
        k = torch.cat([ctx_k, k], 1).transpose(1, 2)
        v = torch.cat([ctx_v, v], 1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask[:, None], enable_gqa=True)
        x = x + attn.o_proj(out.transpose(1, 2).flatten(-2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return backbone.norm(x).view(num_seqs, nb, block_len, hidden)


def random_blocks(cfg: DrafterConfig, num_seqs=3, ctx_len=11, nb=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    block_len = cfg.block_size + 1
    embeds = torch.randn((num_seqs, nb, block_len, cfg.hidden_size), generator=g)
    anchors = torch.stack([torch.randperm(ctx_len, generator=g)[:nb].sort().values for _ in range(num_seqs)])
    block_pos = anchors[:, :, None] + torch.arange(block_len)
    features = torch.randn((num_seqs, ctx_len, cfg.num_features), generator=g) * 3
    ctx_pos = torch.arange(ctx_len).expand(num_seqs, -1)
    ctx_valid = ctx_pos < torch.tensor([ctx_len, ctx_len - 3, ctx_len - 5])[:num_seqs, None]
    return embeds, block_pos, features, ctx_pos, ctx_valid


def test_split_block_attention_equals_dense_block_diagonal_mask():
    torch.manual_seed(0)
    cfg = tiny_config()
    backbone = DFlashBackbone(cfg)
    backbone.feature_scale.uniform_(0.2, 2.0)
    inputs = list(random_blocks(cfg))  # float32: rotary tables and norms run in float32 anyway
    got = backbone(*inputs)
    want = dense_backbone(backbone, *inputs)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # A block whose anchor is position 0 sees no context at all: only its own tokens.
    inputs[1] = inputs[1] - inputs[1][:, :1, :1]
    torch.testing.assert_close(backbone(*inputs), dense_backbone(backbone, *inputs), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kl_weight,ce_weight,chunk,softcap,lse_grad", [
    (1.0, 0.1, 7, None, False), (0.0, 0.1, 1000, None, True), (1.0, 0.0, 3, 5.0, True), (0.5, 2.0, 1, None, False)])
def test_chunked_head_loss_matches_full_logits(kl_weight, ce_weight, chunk, softcap, lse_grad):
    g = torch.Generator().manual_seed(1)
    rows, hidden, vocab, top_k = 23, 16, 40, 6
    weight = torch.randn((vocab, hidden), generator=g, dtype=torch.float64)
    h = torch.randn((rows, hidden), generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randn((rows, hidden), generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    row_w = torch.rand(rows, generator=g, dtype=torch.float64)

    out = head_loss(h, weight, t, labels, row_w, kl_weight, ce_weight, top_k, softcap, chunk, lse_grad)
    want = head_loss_reference(h, weight, t, labels, row_w.float(), kl_weight, ce_weight, softcap)
    torch.testing.assert_close(out.loss, want.float(), rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(out.loss, h, retain_graph=lse_grad)
    (want_grad,) = torch.autograd.grad(want, h)
    torch.testing.assert_close(grad, want_grad, rtol=1e-5, atol=1e-6)

    log_q = torch.log_softmax(h.detach() @ weight.t(), -1)
    want_logp, want_cand = log_q.topk(top_k, -1)
    assert torch.equal(out.cand, want_cand) and torch.equal(out.top1, log_q.argmax(-1))
    torch.testing.assert_close(out.cand_logp, want_logp.float())
    torch.testing.assert_close(out.ce_rows, -log_q.gather(1, labels[:, None]).squeeze(1).float())
    if lse_grad:  # the log-sum-exp output is differentiable: d lse / d h = softmax(W h) @ W
        (g_lse,) = torch.autograd.grad(out.lse.sum(), h)
        (want_lse,) = torch.autograd.grad(torch.logsumexp(h @ weight.t(), -1).sum(), h)
        torch.testing.assert_close(g_lse, want_lse, rtol=1e-5, atol=1e-6)
    else:
        assert not out.lse.requires_grad


def test_feature_scale_is_folded_into_fc_at_export(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_config()
    drafter = UBTreeDrafter(cfg)
    drafter.backbone.feature_scale.copy_(torch.rand(cfg.num_features) * 0.05 + 0.001)
    embed, head = torch.randn(cfg.vocab_size, cfg.hidden_size), torch.randn(cfg.vocab_size, cfg.hidden_size)
    drafter.bind_target(embed, head)
    folder = export_drafter(drafter, tmp_path / "d", {})
    check_round_trip(drafter, folder)  # bit-identical logits after reload (the fold is exact in the format)
    loaded = load_drafter(folder)
    assert torch.equal(loaded.backbone.feature_scale, torch.ones(cfg.num_features))
    # Same function as the scaled in-memory drafter, up to the bf16 rounding of the weights.
    inputs = random_blocks(cfg, num_seqs=1, nb=1)
    want = drafter.backbone(*inputs)
    got = loaded.backbone(*inputs)
    assert (got - want).abs().max() < 0.1 * want.abs().max()
