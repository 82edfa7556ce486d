"""Let vLLM's speculative CPU Gated DeltaNet paths take the conv kernel plain decoding takes.

vLLM 0.32 packs the conv1d weights of a GDN layer for its C++ conv kernel on every CPU with ARM bf16 or
AVX-512 BF16 (``model_executor/layers/utils.py:dispatch_cpu_unquantized_gemm``), and its non-speculative
path runs that kernel on the same CPUs. Its speculation-aware paths (``gdn_attention._spec_aware_nonspec``,
``_spec_aware_nonspec_subset``, ``_spec_forward``) test ``torch.cpu._is_amx_tile_supported() or
is_arm_bf16()`` instead, so on an AVX-512 BF16 CPU without AMX (AMD Zen 4/5) an engine with speculation
prefills every request through the torch conv on the unpacked copy of the weights: other arithmetic than
plain decoding's, and greedy UBTree on a tiny Qwen3-Next then differed from plain decoding from its first
token (not a near-tie, 2026-12-03). The patch rebinds the module-level ``is_arm_bf16`` that those
paths read to vLLM's packing predicate (ARM bf16 or AVX-512 BF16). The non-speculative path already tests
AVX-512 BF16 and is unchanged; so is every CPU with AMX or without AVX-512 BF16.
"""
from __future__ import annotations

from ubtree_vllm.patches._patching import original_attr_name, replace_attr

NAME = "cpu_gdn_native_conv"


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import torch
    import vllm.model_executor.layers.mamba.ops.cpu.gdn_attention as gdn_attention

    def is_arm_bf16() -> bool:  # read as "the packed-weight C++ conv runs here" by the speculation-aware paths
        return bool(getattr(gdn_attention, original_attr_name("is_arm_bf16"))()
                    or torch.cpu._is_avx512_bf16_supported())

    replace_attr(gdn_attention, "is_arm_bf16", is_arm_bf16, NAME)
