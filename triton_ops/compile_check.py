"""Ahead-of-time compile of the Triton kernels for a GPU architecture, without a GPU.

The Triton interpreter (the CPU tests) accepts programs the compiler rejects, so CI also
compiles each kernel to a cubin for Hopper (sm_90) with Triton's bundled ptxas:

    python -m ubtree_vllm.triton_ops.compile_check [--arch 90]

prints one line per configuration and exits non-zero on the first failure. Must run
without ``TRITON_INTERPRET`` (the kernels would be interpreter functions).
"""
from __future__ import annotations

import argparse
import importlib
import inspect
from collections.abc import Callable

import torch

# (dtype, head size, GQA group, KV block size) configurations of tree_attention to compile.
TREE_ATTENTION_CONFIGS = ((torch.bfloat16, 64, 3, 16), (torch.float16, 128, 4, 16), (torch.bfloat16, 256, 8, 16),
                          (torch.float32, 128, 1, 32))
# (dtype, head size, GQA group, KV block size, context splits) of the split form and its combine launch:
# SmolLM2 at batch 1 (16 splits) and a Qwen3-8B layer (7)
TREE_ATTENTION_SPLIT_CONFIGS = ((torch.bfloat16, 64, 3, 16, 16), (torch.bfloat16, 128, 4, 16, 7),
                                (torch.float32, 64, 3, 16, 8))  # fp32: a float32 target on TRITON_ATTN
_POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
_FLOAT_POINTERS = {"out_ptr", "query_ptr", "key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr", "ctx_out_ptr"}


def _compile(module_name: str, kernel_name: str, meta: dict[str, object], kind: Callable[[str], str],
             arch: int) -> int:
    """Compile ``module_name._kernel_name`` with compile-time ``meta`` and argument types ``kind(name)``
    for ``sm_<arch>``; returns the cubin size. Raises on a compile error or too much shared memory."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # the module, not the launcher that the package exports under the same name
    kernel = getattr(importlib.import_module(f"ubtree_vllm.triton_ops.{module_name}"), kernel_name)
    if type(kernel).__name__ == "InterpretedFunction":
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreter functions; unset it")
    names = list(inspect.signature(kernel.fn).parameters)
    source = ASTSource(fn=kernel, signature={n: "constexpr" if n in meta else kind(n) for n in names},
                       constexprs={(names.index(n),): v for n, v in meta.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    shared_limit = 228 * 1024
    if compiled.metadata.shared > shared_limit:
        raise RuntimeError(f"{kernel_name} needs {compiled.metadata.shared} bytes of shared memory > {shared_limit}")
    # A launch specializes an integer argument equal to 1 into a constant (a Python int inside the kernel, where
    # ``x.to(...)`` fails): compile that form too, every integer scalar at 1 (the interpreter never specializes)
    ones = {n: 1 for n in names if n not in meta and kind(n) in ("i32", "i64")}
    if ones:
        triton.compile(ASTSource(fn=kernel, signature={n: "constexpr" if n in meta or n in ones else kind(n)
                                                       for n in names},
                                 constexprs={(names.index(n),): v for n, v in {**meta, **ones}.items()}),
                       target=GPUTarget("cuda", arch, 32))
    return len(compiled.asm["cubin"])


def _tree_attention_kind(dtype: torch.dtype) -> Callable[[str], str]:
    def kind(name: str) -> str:
        if name.endswith("_ptr"):
            return (_POINTER[dtype] if name in _FLOAT_POINTERS else
                    "*fp32" if name.startswith("part_") or name == "ctx_lse_ptr" else "*i64")
        return "fp32" if name == "qk_scale" else "i64" if name.startswith("stride") else "i32"
    return kind


def compile_tree_attention(dtype: torch.dtype, head_size: int, group: int, block_size: int, arch: int,
                           num_splits: int = 1, context_given: bool = False) -> int:
    """`_tree_attention_kernel` with the launcher's compile-time parameters; returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_attention import launch_meta

    return _compile("tree_attention", "_tree_attention_kernel",
                    launch_meta(group, head_size, block_size, dtype, num_splits, context_given),
                    _tree_attention_kind(dtype), arch)


