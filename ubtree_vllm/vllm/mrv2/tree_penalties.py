"""Penalties on Model Runner V2 under a tree: vLLM's ``PenaltiesState`` with each node's path.

vLLM's MRV2 sampler applies its logits processors in list order (logit bias, penalties, bad words,
then custom ones) from ``Sampler.apply_sampling_params``, which the UBTree rejection sampler calls
for every tree node. Its penalties kernel counts the drafts before a row in the flat batch (a
chain); :class:`TreePenalties` takes the penalties slot of that list and counts the drafts on the
node's own path instead (:func:`ubtree_vllm.triton_ops.tree_penalties`), reading the speculator's
tree topology. Everything else -- the per-request penalty values, the prompt mask, the output
counts that vLLM's ``post_update`` advances with each step's sampled tokens (the accepted path and
the bonus) -- stays vLLM's state, which this wrapper delegates to.

Rows of a step without drafts (prefill, plain decode) have node index 0: nothing is walked, and
the result is vLLM's. No host sync: the skip check reads vLLM's host copy of ``use_penalty``.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ubtree_vllm.triton_ops.reference import tree_penalties_reference
from ubtree_vllm.triton_ops.tree_penalties import tree_penalties


class TreePenalties:
    """A logits processor for vLLM MRV2's sampler list: vLLM's penalties, counted along each node's path."""

    def __init__(self, state: Any, parents: torch.Tensor, max_depth: int):
        self.state = state  # vLLM's PenaltiesState (values, prompt mask, output counts)
        self.parents = parents  # [max_reqs + 1, B + 1] int32 (the speculator's topology)
        self.max_depth = max_depth  # gamma: no path is deeper

    def __getattr__(self, name: str) -> Any:  # add_request, apply_staged_writes, use_penalty, ...
        return getattr(self.state, name)

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        state = self.state
        if not np.any(state.use_penalty[ctx.idx_mapping_np]):
            return logits
        penalise = tree_penalties if logits.is_cuda else tree_penalties_reference  # the twin: CPU tests
        penalise(logits, ctx.expanded_idx_mapping, ctx.expanded_local_pos, ctx.input_ids, self.parents,
                 state.repetition_penalty.gpu, state.frequency_penalty.gpu, state.presence_penalty.gpu,
                 state.prompt_bin_mask, state.output_bin_counts, self.max_depth)
        return logits


def install_tree_penalties(sampler: Any, parents: torch.Tensor, max_depth: int) -> TreePenalties:
    """Put a :class:`TreePenalties` in the place of ``sampler.penalties_state`` in its processor list."""
    processors = sampler.logits_processors
    index = next(i for i, p in enumerate(processors) if p is sampler.penalties_state)
    processors[index] = TreePenalties(sampler.penalties_state, parents, max_depth)
    return processors[index]
