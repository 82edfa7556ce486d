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

import torch

# (dtype, head size, GQA group, KV block size) configurations of tree_attention to compile.
TREE_ATTENTION_CONFIGS = ((torch.bfloat16, 64, 3, 16), (torch.float16, 128, 4, 16), (torch.bfloat16, 256, 8, 16),
                          (torch.float32, 128, 1, 32))
_POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}
_FLOAT_POINTERS = {"out_ptr", "query_ptr", "key_ptr", "value_ptr", "key_cache_ptr", "value_cache_ptr"}


def compile_tree_attention(dtype: torch.dtype, head_size: int, group: int, block_size: int, arch: int) -> int:
    """Compile `_tree_attention_kernel` with the launcher's compile-time parameters; returns the cubin size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    # the module, not the launcher that the package exports under the same name
    module = importlib.import_module("ubtree_vllm.triton_ops.tree_attention")
    kernel = module._tree_attention_kernel
    if type(kernel).__name__ == "InterpretedFunction":
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreter functions; unset it")
    meta = module.launch_meta(group, head_size, block_size, dtype)
    names = list(inspect.signature(kernel.fn).parameters)

    def kind(name: str) -> str:
        if name in meta:
            return "constexpr"
        if name.endswith("_ptr"):
            return _POINTER[dtype] if name in _FLOAT_POINTERS else "*i64"
        return "fp32" if name == "qk_scale" else "i64" if name.startswith("stride") else "i32"

    source = ASTSource(fn=kernel, signature={n: kind(n) for n in names},
                       constexprs={(names.index(n),): v for n, v in meta.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32))
    shared_limit = 228 * 1024
    if compiled.metadata.shared > shared_limit:
        raise RuntimeError(f"needs {compiled.metadata.shared} bytes of shared memory > {shared_limit}")
    return len(compiled.asm["cubin"])


# (cache dtype, H_kv, E) configurations of kv_path_commit to compile.
KV_PATH_COMMIT_CONFIGS = ((torch.bfloat16, 8, 256), (torch.float16, 3, 128))


def compile_kv_path_commit(dtype: torch.dtype, heads: int, elems: int, arch: int) -> int:
    """Compile `_kv_path_commit_kernel` as its launcher would; returns the cubin size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = importlib.import_module("ubtree_vllm.triton_ops.kv_path_commit")
    kernel = module._kv_path_commit_kernel
    if type(kernel).__name__ == "InterpretedFunction":
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreter functions; unset it")
    meta = {"ELEMS": elems, "NUM_ELEMS": heads * elems, "BLOCK": min(1024, triton.next_power_of_2(heads * elems)),
            "DTYPE": module._TL_DTYPES[dtype]}
    names = list(inspect.signature(kernel.fn).parameters)
    kinds = {"kv_cache_ptrs": "*i64", "src_slot_ptr": "*i64", "dst_slot_ptr": "*i64", "moves_ptr": "*i1",
             "num_depths": "i32", "block_size": "i32"}
    signature = {n: "constexpr" if n in meta else kinds.get(n, "i64") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in meta.items()})
    return len(triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm["cubin"])


def compile_tree_accept(max_depth: int, nodes_pad: int, arch: int) -> int:
    """Compile `_tree_accept_kernel` as its launcher would (int64 trees); returns the cubin size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = importlib.import_module("ubtree_vllm.triton_ops.tree_accept")
    kernel = module._tree_accept_kernel
    if type(kernel).__name__ == "InterpretedFunction":
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreter functions; unset it")
    meta = {"MAX_DEPTH": max_depth, "NODES_PAD": nodes_pad}
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in meta else "*i64" if n.endswith("_ptr") else
                 "i32" if n == "num_nodes" else "i64" for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in meta.items()})
    return len(triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm["cubin"])


def compile_tree_search(gamma: int, top_k: int, beam_width: int, budget: int, arch: int) -> int:
    """Compile `_tree_search_kernel` as its launcher would (fp32 log-probs); returns the cubin size."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module = importlib.import_module("ubtree_vllm.triton_ops.tree_search")
    kernel = module._tree_search_kernel
    if type(kernel).__name__ == "InterpretedFunction":
        raise RuntimeError("TRITON_INTERPRET is set: the kernels are interpreter functions; unset it")
    nodes = module.beam_node_count(gamma, top_k, beam_width)
    meta = {"GAMMA": gamma, "K": top_k, "K_PAD": triton.next_power_of_2(top_k), "W": beam_width,
            "W_PAD": triton.next_power_of_2(beam_width), "BUDGET": budget, "M_PAD": triton.next_power_of_2(nodes),
            "B_PAD": triton.next_power_of_2(budget)}
    names = list(inspect.signature(kernel.fn).parameters)
    pointers = {"anchor_ptr": "*i64", "cand_ptr": "*i64", "root_ptr": "*fp32", "trans_ptr": "*fp32",
                "scratch_ptr": "*i32", "out_tokens_ptr": "*i64", "out_parents_ptr": "*i64", "out_depth_ptr": "*i64",
                "out_scores_ptr": "*fp32"}
    signature = {n: "constexpr" if n in meta else pointers.get(n, "i64") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in meta.items()})
    return len(triton.compile(source, target=GPUTarget("cuda", arch, 32)).asm["cubin"])


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
    for dtype, heads, elems in KV_PATH_COMMIT_CONFIGS:
        size = compile_kv_path_commit(dtype, heads, elems, args.arch)
        print(f"kv_path_commit sm_{args.arch} {str(dtype).removeprefix('torch.')} heads {heads} elems {elems}: "
              f"cubin {size} bytes")
    for max_depth, nodes_pad in ((16, 128), (8, 32)):
        size = compile_tree_accept(max_depth, nodes_pad, args.arch)
        print(f"tree_accept sm_{args.arch} depth {max_depth} nodes {nodes_pad}: cubin {size} bytes")
    for gamma, top_k, beam_width, budget in ((16, 64, 12, 64), (8, 16, 4, 16)):
        size = compile_tree_search(gamma, top_k, beam_width, budget, args.arch)
        print(f"tree_search sm_{args.arch} gamma {gamma} K {top_k} W {beam_width} B {budget}: cubin {size} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
