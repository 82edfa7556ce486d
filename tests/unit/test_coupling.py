"""Coupled drafting (drafter/coupling.py) on the CPU: the candidates hold the target's own draw, greedy drafting is
unchanged bit for bit, and the edges are re-ranked under the noise.

The noise kernel runs under the Triton interpreter here (tests/conftest.py), as in tests/triton/test_target_noise.py,
which also checks it against vLLM's own draws."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from ubtree_vllm.drafter.coupling import CoupledNoise, couple_edges, coupled_candidates
from ubtree_vllm.triton_ops.reference import gumbel_noise_reference

from test_mrv2_speculator import GAMMA, HIDDEN, TREE, VOCAB, context, make_drafter


def noise_for(num_reqs: int, temperature: list[float], seed: int) -> CoupledNoise:
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, 5000, (num_reqs, 1), generator=gen)
    return CoupledNoise(temperature=torch.tensor(temperature), seeds=torch.randint(0, 2 ** 62, (num_reqs,), generator=gen),
                        key_pos=start + torch.arange(GAMMA)[None, :])


def target_draws(logits: torch.Tensor, noise: CoupledNoise) -> torch.Tensor:
    """[R, gamma] the token the target draws at each depth: argmax(logits / T + G(seed, pos, v))."""
    g = gumbel_noise_reference(noise.seeds[:, None, None], noise.key_pos[:, :, None],
                               torch.arange(logits.shape[-1])[None, None, :])
    return (logits / noise.temperature[:, None, None] + g).argmax(-1)


def test_a_perfect_proposers_coupled_top_candidate_is_the_targets_draw():
    """With the proposer's log-probs equal to the target's, the coupled top 1 at every depth is the token the target
    will draw there; the top 1 by log-prob alone is it far less often (what coupling buys)."""
    num_reqs = 16
    logits = torch.randn(num_reqs, GAMMA, VOCAB, generator=torch.Generator().manual_seed(4)) * 1.5
    noise = noise_for(num_reqs, [1.0, 0.8] * (num_reqs // 2), seed=5)
    draws = target_draws(logits, noise)
    tokens, cand_logp, cand_noise = coupled_candidates(logits, 1, noise)
    assert torch.equal(tokens[..., 0], draws)
    greedy = logits.argmax(-1)
    assert (greedy == draws).float().mean() < 0.5
    logp = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(cand_logp, logp.gather(-1, tokens))
    g = gumbel_noise_reference(noise.seeds[:, None, None], noise.key_pos[:, :, None], tokens)
    torch.testing.assert_close(cand_noise, g.float(), atol=1e-4, rtol=1e-4)


def test_greedy_rows_keep_the_top_k_by_log_prob_and_their_edges():
    num_reqs, top_k = 4, 6
    logits = torch.randn(num_reqs, GAMMA, VOCAB, generator=torch.Generator().manual_seed(1))
    logp = torch.log_softmax(logits, -1)
    noise = noise_for(num_reqs, [0.0, 1.0, 0.0, 2.0], seed=2)
    tokens, cand_logp, cand_noise = coupled_candidates(logits, top_k, noise)
    plain_logp, plain_tokens = torch.topk(logp, top_k, dim=-1)
    greedy = torch.tensor([0, 2])
    assert torch.equal(tokens[greedy], plain_tokens[greedy]) and torch.equal(cand_logp[greedy], plain_logp[greedy])
    assert not cand_noise[greedy].any()
    assert not torch.equal(tokens[1], plain_tokens[1])  # sampled rows are re-ranked
    root = torch.log_softmax(torch.randn(num_reqs, top_k), -1)
    trans = torch.log_softmax(torch.randn(num_reqs, GAMMA - 1, top_k, top_k), -1)
    root2, trans2 = couple_edges(root, trans, cand_noise, noise.temperature, 1.0)
    assert torch.equal(root2[greedy], root[greedy]) and torch.equal(trans2[greedy], trans[greedy])
    sampled = torch.tensor([1, 3])
    torch.testing.assert_close(root2[sampled].logsumexp(-1), torch.zeros(2))
    torch.testing.assert_close(trans2[sampled].logsumexp(-1), torch.zeros(2, GAMMA - 1, top_k))
    t = noise.temperature[sampled]
    want = torch.log_softmax(root[sampled] / t[:, None] + cand_noise[sampled, 0], -1)
    torch.testing.assert_close(root2[sampled], want)


def test_the_edge_weight_scales_the_selectors_log_probs_against_the_noise():
    """log_softmax(w * log q / T + G) on sampled rows; greedy rows keep the selector's edges at every w."""
    num_reqs, top_k, w = 3, 5, 1.25
    noise = noise_for(num_reqs, [1.0, 0.0, 0.7], seed=3)
    logits = torch.randn(num_reqs, GAMMA, VOCAB, generator=torch.Generator().manual_seed(8))
    _, _, cand_noise = coupled_candidates(logits, top_k, noise)
    gen = torch.Generator().manual_seed(9)
    root = torch.log_softmax(torch.randn(num_reqs, top_k, generator=gen), -1)
    trans = torch.log_softmax(torch.randn(num_reqs, GAMMA - 1, top_k, top_k, generator=gen), -1)
    root_w, trans_w = couple_edges(root, trans, cand_noise, noise.temperature, w)
    t = noise.temperature.clamp(min=1e-9)
    for r in (0, 2):
        torch.testing.assert_close(root_w[r], torch.log_softmax(w * root[r] / t[r] + cand_noise[r, 0], -1))
        torch.testing.assert_close(trans_w[r], torch.log_softmax(w * trans[r] / t[r] + cand_noise[r, 1:, None, :], -1))
    assert torch.equal(root_w[1], root[1]) and torch.equal(trans_w[1], trans[1])
    root_1, _ = couple_edges(root, trans, cand_noise, noise.temperature, 1.0)
    assert not torch.allclose(root_w[0], root_1[0])  # the weight reaches the edges


