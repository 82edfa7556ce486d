"""CPU tree attention and the KV commit against dense references, on vLLM's real CPU kernels.

The CPU KV layout differs per ISA (keys transposed for "vec", VNNI-tiled for "amx"), so
both are exercised where the machine supports them; the tests never read the cache
directly, only through vLLM's own kernels.
"""
from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from vllm import _custom_ops as ops
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from ubtree_vllm.vllm.attention.cpu import TreeCPUAttentionImpl, VirtualLayout
from ubtree_vllm.vllm.attention.state import RowBuffers, TreeForwardState
from ubtree_vllm.triton_ops.kv_path_commit import kv_cache_pointers
from ubtree_vllm.vllm.kv_commit import commit_accepted_paths, commit_accepted_paths_in_cache
from ubtree_vllm.vllm.tree_plan import build_plan
from vllm_batches import BLOCK_SIZE, BLOCK_TABLE, NUM_COMPUTED, PARENTS, ancestors, make_batch

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, NUM_BLOCKS = 4, 2, 64, 8
SCALE = HEAD_SIZE ** -0.5
DTYPES = [torch.float32] + ([torch.bfloat16] if torch.cpu._is_amx_tile_supported() else [])


@pytest.fixture(scope="module")
def impl(tiny_target):
    config = EngineArgs(model=str(tiny_target), skip_tokenizer_init=True, dtype="float32").create_engine_config()
    with set_current_vllm_config(config):
        return TreeCPUAttentionImpl(num_heads=NUM_HEADS, head_size=HEAD_SIZE, scale=SCALE, num_kv_heads=NUM_KV_HEADS,
                                    alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")


def write(cache, key, value, slots, isa):
    key_cache, value_cache = cache.view(NUM_BLOCKS, NUM_KV_HEADS, 2 * BLOCK_SIZE, HEAD_SIZE).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                                   kv_cache_dtype="auto")


def setup(dtype):
    """A cache holding every request's context, plus the step's fresh q/k/v and written rows."""
    torch.manual_seed(0)
    batch = make_batch()
    isa = _get_attn_isa(dtype, BLOCK_SIZE, HEAD_SIZE, "auto")
    layer = types.SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0, layer_name="layer0")
    cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=dtype)
    ctx_k = [torch.randn(int(n), NUM_KV_HEADS, HEAD_SIZE, dtype=dtype) for n in NUM_COMPUTED]
    ctx_v = [torch.randn(int(n), NUM_KV_HEADS, HEAD_SIZE, dtype=dtype) for n in NUM_COMPUTED]
    for k, v, s in zip(ctx_k, ctx_v, batch.context_slots):
        if len(s):
            write(cache, k, v, s, isa)
    num_rows = batch.slot_mapping.shape[0]
    query = torch.randn(num_rows, NUM_HEADS, HEAD_SIZE, dtype=dtype)
    key = torch.randn(num_rows, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)
    value = torch.randn(num_rows, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype)
    write(cache, key, value, batch.slot_mapping, isa)  # vLLM writes the new rows before attention
    return batch, layer, cache, ctx_k, ctx_v, query, key, value


