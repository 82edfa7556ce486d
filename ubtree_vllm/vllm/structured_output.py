"""Structured output (JSON schema, regex, grammar, choice) under tree verification, V1 runner.

vLLM's scheduler advances each request's grammar (xgrammar by default) over the scheduled
drafts as one chain: ``StructuredOutputManager.grammar_bitmask`` fills row i with the mask
after drafts 0..i-1, and ``validate_tokens`` cuts the drafts at the first one the grammar
refuses. With a tree both are wrong: node j's parent is not node j - 1. Here:

* the runner hands the scheduler each tree's topology with its draft tokens
  (:class:`TreeDraftTokenIds`, from ``UBTreeRunnerMixin.take_draft_token_ids``); the scheduler
  patch keeps it on the request (:func:`keep_tree_parents`);
* :func:`validate_tree_drafts` keeps every node: a node whose path the grammar refuses is
  unreachable anyway (its parent's row masks its token, so the target never draws it);
* :func:`fill_tree_rows` fills row j with the grammar advanced along root -> node j, exactly
  the row plain decoding would have had after generating that path (vLLM's own grammar
  objects: no grammar is re-implemented). With xgrammar (vLLM's default backend) one call walks
  the whole tree in C++ (``GrammarMatcher.traverse_draft_tree``; the per-node Python walk took over
  twice the host time in the ``grammar-rows`` microbench); other backends are moved forward with
  ``accept_tokens`` and back with ``rollback``, node by node. With reasoning still open (a reasoning
  parser), each node's constraint bounds are vLLM's ``_get_constraint_bounds`` over that node's own path.

The rows keep vLLM's layout ([root, node 1..n] per request, the runner's logits rows), so
vLLM's ``apply_grammar_bitmask`` masks each node's logits before the tree sampler sees them,
and the acceptance walk, lossless at every temperature, draws only grammar-valid tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.v1.outputs import DraftTokenIds

from ubtree_vllm.compat import xgrammar_tree_traversal

# attribute of a vLLM ``Request``: parents of the nodes of its latest drafts
PARENTS_ATTR = "ubtree_draft_parents"


@dataclass
class TreeDraftTokenIds(DraftTokenIds):
    """vLLM's draft tokens plus each tree's topology: ``parents[i][j]`` is the parent of node j + 1
    of request i (0 = the root, else a node before it), aligned with ``draft_token_ids[i]``."""

    parents: list[list[int]] = field(default_factory=list)


def keep_tree_parents(requests: dict[str, Any], drafts: DraftTokenIds) -> None:
    """Scheduler side: store each structured-output request's tree topology before vLLM validates its drafts."""
    if not isinstance(drafts, TreeDraftTokenIds):
        return
    for req_id, parents in zip(drafts.req_ids, drafts.parents, strict=True):
        request = requests.get(req_id)
        if request is not None and request.use_structured_output:
            setattr(request, PARENTS_ATTR, list(parents))


def tree_parents(request: Any) -> list[int] | None:
    """The topology kept by :func:`keep_tree_parents`, or None for a chain (another method's request)."""
    return getattr(request, PARENTS_ATTR, None)


def validate_tree_drafts(spec_tokens: list[int]) -> list[int]:
    """Every node stays (module docstring): unreachable nodes cost verification rows, never tokens."""
    return list(spec_tokens)


def fill_tree_rows(manager: Any, request: Any, tokens: list[int], parents: list[int], base: int) -> int:
    """Fill rows ``base .. base + len(tokens)`` of ``manager._grammar_bitmask`` for one tree; return the rows used.

    tokens [n] node 1..n draft tokens (-1: none); parents [>= n] node j + 1's parent (< j + 1).
    The grammar ends where it started (every advance is rolled back)."""
    n = len(tokens)
    if len(parents) < n or any(not 0 <= parents[j] <= j for j in range(n)):
        raise RuntimeError(f"ubtree: request {request.request_id} has {n} scheduled drafts but tree parents "
                           f"{parents[:n]} (each node's parent must come before it)")
    bounds = manager._get_constraint_bounds(request, ())
    if tuple(bounds) == (0, 0):
        _fill_constrained(manager, request, tokens, parents, base)
    else:
        _fill_per_path(manager, request, tokens, parents, base)
    return n + 1


def _accepts(grammar: Any, tokens: list[int]) -> bool:
    """Whether the grammar takes all of ``tokens`` from its state (no advance; no error log on refusal)."""
    if any(t < 0 for t in tokens) or grammar.is_terminated():
        return False
    return grammar.validate_tokens(tokens) == tokens


