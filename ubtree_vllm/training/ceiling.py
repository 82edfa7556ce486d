"""`ubtree eval-tau --ceiling`: how far a drafter's tree is from the best tree of the same size.

At a context c with root token x, a B-node tree accepts, in expectation (the sample-then-match walk of
verify/accept.py, each node's draw independent),

    E[tau] = 1 + sum over nodes j of prod over the edges on root->j of p_T(edge token | path before it),

where p_T is the target's distribution at temperature T (one-hot on the argmax at T = 0). Two trees are
scored at the same contexts, from the target's own T rollouts (an anchor every ``every`` response tokens):

* ``drafter``: the drafter's tree (proposer -> selector -> beam, exactly what serving drafts, no lookup
  branch), scored with the target's probabilities at its nodes (one tree forward);
* ``best``: the B-node tree of depth <= gamma that maximises E[tau] itself: path probabilities only fall
  along a path, so the B nodes of largest path probability form a tree, found best-first with one target
  forward per node. No drafter of this tree shape can do better at these contexts: the ceiling.

A drafter far below the ceiling is the drafter's fault; a goal above the ceiling is out of reach at this B
for this target and temperature. HF transformers, host loops (an evaluation, not the serving path).

At T > 0 a third tree is scored: ``coupled``, the drafter's tree drafted under the noise the target's draws will
take (drafter/coupling.py; Model Runner V2 serves it). Its nodes depend on the noise, so E[tau] is a Monte Carlo
mean over ``coupled_samples`` noise draws per context (a random seed each, keys at the nodes' positions as
serving keys them): the drafted tree's nodes are walked with the target's own Gumbel-max draws under that noise.
It is scored at each of ``coupled_weights`` (the coupled edge weight w), every w under the same noise draws, so
the weights compare pair by pair. The best tree's bound holds for trees drafted without knowing the noise; a
coupled tree can exceed it.
"""
from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.drafter.coupling import CoupledNoise
from ubtree_vllm.triton_ops.reference import gumbel_noise_reference
from ubtree_vllm.tree.topology import DraftTree, ancestor_mask
from ubtree_vllm.types import DraftContext
from ubtree_vllm.verify.accept import accept_tree


@dataclass
class CeilingResult:
    dataset: str
    temperature: float
    num_contexts: int
    drafter_tau: float  # mean E[tau] of the drafter's tree
    best_tau: float  # mean E[tau] of the best tree (the ceiling)
    wall_s: float
    # mean tau of the coupled tree per coupled edge weight (T > 0, Monte Carlo); None: not scored
    coupled_tau: dict[float, float] | None = None


@dataclass
class CeilingScores:
    """Means over the contexts of one rollout set: E[tau] of the drafter's tree, of the best tree, and (T > 0 with
    coupled samples) the Monte Carlo tau of the coupled tree at each coupled edge weight."""

    drafter: float
    best: float
    num_contexts: int
    coupled: dict[float, float] | None = None


class TreeScorer:
    """The target's distribution at every node of a tree over one cached context."""

    def __init__(self, target: torch.nn.Module, temperature: float, max_depth: int) -> None:
        self.target, self.temperature, self.max_depth = target, temperature, max_depth
        self.dtype = next(target.parameters()).dtype
        self.device = next(target.parameters()).device

    def probs(self, cache: Any, ctx_len: int, tokens: list[int], parents: list[int], depth: list[int]) -> torch.Tensor:
        """[n, V] float32 at the n nodes; the cache is cropped back to the context afterwards."""
        n = len(tokens)
        tree_mask = ancestor_mask(torch.tensor([parents], device=self.device), self.max_depth)  # [1, n, n]
        allowed = torch.cat([torch.ones(1, n, ctx_len, dtype=torch.bool, device=self.device), tree_mask], dim=2)
        bias = torch.zeros(allowed.shape, dtype=self.dtype, device=self.device)
        bias.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        out = self.target(input_ids=torch.tensor([tokens], device=self.device),
                          position_ids=ctx_len + torch.tensor([depth], device=self.device),
                          attention_mask=bias[:, None], past_key_values=cache, use_cache=True)
        cache.crop(-n)  # drop the n tree entries: the context's ctx_len stay
        logits = out.logits[0].float()  # [n, V]
        if self.temperature == 0.0:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return torch.softmax(logits / self.temperature, dim=-1)