def reference_row(query, ctx_k, ctx_v, key, value, rows):
    """Dense attention of one query over context + the given fresh rows. -> [H, D] float32."""
    k = torch.cat([ctx_k, key[rows]]).float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    v = torch.cat([ctx_v, value[rows]]).float().repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    out = F.scaled_dot_product_attention(query.float()[:, None], k.transpose(0, 1), v.transpose(0, 1), scale=SCALE)
    return out[:, 0]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_rows_attend_to_context_and_ancestors_only(impl, dtype):
    batch, layer, cache, ctx_k, ctx_v, query, key, value = setup(dtype)
    plan = batch.plan
    trees = plan.to_device(torch.device("cpu"))
    layout = VirtualLayout(plan, trees, BLOCK_TABLE, BLOCK_SIZE)
    output = torch.full((query.shape[0], NUM_HEADS, HEAD_SIZE), float("nan"), dtype=dtype)
    impl._attend_tree_rows(layer, query, key, value, cache, output, trees, layout)
    tol = dict(atol=1e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for i, (req_id, root) in enumerate((("r0", 0), ("r2", 11))):
        req = 0 if req_id == "r0" else 2
        for node in range(1, len(PARENTS[req_id])):
            rows = [root + a for a in ancestors(PARENTS[req_id], node)]
            expected = reference_row(query[root + node], ctx_k[req], ctx_v[req], key, value, rows)
            torch.testing.assert_close(output[root + node].float(), expected, **tol)
    untouched = [r for r in range(query.shape[0]) if r not in plan.row_index.tolist()]
    assert torch.isnan(output[untouched]).all()  # roots, prefill rows: left to the stock kernel


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kv_commit_moves_accepted_nodes_to_their_depth(impl, dtype):
    batch, layer, cache, _, _, _, key, value = setup(dtype)
    plan = batch.plan
    layer.impl, layer.kv_cache = impl, cache
    state = TreeForwardState()
    state.begin(plan, torch.device("cpu"))
    state.stash_layer(layer, key, value, batch.slot_mapping)
    # r0 accepted root -> 1 -> 3 -> 5 (node 1 already sits at depth 1); r2 accepted node 2 only.
    accepted_path = torch.tensor([[0, 1, 3, 5], [0, -1, -1, -1], [0, 2, -1, -1]])
    num_accepted = torch.tensor([3, 0, 1])
    expected = cache.clone()
    moves = [(0, 1, 1), (0, 2, 3), (0, 3, 5), (11, 1, 2)]  # (root row, depth, node)
    rows = torch.tensor([root + node for root, _, node in moves])
    slots = torch.tensor([int(batch.slot_mapping[root + depth]) for root, depth, _ in moves])
    write(expected, key[rows], value[rows], slots, layer.isa)
    commit_accepted_paths(state, plan, accepted_path, num_accepted)
    assert torch.equal(cache, expected)


def test_in_cache_kv_commit_on_a_flash_attention_layout():
    """FLASH_ATTN's commit: accepted nodes' K/V copied slot to slot inside the cache, every layer."""
    batch = make_batch()
    plan = batch.plan
    torch.manual_seed(0)
    # Two layers' caches [num_blocks, H_kv, block_size, 2 * head_size], non-contiguous (FA's physical layout).
    caches = [torch.randn(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, 2 * HEAD_SIZE).transpose(1, 2) for _ in range(2)]
    stash_slots = batch.slot_mapping[torch.from_numpy(plan.stash_rows)]
    # r0 accepted root -> 1 -> 3 -> 5 (node 1 already sits at depth 1); r2 accepted node 2 only.
    accepted_path = torch.tensor([[0, 1, 3, 5], [0, -1, -1, -1], [0, 2, -1, -1]])
    num_accepted = torch.tensor([3, 0, 1])
    expected = [c.clone() for c in caches]
    for exp, cache in zip(expected, caches):
        for root, depth, node in [(0, 2, 3), (0, 3, 5), (11, 1, 2)]:  # (root row, depth, node)
            src, dst = int(batch.slot_mapping[root + node]), int(batch.slot_mapping[root + depth])
            exp[dst // BLOCK_SIZE, :, dst % BLOCK_SIZE] = cache[src // BLOCK_SIZE, :, src % BLOCK_SIZE]
    commit_accepted_paths_in_cache(kv_cache_pointers(caches), caches[0], stash_slots, plan, accepted_path,
                                   num_accepted)
    for got, exp in zip(caches, expected):
        assert torch.equal(got, exp)


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "TRITON_ATTN"])
def test_cuda_backend_tree_rows_on_their_cache_layout(backend, monkeypatch):
    """The CUDA backends' tree path (the Triton kernel, interpreted on CPU) over the cache layout FLASH_ATTN and
    TRITON_ATTN share, through each tree impl's forward (the stock kernel before it faked: it needs CUDA)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 "
                    "for CPU-only torch builds)")
    from vllm.v1.attention.backend import AttentionType

    from ubtree_vllm.vllm.attention import flash, tree_rows, triton_attn

    impl_cls, stock = {"FLASH_ATTN": (flash.TreeFlashAttentionImpl, flash.FlashAttentionImpl),
                       "TRITON_ATTN": (triton_attn.TreeTritonAttentionImpl, triton_attn.TritonAttentionImpl)}[backend]
    monkeypatch.setattr(stock, "forward", lambda self, layer, q, k, v, cache, meta, out, *rest: out)
    monkeypatch.setattr(tree_rows, "tree_forward_state", lambda: state)  # the test's state, not the process's
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU torch build has no CUDA
    torch.manual_seed(0)
    batch = make_batch()
    plan = batch.plan
    impl = object.__new__(impl_cls)  # the tree path reads head_size, scale, attn_type and the bound buffers
    impl.head_size, impl.scale, impl.attn_type = HEAD_SIZE, SCALE, AttentionType.DECODER
    impl.ubtree_context_from_flash = False
    metadata = types.SimpleNamespace(block_table=BLOCK_TABLE)
    kv_cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    key_cache, value_cache = kv_cache.transpose(1, 2).split(HEAD_SIZE, dim=-1)  # FlashAttentionImpl's view

    def write_fa(key, value, slots):
        key_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = key
        value_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = value

    ctx_k = [torch.randn(int(n), NUM_KV_HEADS, HEAD_SIZE) for n in NUM_COMPUTED]
    ctx_v = [torch.randn(int(n), NUM_KV_HEADS, HEAD_SIZE) for n in NUM_COMPUTED]
    for k, v, s in zip(ctx_k, ctx_v, batch.context_slots):
        write_fa(k, v, s)
    rows = batch.slot_mapping.shape[0]
    query = torch.randn(rows, NUM_HEADS, HEAD_SIZE)
    key, value = torch.randn(rows, NUM_KV_HEADS, HEAD_SIZE), torch.randn(rows, NUM_KV_HEADS, HEAD_SIZE)
    write_fa(key, value, batch.slot_mapping)
    # The fixed-size row buffers the launch reads (as under a CUDA graph): a previous step with
    # more rows left a tail that this step's fill must mark unused.
    state, buffers = TreeForwardState(), RowBuffers.empty(max_tokens=64, path_width=5, device=torch.device("cpu"))
    buffers.row_index[:40], buffers.filled = 3, 40
    state.begin(plan, torch.device("cpu"), buffers)
    assert buffers.row_index[:8].tolist() == plan.row_index.tolist() and buffers.filled == 8
    assert (buffers.row_index[8:] == -1).all()
    output = torch.full_like(query, float("nan"))
    impl.ubtree_row_buffers = buffers
    impl.forward(None, query, key, value, kv_cache, metadata, output)
    for req_id, req, root in (("r0", 0, 0), ("r2", 2, 11)):
        for node in range(1, len(PARENTS[req_id])):
            path = [root + a for a in ancestors(PARENTS[req_id], node)]
            expected = reference_row(query[root + node], ctx_k[req], ctx_v[req], key, value, path)
            torch.testing.assert_close(output[root + node], expected, atol=1e-5, rtol=1e-4)
    assert torch.isnan(output[[0, 6, 7, 8, 9, 10, 11]]).all()
    # A step without tree rows: every entry unused, nothing written.
    empty = build_plan(["a"], np.array([0, 1]), np.array([1]), np.array([4]), np.arange(1), {}, {})
    state.begin(empty, torch.device("cpu"), buffers)
    assert (buffers.row_index == -1).all() and not state.has_tree_rows
    untouched = torch.full_like(query, float("nan"))
    impl.forward(None, query, key, value, kv_cache, metadata, untouched)
    assert torch.isnan(untouched).all()
    # an engine without UBTree (no buffers bound) runs the stock kernel alone, even with tree rows published
    state.begin(plan, torch.device("cpu"), buffers)
    impl.ubtree_row_buffers = None
    impl.forward(None, query, key, value, kv_cache, metadata, untouched)
    assert torch.isnan(untouched).all()


def test_flash_merge_context_lengths_once_per_forward(monkeypatch):
    """tree_attention "flash_merge": the committed context lengths are computed by a forward's first tree layer and
    reused by its other layers (one metadata object per forward), never carried into another forward."""
    from ubtree_vllm.vllm.attention import flash
    from ubtree_vllm.vllm.attention.flash import TreeFlashAttentionImpl, committed_context_lens

    seen = []
    monkeypatch.setattr(flash, "flash_context_attention", lambda *args: seen.append(args[4]) or (None, None))
    monkeypatch.setattr(flash, "tree_forward_state", lambda: state)
    state = TreeForwardState()

    def metadata(seq_lens: list[int]) -> types.SimpleNamespace:
        return types.SimpleNamespace(num_actual_tokens=6, query_start_loc=torch.tensor([0, 4, 6], dtype=torch.int32),
                                     seq_lens=torch.tensor(seq_lens, dtype=torch.int32), max_query_len=4,
                                     max_seq_len=max(seq_lens), block_table=torch.zeros(2, 1, dtype=torch.int32),
                                     max_num_splits=0)

    impl = types.SimpleNamespace(scale=1.0, vllm_flash_attn_version=3)
    cache = torch.zeros(2, 16, 1, 64)
    query = torch.zeros(6, 2, 64)
    first = metadata([9, 2])
    for _ in range(3):  # the layers of one forward
        TreeFlashAttentionImpl._context_part(impl, query, cache, cache, first)
    assert all(lens is seen[0] for lens in seen) and seen[0].tolist() == [5, 0] and seen[0].dtype == torch.int32
    TreeFlashAttentionImpl._context_part(impl, query, cache, cache, metadata([12, 3]))  # the next forward
    assert seen[-1] is not seen[0] and seen[-1].tolist() == [8, 1]
    assert committed_context_lens(first.query_start_loc, first.seq_lens).tolist() == [5, 0]


def test_latent_tree_rows_on_the_mla_cache(monkeypatch):
    """FLASH_ATTN_MLA's tree path (attend_latent_tree_rows; the Triton tree MLA kernel, interpreted on CPU) over vLLM's
    latent cache [num_blocks, block_size, L + R] with strided blocks (a hybrid's page alignment): every non-root tree
    row equals absorbed MLA attention over its request's committed context plus its root -> self path, the fresh rows
    read from the cache at the slot mapping; every other row keeps the stock kernel's output."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 "
                    "for CPU-only torch builds)")
    from ubtree_vllm.vllm.attention.tree_rows import attend_latent_tree_rows

    latent, rope, heads, scale = 32, 16, 4, 0.2
    torch.manual_seed(0)
    batch = make_batch()
    plan = batch.plan
    padded = torch.randn(NUM_BLOCKS, BLOCK_SIZE + 3, latent + rope)  # 3 padding slots per block
    kv_cache = padded[:, :BLOCK_SIZE]  # [num_blocks, block_size, L + R], block stride > block_size * (L + R)
    rows = batch.slot_mapping.shape[0]
    for slots in batch.context_slots + [batch.slot_mapping]:  # contexts, then the fresh rows vLLM writes first
        kv_cache[slots // BLOCK_SIZE, slots % BLOCK_SIZE] = torch.randn(len(slots), latent + rope)
    q_latent, q_rope = torch.randn(rows, heads, latent), torch.randn(rows, heads, rope)
    state, buffers = TreeForwardState(), RowBuffers.empty(max_tokens=32, path_width=5, device=torch.device("cpu"))
    state.begin(plan, torch.device("cpu"), buffers)
    out = torch.full((rows, heads, latent), float("nan"))  # the stock call's output, here never computed
    attend_latent_tree_rows((q_latent, q_rope), kv_cache, batch.slot_mapping, BLOCK_TABLE, out, buffers, latent,
                            scale)
    for req_id, req, root in (("r0", 0, 0), ("r2", 2, 11)):
        context = kv_cache[batch.context_slots[req] // BLOCK_SIZE, batch.context_slots[req] % BLOCK_SIZE]
        for node in range(1, len(PARENTS[req_id])):
            path = batch.slot_mapping[[root + a for a in ancestors(PARENTS[req_id], node)]]
            keys = torch.cat([context, kv_cache[path // BLOCK_SIZE, path % BLOCK_SIZE]])  # [n, L + R]
            scores = (q_latent[root + node] @ keys[:, :latent].T + q_rope[root + node] @ keys[:, latent:].T) * scale
            expected = scores.softmax(dim=-1) @ keys[:, :latent]  # [H, L]
            torch.testing.assert_close(out[root + node], expected, atol=1e-5, rtol=1e-4)
    assert torch.isnan(out[[0, 6, 7, 8, 9, 10, 11]]).all()  # roots and the prefill rows: the stock kernel's
    # the same rows through the concatenated query form FlashAttention MLA may be handed
    joined = torch.full_like(out, float("nan"))
    attend_latent_tree_rows(torch.cat([q_latent, q_rope], dim=-1), kv_cache, batch.slot_mapping, BLOCK_TABLE, joined,
                            buffers, latent, scale)
    torch.testing.assert_close(joined, out, equal_nan=True)
