"""`ubtree bench microbench --which tree-attention-numerics`: how far the tree rows' attention is from exact, and from
what plain decoding computes for the same tokens (issue 19: why UBTree's bf16 greedy output parts from plain
decoding's more often than vLLM's chain methods).

One request, a random 64-node tree over a committed context of C tokens (the tree and inputs of
tree-attention-vs-flash: bench/attention_bench.py), bf16, page size 16, at two attention shapes: Qwen3-8B (32 query
heads, 8 KV heads, head size 128) and SmolLM2-135M (9, 3, 64; the benchmarked target). For every tree row (the 64
non-root nodes), four outputs from the same inputs:

  exact  fp32 attention over the context and the root -> node path (`triton_ops.reference.tree_attention_reference`)
  tree   `triton_ops.tree_attention`, as `tree_attention: "triton"` serves the tree rows
  merge  `tree_attention: "flash_merge"`: FlashAttention over the context, the kernel adding the path
  plain  what plain decoding computes for that token: FlashAttention with one query row over a sequence of the
         context followed by the node's path, the path's K/V in pages of its own after the context's (shared)
         pages; one call per node, at batch 1 like a lone request's decode step (FlashAttention's split heuristics
         depend on the batch); `num_splits=0`, FlashAttention's own heuristic

Metrics per shape and context, in bf16 units in the last place of the exact value (unit "ulp"; mean over every
element of every tree row; the notes give the 99.9th percentile and the maximum):

  tree_attention_error_ulp   |tree - exact|
  flash_merge_error_ulp      |merge - exact|
  plain_attention_error_ulp  |plain - exact|
  tree_plain_mismatch        fraction of elements where tree and plain differ (unit "fraction")

A tree kernel no farther from exact than plain decoding's FlashAttention means attention is not what makes outputs
part more often. The other suspect is the linear layers' batch shape: a verification multiplies 1 + B rows per
request where plain decoding multiplies one, and the GEMM a library picks (and its accumulation order) depends on the
row count, so the same row can come out with other bits, in the hidden states and in the K/V cached for accepted
nodes. Per shape, for each of the target's linear layers (q/k/v, o, gate/up, down) and row counts M = 9, 17, 65
(vLLM's n-gram at k = 8, a 16-token chain, a 64-node tree):

  linear_rows_mismatch   fraction of output elements of ``F.linear(x[:M], W)`` (bf16) that differ from the same
                         rows multiplied one at a time (unit "fraction"; target "<shape> <layer> (rows M)")

GPU only (FlashAttention, cuBLAS); the pure helpers here are tested on the CPU.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubtree_vllm.bench.attention_bench import QWEN3_8B_ATTENTION, AttentionShape, merge_launch, tree_inputs

SMOLLM2_ATTENTION = AttentionShape("smollm2-135m", num_heads=9, num_kv_heads=3, head_size=64, block_size=16,
                                   dtype=torch.bfloat16)
SHAPES = (QWEN3_8B_ATTENTION, SMOLLM2_ATTENTION)
# shape name -> (hidden size, MLP intermediate size) of the target (config.json)
LINEAR_SIZES = {"qwen3-8b": (4096, 12288), "smollm2-135m": (576, 1536)}
VERIFY_ROWS = (9, 17, 65)  # n-gram k = 8, a 16-token chain, a 64-node tree: rows per request of one verification
BF16_MANTISSA_BITS = 7
_MIN_EXPONENT = -125  # frexp exponent of bf16's smallest normal (2^-126 = 0.5 * 2^-125)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """fp32 tensor: the spacing of bf16 values at |x| (2^(floor(log2 |x|) - 7)); zeros and subnormals get the
    smallest normal's spacing."""
    _, exponent = torch.frexp(x.float())  # |x| = m * 2^e, m in [0.5, 1): floor(log2 |x|) = e - 1; zero: e = 0
    exponent = torch.where(x == 0, _MIN_EXPONENT, exponent).clamp(min=_MIN_EXPONENT)
    return torch.ldexp(torch.ones_like(x, dtype=torch.float32), exponent - 1 - BF16_MANTISSA_BITS)


