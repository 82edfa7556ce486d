"""Test-only drafting: trees that hide the target's known greedy continuation on one branch.

Installed into an in-process engine's :class:`ubtree_vllm.vllm.proposer.UBTreeProposer`
(``install_oracle``), never into the production path. The truth is placed on the
*second* depth-1 node (so accepted nodes never sit at their depth and the KV commit has
to move them), and with probability ``corrupt_prob`` per round it is cut at a random
depth (partial acceptance). Verification must still produce exactly the reference.

It also keeps, per reference, the rounds it drafted from the reference (:meth:`ReferenceOracle.on_reference_rounds`):
once an output leaves the reference (a bf16 near-tie, say) there is nothing to copy, and vLLM's engine-wide
acceptance counters then mix in rounds no oracle could draft well.
"""
from __future__ import annotations

import math
import random
from typing import Any, Sequence

import torch

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.tree.search import build_tree
from ubtree_vllm.tree.topology import DraftTree
from ubtree_vllm.types import DraftContext


class ReferenceOracle:
    """propose(ctx) -> DraftTree, copying known greedy continuations of known prompts."""

    def __init__(self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                 tree_cfg: UBTreeConfig, vocab_size: int, corrupt_prob: float = 0.3, seed: int = 0) -> None:
        self.references = [(list(p), list(c)) for p, c in zip(prompts, continuations)]
        self.tree_cfg = tree_cfg
        self.vocab_size = vocab_size
        self.corrupt_prob = corrupt_prob
        self.rng = random.Random(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.calls = 0
        # reference index -> (len(sofar), drafted from the reference) per propose call for its request
        self.trace: dict[int, list[tuple[int, bool]]] = {}

    def truth(self, sofar: list[int]) -> list[int]:
        """The reference tokens after ``sofar`` (random tokens where there is no reference)."""
        gamma = self.tree_cfg.block_size
        for prompt, cont in self.references:
            n = len(prompt)
            if sofar[:n] == prompt and sofar[n:] == cont[: len(sofar) - n]:
                nxt = cont[len(sofar) - n: len(sofar) - n + gamma]
                return nxt + [self.rng.randrange(self.vocab_size) for _ in range(gamma - len(nxt))]
        return [self.rng.randrange(self.vocab_size) for _ in range(gamma)]

    def _note_round(self, sofar: list[int]) -> None:
        """Record a round starting at ``sofar`` (committed tokens + anchor) for the request of the longest reference
        prompt ``sofar`` starts with (none: not recorded). Prompts must be distinct, one request each at a time."""
        matches = [i for i, (prompt, _) in enumerate(self.references) if sofar[:len(prompt)] == prompt]
        if not matches:
            return
        index = max(matches, key=lambda i: len(self.references[i][0]))
        prompt, cont = self.references[index]
        done = len(sofar) - len(prompt)
        on_reference = sofar[len(prompt):] == cont[:done] and done < len(cont)  # and a reference token left to copy
        self.trace.setdefault(index, []).append((len(sofar), on_reference))

    def on_reference_rounds(self) -> tuple[int, float]:
        """(rounds, tau): the rounds that started on their reference and have a later call for the same request, and
        their mean committed tokens (accepted drafts + 1: the growth of ``sofar`` up to that call; nan if none).
        A call at an unchanged length is another call for the same step, not a round; a shorter one is a later
        request for the same prompt."""
        committed = [b - a for trace in self.trace.values()
                     for (a, on_reference), (b, _) in zip(trace, trace[1:]) if on_reference and b > a]
        return len(committed), (sum(committed) / len(committed) if committed else math.nan)

    def propose(self, ctx: DraftContext) -> DraftTree:
        self.calls += 1
        cfg = self.tree_cfg
        gamma, top_k = cfg.block_size, cfg.top_k
        rows = []
        for n in range(ctx.anchor.shape[0]):
            length = int(ctx.anchor_pos[n])
            sofar = ctx.tokens[n, :length].tolist() + [int(ctx.anchor[n])]
            self._note_round(sofar)
            truth = self.truth(sofar)
            if self.rng.random() < self.corrupt_prob:
                cut = self.rng.randrange(gamma)
                truth[cut:] = [(t + 1 + self.rng.randrange(self.vocab_size - 1)) % self.vocab_size
                               for t in truth[cut:]]
            rows.append(truth)
        truth_t = torch.tensor(rows, dtype=torch.long)  # [N, gamma]
        num_reqs = truth_t.shape[0]
        noise = torch.rand(num_reqs, gamma, self.vocab_size, generator=self.generator)
        noise.scatter_(2, truth_t[:, :, None], 2.0)
        cand = noise.topk(top_k, dim=-1).indices  # cand[..., 0] = truth
        root = torch.randn(num_reqs, top_k, generator=self.generator)
        trans = torch.randn(num_reqs, gamma - 1, top_k, top_k, generator=self.generator)
        root[:, 0] += 3.0  # the truth ...
        root[:, 1] += 4.0  # ... second at depth 1, after a distractor
        trans[:, :, 0, 0] += 3.0
        tree = build_tree(ctx.anchor.cpu(), cand, torch.log_softmax(root, -1), torch.log_softmax(trans, -1), cfg)
        return tree.to(ctx.anchor.device)


def engine_runner(llm: Any) -> Any:
    """The UBTree model runner of an in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) LLM."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def install_oracle(llm: Any, oracle: ReferenceOracle | None) -> None:
    """Route the engine's drafting through ``oracle`` (None restores the real drafter)."""
    proposer = engine_runner(llm).drafter
    if oracle is None:
        proposer.__dict__.pop("propose", None)
    else:
        proposer.propose = oracle.propose


def install_oracle_in_worker(worker: Any, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
                             vocab_size: int) -> bool:
    """``LLM.collective_rpc`` target for a multi-process engine (tensor parallelism): route this worker's drafting
    through a :class:`ReferenceOracle` (under TP only the driver rank drafts; the others get its trees)."""
    proposer = worker.model_runner.drafter
    oracle = ReferenceOracle(prompts, continuations, proposer.config.tree, vocab_size=vocab_size)
    proposer.propose = oracle.propose
    worker.ubtree_test_oracle = oracle
    return True


def oracle_rounds_in_worker(worker: Any) -> tuple[int, int, float]:
    """``LLM.collective_rpc`` target: (propose calls, rounds drafted from the reference, their tau) of the oracle
    :func:`install_oracle_in_worker` put there."""
    oracle = worker.ubtree_test_oracle
    return (oracle.calls, *oracle.on_reference_rounds())