def expected_accepted(probs: torch.Tensor, tokens: Sequence[int], parents: Sequence[int]) -> float:
    """sum over non-root nodes of their path probability (parents first; probs [n, V] at the nodes)."""
    path = [1.0] * len(tokens)
    for j in range(1, len(tokens)):
        path[j] = path[parents[j]] * float(probs[parents[j], tokens[j]])
    return sum(path[1:])


def accepted_under_noise(probs: torch.Tensor, tokens: Sequence[int], parents: Sequence[int], depth: Sequence[int],
                         noise: torch.Tensor) -> int:
    """Drafts the walk accepts when the target draws ``argmax(log probs[node] + noise[depth(node)])`` at each node
    (its Gumbel-max draw; ``probs`` [n, V] the target's at temperature T, ``noise`` [gamma, V] the noise its draws
    at depths 1..gamma take)."""
    gamma = noise.shape[0]
    node_depth = torch.tensor(depth, device=probs.device)
    # a node at depth d draws its child's token with depth d + 1's noise (row d); a node at depth gamma draws nothing
    draws = (probs.clamp_min(1e-30).log() + noise[node_depth.clamp(max=gamma - 1)]).argmax(-1)  # [n]
    tree = DraftTree(tokens=torch.tensor([list(tokens)], device=probs.device),
                     parents=torch.tensor([list(parents)], device=probs.device), depth=node_depth[None],
                     scores=torch.zeros(1, len(tokens), device=probs.device))
    return int(accept_tree(tree, draws[None], gamma).num_accepted[0])


def coupled_tree_accepted(scorer: TreeScorer, cache: Any, ctx_len: int, drafter: Any, draft_ctx: DraftContext,
                          tree: UBTreeConfig, samples: int, gen: torch.Generator,
                          weights: Sequence[float] | None = None) -> dict[float, float]:
    """Mean accepted drafts of the coupled tree over ``samples`` noise draws, per coupled edge weight (default: the
    tree's own), every weight under the same draws (module docstring)."""
    device = draft_ctx.anchor.device
    key_pos = ctx_len + torch.arange(tree.block_size, device=device)  # depth d is drawn by the row at ctx_len + d - 1
    vocab = torch.arange(drafter.cfg.vocab_size, device=device)
    trees = {float(w): dataclasses.replace(tree, coupled_edge_weight=float(w))
             for w in (weights or (tree.coupled_edge_weight,))}
    total = dict.fromkeys(trees, 0)
    for _ in range(samples):
        seed = torch.randint(0, 2 ** 62, (1,), generator=gen).to(device)
        noise = CoupledNoise(temperature=torch.tensor([scorer.temperature], device=device), seeds=seed,
                             key_pos=key_pos[None])
        keyed = gumbel_noise_reference(seed, key_pos[:, None], vocab[None, :]).float()  # [gamma, V]
        for weight, weighted in trees.items():
            t = drafter.draft_tree(draft_ctx, weighted, noise)
            tokens, parents, depth = t.tokens[0].tolist(), t.parents[0].tolist(), t.depth[0].tolist()
            total[weight] += accepted_under_noise(scorer.probs(cache, ctx_len, tokens, parents, depth), tokens,
                                                  parents, depth, keyed)
    return {weight: count / samples for weight, count in total.items()}


