"""``tree_attention: "flashinfer"`` on the CPU: the host plan and the two device launches give FlashInfer what makes
each row attend exactly to its committed context and root -> row path (ubtree_vllm/vllm/attention/flashinfer_rows.py).

FlashInfer itself is GPU-only, so a stand-in wrapper here computes what FlashInfer's paged prefill with a custom mask
is documented to compute (the pages of ``paged_kv_indices`` between ``paged_kv_indptr`` offsets, ``last_page_len`` keys
in the last page, the packed mask's bit ``i * kv_len + j`` at byte offset ``mask_indptr[r]``, little bit order) from
the buffers and plan arguments the mode hands it; the result must equal the tree-attention reference row for row.
The call itself is checked on the GPU (tests/vllm/test_vllm_mrv2_gpu.py, the "flashinfer" attention mode)."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

from ubtree_vllm.triton_ops.reference import tree_attention_reference
from ubtree_vllm.triton_ops.tree_attention_inputs import make_inputs, path_to, random_parents
from ubtree_vllm.vllm.attention.flashinfer_rows import MAX_REQS, FlashInferTreeRows, LayerShape

KERNEL_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


class StandInWrapper:
    """FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` in CUDA-graph mode, as documented, on any device."""

    def __init__(self, workspace, layout, use_cuda_graph, **buffers):
        assert layout == "NHD" and use_cuda_graph
        self.buffers, self.plans = buffers, []

    def plan(self, **kw):
        assert not kw["causal"] and kw.get("custom_mask") is None and kw.get("packed_custom_mask") is None
        assert len(kw["qo_indptr"]) == len(self.buffers["qo_indptr_buf"]), "graph mode fixes the batch size"
        self.plans.append(kw)

    def run(self, q, paged_kv_cache, out):
        kw, b = self.plans[-1], self.buffers
        key_cache, value_cache = paged_kv_cache
        page, qo, kv_indptr = kw["page_size"], kw["qo_indptr"].tolist(), kw["paged_kv_indptr"].tolist()
        last = kw["paged_kv_last_page_len"].tolist()
        indices, mask, mask_indptr = b["paged_kv_indices_buf"].cpu(), b["custom_mask_buf"].cpu(), b["mask_indptr_buf"]
        group = q.shape[1] // key_cache.shape[2]
        for r in range(len(qo) - 1):
            pages = indices[kv_indptr[r]:kv_indptr[r + 1]].long()
            kv_len = (len(pages) - 1) * page + last[r]
            k = key_cache.cpu()[pages].flatten(0, 1)[:kv_len].float()  # [kv_len, H_kv, D]
            v = value_cache.cpu()[pages].flatten(0, 1)[:kv_len].float()
            rows = qo[r + 1] - qo[r]
            start, nbits = int(mask_indptr[r]), rows * kv_len
            bits = torch.from_numpy(np.unpackbits(mask[start:start + -(-nbits // 8)].numpy(), bitorder="little"))
            visible = bits[:nbits].view(rows, kv_len).bool()
            scores = torch.einsum("ihd,jhd->hij", q[qo[r]:qo[r + 1]].cpu().float(),
                                  k.repeat_interleave(group, dim=1)) * kw["sm_scale"]
            probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
            out[qo[r]:qo[r + 1]] = torch.einsum("hij,jhd->ihd", probs,
                                                v.repeat_interleave(group, dim=1)).to(out.dtype).to(out.device)


@pytest.fixture
def stand_in_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer",
                        types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=StandInWrapper))


def uniform_step(num_reqs: int, nodes: int, contexts: list[int], seed: int, block: int = 16):
    """A uniform decode step: ``num_reqs`` requests of 1 + ``nodes`` rows, their fresh K/V written into the cache at
    the linear slots (ctx + i), as vLLM writes them before attention; row buffers with an entry per row (entry g =
    row g, roots -1), as Model Runner V2's layout gives a covered step."""
    gen = torch.Generator().manual_seed(seed)
    trees = [random_parents(nodes, max_depth=4, window=3, generator=gen) for _ in range(num_reqs)]
    inputs = make_inputs(list(zip(contexts, trees)), device="cpu", prefill_rows=0, block_size=block, seed=seed,
                         num_heads=4, num_kv_heads=2, head_size=32)
    q = nodes + 1
    for r, ctx in enumerate(contexts):
        for i in range(q):
            slot = ctx + i
            page = inputs.block_table[r, slot // block].long()
            inputs.key_cache[page, slot % block] = inputs.key[r * q + i]
            inputs.value_cache[page, slot % block] = inputs.value[r * q + i]
    width = inputs.row_path.shape[1]
    row_index = torch.full((num_reqs * q + 16,), -1, dtype=torch.int64)  # the runner's buffers: room past the step
    row_path = torch.full((num_reqs * q + 16, width), -1, dtype=torch.int64)
    for r, parents in enumerate(trees):
        for j in range(1, q):
            g = r * q + j
            row_index[g] = g
            path = [r * q + a for a in path_to(parents, j)]
            row_path[g, :len(path)] = torch.tensor(path)
    return inputs, trees, row_index, row_path


def reference_rows(inputs, trees, contexts):
    """Every row by the tree-attention reference: a root over its context and itself, a node over its context and
    its root -> node path."""
    q = len(trees[0])
    rows, reqs, ctx_lens, paths = [], [], [], []
    for r, (ctx, parents) in enumerate(zip(contexts, trees)):
        for j in range(q):
            rows.append(r * q + j)
            reqs.append(r)
            ctx_lens.append(ctx)
            path = [r * q + a for a in path_to(parents, j)]
            paths.append(path + [-1] * (q - len(path)))
    out = torch.full_like(inputs.query, float("nan"))
    t = torch.tensor
    return tree_attention_reference(inputs.query, inputs.key, inputs.value, inputs.key_cache, inputs.value_cache,
                                    inputs.block_table, t(rows), t(reqs), t(ctx_lens), t(paths), inputs.scale, out)


@pytest.mark.parametrize("padding", [0, 1], ids=["exact-batch", "padded-batch"])
def test_every_row_attends_to_its_context_and_path(stand_in_flashinfer, padding):
    contexts, nodes, block = [37, 5, 64], 6, 16
    inputs, trees, row_index, row_path = uniform_step(len(contexts), nodes, contexts, seed=3, block=block)
    q, num_reqs = nodes + 1, len(contexts) + padding
    # stale keys between a request's true length and its bound: huge, so a mask that lets one through shows
    for r, ctx in enumerate(contexts):
        for slot in range(ctx + q, inputs.block_table.shape[1] * block):
            inputs.key_cache[inputs.block_table[r, slot // block].long(), slot % block] = 50.0
    shape = LayerShape(4, 2, 32, torch.float32, inputs.scale)
    rows = FlashInferTreeRows(KERNEL_DEVICE, torch.empty(0), shape, block, max_model_len=256,
                              query_lens=frozenset({q}))
    bounds = np.array([ctx + q + slack for ctx, slack in zip(contexts, (9, 0, 30))])  # upper bounds, >= true lengths
    seq_lens = torch.tensor([ctx + q for ctx in contexts] + [0] * padding, dtype=torch.int32)
    rows.plan(num_reqs, q, bounds, *(x.to(KERNEL_DEVICE) for x in (seq_lens, row_index, row_path,
                                                                     inputs.block_table)))
    plan = rows._wrappers[(num_reqs, q)].wrapper.plans[-1]
    expected_pages = [-(-int(b) // block) for b in bounds] + [1] * padding
    assert plan["paged_kv_indptr"].tolist() == np.concatenate([[0], np.cumsum(expected_pages)]).tolist()
    assert plan["paged_kv_last_page_len"].tolist() == [block] * num_reqs
    out = torch.full((num_reqs * q + 5, 4, 32), float("nan"))
    query = torch.cat([inputs.query, torch.randn(padding * q + 5, 4, 32)])  # padding rows, then rows past the step
    rows.run(query, inputs.key_cache, inputs.value_cache, out, num_reqs, q)
    ref = reference_rows(inputs, trees, contexts)
    real = len(contexts) * q
    torch.testing.assert_close(out[:real], ref[:real], atol=2e-5, rtol=2e-5)
    assert torch.isfinite(out[real:num_reqs * q]).all(), "a padding request's rows see key 0: finite"
    assert torch.isnan(out[num_reqs * q:]).all(), "rows past the step untouched"


def test_a_shape_it_was_not_planned_for_is_refused(stand_in_flashinfer):
    contexts, nodes = [20], 3
    inputs, trees, row_index, row_path = uniform_step(1, nodes, contexts, seed=1)
    rows = FlashInferTreeRows(KERNEL_DEVICE, torch.empty(0), LayerShape(4, 2, 32, torch.float32, inputs.scale), 16,
                              max_model_len=128, query_lens=frozenset({nodes + 1}))
    with pytest.raises(RuntimeError, match="planned None"):
        rows.run(inputs.query, inputs.key_cache, inputs.value_cache, torch.empty_like(inputs.query), 1, nodes + 1)


def test_it_serves_the_engines_tree_steps_of_up_to_eight_requests():
    rows = FlashInferTreeRows(torch.device("cpu"), torch.empty(0), LayerShape(4, 2, 32, torch.float32, 1.0), 16,
                              max_model_len=128, query_lens=frozenset({65, 33}))
    assert rows.serves(1, 65) and rows.serves(MAX_REQS, 33)
    assert not rows.serves(MAX_REQS + 1, 65), "larger steps take the Triton rows"
    assert not rows.serves(2, 64), "a shape no tree step has (a prefill chunk) is not planned"
    with pytest.raises(NotImplementedError, match="multiple of 8"):
        FlashInferTreeRows(torch.device("cpu"), torch.empty(0), LayerShape(4, 2, 32, torch.float32, 1.0), 12,
                           max_model_len=128, query_lens=frozenset({65}))


def test_flashinfers_schedule_is_planned_again_only_when_a_requests_pages_change(stand_in_flashinfer):
    """FlashInfer's host plan depends on the pages per request alone (rows and heads are fixed per wrapper): a step
    whose bounds stay within the same pages keeps it, while the page list and the mask are rewritten every step."""
    contexts, nodes = [20, 40], 3
    inputs, trees, row_index, row_path = uniform_step(2, nodes, contexts, seed=2)
    q = nodes + 1
    rows = FlashInferTreeRows(KERNEL_DEVICE, torch.empty(0), LayerShape(4, 2, 32, torch.float32, inputs.scale), 16,
                              max_model_len=128, query_lens=frozenset({q}))
    seq_lens = torch.tensor([ctx + q for ctx in contexts], dtype=torch.int32)
    args = [x.to(KERNEL_DEVICE) for x in (seq_lens, row_index, row_path, inputs.block_table)]
    wrapper = rows._wrapper(2, q)
    for bounds, plans in (([24, 44], 1), ([25, 48], 1), ([33, 48], 2), ([33, 48], 2), ([33, 49], 3)):
        rows.plan(2, q, np.array(bounds), *args)
        assert len(wrapper.wrapper.plans) == plans, (bounds, len(wrapper.wrapper.plans))
    wrapper.mask.zero_()
    rows.plan(2, q, np.array([33, 49]), *args)
    assert len(wrapper.wrapper.plans) == 3 and wrapper.mask.any(), "the mask is rewritten without a new plan"
