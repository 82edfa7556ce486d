"""Reference UBTree decoder on HF transformers: the oracle for every faster path.

One round for N requests, batched:
  1. draft: the drafter turns the committed context into a tree of B + 1 nodes;
  2. verify: the target runs the B + 1 tree tokens over its KV cache with a 4-D mask
     (committed context + ancestor-or-self inside the tree) at positions root_pos + depth;
  3. accept: the target's token is drawn at every node, the tree is walked (verify.accept);
  4. commit: KV entries and target features of the root and the accepted nodes are kept,
     every other tree entry is dropped.
Without a drafter the same loop is plain autoregressive decoding (a root-only tree), which
is the baseline the lossless tests compare against.

Cache layout: request n's committed entries occupy rows 0 .. len_n - 1 of every buffer
(HF KV cache, features, tokens) at positions 0 .. len_n - 1; the rest is padding that the
mask hides. Host syncs here (`# SYNC`) are fine: this decoder is a test oracle and demo,
not the serving path.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch
from transformers import DynamicCache

from ubtree_vllm.config import SamplingConfig, UBTreeConfig
from ubtree_vllm.tree.topology import DraftTree, ancestor_mask
from ubtree_vllm.types import DraftContext
from ubtree_vllm.verify.accept import accept_tree
from ubtree_vllm.verify.sampling import SamplingTensors, sample_tokens


class TreeDrafter(Protocol):
    def draft_tree(self, ctx: DraftContext, tree_cfg: UBTreeConfig) -> DraftTree: ...


@dataclass
class GenerationOutput:
    token_ids: list[int]
    # tokens emitted by each verification round after the prefill (bonus included)
    tokens_per_round: list[int] = field(default_factory=list)

    @property
    def acceptance_length(self) -> float:
        """tau: mean tokens committed per target verification (bonus included)."""
        return sum(self.tokens_per_round) / max(1, len(self.tokens_per_round))


def _root_only_tree(anchor: torch.Tensor) -> DraftTree:
    zeros = torch.zeros_like(anchor)[:, None]
    return DraftTree(tokens=anchor[:, None], parents=zeros - 1, depth=zeros, scores=zeros.float())


class ReferenceDecoder:
    """Batched tree-speculative (or plain) decoding of an HF causal LM."""

    def __init__(self, target: torch.nn.Module, drafter: TreeDrafter | None = None,
                 tree_cfg: UBTreeConfig | None = None, feature_layer_ids: Sequence[int] = ()) -> None:
        if (drafter is None) != (tree_cfg is None):
            raise ValueError("drafter and tree_cfg must be given together (or neither, for plain decoding)")
        self.target = target
        self.drafter = drafter
        self.tree_cfg = tree_cfg
        cfg = getattr(drafter, "cfg", None)
        self.feature_layer_ids = tuple(feature_layer_ids) or tuple(getattr(cfg, "target_layer_ids", ()))
        if tree_cfg is not None:
            tree_cfg.check_vocab(target.config.get_text_config().vocab_size)
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype

    # ---- target forward -------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, allowed: torch.Tensor,
                 cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids/positions [N, T]; allowed [N, T, L + T] bool. -> logits [N, T, V] f32, features [N, T, F]."""
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        out = self.target(input_ids=input_ids, position_ids=positions, attention_mask=bias[:, None],
                          past_key_values=cache, use_cache=True, output_hidden_states=bool(self.feature_layer_ids))
        if self.feature_layer_ids:
            features = torch.cat([out.hidden_states[i + 1] for i in self.feature_layer_ids], dim=-1)
        else:
            features = input_ids.new_zeros((*input_ids.shape, 0), dtype=self.dtype)
        return out.logits.float(), features

    def sample_nodes(self, logits: torch.Tensor, params: SamplingTensors, generator: torch.Generator) -> torch.Tensor:
        """The target's draw at every node: [N, n, V] -> [N, n]."""
        return sample_tokens(logits, params, generator)

    # ---- decoding loop ---------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 sampling: SamplingConfig | Sequence[SamplingConfig] = SamplingConfig(), seed: int = 0,
                 eos_token_ids: Sequence[int] = ()) -> list[GenerationOutput]:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token id lists")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        configs = [sampling] * len(prompts) if isinstance(sampling, SamplingConfig) else list(sampling)
        if len(configs) != len(prompts):
            raise ValueError("sampling must be one SamplingConfig or one per prompt")
        params = SamplingTensors.from_configs(configs, self.device)
        generator = torch.Generator(device=self.device).manual_seed(seed)
        dev = self.device
        num_reqs = len(prompts)
        max_depth = self.tree_cfg.block_size if self.tree_cfg else 0

        # Prefill (right-padded prompts).
        lens = torch.tensor([len(p) for p in prompts], device=dev)
        width = int(max(len(p) for p in prompts))
        tokens = torch.zeros((num_reqs, width), dtype=torch.long, device=dev)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(list(p), device=dev)
        cols = torch.arange(width, device=dev)
        allowed = (cols[None, :, None] >= cols[None, None, :]) & (cols[None, None, :] < lens[:, None, None])
        cache = DynamicCache(config=self.target.config)
        logits, features = self._forward(tokens, cols.expand(num_reqs, -1), allowed, cache)
        last = (lens - 1)[:, None, None]
        first_logits = logits.gather(1, last.expand(-1, 1, logits.shape[-1]))
        anchor = self.sample_nodes(first_logits, params, generator)[:, 0]

        emitted = [anchor[:, None]]
        num_emitted = torch.ones(num_reqs, dtype=torch.long, device=dev)
        eos = torch.tensor(list(eos_token_ids), dtype=torch.long, device=dev)
        done = (num_emitted >= max_new_tokens) | torch.isin(anchor, eos)
        rounds: list[torch.Tensor] = []
        while not bool(done.all()):  # SYNC: loop exit (oracle decoder)
            cache_len = tokens.shape[1]
            positions = torch.arange(cache_len, device=dev).expand(num_reqs, -1)
            valid = positions < lens[:, None]
            ctx = DraftContext(anchor=anchor, anchor_pos=lens, features=features, positions=positions,
                               valid=valid, tokens=tokens)
            tree = self.drafter.draft_tree(ctx, self.tree_cfg) if self.drafter else _root_only_tree(anchor)
            n = tree.num_nodes
            # Verify: committed context + ancestor-or-self inside the tree.
            allowed = torch.cat([valid[:, None, :].expand(-1, n, -1), ancestor_mask(tree.parents, max_depth)], dim=2)
            logits, tree_features = self._forward(tree.tokens, lens[:, None] + tree.depth, allowed, cache)
            result = accept_tree(tree, self.sample_nodes(logits, params, generator), max_depth)

            # Commit the root and the accepted nodes right after each request's committed rows.
            new_lens = lens + 1 + result.num_accepted
            new_width = int(new_lens.max())  # SYNC: buffer width (oracle decoder)
            j = torch.arange(new_width, device=dev)[None, :]
            path_slot = (j - lens[:, None]).clamp(0, max_depth)
            path_node = result.accepted_path.gather(1, path_slot).clamp(min=0)
            index = torch.where(j < lens[:, None], j, cache_len + path_node)
            index = torch.where(j < new_lens[:, None], index, 0)
            for layer in cache.layers:
                kv_index = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
                layer.keys = layer.keys.gather(2, kv_index)
                layer.values = layer.values.gather(2, kv_index)
            features = torch.cat([features, tree_features], 1).gather(
                1, index[:, :, None].expand(-1, -1, features.shape[-1]))
            tokens = torch.cat([tokens, tree.tokens], 1).gather(1, index)
            lens = new_lens
            anchor = result.output_tokens.gather(1, result.num_accepted[:, None]).squeeze(1)

            out = torch.where(done[:, None], -1, result.output_tokens)
            emitted.append(out)
            rounds.append(torch.where(done, 0, result.num_accepted + 1))
            hit_eos = (torch.isin(out, eos) & (out >= 0)).any(dim=1)
            num_emitted = num_emitted + (out >= 0).sum(dim=1)
            done = done | hit_eos | (num_emitted >= max_new_tokens)

        return self._collect(emitted, rounds, max_new_tokens, set(int(e) for e in eos_token_ids))

    @staticmethod
    def _collect(emitted: list[torch.Tensor], rounds: list[torch.Tensor], max_new_tokens: int,
                 eos: set[int]) -> list[GenerationOutput]:
        all_tokens = torch.cat(emitted, dim=1).tolist()
        per_round = torch.stack(rounds, dim=1).tolist() if rounds else [[] for _ in all_tokens]
        outputs = []
        for row, counts in zip(all_tokens, per_round):
            ids: list[int] = []
            for t in row:
                if t < 0:
                    continue
                ids.append(t)
                if t in eos or len(ids) >= max_new_tokens:
                    break
            outputs.append(GenerationOutput(token_ids=ids, tokens_per_round=[c for c in counts if c > 0]))
        return outputs
