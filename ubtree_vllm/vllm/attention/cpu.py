"""CPU_ATTN with tree rows: vLLM's C++ CPU attention, run on virtual per-node sequences.

vLLM's CPU kernel (``cpu_attention_with_kv_cache``) knows causal / non-causal / sliding
masks only, and its paged KV layout is ISA-specific (keys are stored transposed or
VNNI-tiled per block), so tree rows cannot be read back and re-attended in torch. This
backend instead runs the *same* kernel a second time for the tree rows, each as its own
decode query over a virtual sequence that holds exactly what the node may see:

    virtual sequence of tree row (r, j) = context of r (positions < root_pos)
                                          + the root->j path (depth[j] + 1 tokens)

built in a small scratch cache of whole blocks:

* full context blocks of r are copied whole (block interiors are opaque but self-contained);
* each row gets its own tail blocks: a copy of r's partially filled block, into which the
  fresh K/V of the path tokens are written at virtual positions root_pos .. root_pos + depth
  with the backend's own ``cpu_attn_reshape_and_cache`` (so any ISA layout is right).

The query of a node therefore attends to precisely ancestor-or-self + context, through the
same numerics a non-speculative decode at that position uses. All other rows (prefill
chunks, plain decodes, roots and chain-shaped trees) keep the stock causal result.
"""
from __future__ import annotations

from typing import Any

import torch
from vllm import _custom_ops as ops
from vllm import envs
from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend, CPUAttentionBackendImpl,
                                                 CPUAttentionMetadata)