def _fill_constrained(manager: Any, request: Any, tokens: list[int], parents: list[int], base: int) -> None:
    """Grammar active from the root: one depth-first walk, each node accepted once and rolled back on leaving."""
    grammar, bitmask, n = request.structured_output_request.grammar, manager._grammar_bitmask, len(tokens)
    traverse = xgrammar_tree_traversal(grammar)
    if traverse is not None and not grammar.is_terminated():
        _fill_by_traversal(traverse, bitmask[base:base + n + 1], grammar.matcher.stop_token_ids,
                           int(manager._full_mask), tokens, parents)
        return
    children: list[list[int]] = [[] for _ in range(n + 1)]
    for j in range(n):
        children[parents[j]].append(j + 1)
    manager._fill_bitmasks(((grammar, base, True),))
    alive = [True] + [False] * n
    stack = children[0][::-1]  # node > 0: enter it; ~node < 0: leave it (roll its token back)
    while stack:
        item = stack.pop()
        if item < 0:
            grammar.rollback(1)
            continue
        parent, token = parents[item - 1], tokens[item - 1]
        if alive[parent] and _accepts(grammar, [token]) and grammar.accept_tokens(request.request_id, [token]):
            alive[item] = True
            manager._fill_bitmasks(((grammar, base + item, True),))
            stack.append(~item)
        else:  # unreachable: any row will do; the parent's keeps the row valid
            bitmask[base + item].copy_(bitmask[base + parent])
        stack.extend(children[item][::-1])


def _fill_by_traversal(traverse: Any, rows: Any, stop_token_ids: list[int], full_mask: int, tokens: list[int],
                       parents: list[int]) -> None:
    """:func:`_fill_constrained`'s rows from one ``traverse_draft_tree`` call (``rows`` [n + 1, words] int32, the
    root's first), then vLLM's rules where the walk has no row to give: a node whose token the grammar refuses (or
    -1) copies its parent's row, and so do its descendants; a node that ends the grammar (a stop token) gets the
    full mask (``full_mask``, the manager's word), as ``StructuredOutputManager._fill_bitmasks`` gives a terminated
    grammar."""
    import numpy as np
    import torch

    n, stops = len(tokens), set(stop_token_ids)
    first_child, next_sibling, last_child = [-1] * (n + 1), [-1] * (n + 1), [-1] * (n + 1)
    for j in range(1, n + 1):  # the walk's tree: nodes with a token that leaves the grammar running, in node order
        parent = parents[j - 1]
        if tokens[j - 1] < 0 or tokens[j - 1] in stops:  # a stop token ends the grammar: its row is set below
            continue
        if first_child[parent] < 0:
            first_child[parent] = j
        else:
            next_sibling[last_child[parent]] = j
        last_child[parent] = j
    traverse(torch.tensor(first_child, dtype=torch.int64), torch.tensor(next_sibling, dtype=torch.int64),
             torch.tensor([0] + [max(t, 0) for t in tokens], dtype=torch.int64), rows)
    words: np.ndarray = rows.numpy()  # [n + 1, ceil(V / 32)] int32, a view
    reached, ended = [True] + [False] * n, [False] * (n + 1)
    for j in range(1, n + 1):
        parent, token = parents[j - 1], tokens[j - 1]
        reached[j] = (reached[parent] and not ended[parent] and token >= 0
                      and (int(words[parent, token >> 5]) >> (token & 31)) & 1 == 1)
        if not reached[j]:
            words[j] = words[parent]
        elif token in stops:
            ended[j] = True
            words[j] = full_mask


def _fill_per_path(manager: Any, request: Any, tokens: list[int], parents: list[int], base: int) -> None:
    """Reasoning still open: vLLM's chain rule applied to each node's own path (row d of that chain)."""
    grammar, bitmask = request.structured_output_request.grammar, manager._grammar_bitmask
    paths: list[list[int]] = [[]]
    for j, token in enumerate(tokens):
        paths.append(paths[parents[j]] + [token])
    for node, path in enumerate(paths):
        grammar_start, constraint_start = manager._get_constraint_bounds(request, path)
        segment = path[grammar_start:]
        if any(t < 0 for t in path) or (segment and not _accepts(grammar, segment)):
            bitmask[base + node].copy_(bitmask[base + parents[node - 1]])  # unreachable (node > 0 here)
            continue
        if segment:
            grammar.accept_tokens(request.request_id, segment)
        manager._fill_bitmasks(((grammar, base + node, len(path) >= constraint_start),))
        if segment:
            grammar.rollback(len(segment))


def tree_grammar_bitmask(manager: Any, requests: dict[str, Any], request_ids: list[str],
                         scheduled_spec_tokens: dict[str, list[int]]) -> Any:
    """``StructuredOutputManager.grammar_bitmask`` for a batch with trees: same rows, same return value."""
    if manager._grammar_bitmask is None:
        max_batch = manager.vllm_config.scheduler_config.max_num_seqs
        manager._grammar_bitmask = manager.backend.allocate_token_bitmask(
            max_batch * (1 + manager.vllm_config.num_speculative_tokens))
    rows = 0
    for req_id in request_ids:
        request = requests[req_id]
        tokens = list(scheduled_spec_tokens.get(req_id, ()))
        parents = tree_parents(request) if tokens else []
        if parents is None:
            raise RuntimeError(f"ubtree: request {req_id} has scheduled drafts without a tree topology")
        rows += fill_tree_rows(manager, request, tokens, parents, rows)
    bitmask = manager._grammar_bitmask
    return (bitmask[:rows] if rows < bitmask.shape[0] else bitmask).numpy()


def batch_has_trees(requests: dict[str, Any], request_ids: list[str]) -> bool:
    return any(tree_parents(requests[r]) is not None for r in request_ids)
