"""Which per-request sampling options tree verification serves exactly.

The tree rejection sampler (:mod:`ubtree_vllm.vllm.sampler`) draws the target's token at
every tree node with temperature, top-k and top-p (vLLM semantics) and a per-request
seeded generator when ``seed`` is set. Everything that makes the draw at a node depend
on the tokens *before* it in the flattened batch, or that returns per-token data the
sampler does not compute, would be wrong for a tree, so such requests are rejected at
admission (HTTP 400 in the server) instead of getting different tokens than
non-speculative decoding:

* thinking_token_budget -- a vLLM state machine that assumes a chain of drafts;
* trace replay (trace_decode_token_ids) -- not exercised with trees.

On Model Runner V2 ``allowed_token_ids``, ``logit_bias``, ``min_tokens`` and ``min_p`` are served by
vLLM's own ``Sampler.apply_sampling_params`` at every node: each is a function of the row's request and
position only (min_tokens masks the stop tokens while ``pos + 1 < prompt_len + min_tokens``), and a
node's position is its depth position, the one plain decoding samples that token at
(``ubtree_vllm/vllm/mrv2/rejection_sampler.py``); presence, frequency and repetition penalties count
the outputs plus each node's own path and bad words match against them
(``ubtree_vllm/vllm/mrv2/path_processors.py``); ``logprobs`` and ``logprob_token_ids`` are
scored on the row of the node that drew each emitted token, in every logprobs mode (vLLM's own MRV2
scoring; its chain rejection sampler ignores ``logprob_token_ids``). On the V1 runner
penalties, ``logprobs`` (raw logprobs modes) and ``logprob_token_ids``, ``bad_words``,
``allowed_token_ids``, ``logit_bias``, ``min_p``, ``min_tokens`` (``ubtree_vllm/vllm/sampler.py``). On both
runners structured outputs (JSON schema, JSON object, regex, grammar, choice;
``ubtree_vllm/vllm/structured_output.py``) are served exactly. On both runners ``repetition_detection``
(vLLM's scheduler checks it after every accepted token, as for a chain), ``prompt_logprobs``, ``n``,
``seed``, ``stop``, ``stop_token_ids``, ``ignore_eos`` and ``max_tokens`` are served (prompt rows carry
no tree; stop handling is the scheduler's and sees the same accepted tokens as a chain would).
"""
from __future__ import annotations

from typing import Any

# vLLM logprobs modes (ModelConfig.logprobs_mode) the tree sampler reports exactly: the model's own
# logits, before temperature and top-k/top-p, as vLLM's sampler reports them in these modes.
LOGPROBS_MODES = ("raw_logprobs", "raw_logits")


def unsupported_options(params: Any) -> list[str]:
    """Names of the options of a vLLM ``SamplingParams`` that method 'ubtree' cannot serve (on either runner)."""
    checks = (
        ("thinking_token_budget", getattr(params, "thinking_token_budget", None) is not None),
        ("trace_decode_token_ids", bool(getattr(params, "trace_decode_token_ids", None))),
    )
    return [name for name, used in checks if used]


def unsupported_message(names: list[str]) -> str:
    """The client-facing explanation for :func:`unsupported_options`."""
    return (f"sampling option(s) {names} are not supported with speculative decoding method 'ubtree' "
            "(tree verification would not reproduce non-speculative decoding exactly); remove them or "
            "use a server without speculative decoding. Supported: temperature, top_k, top_p, seed, n, "
            "stop, stop_token_ids, ignore_eos, max_tokens, prompt_logprobs, allowed_token_ids, logit_bias, min_p, "
            "min_tokens, penalties, logprobs, logprob_token_ids, bad_words and structured outputs.")
