"""`ubtree bench microbench --which fa3-virtual-rows`: can one FlashAttention 3 call give every tree row the bits
plain decoding gives it? The premise of the exact tree attention designed in docs/design/mrv2.md §13 (issue 19).

Inputs as tree-attention-numerics (bench/attention_numerics.py): one request, a random 64-node tree over a committed
context of C tokens, bf16, page size 16, Qwen3-8B's and SmolLM2's attention shapes; each tree row held as a lone
decode sequence of context + root -> node path (`path_sequences`, the path's K/V in pages of its own). Three ways to
compute every row:

  lone     plain decoding as vLLM serves it under FULL CUDA graphs: one FlashAttention call per row, batch 1, one
           query row, `num_splits` = vLLM's cap for graphs (FA3_MAX_SPLITS); FA3's scheduler then splits the row's
           keys by its own work alone
  batch    one call over all rows, each a sequence of its own, the scheduler splitting by the whole batch's work
  pinned   the same call with the scheduler metadata's per-sequence split counts overwritten with the lone counts

Metrics per shape and context (unit "fraction"): `virtual_batch_mismatch` and `virtual_batch_pinned_mismatch`,
the fraction of output elements whose bits differ from `lone`. `pinned` at zero says the exact form is reachable
with FA3 itself; the notes also say whether the metadata FA3 computed for the batch held the split counts this
module predicts (`fa3_split_counts`), i.e. whether its reading of FA3's scheduler and metadata layout is right.

FA3's split rule and metadata layout as this module reads them: `fa3_split_counts` and `split_count_slice` in
ubtree_vllm/vllm/attention/exact_rows.py, which serves the exact form.

GPU only (FlashAttention 3); the pure helpers are tested on the CPU.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubtree_vllm.vllm.attention.exact_rows import (FA3_MAX_SPLITS, decode_scheduler_metadata, fa3_split_counts,
                                                   num_sms, split_count_slice)


@dataclass(frozen=True)
class VirtualRowsResult:
    shape_name: str
    context_len: int
    batch_mismatch: float
    pinned_mismatch: float
    # FA3's own batch metadata held this module's predicted batch split counts
    layout_confirmed: bool
    lone_splits: tuple[int, int]  # min, max over the rows


def measure(shape: Any, context_len: int, device: torch.device, seed: int = 0) -> VirtualRowsResult:
    """The three computations of one shape and context (GPU only; module docstring)."""
    from ubtree_vllm.bench.attention_bench import tree_inputs
    from ubtree_vllm.bench.attention_numerics import flash_decode_rows, path_sequences, plain_decode_attention

    inputs = tree_inputs(context_len, device, shape=shape, seed=seed)
    seqs = path_sequences(inputs, context_len)
    num_rows, num_heads, head_size = seqs.query.shape
    kv_heads, sms = seqs.key_cache.shape[2], num_sms(device)

    every_row = slice(0, num_rows)
    lone = plain_decode_attention(seqs, inputs.scale, num_splits=FA3_MAX_SPLITS, fa_version=3)
    batch = torch.empty_like(seqs.query)
    flash_decode_rows(seqs, inputs.scale, every_row, batch, num_splits=FA3_MAX_SPLITS, fa_version=3)

    metadata = decode_scheduler_metadata(seqs.seq_lens, int(seqs.seq_lens.max()), num_heads, kv_heads, head_size,
                                         seqs.query.dtype, seqs.key_cache.shape[1], FA3_MAX_SPLITS)
    counts = split_count_slice(num_rows)
    predicted = fa3_split_counts(seqs.seq_lens, head_size, kv_heads, sms, alone=False)
    layout_confirmed = bool(torch.equal(metadata[counts].cpu(), predicted.cpu()))
    lone_splits = fa3_split_counts(seqs.seq_lens, head_size, kv_heads, sms, alone=True)
    metadata[counts] = lone_splits.to(device)
    pinned = torch.empty_like(seqs.query)
    flash_decode_rows(seqs, inputs.scale, every_row, pinned, num_splits=FA3_MAX_SPLITS, fa_version=3,
                      scheduler_metadata=metadata)
    torch.cuda.synchronize(device)
    return VirtualRowsResult(shape.name, context_len, float((batch != lone).float().mean()),
                             float((pinned != lone).float().mean()), layout_confirmed,
                             (int(lone_splits.min()), int(lone_splits.max())))


def virtual_rows_records(results: Sequence[VirtualRowsResult], hardware: str) -> list[dict[str, Any]]:
    """Per shape and context: the two mismatch fractions (module docstring)."""
    records = []
    for res in results:
        notes = (f"{res.shape_name} attention shape, bf16, page size 16; context {res.context_len} tokens, one "
                 f"request, a random 64-node tree; every tree row a one-query-row FlashAttention 3 sequence of "
                 f"context + root -> node path; fraction of output elements differing from the same rows decoded "
                 f"one call each (num_splits {FA3_MAX_SPLITS}, as vLLM's plain decoding under FULL graphs); lone "
                 f"split counts {res.lone_splits[0]}-{res.lone_splits[1]}; FA3's batch metadata "
                 + ("held" if res.layout_confirmed else "did NOT hold")
                 + " the predicted batch split counts at the expected offset")
        for metric, value in (("virtual_batch_mismatch", res.batch_mismatch),
                              ("virtual_batch_pinned_mismatch", res.pinned_mismatch)):
            records.append({
                "kind": "microbench", "method": "ubtree", "target": f"{res.shape_name} (context {res.context_len})",
                "metric": metric, "value": round(value, 5), "unit": "fraction", "batch_size": 1,
                "tree_budget": 64, "block_size": 16, "cuda_graphs": False, "hardware": hardware, "notes": notes})
    return records