def compile_tree_attention_combine(dtype: torch.dtype, head_size: int, num_splits: int, arch: int) -> int:
    """`_tree_attention_combine_kernel` as the launcher compiles it; returns the cubin size."""
    meta = {"HEAD_SIZE": head_size, "NUM_SPLITS": num_splits, "SPLITS_PAD": 1 << (num_splits - 1).bit_length()}
    return _compile("tree_attention", "_tree_attention_combine_kernel", meta, _tree_attention_kind(dtype), arch)


def compile_node_inputs(arch: int) -> int:
    """`_node_inputs_kernel` with MRV2's dtypes (int32 ids and index rows, int64 positions); returns the cubin size."""
    from ubtree_vllm.triton_ops.node_inputs import BLOCK

    pointers = {"token_ptr": "*i32", "pos_ptr": "*i64", "input_ids_ptr": "*i32", "positions_ptr": "*i64"}
    return _compile("node_inputs", "_node_inputs_kernel", {"BLOCK": BLOCK},
                    lambda name: pointers.get(name, "*i32") if name.endswith("_ptr") else "i32", arch)


def compile_lookup_chain(min_n: int, max_n: int, gamma: int, arch: int) -> tuple[int, int]:
    """`_lookup_scan_kernel` and `_lookup_finalize_kernel` with MRV2's dtypes (int32 token history and lengths,
    int64 slots); returns their cubin sizes."""
    from ubtree_vllm.triton_ops.lookup_chain import BLOCK_L

    pointers = {"token_ids_ptr": "*i32", "total_len_ptr": "*i32", "slots_ptr": "*i64", "scratch_ptr": "*i64",
                "stage_ptr": "*i32", "chain_ptr": "*i64", "chain_len_ptr": "*i64"}

    def kind(name: str) -> str:
        return pointers[name] if name.endswith("_ptr") else "i32"

    scan = _compile("lookup_chain", "_lookup_scan_kernel",
                    {"MIN_N": min_n, "MAX_N": max_n, "MAX_N_PAD": 1 << (max_n - 1).bit_length(), "BLOCK_L": BLOCK_L},
                    kind, arch)
    finalize = _compile("lookup_chain", "_lookup_finalize_kernel",
                        {"GAMMA": gamma, "GAMMA_PAD": 1 << (gamma - 1).bit_length(), "BLOCKS_PAD": 8}, kind, arch)
    return scan, finalize


def compile_inject_chain(gamma: int, top_k: int, arch: int) -> int:
    """`_inject_chain_kernel` with the drafter's dtypes (int64 candidates and chains, fp32 edges); returns the cubin
    size."""
    pointers = {"cand_ptr": "*i64", "root_ptr": "*fp32", "trans_ptr": "*fp32", "chain_ptr": "*i64",
                "chain_len_ptr": "*i64", "out_tokens_ptr": "*i64", "out_root_ptr": "*fp32", "out_trans_ptr": "*fp32"}

    def kind(name: str) -> str:
        return pointers[name] if name.endswith("_ptr") else "fp32" if name in ("edge_logprob", "neg_inf") else "i64"

    return _compile("lookup_chain", "_inject_chain_kernel",
                    {"GAMMA": gamma, "K": top_k, "K_PAD": 1 << (top_k - 1).bit_length()}, kind, arch)


def compile_vocab_top_k(dtype: torch.dtype, has_noise: bool, use_fp64: bool, top_k: int, arch: int) -> int:
    """`_block_top_k_kernel` with the drafter's dtypes (``dtype`` logits, fp32 temperatures, int64 seeds and
    positions); returns the cubin size."""
    from ubtree_vllm.triton_ops.vocab_top_k import BLOCK

    pointers = {"logits_ptr": _POINTER[dtype], "temperature_ptr": "*fp32", "seeds_ptr": "*i64", "pos_ptr": "*i64",
                "top_score_ptr": "*fp32", "top_token_ptr": "*i32", "block_max_ptr": "*fp32", "block_sum_ptr": "*fp32"}
    return _compile("vocab_top_k", "_block_top_k_kernel",
                    {"BLOCK": BLOCK, "K_PAD": 1 << (top_k - 1).bit_length(), "HAS_NOISE": has_noise,
                     "USE_FP64": use_fp64}, lambda name: pointers.get(name, "i32"), arch)


