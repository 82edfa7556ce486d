"""Exact-distribution checks for sampled continuations of a tiny-vocabulary model.

Shared by the reference-decoder tests and the vLLM tests (vocabulary,
horizon and prompt are arguments here): the exact joint law of the next ``horizon``
tokens is enumerated with the HF model and :func:`ubtree_vllm.verify.sampling.processed_probs`
(vLLM's temperature / top-k / top-p semantics), then per-position marginals and
adjacent-pair joints of the samples are compared with Pearson chi-square tests.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

import torch
from scipy import stats

from ubtree_vllm.config import SamplingConfig
from ubtree_vllm.verify.sampling import SamplingTensors, processed_probs


@torch.no_grad()
def exact_joint(model: torch.nn.Module, prompt: Sequence[int], vocab_size: int, horizon: int,
                sampling: SamplingConfig, process: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                min_p: float = 0.0) -> torch.Tensor:
    """p(x_1..x_H | prompt) for all vocab**horizon continuations. -> [vocab] * horizon float64.

    ``process(logits [S, H, V], seqs [S, H])`` stands for vLLM's logits processing before temperature
    (position t's row may depend on ``seqs[:, :t]``, the output so far); ``min_p`` is applied after
    temperature, as vLLM does."""
    seqs = torch.tensor(list(itertools.product(range(vocab_size), repeat=horizon)))
    ids = torch.cat([torch.tensor(list(prompt)).expand(len(seqs), -1), seqs], dim=1)
    logits = model(input_ids=ids).logits[:, len(prompt) - 1: -1].float()  # [S, H, V]
    if process is not None:
        logits = process(logits, seqs)
    params = SamplingTensors.from_configs([sampling] * len(seqs), "cpu")
    if min_p:
        params.min_p = torch.full((len(seqs),), float(min_p))
    probs = processed_probs(logits, params)
    p = probs.double().gather(2, seqs[:, :, None]).squeeze(2).prod(dim=1)
    return p.view([vocab_size] * horizon)


def chi2_pvalue(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson chi-square; impossible cells must stay empty, cells with expected count < 5 are pooled."""
    obs = observed.flatten().double()
    exp = expected_p.flatten() / expected_p.sum() * obs.sum()
    impossible = exp == 0
    if obs[impossible].sum() > 0:
        return 0.0
    obs, exp = obs[~impossible], exp[~impossible]
    small = exp < 5
    if small.any():
        obs = torch.cat([obs[~small], obs[small].sum()[None]])
        exp = torch.cat([exp[~small], exp[small].sum()[None]])
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs.numpy(), exp.numpy()).pvalue)


def distribution_pvalues(samples: torch.Tensor, joint: torch.Tensor) -> list[float]:
    """p-values of each position's marginal and each adjacent pair's joint. samples [N, H] int64."""
    vocab_size, horizon = joint.shape[0], joint.dim()
    dims = list(range(horizon))
    pvals = []
    for t in dims:
        obs = torch.bincount(samples[:, t], minlength=vocab_size)
        pvals.append(chi2_pvalue(obs, joint.sum(dim=[d for d in dims if d != t])))
    for t in dims[:-1]:
        obs = torch.bincount(samples[:, t] * vocab_size + samples[:, t + 1], minlength=vocab_size ** 2)
        pvals.append(chi2_pvalue(obs, joint.sum(dim=[d for d in dims if d not in (t, t + 1)])))
    return pvals


def homogeneity_pvalue(a: torch.Tensor, b: torch.Tensor) -> float:
    """Chi-square test that two count vectors over the same cells come from one law.

    Cells whose pooled count is below 10 are merged into one (expected counts >= 5 per sample).
    """
    a, b = a.flatten().double(), b.flatten().double()
    keep = (a + b) >= 10
    table = torch.stack([torch.cat([a[keep], a[~keep].sum()[None]]), torch.cat([b[keep], b[~keep].sum()[None]])])
    table = table[:, table.sum(dim=0) > 0]
    if table.shape[1] < 2:
        return 1.0
    return float(stats.chi2_contingency(table.numpy(), correction=False).pvalue)


def two_sample_pvalues(a: torch.Tensor, b: torch.Tensor, vocab_size: int) -> list[float]:
    """Homogeneity p-values of each position's marginal and each adjacent pair. a, b [N, H] int64.

    For engines whose arithmetic (bf16 on the GPU) differs from the HF enumeration: the
    reference is then samples of the same target in the same engine without speculation.
    """
    horizon = a.shape[1]
    pvals = []
    for t in range(horizon):
        pvals.append(homogeneity_pvalue(torch.bincount(a[:, t], minlength=vocab_size),
                                        torch.bincount(b[:, t], minlength=vocab_size)))
    for t in range(horizon - 1):
        pair = lambda s: torch.bincount(s[:, t] * vocab_size + s[:, t + 1], minlength=vocab_size ** 2)  # noqa: E731
        pvals.append(homogeneity_pvalue(pair(a), pair(b)))
    return pvals
