"""Rotate 3-D multi-head queries and keys on the CPU with vLLM's own torch rotary embedding.

vLLM 0.32's CPU rotary op (``_C.rotary_embedding``, called by ``RotaryEmbedding.forward_cpu``) rotates
``[tokens, heads * head_size]`` tensors correctly but mis-rotates ``[tokens, heads, head_size]`` ones with more than
one head (probe 2026-12-05: the query's heads come out up to ~7 off ``forward_native``; the single-head key is
right). Most models pass 2-D tensors; DeepSeek-V2/V3's multi-head latent attention passes its query's RoPE part as
a 3-D slice (``model_executor/layers/mla.py``), so on the CPU a DeepSeek target computed another function than its
HF model, and one that differs between one-token decode rows and multi-token rows: vLLM's own n-gram speculation
changed its greedy tokens within a few tokens, not at near-ties. With this patch plain decoding, vLLM's n-gram
speculation and the HF model give the same greedy tokens on a tiny random DeepSeek-V2 (fp32).

This is an engine-stage (process-global) patch that changes plain engines too, on purpose: it fixes the model
function itself, and "token-identical to plain decoding of the same engine" needs both sides to compute it.
2-D inputs and single-head 3-D inputs keep vLLM's op; CPU platform only.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import original_attr_name, replace_attr

NAME = "cpu_rope_multihead"


def _mis_rotated(t: Any) -> bool:
    """vLLM's CPU op mis-rotates this tensor: [tokens, heads > 1, head_size]."""
    return t is not None and t.dim() == 3 and t.shape[1] > 1


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    def forward_cpu(self: Any, positions: Any, query: Any, key: Any = None) -> tuple[Any, Any]:
        if not (_mis_rotated(query) or _mis_rotated(key)):
            return getattr(RotaryEmbedding, original_attr_name("forward_cpu"))(self, positions, query, key)
        rotated_q, rotated_k = self.forward_native(positions, query, key)
        # vLLM's op rotates in place and some callers rely on it: keep that contract.
        query.copy_(rotated_q.view(query.shape))
        if key is not None:
            key.copy_(rotated_k.view(key.shape))
        return query, key

    replace_attr(RotaryEmbedding, "forward_cpu", forward_cpu, NAME)