_TREE_PENALTIES_KINDS = {"logits_ptr": "*fp32", "state_ptr": "*i64", "local_pos_ptr": "*i32", "token_ptr": "*i32",
                         "parents_ptr": "*i32", "repetition_ptr": "*fp32", "frequency_ptr": "*fp32",
                         "presence_ptr": "*fp32", "prompt_mask_ptr": "*i32", "counts_ptr": "*i32"}


def compile_tree_penalties(max_depth: int, arch: int) -> int:
    """`_tree_penalties_kernel` with MRV2's dtypes (fp32 logits, int32 tokens and counts); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_penalties import BLOCK

    return _compile("tree_penalties", "_tree_penalties_kernel", {"MAX_DEPTH": max_depth, "BLOCK": BLOCK},
                    lambda name: _TREE_PENALTIES_KINDS.get(name, "i32"), arch)


_TREE_BAD_WORDS_KINDS = {"logits_ptr": "*fp32", "state_ptr": "*i64", "all_token_ids_ptr": "*i32"}


def compile_tree_bad_words(arch: int) -> int:
    """`_tree_bad_words_kernel` with MRV2's dtypes (fp32 logits, int32 tokens, words and lengths); the cubin size."""
    return _compile("tree_bad_words", "_tree_bad_words_kernel", {},
                    lambda name: _TREE_BAD_WORDS_KINDS.get(name, "*i32") if name.endswith("_ptr") else "i32", arch)


# (cache dtype, H_kv, E) configurations of kv_path_commit to compile.
KV_PATH_COMMIT_CONFIGS = ((torch.bfloat16, 8, 256), (torch.float16, 3, 128), (torch.float32, 3, 128))
_KV_PATH_COMMIT_KINDS = {"kv_cache_ptrs": "*i64", "src_slot_ptr": "*i64", "dst_slot_ptr": "*i64",
                         "moves_ptr": "*i1", "num_depths": "i32", "block_size": "i32"}


def compile_kv_path_commit(dtype: torch.dtype, heads: int, elems: int, arch: int) -> int:
    """`_kv_path_commit_kernel` as its launcher compiles it; returns the cubin size."""
    from ubtree_vllm.triton_ops.kv_path_commit import launch_meta

    return _compile("kv_path_commit", "_kv_path_commit_kernel", launch_meta(dtype, heads, elems),
                    lambda name: _KV_PATH_COMMIT_KINDS.get(name, "i64"), arch)


# (cache dtype, H_kv, head size) configurations of scratch_rows (flash_exact) to compile: SmolLM2, Qwen3-8B
SCRATCH_ROWS_CONFIGS = ((torch.bfloat16, 3, 64), (torch.float16, 8, 128))


def compile_scratch_rows(dtype: torch.dtype, heads: int, head_size: int, arch: int) -> int:
    """`_scratch_rows_kernel` as its launcher compiles it (int64 copy lists); returns the cubin size."""
    from ubtree_vllm.triton_ops.scratch_rows import launch_meta

    def kind(name: str) -> str:
        if name in ("key_cache_ptr", "value_cache_ptr", "key_ptr", "value_ptr"):
            return _POINTER[dtype]
        return "*i64" if name.endswith("_ptr") else "i32" if name in ("num_tail", "num_path", "skip_page") else "i64"

    return _compile("scratch_rows", "_scratch_rows_kernel", launch_meta(heads, head_size), kind, arch)


_VIRTUAL_ROWS_POINTERS = {"block_table_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                          "tree_ptr": "*i1", "root_ptr": "*i1", "cu_seqlens_q_ptr": "*i32", "keys_ptr": "*i32",
                          "table_ptr": "*i32", "splits_ptr": "*i32"}


def compile_virtual_rows(block_size: int, pages_per_row: int, path_width: int, key_block: int, arch: int) -> int:
    """`_virtual_rows_kernel` (flash_exact's layout) as its launcher compiles it; returns the cubin size."""
    from ubtree_vllm.triton_ops.virtual_rows import launch_meta

    def kind(name: str) -> str:
        if name.endswith("_ptr"):
            return _VIRTUAL_ROWS_POINTERS.get(name, "*i64")
        if name in ("num_kv_heads", "num_sms"):
            return "fp32"
        return "i64" if name.startswith("stride") else "i32"

    return _compile("virtual_rows", "_virtual_rows_kernel",
                    launch_meta(block_size, pages_per_row, path_width, key_block), kind, arch)