def ulp_errors(got: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """[numel] fp32: |got - exact| in bf16 ulps of exact, elementwise."""
    return ((got.float() - exact.float()).abs() / bf16_ulp(exact)).flatten()


@dataclass(frozen=True)
class PathSequences:
    """Every tree row as a lone decode request: its query row and a paged sequence of context + path."""

    # [N, H, D] the tree rows' queries
    query: torch.Tensor
    # [num_blocks', block_size, H_kv, D] contiguous: the original cache's blocks, then the paths' pages
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    # [N, context_blocks + path_blocks] int32: the context's blocks (shared), then the row's own
    block_table: torch.Tensor
    # [N] int32: context + path length (the node's position + 1)
    seq_lens: torch.Tensor


def path_sequences(inputs: Any, context_len: int) -> PathSequences:
    """The tree rows of one request's ``TreeAttentionInputs`` as plain decoding would hold them: row r's K/V
    sequence is the request's ``context_len`` committed tokens (its first ``context_len / block_size`` blocks) and
    then the K/V of its root -> node path, written into fresh blocks after the original cache's."""
    block_size = inputs.key_cache.shape[1]
    if bool((inputs.row_context_len != context_len).any()):
        raise ValueError(f"every tree row must have the committed context {context_len} (one request's rows)")
    if context_len % block_size:
        raise ValueError(f"context_len {context_len} must be a multiple of the page size {block_size} (the paths' "
                         "pages follow the context's whole pages)")
    paths = inputs.row_path.long()  # [N, P], root first, -1 padded
    num_rows, width = paths.shape
    path_blocks = -(-width // block_size)
    context_blocks = context_len // block_size
    num_old = inputs.key_cache.shape[0]
    device = inputs.key_cache.device
    fresh = torch.arange(num_rows * path_blocks, device=device).view(num_rows, path_blocks) + num_old
    used = paths >= 0  # [N, P]
    slot = (torch.arange(num_rows, device=device)[:, None] * path_blocks * block_size
            + torch.arange(width, device=device)[None, :])[used]  # the fresh slot of each used path entry
    source = paths[used]  # ... and the forward row it copies

    def extend(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        extra = torch.zeros(num_rows * path_blocks * block_size, *cache.shape[2:], dtype=cache.dtype, device=device)
        extra[slot] = rows[source]
        return torch.cat([cache.contiguous(), extra.view(-1, block_size, *cache.shape[2:])])

    request = inputs.row_req.long()
    context = inputs.block_table[request, :context_blocks].to(torch.int32)  # [N, context_blocks]
    return PathSequences(query=inputs.query[inputs.row_index.long()],
                         key_cache=extend(inputs.key_cache, inputs.key),
                         value_cache=extend(inputs.value_cache, inputs.value),
                         block_table=torch.cat([context, fresh.to(torch.int32)], dim=1),
                         seq_lens=(context_len + used.sum(dim=1)).to(torch.int32))


def path_sequences_reference(seqs: PathSequences, scale: float) -> torch.Tensor:
    """[N, H, D] fp32: each row's exact attention over its paged sequence (the tree reference with no path rows)."""
    from ubtree_vllm.triton_ops.reference import tree_attention_reference

    num_rows, _, head_size = seqs.query.shape
    rows = torch.arange(num_rows, device=seqs.query.device)
    empty = torch.empty(0, seqs.key_cache.shape[2], head_size, dtype=seqs.key_cache.dtype, device=rows.device)
    out = torch.zeros(seqs.query.shape, dtype=torch.float32, device=rows.device)
    return tree_attention_reference(seqs.query, empty, empty, seqs.key_cache, seqs.value_cache, seqs.block_table,
                                    rows, rows, seqs.seq_lens, torch.full((num_rows, 1), -1, device=rows.device),
                                    scale, out)


def flash_decode_rows(seqs: PathSequences, scale: float, rows: slice, out: torch.Tensor, *, num_splits: int,
                      fa_version: int, scheduler_metadata: torch.Tensor | None = None) -> None:
    """One FlashAttention call over ``rows`` of ``seqs``, each row a sequence of its own with one query row, into
    ``out[rows]``."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    lens = seqs.seq_lens[rows]
    flash_attn_varlen_func(
        q=seqs.query[rows], k=seqs.key_cache, v=seqs.value_cache, out=out[rows],
        cu_seqlens_q=torch.arange(lens.shape[0] + 1, dtype=torch.int32, device=lens.device), max_seqlen_q=1,
        seqused_k=lens, max_seqlen_k=int(lens.max()), softmax_scale=scale, causal=True, alibi_slopes=None,
        window_size=[-1, -1], block_table=seqs.block_table[rows], softcap=0.0,
        scheduler_metadata=scheduler_metadata, fa_version=fa_version, num_splits=num_splits)


def plain_decode_attention(seqs: PathSequences, scale: float, num_splits: int = 0,
                           fa_version: int | None = None) -> torch.Tensor:
    """[N, H, D]: FlashAttention as plain decoding calls it, one lone request (one query row) per tree row;
    ``num_splits`` 0 is FlashAttention's own heuristic, ``fa_version`` None vLLM's choice for the head size."""
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

    if fa_version is None:
        fa_version = get_flash_attn_version(head_size=seqs.query.shape[2])
    out = torch.empty_like(seqs.query)
    for r in range(seqs.query.shape[0]):
        flash_decode_rows(seqs, scale, slice(r, r + 1), out, num_splits=num_splits, fa_version=fa_version)
    return out


@dataclass(frozen=True)
class NumericsResult:
    shape: AttentionShape
    context_len: int
    # method ("tree", "merge", "plain") -> [numel] fp32 ulp errors against exact
    errors: dict[str, torch.Tensor]
    tree_plain_mismatch: float


def measure(shape: AttentionShape, context_len: int, device: torch.device, seed: int = 0) -> NumericsResult:
    """The four outputs of one shape and context (GPU only; see the module docstring)."""
    from ubtree_vllm.triton_ops import tree_attention
    from ubtree_vllm.triton_ops.reference import tree_attention_reference

    inputs = tree_inputs(context_len, device, shape=shape, seed=seed)
    rows = inputs.row_index.long()
    exact = tree_attention_reference(*inputs.args(), torch.zeros(inputs.query.shape, dtype=torch.float32,
                                                                 device=device))[rows]
    tree = tree_attention(*inputs.args(), torch.empty_like(inputs.query))[rows]
    merge = merge_launch(inputs, torch.empty_like(inputs.query))()[rows]
    plain = plain_decode_attention(path_sequences(inputs, context_len), inputs.scale)
    torch.cuda.synchronize(device)
    errors = {name: ulp_errors(value, exact).cpu() for name, value in (("tree", tree), ("merge", merge),
                                                                       ("plain", plain))}
    return NumericsResult(shape, context_len, errors, float((tree != plain).float().mean()))


METRICS = {"tree": "tree_attention_error_ulp", "merge": "flash_merge_error_ulp", "plain": "plain_attention_error_ulp"}


def numerics_records(results: Sequence[NumericsResult], hardware: str) -> list[dict[str, Any]]:
    """Per shape and context: the three mean ulp errors and the tree/plain mismatch (module docstring)."""
    records = []
    for res in results:
        shape = res.shape
        spread = "; ".join(f"{name}: p99.9 {torch.quantile(err[:1 << 24], 0.999).item():.2f}, "
                           f"max {err.max().item():.2f} ulp" for name, err in res.errors.items())
        notes = (f"{shape.name} attention shape: {shape.num_heads} query heads, {shape.num_kv_heads} KV heads, head "
                 f"size {shape.head_size}, bf16, page size {shape.block_size}; context {res.context_len} tokens, one "
                 f"request, a random 64-node tree (depth <= 16); errors in bf16 ulps of the fp32 exact value, mean "
                 f"over every element of the 64 tree rows; tree = Triton tree_attention, merge = flash_merge, plain "
                 f"= FlashAttention with one query row over context + path, one call per node; {spread}")
        values = [(METRICS[name], float(err.mean()), "ulp") for name, err in res.errors.items()]
        values.append(("tree_plain_mismatch", res.tree_plain_mismatch, "fraction"))
        records += [{
            "kind": "microbench", "method": "ubtree", "target": f"{shape.name} (context {res.context_len})",
            "metric": metric, "value": round(value, 5), "unit": unit, "batch_size": 1, "tree_budget": 64,
            "block_size": 16, "cuda_graphs": False, "hardware": hardware, "notes": notes,
        } for metric, value, unit in values]
    return records


def linear_layers(shape: AttentionShape) -> dict[str, tuple[int, int]]:
    """layer name -> (in features, out features) of one decoder layer's linear layers (vLLM's merged forms)."""
    hidden, intermediate = LINEAR_SIZES[shape.name]
    qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_size
    return {"qkv_proj": (hidden, qkv), "o_proj": (shape.num_heads * shape.head_size, hidden),
            "gate_up_proj": (hidden, 2 * intermediate), "down_proj": (intermediate, hidden)}


def rows_mismatch(x: torch.Tensor, weight: torch.Tensor, num_rows: int) -> float:
    """Fraction of ``F.linear(x[:num_rows], weight)``'s elements that differ from the same rows multiplied alone."""
    together = torch.nn.functional.linear(x[:num_rows], weight)
    alone = torch.cat([torch.nn.functional.linear(x[i:i + 1], weight) for i in range(num_rows)])
    return float((together != alone).float().mean())


def linear_records(shape: AttentionShape, device: torch.device, hardware: str, seed: int = 0) -> list[dict[str, Any]]:
    """linear_rows_mismatch of each linear layer of ``shape`` at every VERIFY_ROWS count (module docstring)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    records = []
    for layer, (fan_in, fan_out) in linear_layers(shape).items():
        x = torch.randn(max(VERIFY_ROWS), fan_in, generator=gen, device=device).to(torch.bfloat16)
        weight = (torch.randn(fan_out, fan_in, generator=gen, device=device) * fan_in ** -0.5).to(torch.bfloat16)
        for num_rows in VERIFY_ROWS:
            records.append({
                "kind": "microbench", "method": "ubtree", "target": f"{shape.name} {layer} (rows {num_rows})",
                "metric": "linear_rows_mismatch", "value": round(rows_mismatch(x, weight, num_rows), 5),
                "unit": "fraction", "batch_size": 1, "cuda_graphs": False, "hardware": hardware,
                "notes": (f"F.linear of {num_rows} standard-normal bf16 rows through a {fan_in} -> {fan_out} bf16 "
                          f"weight (std fan_in^-1/2) against the same rows one at a time, as plain decoding "
                          f"multiplies them; fraction of output elements whose bits differ")})
    return records
