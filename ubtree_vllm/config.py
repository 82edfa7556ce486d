"""UBTree runtime settings: one frozen, validated object for tree budget, beam and top-K.

Every entry point (the reference decoder, the CLI, later the vLLM plugin) builds a
`UBTreeConfig` once and passes it down; nobody else validates these numbers.
Errors are `ValueError`s that name the field and the allowed range.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

# Upper bounds keep the verification batch and the beam's sort small enough for one forward.
MAX_TREE_BUDGET = 1024
MAX_BLOCK_SIZE = 64
PAPER_DEFAULTS = {"tree_budget": 64, "beam_width": 12, "top_k": 64, "block_size": 16}
# Longest n-gram the prompt-lookup branch matches (one batched comparison per n).
MAX_LOOKUP_N = 16
# Coupled edges (drafter/coupling.py) score log_softmax(w * log q / T + G). The shipped drafter's selector is flatter
# than the target's draws: on the CPU ceiling (HF reference, fp32, T = 1, the same noise draws for every w) w = 1.25
# drafted trees with a higher expected tau than w = 1 on MT-Bench, Spec-Bench and HumanEval (records: method
# ubtree-coupled, field coupled_edge_weight; docs/design/mrv2.md section 11)
DEFAULT_COUPLED_EDGE_WEIGHT = 1.25
MAX_COUPLED_EDGE_WEIGHT = 16.0


def _require_int(name: str, value: Any, lo: int, hi: int | float) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def check_coupled_edge_weight(name: str, value: Any) -> float:
    """A coupled edge weight: a finite number in (0, MAX_COUPLED_EDGE_WEIGHT]; ValueError names ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and 0.0 < value <= MAX_COUPLED_EDGE_WEIGHT):
        raise ValueError(f"{name} (the weight of the selector's log-probs against the target's noise in a coupled "
                         f"edge) must be a number in (0, {MAX_COUPLED_EDGE_WEIGHT:g}], got {value!r}")
    return float(value)


def max_tree_nodes(beam_width: int, top_k: int, block_size: int) -> int:
    """Nodes the depth-wise beam can produce: the sum over depths d of min(W, K**d)."""
    total, width = 0, 1
    for _ in range(block_size):
        width = min(width * top_k, beam_width)
        total += width
    return total


@dataclass(frozen=True)
class UBTreeConfig:
    """Tree shape for one UBTree round.

    tree_budget (B): draft nodes per request, root excluded; the target verifies B + 1 tokens.
    beam_width (W): paths kept per depth by the depth-wise beam.
    top_k (K): candidates per block position kept from the unigram proposer.
    block_size (gamma): draft depths, i.e. block positions predicted by one drafter forward.
    prompt_lookup: a copy of the context joins the tree as a branch (tree/lookup.py), found by
    matching the last lookup_min_n..lookup_max_n tokens; its edges score at least
    lookup_edge_logprob (<= 0; 0 keeps the branch in every tree).
    coupled_drafting: at temperature > 0 the candidates and edges are ranked under the target's own
    sampling noise (drafter/coupling.py); Model Runner V2 only (its draws are keyed by seed and position).
    coupled_edge_weight (w > 0): a coupled edge scores ``log_softmax(w * log q / T + G)``: w > 1 trusts the
    selector's log-probs more against the noise (drafter/coupling.py says why the default is not 1).
    """

    tree_budget: int = PAPER_DEFAULTS["tree_budget"]
    beam_width: int = PAPER_DEFAULTS["beam_width"]
    top_k: int = PAPER_DEFAULTS["top_k"]
    block_size: int = PAPER_DEFAULTS["block_size"]
    prompt_lookup: bool = False
    lookup_min_n: int = 2
    lookup_max_n: int = 4
    lookup_edge_logprob: float = 0.0
    coupled_drafting: bool = False
    coupled_edge_weight: float = DEFAULT_COUPLED_EDGE_WEIGHT

    def __post_init__(self) -> None:
        _require_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE)
        _require_int("top_k", self.top_k, 1, 1 << 20)
        _require_int("beam_width", self.beam_width, 1, 1 << 20)
        capacity = max_tree_nodes(self.beam_width, self.top_k, self.block_size)
        hi = min(MAX_TREE_BUDGET, capacity)
        if isinstance(self.tree_budget, int) and not isinstance(self.tree_budget, bool) and self.tree_budget > capacity:
            raise ValueError(
                f"tree_budget must be in [1, {hi}] for beam_width={self.beam_width}, top_k={self.top_k}, "
                f"block_size={self.block_size} (the beam yields at most {capacity} nodes), got {self.tree_budget}"
            )
        _require_int("tree_budget", self.tree_budget, 1, hi)
        if not isinstance(self.prompt_lookup, bool):
            raise ValueError(f"prompt_lookup must be true or false, got {self.prompt_lookup!r}")
        _require_int("lookup_max_n", self.lookup_max_n, 1, MAX_LOOKUP_N)
        _require_int("lookup_min_n", self.lookup_min_n, 1, self.lookup_max_n)
        edge = self.lookup_edge_logprob
        if isinstance(edge, bool) or not isinstance(edge, (int, float)) or not (math.isfinite(edge) and edge <= 0.0):
            raise ValueError(f"lookup_edge_logprob must be a finite log-probability <= 0, got {edge!r}")
        check_coupled_edge_weight("coupled_edge_weight", self.coupled_edge_weight)

    @property
    def num_verify_tokens(self) -> int:
        """Tokens per request in one verification forward: the root plus B nodes."""
        return self.tree_budget + 1

    def check_vocab(self, vocab_size: int) -> None:
        """top_k must not exceed the vocabulary it selects from."""
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be in [1, {vocab_size}] (the vocabulary size), got {self.top_k}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> "UBTreeConfig":
        """Build from user settings; unknown keys are an error, not silently dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown UBTree setting(s) {unknown}; allowed keys: {sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class SamplingConfig:
    """Per-request sampling, with vLLM's meaning of each field.

    temperature: 0 means greedy (argmax); > 0 scales logits.
    top_k: keep the k most likely tokens; 0 or -1 disables.
    top_p: keep the smallest set whose mass reaches top_p; 1.0 disables.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or not (
            math.isfinite(self.temperature) and self.temperature >= 0.0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
