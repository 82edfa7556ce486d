"""Reject, at admission, sampling options that tree verification cannot serve exactly.

``SamplingParams._validate_spec_decode(speculative_config)`` is vLLM's own per-request
check for speculative decoding (in 0.32 it rejects exactly ``min_p`` and ``logit_bias``, which
vLLM's chain rejection sampler does not apply to drafts); it runs in ``InputProcessor`` for
every request, in the process that accepts it (``LLM`` or the API server), so a
``VLLMValidationError`` raised here becomes an exception from ``LLM.generate`` or an HTTP 400
from the server -- never different tokens. For the rewritten ``ubtree`` speculative config the
wrapper replaces vLLM's check by :func:`ubtree_vllm.vllm.request_support.unsupported_options`:
both tree samplers apply min_p and logit_bias at every node (so vLLM's rejection is lifted for
``ubtree``; on Model Runner V2 through vLLM's own per-row ``apply_sampling_params`` at the nodes'
depth positions); every other method keeps vLLM's check.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import replace_attr

NAME = "sampling_params_spec_decode"


def apply() -> None:
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams

    from ubtree_vllm.vllm.config import is_ubtree_speculative_config
    from ubtree_vllm.vllm.request_support import unsupported_message, unsupported_options

    original = SamplingParams._validate_spec_decode

    def _validate_spec_decode(self: Any, speculative_config: Any) -> None:
        if not is_ubtree_speculative_config(speculative_config):
            return original(self, speculative_config)
        names = unsupported_options(self)
        if names:
            raise VLLMValidationError(unsupported_message(names), parameter=names[0])

    replace_attr(SamplingParams, "_validate_spec_decode", _validate_spec_decode, NAME)
