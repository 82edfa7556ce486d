"""Test drafter that copies the target: its greedy continuation hides on one branch of the tree.

Used to drive deep acceptance (long accepted paths, KV commit of many nodes) through the
same tree search as the real drafter; distractor candidates are random distinct tokens.
"""
from __future__ import annotations

import torch

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.tree.search import build_tree
from ubtree_vllm.tree.topology import DraftTree
from ubtree_vllm.types import DraftContext


class OracleDrafter:
    def __init__(self, target: torch.nn.Module, vocab_size: int, seed: int = 0) -> None:
        self.target = target
        self.vocab_size = vocab_size
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def greedy_continuation(self, ctx: DraftContext, steps: int) -> torch.Tensor:
        """[N, steps] target greedy tokens after each request's context + anchor."""
        rows = []
        for n in range(ctx.anchor.shape[0]):
            length = int(ctx.anchor_pos[n])
            ids = torch.cat([ctx.tokens[n, :length], ctx.anchor[n : n + 1]])[None]
            out = self.target.generate(ids, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                       pad_token_id=0)
            rows.append(out[0, ids.shape[1]:])
        return torch.stack(rows)

    def draft_tree(self, ctx: DraftContext, cfg: UBTreeConfig) -> DraftTree:
        num_reqs, gamma, top_k = ctx.anchor.shape[0], cfg.block_size, cfg.top_k
        truth = self.greedy_continuation(ctx, gamma)  # [N, gamma]
        # Distractors: random tokens, with the true token forced to rank 0.
        noise = torch.rand(num_reqs, gamma, self.vocab_size, generator=self.generator)
        noise.scatter_(2, truth[:, :, None], 2.0)
        cand = noise.topk(top_k, dim=-1).indices  # [N, gamma, K], cand[..., 0] = truth
        root = torch.log_softmax(torch.randn(num_reqs, top_k, generator=self.generator), -1)
        trans = torch.randn(num_reqs, gamma - 1, top_k, top_k, generator=self.generator)
        root[:, 0] += 3.0
        trans[:, :, 0, 0] += 3.0
        return build_tree(ctx.anchor, cand, torch.log_softmax(root, -1), torch.log_softmax(trans, -1), cfg)
