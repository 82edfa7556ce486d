"""`ubtree bench microbench --which grammar-rows`: the scheduler's structured-output cost of one round.

Structured output under a tree adds host work to every round in vLLM's scheduler: each node's
grammar row (:func:`ubtree_vllm.vllm.structured_output.fill_tree_rows`: with xgrammar one
``traverse_draft_tree`` call over the tree, else node by node: accept the node's token, fill its
bitmask, roll back). This times both walks in one invocation, round by round in turn (records
``ubtree`` and ``ubtree-node-walk``), for one request per round with vLLM's real xgrammar grammar
over the default target's tokenizer (SmolLM2, 49k tokens) and a JSON schema, on the worst-case tree
of B = --tree-budget nodes: the tokens opening a string value as a chain, then word tokens branching
anywhere below, so that every node is grammar-valid and each is accepted, filled and rolled back (a
node the grammar refuses costs one check and a row copy). Host-only: the record's hardware is the CPU
it ran on. Metric ``grammar_rows_ms`` (median per round, time.perf_counter).
"""
from __future__ import annotations

import json
import random
import statistics
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from ubtree_vllm.bench.records import hardware

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"]}
STRING_OPEN = '{"name":"'


def build_tree(opening: list[int], words: list[int], num_nodes: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """(tokens [B], parents [B]) of nodes 1..B: the ``opening`` tokens as a chain, then nodes carrying random
    ``words`` (grammar-valid inside the string) under random nodes at or below the chain's end."""
    tokens, parents = list(opening[:num_nodes]), list(range(min(len(opening), num_nodes)))
    while len(tokens) < num_nodes:
        tokens.append(rng.choice(words))
        parents.append(rng.randrange(len(opening), len(tokens)))
    return tokens, parents


def word_tokens(tokenizer: Any, limit: int = 2000) -> list[int]:
    """Token ids that decode to letters only (valid anywhere inside a JSON string)."""
    words = []
    for token_id in range(len(tokenizer)):
        text = tokenizer.decode([token_id])
        if text.isalpha() and text.isascii():
            words.append(token_id)
            if len(words) == limit:
                break
    return words


def bitmask_manager(num_rows: int, vocab_size: int, bounds: Callable[[Any, list[int]], Any]) -> Any:
    """The parts of vLLM's ``StructuredOutputManager`` that ``fill_tree_rows`` uses: a bitmask of ``num_rows``
    rows, vLLM's own ``_fill_bitmasks``, and ``bounds(request, path)`` as ``_get_constraint_bounds``."""
    import xgrammar as xgr
    from vllm.v1.structured_output import StructuredOutputManager

    manager = types.SimpleNamespace(_grammar_bitmask=xgr.allocate_token_bitmask(num_rows, vocab_size),
                                    _full_mask=torch.tensor(-1, dtype=torch.int32), _get_constraint_bounds=bounds)
    manager._fill_bitmasks = types.MethodType(StructuredOutputManager._fill_bitmasks, manager)
    return manager


def grammar_rows(settings: Any) -> list[dict[str, Any]]:
    import xgrammar as xgr
    from transformers import AutoTokenizer
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    from ubtree_vllm.models.default_target import DEFAULT_TARGET_NAME, default_target_path
    from ubtree_vllm.vllm.structured_output import fill_tree_rows

    tokenizer = AutoTokenizer.from_pretrained(default_target_path())
    vocab_size = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                             separators=(",", ":"))  # vLLM, disable_any_whitespace
    grammar = XgrammarGrammar(vocab_size=vocab_size, matcher=xgr.GrammarMatcher(compiled), ctx=compiled)
    budget = settings.tree_budget
    tokens, parents = build_tree(tokenizer.encode(STRING_OPEN), word_tokens(tokenizer), budget,
                                 random.Random(settings.seed))
    paths: list[list[int]] = [[]]
    for token, parent in zip(tokens, parents):
        paths.append(paths[parent] + [token])
    refused = [node for node, path in enumerate(paths) if grammar.validate_tokens(path) != path]
    if refused:  # the record states that every node is grammar-valid
        raise RuntimeError(f"grammar-rows: the bench tree has grammar-refused nodes {refused[:8]}")
    manager = bitmask_manager(budget + 1, vocab_size, lambda _request, _path: (0, 0))
    walks = {method: types.SimpleNamespace(request_id="bench",
                                           structured_output_request=types.SimpleNamespace(grammar=walked))
             for method, walked in (("ubtree", grammar),  # the serving walk, then the other
                                    ("ubtree-node-walk", NodeByNodeGrammar(grammar)))}
    times: dict[str, list[float]] = {method: [] for method in walks}
    for i in range(settings.warmup + settings.iters):  # the two walks alternate round by round
        for method, request in walks.items():
            start = time.perf_counter()
            fill_tree_rows(manager, request, tokens, parents, 0)
            if i >= settings.warmup:
                times[method].append(1000.0 * (time.perf_counter() - start))
    what = {"ubtree": "xgrammar's one-call tree walk (traverse_draft_tree), what serving runs with xgrammar",
            "ubtree-node-walk": "the node-by-node walk (accept, fill, roll back per node) other backends get, "
                                "alternating with the one-call walk round by round"}
    return [{"kind": "microbench", "method": method, "target": DEFAULT_TARGET_NAME, "drafter": None,
             "metric": "grammar_rows_ms", "value": round(statistics.median(times[method]), 5), "unit": "ms",
             "batch_size": 1, "tree_budget": budget, "cuda_graphs": False, "hardware": hardware("cpu"),
             "notes": (f"scheduler host work per round: xgrammar JSON-schema rows for a {budget}-node tree, "
                       f"every node grammar-valid (inside a JSON string: the worst case), vocab {vocab_size}; "
                       f"{what[method]}; median over "
                       f"{settings.iters} rounds after {settings.warmup} warm-up (time.perf_counter)")}
            for method in walks]


class NodeByNodeGrammar:
    """vLLM's grammar without its xgrammar matcher in sight, so :func:`fill_tree_rows` takes the node-by-node walk
    (the A/B of this bench); every other attribute is the wrapped grammar's."""

    def __init__(self, grammar: Any) -> None:
        self._grammar = grammar

    def __getattr__(self, name: str) -> Any:
        if name == "matcher":
            raise AttributeError(name)
        return getattr(self._grammar, name)
