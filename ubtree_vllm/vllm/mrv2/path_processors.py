"""Path-dependent logits processors on Model Runner V2 under a tree: vLLM's penalties and bad words per node path.

vLLM's MRV2 sampler applies its logits processors in list order (logit bias, penalties, bad words,
then custom ones) from ``Sampler.apply_sampling_params``, which the UBTree rejection sampler calls
for every tree node. Two of them read the drafts before a row in the flat batch as the tokens
generated before it (a chain): the penalties (counts of the output tokens) and bad words (the tokens
a word's prefix must end). :class:`TreePenalties` and :class:`TreeBadWords` take their slots in that
list and read each node's own path instead (:func:`ubtree_vllm.triton_ops.tree_penalties`,
:func:`ubtree_vllm.triton_ops.tree_bad_words`), with the speculator's tree topology. Everything else
-- the per-request values, the prompt mask, the output counts and token history that vLLM's
``post_update`` advances with each step's sampled tokens (the accepted path and the bonus) -- stays
vLLM's state, which the wrappers delegate to.

Rows of a step without drafts (prefill, plain decode) have node index 0: nothing is walked, and the
result is vLLM's. No host sync: the skip checks read vLLM's host copies (``use_penalty``,
``num_bad_words.np``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ubtree_vllm.triton_ops.reference import tree_bad_words_reference, tree_penalties_reference
from ubtree_vllm.triton_ops.tree_bad_words import tree_bad_words
from ubtree_vllm.triton_ops.tree_penalties import tree_penalties


class _PathProcessor:
    """A vLLM MRV2 logits processor whose ``apply`` reads each node's path; the rest is vLLM's state."""

    def __init__(self, state: Any, parents: torch.Tensor, depth: torch.Tensor, max_depth: int):
        self.state = state  # vLLM's processor (its values and device buffers)
        self.parents, self.depth = parents, depth  # [max_reqs + 1, B + 1] int32 (the speculator's topology)
        self.max_depth = max_depth  # gamma: no path is deeper

    def __getattr__(self, name: str) -> Any:  # add_request, apply_staged_writes, use_penalty, ...
        return getattr(self.state, name)


class TreePenalties(_PathProcessor):
    """vLLM's penalties, the drafts counted along each node's path."""

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        state = self.state
        if not np.any(state.use_penalty[ctx.idx_mapping_np]):
            return logits
        penalise = tree_penalties if logits.is_cuda else tree_penalties_reference  # the twin: CPU tests
        penalise(logits, ctx.expanded_idx_mapping, ctx.expanded_local_pos, ctx.input_ids, self.parents,
                 state.repetition_penalty.gpu, state.frequency_penalty.gpu, state.presence_penalty.gpu,
                 state.prompt_bin_mask, state.output_bin_counts, self.max_depth)
        return logits


class TreeBadWords(_PathProcessor):
    """vLLM's bad words, matched against the outputs followed by each node's path."""

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        state = self.state
        max_num_words = int(state.num_bad_words.np[ctx.idx_mapping_np].max())  # host array
        if max_num_words == 0:
            return logits
        requests = state.req_states
        ban = tree_bad_words if logits.is_cuda else tree_bad_words_reference  # the twin: CPU tests
        ban(logits, ctx.expanded_idx_mapping, ctx.expanded_local_pos, ctx.input_ids, self.parents, self.depth,
            state.bad_word_token_ids.gpu, state.bad_word_offsets.gpu, state.num_bad_words.gpu,
            requests.all_token_ids.gpu, requests.prompt_len.gpu, requests.total_len.gpu, max_num_words)
        return logits


def install_path_processors(sampler: Any, parents: torch.Tensor, depth: torch.Tensor,
                            max_depth: int) -> tuple[TreePenalties, TreeBadWords]:
    """Put :class:`TreePenalties` and :class:`TreeBadWords` in the places of vLLM's penalties and bad-words
    processors in ``sampler.logits_processors`` (found by class: the sampler keeps no bad-words attribute)."""
    processors = sampler.logits_processors
    penalties = next(i for i, p in enumerate(processors) if p is sampler.penalties_state)
    bad_words = next(i for i, p in enumerate(processors) if type(p).__name__ == "BadWordsState")
    processors[penalties] = TreePenalties(processors[penalties], parents, depth, max_depth)
    processors[bad_words] = TreeBadWords(processors[bad_words], parents, depth, max_depth)
    return processors[penalties], processors[bad_words]