def best_tree_accepted(scorer: TreeScorer, cache: Any, ctx_len: int, root: int, budget: int, max_depth: int) -> float:
    """E[accepted drafts] of the best ``budget``-node tree of depth <= max_depth (best-first)."""
    tokens, parents, depth, path = [root], [-1], [0], [1.0]
    frontier: list[tuple[float, int, int]] = []  # (-path probability, parent node, token)

    def expand(j: int) -> None:
        if depth[j] >= max_depth:
            return
        probs = scorer.probs(cache, ctx_len, tokens, parents, depth)[j]
        values, ids = probs.topk(min(budget, probs.numel()))
        for v, t in zip(values.tolist(), ids.tolist()):
            if v > 0.0:
                heapq.heappush(frontier, (-path[j] * v, j, t))

    expand(0)
    while len(tokens) <= budget and frontier:
        neg, parent, token = heapq.heappop(frontier)
        tokens.append(token), parents.append(parent), depth.append(depth[parent] + 1), path.append(-neg)
        if len(tokens) <= budget:
            expand(len(tokens) - 1)
    return sum(path[1:])


@torch.no_grad()
def tree_ceiling(target: torch.nn.Module, drafter: Any, prompts: Sequence[Sequence[int]], temperature: float,
                 tree: UBTreeConfig, every: int, max_new_tokens: int, eos: Sequence[int], seed: int = 0,
                 coupled_samples: int = 0, coupled_weights: Sequence[float] | None = None) -> CeilingScores:
    """Mean drafter and best-tree E[tau] over anchors of the target's rollouts, and the coupled tree's at each of
    ``coupled_weights`` (default: the tree's own weight; T > 0 and ``coupled_samples`` > 0)."""
    from transformers import DynamicCache

    device = next(target.parameters()).device
    scorer = TreeScorer(target, temperature, tree.block_size)
    layer_ids = drafter.cfg.target_layer_ids
    drafted = best = 0.0
    coupled: dict[float, float] = {}  # coupled edge weight -> accepted drafts summed over the contexts
    count = 0
    torch.manual_seed(seed)
    noise_gen = torch.Generator().manual_seed(seed)
    score_coupled = temperature > 0 and coupled_samples > 0
    for prompt in prompts:
        sample = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else \
            {"do_sample": False}
        seq = target.generate(torch.tensor([list(prompt)], device=device), max_new_tokens=max_new_tokens + 1,
                              eos_token_id=list(eos) or None, pad_token_id=(list(eos) or [0])[0], **sample)[0].tolist()
        for anchor_at in range(len(prompt), len(seq) - 1, every):
            ctx, root = seq[:anchor_at], seq[anchor_at]
            cache = DynamicCache(config=target.config)
            out = target(input_ids=torch.tensor([ctx], device=device), past_key_values=cache, use_cache=True,
                         output_hidden_states=True)
            features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
            n = len(ctx)
            draft_ctx = DraftContext(anchor=torch.tensor([root], device=device),
                                     anchor_pos=torch.tensor([n], device=device), features=features,
                                     positions=torch.arange(n, device=device)[None],
                                     valid=torch.ones(1, n, dtype=torch.bool, device=device),
                                     tokens=torch.tensor([ctx], device=device))
            t = drafter.draft_tree(draft_ctx, tree)
            tokens, parents, depth = t.tokens[0].tolist(), t.parents[0].tolist(), t.depth[0].tolist()
            drafted += expected_accepted(scorer.probs(cache, n, tokens, parents, depth), tokens, parents)
            best += best_tree_accepted(scorer, cache, n, root, tree.tree_budget, tree.block_size)
            if score_coupled:
                for weight, accepted in coupled_tree_accepted(scorer, cache, n, drafter, draft_ctx, tree,
                                                              coupled_samples, noise_gen, coupled_weights).items():
                    coupled[weight] = coupled.get(weight, 0.0) + accepted
            count += 1
    if count == 0:
        raise ValueError("no context to score: every rollout ended before its first anchor")
    return CeilingScores(1.0 + drafted / count, 1.0 + best / count, count,
                         {w: 1.0 + c / count for w, c in coupled.items()} if score_coupled else None)