def test_drafted_trees_are_unchanged_at_temperature_zero_and_coupled_above():
    drafter = make_drafter()
    coupled = dataclasses.replace(TREE, coupled_drafting=True)
    ctx = context([9, 3, 20], drafter.cfg.num_features, seed=3)
    with torch.no_grad():
        hidden = drafter.block_hidden(ctx.anchor[:, None], ctx.anchor_pos[:, None], ctx.features, ctx.positions,
                                      ctx.valid)[:, 0]
        plain = drafter.tree_from_candidates(ctx.anchor, drafter.top_k_candidates(hidden, TREE.top_k), TREE)
        noise = noise_for(3, [0.0, 1.0, 1.0], seed=7)
        tree = drafter.tree_from_candidates(ctx.anchor, drafter.top_k_candidates(hidden, TREE.top_k, noise), coupled)
    assert torch.equal(tree.tokens[0], plain.tokens[0]) and torch.equal(tree.parents[0], plain.parents[0])
    assert not torch.equal(tree.tokens[1:], plain.tokens[1:])


@pytest.mark.parametrize("value", [1, "yes", None])
def test_the_spec_key_takes_true_or_false(value, tmp_path):
    from ubtree_vllm.drafter.io import save_drafter
    from ubtree_vllm.drafter.proposer import UBTreeDrafter
    from ubtree_vllm.vllm.config import TargetInfo, parse_speculative_config

    from test_mrv2_speculator import drafter_config

    save_drafter(UBTreeDrafter(drafter_config()), tmp_path / "d")
    target = TargetInfo(architectures=("LlamaForCausalLM",), vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=4)
    spec = {"method": "ubtree", "model": str(tmp_path / "d"), "num_speculative_tokens": 8}
    assert parse_speculative_config(spec, target).tree.coupled_drafting is True  # the serving default
    assert parse_speculative_config({**spec, "coupled_drafting": False}, target).tree.coupled_drafting is False
    with pytest.raises(ValueError, match=r"speculative_config.coupled_drafting .* must be true or false"):
        parse_speculative_config({**spec, "coupled_drafting": value}, target)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), 17, True, "1.5"])
def test_the_edge_weight_key_takes_a_positive_number(value, tmp_path):
    from ubtree_vllm.config import DEFAULT_COUPLED_EDGE_WEIGHT
    from ubtree_vllm.drafter.io import save_drafter
    from ubtree_vllm.drafter.proposer import UBTreeDrafter
    from ubtree_vllm.vllm.config import TargetInfo, parse_speculative_config

    from test_mrv2_speculator import drafter_config

    save_drafter(UBTreeDrafter(drafter_config()), tmp_path / "d")
    target = TargetInfo(architectures=("LlamaForCausalLM",), vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=4)
    spec = {"method": "ubtree", "model": str(tmp_path / "d"), "num_speculative_tokens": 8}
    assert parse_speculative_config(spec, target).tree.coupled_edge_weight == DEFAULT_COUPLED_EDGE_WEIGHT
    assert parse_speculative_config({**spec, "coupled_edge_weight": 2}, target).tree.coupled_edge_weight == 2.0
    with pytest.raises(ValueError, match=r"speculative_config.coupled_edge_weight .* must be a number in \(0, 16\]"):
        parse_speculative_config({**spec, "coupled_edge_weight": value}, target)