from ubtree_vllm.vllm.attention.state import begin_tree_rows, tree_forward_state
from ubtree_vllm.vllm.tree_plan import DeviceTrees, TreeStepPlan


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN whose impl applies the ancestor mask to tree rows (name kept: CPU_ATTN)."""

    @staticmethod
    def get_impl_cls() -> type["TreeCPUAttentionImpl"]:
        return TreeCPUAttentionImpl


class VirtualLayout:
    """Scratch-cache layout of one step's tree rows for one block size (shared by layers).

    Scratch blocks: first the full context blocks of every tree request, then
    ``tail_blocks`` private blocks per tree row.
    """

    def __init__(self, plan: TreeStepPlan, trees: DeviceTrees, block_table: torch.Tensor,
                 block_size: int) -> None:
        device = block_table.device
        ctx_len = trees.row_context_len  # [R]
        num_rows = ctx_len.shape[0]
        # Host copies of small per-request numbers (the plan is host data).
        tree_req = torch.from_numpy(plan.is_tree.nonzero()[0]).to(device)  # [Q]
        req_ctx = torch.from_numpy(plan.root_positions).to(device)  # [num_reqs]
        full = torch.div(req_ctx, block_size, rounding_mode="floor")  # [num_reqs]
        full_tree = full[tree_req]
        # Full context blocks of all tree requests, request-major.
        ctx_start = torch.zeros_like(full)
        ctx_start[tree_req] = torch.cumsum(full_tree, 0) - full_tree
        num_ctx_blocks = int((plan.root_positions[plan.is_tree] // block_size).sum())
        ctx_req = torch.repeat_interleave(tree_req, full_tree)  # [num_ctx_blocks]
        ctx_col = torch.arange(num_ctx_blocks, device=device) - ctx_start[ctx_req]
        # One tail block holds the partial context block plus the path (< block_size + depth).
        self.tail_blocks = -(-(block_size + plan.max_depth) // block_size)
        tail_base = num_ctx_blocks
        # Source block of every scratch block in the real cache.
        block_table = block_table.long()
        tail_src = block_table[trees.row_req, full[trees.row_req]]  # [R] partial block of each row
        self.src_blocks = torch.cat([block_table[ctx_req, ctx_col], tail_src])  # copied whole
        self.dst_blocks = torch.cat([torch.arange(num_ctx_blocks, device=device),
                                     tail_base + torch.arange(num_rows, device=device) * self.tail_blocks])
        self.num_blocks = tail_base + num_rows * self.tail_blocks
        # Virtual block table [R, max_full + tail_blocks].
        max_full = int(plan.root_positions[plan.is_tree].max()) // block_size if num_rows else 0
        col = torch.arange(max_full + self.tail_blocks, device=device)[None, :]
        row_full = full[trees.row_req][:, None]
        tails = tail_base + torch.arange(num_rows, device=device)[:, None] * self.tail_blocks + (col - row_full)
        ctx_cols = ctx_start[trees.row_req][:, None] + col
        self.block_table = torch.where(col < row_full, ctx_cols,
                                       torch.where(col < row_full + self.tail_blocks, tails, 0)).to(torch.int32)
        # Path tokens: global row -> virtual slot.
        depth_idx = torch.arange(trees.row_path.shape[1], device=device)[None, :]
        valid = trees.row_path >= 0  # [R, D + 1]
        vpos = ctx_len[:, None] + depth_idx
        vblock = self.block_table.long().gather(1, torch.div(vpos, block_size, rounding_mode="floor")
                                                .clamp(max=self.block_table.shape[1] - 1))
        vslot = vblock * block_size + vpos % block_size
        self.path_rows = trees.row_path.clamp(min=0).flatten()  # [R * (D + 1)] global rows
        self.path_slots = torch.where(valid, vslot, -1).flatten()  # -1: skipped by the writer
        self.seq_lens = (ctx_len + trees.row_depth + 1).to(torch.int32)  # [R]
        self.query_start_loc = torch.arange(num_rows + 1, device=device, dtype=torch.int32)
        self._scheduler_metadata: dict[Any, torch.Tensor] = {}

    def scheduler_metadata(self, impl: "TreeCPUAttentionImpl", layer: Any, dtype: torch.dtype) -> torch.Tensor:
        key = (impl.num_heads, impl.num_kv_heads, impl.head_size, impl.sliding_window, layer.isa, dtype)
        if key not in self._scheduler_metadata:
            self._scheduler_metadata[key] = ops.cpu_attn_get_scheduler_metadata(
                num_reqs=self.seq_lens.shape[0], num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
                head_dim=impl.head_size, seq_lens=self.seq_lens, dtype=dtype,
                query_start_loc=self.query_start_loc, causal=True, sliding_window_size=impl.sliding_window,
                isa=layer.isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
                kv_cache_dtype=impl.kv_cache_dtype)
        return self._scheduler_metadata[key]


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    """Stock CPU attention, then tree rows recomputed on their virtual sequences."""

    # Checked by the UBTree runner after model load.
    ubtree_tree_aware = True

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CPUAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        """query [T, H, D]; key/value [T, H_kv, D]; kv_cache [num_blocks, H_kv, block, 2D]."""
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                 output_scale, output_block_scale)
        active = begin_tree_rows(self, layer, key, value, attn_metadata)
        if active is None:
            return output
        plan, trees = active
        state = tree_forward_state()
        block_size = kv_cache.shape[2]
        layout = state.step_cache.get(("cpu_layout", block_size))
        if layout is None:
            layout = VirtualLayout(plan, trees, attn_metadata.block_table, block_size)
            state.step_cache[("cpu_layout", block_size)] = layout
        self._attend_tree_rows(layer, query, key, value, kv_cache, output, trees, layout)
        return output

    def _attend_tree_rows(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          kv_cache: torch.Tensor, output: torch.Tensor, trees: DeviceTrees,
                          layout: VirtualLayout) -> None:
        # Scratch cache: whole-block copies, then the path tokens in the backend's own layout.
        # Zero-filled like vLLM's fresh blocks: the kernel reads whole tiles and masks by
        # adding -inf, so garbage (NaN) past seq_len would leak into the result.
        scratch = kv_cache.new_zeros((layout.num_blocks, *kv_cache.shape[1:]))
        scratch[layout.dst_blocks] = kv_cache[layout.src_blocks]
        num_blocks, num_kv_heads, block_size, _ = scratch.shape
        key_cache, value_cache = scratch.view(num_blocks, num_kv_heads, 2 * block_size, -1).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            key[layout.path_rows], value[layout.path_rows], key_cache, value_cache, layout.path_slots,
            layer.isa, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        rows = trees.row_index
        tree_out = torch.empty((rows.shape[0], *output.shape[1:]), dtype=output.dtype, device=output.device)
        ops.cpu_attention_with_kv_cache(
            query=query[rows].contiguous(), key_cache=key_cache, value_cache=value_cache, output=tree_out,
            query_start_loc=layout.query_start_loc, seq_lens=layout.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=self.alibi_slopes, sliding_window=self.sliding_window, block_table=layout.block_table,
            softcap=self.logits_soft_cap, scheduler_metadata=layout.scheduler_metadata(self, layer, query.dtype),
            s_aux=self.sinks, dynamic_causal=None, k_scale=layer._k_scale_float, v_scale=layer._v_scale_float,
            kv_cache_dtype=self.kv_cache_dtype)
        output[rows] = tree_out
