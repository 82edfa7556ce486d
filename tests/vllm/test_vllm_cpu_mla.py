"""The CPU MLA tree form (ubtree_vllm/vllm/attention/cpu_mla.py): the new-token mask of a step's multi-token rows
and the masked attention over it, against vLLM's causal ragged SDPA and a per-row reference."""
from __future__ import annotations

import random
import types

import numpy as np
import pytest
import torch

from hybrid_checks import path_to, random_tree
from ubtree_vllm.vllm.attention.cpu_mla import masked_ragged_attention, new_token_mask


def step_layout(rng: random.Random, row_offset: int):
    """Three multi-token requests (one a chain, two trees) after ``row_offset`` one-row requests: the requests'
    local query_start_loc, the tree rows as the plan lays them out (global rows of the non-root nodes and their
    root-first path rows) and, for the reference, each local row's visible local rows."""
    sizes = [5, 9, 7]
    is_tree = [False, True, True]
    qsl = np.concatenate([[0], np.cumsum(sizes)])
    row_index, row_path, visible = [], [], []
    width = max(sizes)
    for r, n in enumerate(sizes):
        parents, _ = random_tree(n, rng) if is_tree[r] else (np.arange(n) - 1, None)
        for j in range(n):
            path = path_to(parents, j) if is_tree[r] else list(range(j + 1))
            visible.append([int(qsl[r]) + p for p in path])
            if is_tree[r] and j > 0:
                row_index.append(row_offset + int(qsl[r]) + j)
                row_path.append([row_offset + int(qsl[r]) + p for p in path] + [-1] * (width - len(path)))
    trees = types.SimpleNamespace(row_index=torch.tensor(row_index), row_path=torch.tensor(row_path))
    return torch.tensor(qsl, dtype=torch.int32), trees, visible


@pytest.mark.parametrize("row_offset", [0, 3])
def test_new_token_mask_is_causal_but_for_tree_rows_which_see_their_path(row_offset):
    qsl, trees, visible = step_layout(random.Random(row_offset), row_offset)
    allowed = new_token_mask(trees, qsl, row_offset)
    starts = np.repeat(qsl[:-1].numpy(), np.diff(qsl.numpy()))
    assert allowed.shape == (int(qsl[-1]), int(torch.diff(qsl).max()))
    for i, rows in enumerate(visible):
        assert sorted((allowed[i].nonzero().flatten() + int(starts[i])).tolist()) == rows, i


def test_masked_attention_is_vllms_causal_ragged_sdpa_on_chains_and_per_row_attention_on_trees():
    from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend

    qsl, trees, visible = step_layout(random.Random(7), 0)
    num_rows, heads, scale = int(qsl[-1]), 2, 0.3
    torch.manual_seed(0)
    q, k, v = torch.randn(num_rows, heads, 96), torch.randn(num_rows, heads, 96), torch.randn(num_rows, heads, 32)

    causal = new_token_mask(types.SimpleNamespace(row_index=torch.zeros(0, dtype=torch.long),
                                                  row_path=torch.zeros(0, 1, dtype=torch.long)), qsl, 0)
    stock = CPUSDPAMLAPrefillBackend.__new__(CPUSDPAMLAPrefillBackend)
    stock.scale = scale
    out_v, lse_v = stock._ragged_sdpa(q, k, v, qsl, qsl, causal=True, return_softmax_lse=True)
    out_c, lse_c = masked_ragged_attention(q, k, v, qsl, causal, scale, return_softmax_lse=True)
    assert torch.equal(out_c, out_v) and torch.equal(lse_c, lse_v)  # vLLM's arithmetic, bit for bit

    out, lse = masked_ragged_attention(q, k, v, qsl, new_token_mask(trees, qsl, 0), scale, return_softmax_lse=True)
    for i, rows in enumerate(visible):
        scores = torch.einsum("hd,khd->hk", q[i], k[rows]) * scale  # [H, len(rows)]
        torch.testing.assert_close(out[i], torch.einsum("hk,khd->hd", scores.softmax(-1), v[rows]))
        torch.testing.assert_close(lse[:, i], torch.logsumexp(scores, -1))
    assert torch.equal(masked_ragged_attention(q, k, v, qsl, new_token_mask(trees, qsl, 0), scale, False), out)
