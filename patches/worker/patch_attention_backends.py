"""Route the target's attention through the tree-aware subclasses of vLLM's backends.

vLLM's attention registry (``vllm.v1.attention.backends.registry.register_backend``) is
the sanctioned override hook: the CPU platform always resolves ``CPU_ATTN`` (``CPU_MLA`` for
multi-head latent attention) through it,
and the UBTree engine args pin ``FLASH_ATTN`` on CUDA (``TRITON_ATTN`` for a float32 target,
which FlashAttention cannot run; ``FLASH_ATTN_MLA`` for multi-head latent attention). The subclasses behave exactly
like the stock backend unless the UBTree runner has published a tree plan for the
current forward (see :mod:`ubtree_vllm.vllm.attention`), so other engines in the same
process are unaffected. The backend selector caches its answer per process; the cache
is cleared so a selection made before this patch cannot outlive it, and the UBTree
runner checks after model load that every attention layer got the tree-aware impl.
"""
from __future__ import annotations

NAME = "attention_backends"
CPU_BACKEND_PATH = "ubtree_vllm.vllm.attention.cpu.TreeCPUAttentionBackend"
CPU_MLA_BACKEND_PATH = "ubtree_vllm.vllm.attention.cpu_mla.TreeCPUMLABackend"
FLASH_BACKEND_PATH = "ubtree_vllm.vllm.attention.flash.TreeFlashAttentionBackend"
TRITON_BACKEND_PATH = "ubtree_vllm.vllm.attention.triton_attn.TreeTritonAttentionBackend"
FLASH_MLA_BACKEND_PATH = "ubtree_vllm.vllm.attention.flash_mla.TreeFlashAttnMLABackend"


def apply() -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention import selector
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if current_platform.is_cpu():
        overrides = {AttentionBackendEnum.CPU_ATTN: CPU_BACKEND_PATH,
                     AttentionBackendEnum.CPU_MLA: CPU_MLA_BACKEND_PATH}
    elif current_platform.is_cuda():
        overrides = {AttentionBackendEnum.FLASH_ATTN: FLASH_BACKEND_PATH,
                     AttentionBackendEnum.TRITON_ATTN: TRITON_BACKEND_PATH,
                     AttentionBackendEnum.FLASH_ATTN_MLA: FLASH_MLA_BACKEND_PATH}
    else:
        return
    changed = False
    for backend, path in overrides.items():
        if backend.get_path() != path:
            register_backend(backend, path)
            changed = True
    if changed:
        selector._cached_get_attn_backend.cache_clear()