_TREE_PREFILL_MASK_POINTERS = {"seq_lens_ptr": "*i32", "kv_pages_ptr": "*i32", "out_mask_ptr": "*u8"}


def compile_tree_prefill_mask(arch: int) -> int:
    """`_tree_prefill_mask_kernel` (FlashInfer's packed tree mask) as its launcher compiles it (int32 lengths and
    pages, int64 rows, paths and byte offsets; the launcher's default tile); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_prefill_mask import launch_meta

    def kind(name: str) -> str:
        if name.endswith("_ptr"):
            return _TREE_PREFILL_MASK_POINTERS.get(name, "*i64")
        return "i64" if name.startswith("stride") else "i32"

    return _compile("tree_prefill_mask", "_tree_prefill_mask_kernel", launch_meta(), kind, arch)


def compile_paged_kv_indices(arch: int) -> int:
    """`_paged_kv_indices_kernel` (FlashInfer's flat page list) as its launcher compiles it (int32 tables and
    lists; the launcher's default tile); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_prefill_mask import indices_launch_meta

    return _compile("tree_prefill_mask", "_paged_kv_indices_kernel", indices_launch_meta(),
                    lambda name: "*i32" if name.endswith("_ptr") else "i64" if name.startswith("stride") else "i32",
                    arch)


def compile_tree_accept(max_depth: int, num_nodes: int, arch: int) -> int:
    """`_tree_accept_kernel` as its launcher compiles it (int64 trees); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_accept import launch_meta

    return _compile("tree_accept", "_tree_accept_kernel", launch_meta(max_depth, num_nodes),
                    lambda name: "*i64" if name.endswith("_ptr") else "i32" if name == "num_nodes" else "i64", arch)


_TREE_SEARCH_POINTERS = {"anchor_ptr": "*i64", "cand_ptr": "*i64", "root_ptr": "*fp32", "trans_ptr": "*fp32",
                         "scratch_ptr": "*i32", "key_scratch_ptr": "*i64", "out_tokens_ptr": "*i64", "out_parents_ptr": "*i64",
                         "out_depth_ptr": "*i64", "out_scores_ptr": "*fp32"}


def compile_tree_search(gamma: int, top_k: int, beam_width: int, budget: int, arch: int) -> int:
    """`_tree_search_kernel` as its launcher compiles it (fp32 log-probs); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_search import launch_meta

    return _compile("tree_search", "_tree_search_kernel", launch_meta(gamma, top_k, beam_width, budget),
                    lambda name: _TREE_SEARCH_POINTERS.get(name, "i64"), arch)


def compile_tree_accept_rows(max_depth: int, num_nodes: int, arch: int) -> int:
    """`_tree_accept_rows_kernel` with MRV2's dtypes (int32 rows and topology, int64 draws); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_accept import launch_meta

    pointers = {"tokens_ptr": "*i32", "cu_ptr": "*i32", "idx_mapping_ptr": "*i32", "parents_ptr": "*i32",
                "seq_lens_ptr": "*i32", "prefill_len_ptr": "*i32", "num_sampled_ptr": "*i32",
                "num_rejected_ptr": "*i32"}
    return _compile("tree_accept", "_tree_accept_rows_kernel", launch_meta(max_depth, num_nodes),
                    lambda name: pointers.get(name, "*i64") if name.endswith("_ptr") else "i64", arch)


# MRV2's InputBatch dtypes: positions and slot mappings int64, the other index tensors int32.
_TREE_LAYOUT_POINTERS = {"positions_ptr": "*i64", "logits_indices_ptr": "*i32", "cu_ptr": "*i32",
                         "state_ptr": "*i32", "local_pos_ptr": "*i32", "parents_ptr": "*i32", "depth_ptr": "*i32"}


def compile_tree_layout(max_depth: int, arch: int, cover_rows: bool = False) -> int:
    """`_tree_layout_kernel` as its launcher compiles it (int64 row buffers); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_layout import launch_meta

    def kind(name: str) -> str:
        return _TREE_LAYOUT_POINTERS.get(name, "*i64") if name.endswith("_ptr") else \
            "i64" if name.startswith("stride") else "i32"

    return _compile("tree_layout", "_tree_layout_kernel", launch_meta(max_depth, cover_rows), kind, arch)


def compile_commit_accepted(max_depth: int, dtype: torch.dtype, heads: int, elems: int, write_pos: bool,
                            arch: int) -> int:
    """`_commit_accepted_kernel` with MRV2's dtypes (int32 logits rows, int64 slots and positions); returns the
    cubin size."""
    from ubtree_vllm.triton_ops.accepted_rows import launch_meta

    pointers = {"logits_indices_ptr": "*i32", "cu_ptr": "*i32"}

    def kind(name: str) -> str:
        if name.endswith("_ptr") or name == "kv_cache_ptrs":
            return pointers.get(name, "*i64")
        return "i32" if name in ("num_layers", "block_size") else "i64"

    return _compile("accepted_rows", "_commit_accepted_kernel", launch_meta(max_depth, dtype, heads, elems, write_pos),
                    kind, arch)


def compile_tree_delta_rule(dk: int, dv: int, per_channel: bool, delta: bool, arch: int) -> int:
    """`_tree_delta_rule_kernel` with the launcher's tile sizes (bf16 q/k/v/g/beta); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_delta_rule import launch_meta

    def kind(name: str) -> str:
        if name.endswith("_ptr"):
            return {"parents_ptr": "*i64", "h0_ptr": "*fp32", "hs_ptr": "*fp32"}.get(name, "*bf16")
        return "fp32" if name == "scale" else "i32"

    return _compile("tree_delta_rule", "_tree_delta_rule_kernel", launch_meta(dk, dv, 16, per_channel, delta), kind, arch)


def compile_tree_delta_rule_paths(dk: int, dv: int, per_channel: bool, delta: bool, max_depth: int, commit: bool,
                                  arch: int) -> int:
    """`_tree_delta_rule_paths_kernel` (the path-recompute form; outputs, or the commit into a float32 state
    cache) with the launcher's tile sizes (bf16 q/k/v/g/beta); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_delta_rule_paths import paths_launch_meta

    def kind(name: str) -> str:
        if name.endswith("_ptr"):
            out = "*fp32" if commit else "*bf16"
            return {"parents_ptr": "*i64", "node_ptr": "*i64", "slot_ptr": "*i64", "h0_ptr": "*fp32",
                    "out_ptr": out}.get(name, "*bf16")
        return "fp32" if name == "scale" else "i32"

    return _compile("tree_delta_rule_paths", "_tree_delta_rule_paths_kernel",
                    paths_launch_meta(dk, dv, 16, per_channel, delta, max_depth, commit), kind, arch)


def compile_tree_conv(channels: int, width: int, arch: int) -> int:
    """`_tree_conv_kernel` with the launcher's tile size (bf16 inputs, bias, SiLU); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_conv import launch_meta

    return _compile("tree_conv", "_tree_conv_kernel", launch_meta(channels, width, True, "silu"),
                    lambda name: ("*i64" if name == "parents_ptr" else "*bf16") if name.endswith("_ptr") else "i32",
                    arch)


def compile_tree_mla_attention(latent: int, rope: int, path_len: int, block_size: int, arch: int) -> int:
    """`_tree_mla_attention_kernel` with the launcher's tiles (bf16); returns the cubin size."""
    from ubtree_vllm.triton_ops.tree_mla_attention import launch_meta

    index_ptrs = {"block_table_ptr": "*i32", "row_index_ptr": "*i64", "row_req_ptr": "*i64",
                  "row_context_len_ptr": "*i64", "row_path_ptr": "*i64"}

    def kind(name: str) -> str:
        if name.endswith("_ptr"):
            return index_ptrs.get(name, "*bf16")
        return "fp32" if name == "qk_scale" else "i32"

    return _compile("tree_mla_attention", "_tree_mla_attention_kernel",
                    launch_meta(latent, rope, path_len, block_size, torch.bfloat16), kind, arch)


_HEAD_LOSS_ROWS_KINDS = {"labels_ptr": "*i64", "row_weight_ptr": "*fp32", "stats_ptr": "*fp32", "top1_ptr": "*i64",
                         "kl_weight": "fp32", "ce_weight": "fp32", "softcap": "fp32", "vocab": "i32"}


def compile_head_loss_rows(vocab: int, softcap: float | None, arch: int) -> int:
    """`_head_loss_rows_kernel` as its launcher compiles it (bf16 logits and gradient); returns the cubin size."""
    from ubtree_vllm.triton_ops.head_loss_rows import launch_meta

    return _compile("head_loss_rows", "_head_loss_rows_kernel", launch_meta(vocab, softcap),
                    lambda name: _HEAD_LOSS_ROWS_KINDS.get(name, "*bf16" if name.endswith("_ptr") else "i64"), arch)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 90 for Hopper")
    args = parser.parse_args()
    import triton

    print(f"triton {triton.__version__} from {triton.__file__}")
    for dtype, head_size, group, block_size in TREE_ATTENTION_CONFIGS:
        size = compile_tree_attention(dtype, head_size, group, block_size, args.arch)
        print(f"tree_attention sm_{args.arch} {str(dtype).removeprefix('torch.')} head {head_size} "
              f"group {group} block {block_size}: cubin {size} bytes")
    size = compile_tree_attention(torch.bfloat16, 64, 3, 16, args.arch, context_given=True)
    print(f"tree_attention sm_{args.arch} bfloat16 head 64 group 3 block 16, context given: cubin {size} bytes")
    for dtype, head_size, group, block_size, splits in TREE_ATTENTION_SPLIT_CONFIGS:
        size = compile_tree_attention(dtype, head_size, group, block_size, args.arch, splits)
        combine = compile_tree_attention_combine(dtype, head_size, splits, args.arch)
        print(f"tree_attention sm_{args.arch} {str(dtype).removeprefix('torch.')} head {head_size} group {group} "
              f"block {block_size} {splits} splits: cubin {size} bytes, combine cubin {combine} bytes")
    size = compile_node_inputs(args.arch)
    print(f"node_inputs sm_{args.arch}: cubin {size} bytes")
    scan, finalize = compile_lookup_chain(2, 4, 16, args.arch)
    print(f"lookup_chain sm_{args.arch} n 2..4 gamma 16: scan cubin {scan} bytes, finalize cubin {finalize} bytes")
    size = compile_inject_chain(16, 64, args.arch)
    print(f"inject_chain sm_{args.arch} gamma 16 K 64: cubin {size} bytes")
    for dtype, has_noise, use_fp64, top_k in ((torch.bfloat16, False, False, 64), (torch.bfloat16, True, False, 64),
                                              (torch.bfloat16, True, True, 64), (torch.float32, True, False, 64),
                                              (torch.float32, True, False, 1)):
        size = compile_vocab_top_k(dtype, has_noise, use_fp64, top_k, args.arch)
        noise = (" fp64 noise" if use_fp64 else " noise") if has_noise else ""
        print(f"vocab_top_k sm_{args.arch} {str(dtype).removeprefix('torch.')} K {top_k}{noise}: cubin {size} bytes")
    size = compile_tree_penalties(16, args.arch)
    print(f"tree_penalties sm_{args.arch} depth 16: cubin {size} bytes")
    size = compile_tree_bad_words(args.arch)
    print(f"tree_bad_words sm_{args.arch}: cubin {size} bytes")
    for dtype, heads, elems in KV_PATH_COMMIT_CONFIGS:
        size = compile_kv_path_commit(dtype, heads, elems, args.arch)
        print(f"kv_path_commit sm_{args.arch} {str(dtype).removeprefix('torch.')} heads {heads} elems {elems}: "
              f"cubin {size} bytes")
    for dtype, heads, head_size in SCRATCH_ROWS_CONFIGS:
        size = compile_scratch_rows(dtype, heads, head_size, args.arch)
        print(f"scratch_rows sm_{args.arch} {str(dtype).removeprefix('torch.')} heads {heads} head {head_size}: "
              f"cubin {size} bytes")
    for block_size, pages, path_width, key_block in ((16, 3, 17, 192), (16, 2, 9, 128)):  # SmolLM2 / Qwen3-8B heads
        size = compile_virtual_rows(block_size, pages, path_width, key_block, args.arch)
        print(f"virtual_rows sm_{args.arch} block {block_size} pages {pages} path {path_width} key block {key_block}: "
              f"cubin {size} bytes")
    size = compile_tree_prefill_mask(args.arch)
    print(f"tree_prefill_mask sm_{args.arch}: cubin {size} bytes")
    size = compile_paged_kv_indices(args.arch)
    print(f"paged_kv_indices sm_{args.arch}: cubin {size} bytes")
    for max_depth, num_nodes in ((16, 65), (8, 17)):
        size = compile_tree_accept(max_depth, num_nodes, args.arch)
        print(f"tree_accept sm_{args.arch} depth {max_depth} nodes {num_nodes}: cubin {size} bytes")
    for gamma, top_k, beam_width, budget in ((16, 64, 12, 64), (8, 16, 4, 16), (4, 8, 1, 4)):
        size = compile_tree_search(gamma, top_k, beam_width, budget, args.arch)
        print(f"tree_search sm_{args.arch} gamma {gamma} K {top_k} W {beam_width} B {budget}: cubin {size} bytes")
    for max_depth, num_nodes in ((16, 65), (8, 17)):
        size = compile_tree_accept_rows(max_depth, num_nodes, args.arch)
        print(f"tree_accept_rows sm_{args.arch} depth {max_depth} nodes {num_nodes}: cubin {size} bytes")
    for max_depth, cover_rows in ((16, False), (16, True), (4, False)):
        size = compile_tree_layout(max_depth, args.arch, cover_rows)
        print(f"tree_layout sm_{args.arch} depth {max_depth}{' cover_rows' if cover_rows else ''}: cubin {size} bytes")
    for max_depth, (dtype, heads, elems), write_pos in ((16, KV_PATH_COMMIT_CONFIGS[0], True),
                                                         (5, KV_PATH_COMMIT_CONFIGS[1], False),
                                                         (16, KV_PATH_COMMIT_CONFIGS[2], True)):
        size = compile_commit_accepted(max_depth, dtype, heads, elems, write_pos, args.arch)
        print(f"commit_accepted sm_{args.arch} depth {max_depth} {str(dtype).removeprefix('torch.')} heads {heads} "
              f"elems {elems}{' positions' if write_pos else ''}: cubin {size} bytes")
    for dk, dv, per_channel, delta in ((128, 128, False, True), (128, 128, True, True), (128, 64, False, False)):
        size = compile_tree_delta_rule(dk, dv, per_channel, delta, args.arch)  # GDN, KDA, Mamba2 heads
        print(f"tree_delta_rule sm_{args.arch} Dk {dk} Dv {dv} {'per-channel' if per_channel else 'per-head'} gate "
              f"{'delta' if delta else 'ssm'}: cubin {size} bytes")
    for (dk, dv, per_channel, delta), commit in (((128, 128, False, True), False), ((128, 128, False, True), True),
                                                 ((128, 128, True, True), False), ((128, 64, False, False), False)):
        size = compile_tree_delta_rule_paths(dk, dv, per_channel, delta, 16, commit, args.arch)
        print(f"tree_delta_rule_paths sm_{args.arch} Dk {dk} Dv {dv} {'per-channel' if per_channel else 'per-head'} "
              f"gate {'delta' if delta else 'ssm'} depth 16{' commit' if commit else ''}: cubin {size} bytes")
    size = compile_tree_mla_attention(512, 64, 17, 64, args.arch)  # DeepSeek / Ling-3.0 MLA, 16-deep trees
    print(f"tree_mla_attention sm_{args.arch} latent 512 rope 64 path 17 block 64: cubin {size} bytes")
    size = compile_tree_conv(4096, 4, args.arch)
    print(f"tree_conv sm_{args.arch} channels 4096 width 4: cubin {size} bytes")
    for vocab, softcap in ((49152, None), (151936, 30.0)):
        size = compile_head_loss_rows(vocab, softcap, args.arch)
        print(f"head_loss_rows sm_{args.arch} vocab {vocab} {'softcap' if softcap else 'plain'}: cubin {size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