def evaluate_ceiling(drafter_dir: str, target: str, datasets: Sequence[str], temperatures: Sequence[float],
                     num_prompts: int | None, tree: UBTreeConfig, every: int, max_new_tokens: int, data_dir: str,
                     device: str, seed: int, records_path: str | None,
                     log: Callable[[str], None] = print, coupled_samples: int = 8,
                     coupled_weights: Sequence[float] | None = None) -> list[CeilingResult]:
    """One pair of microbench records (drafter, best) per dataset x temperature, and at T > 0 one of the coupled tree
    per coupled edge weight (``coupled_weights``, default the tree's own; ``coupled_samples`` noise draws per
    context; 0: none)."""
    from ubtree_vllm.training.data import chat_prompt_ids
    from ubtree_vllm.training.evaluate import load_eval_prompts, load_target_and_drafter

    from ubtree_vllm.eval_datasets import check_eval_datasets

    if every < 1:
        raise ValueError(f"--every must be >= 1, got {every}")
    check_eval_datasets(datasets)  # before any model is loaded
    model, drafter, tokenizer, eos = load_target_and_drafter(drafter_dir, target, device)
    dev = next(model.parameters()).device
    if tree.block_size != drafter.cfg.block_size:
        raise ValueError(f"block_size {tree.block_size} does not match the drafter's gamma {drafter.cfg.block_size}")
    results = []
    for dataset in datasets:
        prompts = [chat_prompt_ids(tokenizer, text) for text in load_eval_prompts(dataset, data_dir, num_prompts)]
        for temperature in temperatures:
            started = time.monotonic()
            scores = tree_ceiling(model, drafter, prompts, float(temperature), tree, every, max_new_tokens, eos, seed,
                                  coupled_samples, coupled_weights)
            drafter_tau, best_tau, count = scores.drafter, scores.best, scores.num_contexts
            result = CeilingResult(dataset, float(temperature), count, drafter_tau, best_tau,
                                   time.monotonic() - started, scores.coupled)
            results.append(result)
            coupled_text = "" if scores.coupled is None else \
                ", coupled tree " + ", ".join(f"{tau:.3f} at w={w:g}" for w, tau in scores.coupled.items()) + \
                f" ({coupled_samples} noise draws per context)"
            log(f"eval-tau --ceiling: {dataset} T={temperature:g} B={tree.tree_budget} W={tree.beam_width}: drafter "
                f"tree E[tau] {drafter_tau:.3f}, best tree {best_tau:.3f}{coupled_text} over {count} contexts, "
                f"{result.wall_s:.0f}s")
            if records_path:
                from ubtree_vllm.bench.records import append_record, hardware

                note = (f"expected acceptance length at {count} contexts (an anchor every {every} response tokens of "
                        f"the target's own T={temperature:g} rollouts of {len(prompts)} prompts, <= {max_new_tokens} "
                        "tokens each), target probabilities in the HF reference (training/ceiling.py)")
                scored = [("ubtree", drafter_tau, "the drafter's tree (no lookup branch)", None),
                          ("best-tree", best_tau, "the best tree of B nodes, depth <= gamma: the ceiling of any "
                                                  "drafter that does not know the target's noise", None)]
                for weight, tau in (scores.coupled or {}).items():
                    scored.append(("ubtree-coupled", tau,
                                   f"the drafter's tree drafted under the target's sampling noise (coupled drafting, "
                                   f"coupled edge weight {weight:g}, no lookup branch): mean over {coupled_samples} "
                                   f"noise draws per context, the same draws for every weight", weight))
                for method, value, what, weight in scored:
                    append_record({
                        "kind": "microbench", "metric": "expected_tau", "value": round(value, 4),
                        "unit": "tokens per round", "method": method, "target": drafter.cfg.target_name,
                        "drafter": str(drafter_dir), "dataset": dataset, "num_prompts": len(prompts),
                        "max_new_tokens": max_new_tokens, "temperature": float(temperature), "batch_size": 1,
                        "tp": 1, "cuda_graphs": False, "hardware": hardware(dev.type),
                        "tree_budget": tree.tree_budget, "beam_width": tree.beam_width, "top_k": tree.top_k,
                        "block_size": tree.block_size, "coupled_edge_weight": weight, "notes": f"{what}; {note}"},
                        path=records_path)
    return results
