"""The UBTree drafter as the vLLM V1 runner's ``drafter`` object.

vLLM builds it through its ``custom_class`` hook (``Class(vllm_config)``, see
``vllm.v1.spec_decode.custom_class_proposer``) from the path
:data:`ubtree_vllm.vllm.config.PROPOSER_CLASS_PATH`, and calls ``load_model(target)``
after loading the target. The UBTree runner (:mod:`ubtree_vllm.vllm.runner`) then calls
:meth:`UBTreeProposer.propose` with a :class:`ubtree_vllm.types.DraftContext` built from
the target's aux hidden states; vLLM's own custom-class call path is never used.

The drafter runs on the runner's device in the target's dtype and shares the target's
embedding and LM head (first ``vocab_size`` rows: vLLM pads the vocabulary).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from vllm.config import CUDAGraphMode

from ubtree_vllm import compat, envs
from ubtree_vllm.drafter.io import load_drafter
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.tree.topology import DraftTree
from ubtree_vllm.types import DraftContext
from ubtree_vllm.vllm.config import METHOD, UBTreeVllmConfig, from_vllm_config
from ubtree_vllm.vllm.draft_graphs import DraftGraphs
from ubtree_vllm.vllm.tensor_parallel import full_vocab_rows, tp_group


def target_embeddings(target: nn.Module, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, H], LM head [V, H]) of a vLLM decoder (Llama/Qwen layout); with tensor
    parallelism the vocabulary shards are gathered (vllm/tensor_parallel.py)."""
    inner = getattr(target, "model", None)
    embed = getattr(inner, "embed_tokens", None)
    if embed is None:
        raise ValueError(f"{type(target).__name__} has no model.embed_tokens; "
                         f"method {METHOD!r} cannot bind the drafter to it")
    head = getattr(target, "lm_head", None)
    head_weight = getattr(head, "weight", None)
    if head_weight is None:  # tied embeddings without a separate head module
        head_weight = embed.weight
    group = tp_group()
    embed_weight = full_vocab_rows(embed.weight, vocab_size, group)
    return embed_weight, (embed_weight if head_weight is embed.weight else full_vocab_rows(head_weight, vocab_size,
                                                                                           group))


class UBTreeProposer:
    """Loads the drafter next to the target and proposes one tree per request."""

    def __init__(self, vllm_config: Any) -> None:
        compat.check_vllm_version()
        config = from_vllm_config(vllm_config)
        if config is None:
            raise ValueError(f"{type(self).__name__} is the proposer of speculative method {METHOD!r}; "
                             f"configure it with \"method\": {METHOD!r}")
        self.config: UBTreeVllmConfig = config
        self.drafter: UBTreeDrafter | None = None
        self.draft_graphs: DraftGraphs | None = None
        # Draft through CUDA graphs whenever the engine uses CUDA graphs for the target
        # (UBTREE_DRAFT_CUDA_GRAPHS=0 turns them off for debugging).
        self._use_graphs = (envs.UBTREE_DRAFT_CUDA_GRAPHS and not vllm_config.model_config.enforce_eager
                            and vllm_config.compilation_config.cudagraph_mode != CUDAGraphMode.NONE)

    def load_model(self, target: nn.Module) -> None:
        """Load the drafter weights on the target's device/dtype and bind its embedding/head."""
        embed, head = target_embeddings(target, self.config.drafter.vocab_size)
        drafter = load_drafter(self.config.drafter_dir, device=embed.device, dtype=embed.dtype)
        drafter.bind_target(embed, head)
        self.drafter = drafter
        if self._use_graphs and embed.device.type == "cuda":
            self.draft_graphs = DraftGraphs(drafter, self.config.tree, embed.device)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext) -> DraftTree:
        """One tree of B + 1 nodes per request (node 0 = ctx.anchor), parents-first order."""
        if self.drafter is None:
            raise RuntimeError("UBTreeProposer.propose called before load_model")
        if self.draft_graphs is not None:
            return self.draft_graphs(ctx)
        return self.drafter.draft_tree(ctx, self.config.tree)
