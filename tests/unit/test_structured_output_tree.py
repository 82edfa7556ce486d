"""Grammar rows over a draft tree (ubtree_vllm/vllm/structured_output.py) against the chain rule per path.

A real xgrammar matcher (vLLM's XgrammarGrammar) on a tiny raw vocabulary: for every node of
random trees, its row must equal the mask a fresh matcher gives after the node's root -> node
path (what plain decoding would have had there), for reachable nodes; the grammar must end in
its starting state. The reasoning case uses vLLM's chain rule on each node's own path.
"""
from __future__ import annotations

import random
import types

import pytest
import torch

xgr = pytest.importorskip("xgrammar")
from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar  # noqa: E402

from ubtree_vllm.bench.grammar_bench import bitmask_manager  # noqa: E402
from ubtree_vllm.vllm.structured_output import (PARENTS_ATTR, TreeDraftTokenIds, fill_tree_rows,  # noqa: E402
                                                keep_tree_parents, tree_grammar_bitmask)

VOCAB = ["<s>", "</s>", "a", "b", "c", "d", "x", "END"]
END = VOCAB.index("END")
REGEX = r"(ab|ac)+d"


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=len(VOCAB), stop_token_ids=[1])
    return xgr.GrammarCompiler(info).compile_regex(REGEX)


def grammar(compiled) -> XgrammarGrammar:
    return XgrammarGrammar(vocab_size=len(VOCAB), matcher=xgr.GrammarMatcher(compiled, max_rollback_tokens=64),
                           ctx=compiled)


def reasoning_bounds(_request, path):
    """vLLM's bounds for a reasoning request whose reasoning ends at token END (none committed yet)."""
    if not path:
        return (1, 1)
    if END in path:
        start = path.index(END) + 1
        return (start, start)
    return (len(path) + 1, len(path) + 1)


def manager(rows: int, bounds):
    return bitmask_manager(rows, len(VOCAB), bounds)


def random_tree(rng: random.Random, n: int, tokens: list[int]) -> tuple[list[int], list[int]]:
    parents = [rng.randrange(0, j + 1) for j in range(n)]  # node j + 1's parent in 0..j
    return [rng.choice(tokens) for _ in range(n)], parents


def expected_row(compiled, path: list[int], reasoning: bool) -> torch.Tensor | None:
    """The chain rule on one path: the row after it, None where the path is not grammar-valid."""
    g = grammar(compiled)
    start, constrained = reasoning_bounds(None, path) if reasoning else (0, 0)
    for token in path[start:]:
        if g.matcher.is_terminated() or not g.matcher.accept_token(token):
            return None
    row = xgr.allocate_token_bitmask(1, len(VOCAB))
    if len(path) >= constrained and not g.matcher.is_terminated():
        g.matcher.fill_next_token_bitmask(row, 0)
    else:
        row.fill_(-1)
    return row[0]


@pytest.mark.parametrize("reasoning", [False, True], ids=["constrained", "reasoning"])
def test_each_node_row_is_the_chain_row_of_its_path(compiled, reasoning):
    rng = random.Random(7)
    alphabet = [2, 2, 2, 3, 4, 5, 6] + ([END] * 2 if reasoning else [])
    checked = 0
    for _ in range(150):
        n = rng.randrange(1, 24)
        tokens, parents = random_tree(rng, n, alphabet)
        bounds = reasoning_bounds if reasoning else (lambda _r, _p: (0, 0))
        m = manager(n + 1 + 3, bounds)
        g = grammar(compiled)
        request = types.SimpleNamespace(request_id="r", structured_output_request=types.SimpleNamespace(grammar=g))
        assert fill_tree_rows(m, request, tokens, parents, base=3) == n + 1
        assert g.num_processed_tokens == 0 and not g.is_terminated()  # every advance rolled back
        paths = [[]]
        for j in range(n):
            paths.append(paths[parents[j]] + [tokens[j]])
        for node, path in enumerate(paths):
            want = expected_row(compiled, path, reasoning)
            if want is not None:
                assert torch.equal(m._grammar_bitmask[3 + node], want), (tokens, parents, node)
                checked += 1
    assert checked > 300  # reachable nodes compared


def test_unreachable_nodes_and_bad_topology(compiled):
    m = manager(4, lambda _r, _p: (0, 0))
    request = types.SimpleNamespace(request_id="r", structured_output_request=types.SimpleNamespace(
        grammar=grammar(compiled)))
    # 'x' is never valid: its row copies the root's, its child's too
    fill_tree_rows(m, request, [6, 2, 2], [0, 1, 0], base=0)
    assert torch.equal(m._grammar_bitmask[1], m._grammar_bitmask[0])
    assert torch.equal(m._grammar_bitmask[2], m._grammar_bitmask[0])
    with pytest.raises(RuntimeError, match="parent must come before it"):
        fill_tree_rows(m, request, [2, 3], [0, 2], base=0)


def test_batch_rows_and_the_scheduler_side_topology(compiled):
    requests = {}
    for rid in ("a", "b", "c"):
        requests[rid] = types.SimpleNamespace(request_id=rid, use_structured_output=rid != "c",
                                              structured_output_request=types.SimpleNamespace(grammar=grammar(compiled)))
    drafts = TreeDraftTokenIds(["a", "b", "c"], [[2, 3, 4], [2], [5]], [[0, 1, 1], [0], [0]])
    keep_tree_parents(requests, drafts)
    assert getattr(requests["a"], PARENTS_ATTR) == [0, 1, 1] and not hasattr(requests["c"], PARENTS_ATTR)
    m = manager(16, lambda _r, _p: (0, 0))
    m.backend = None
    bitmask = tree_grammar_bitmask(m, requests, ["a", "b"], {"a": [2, 3, 4], "b": []})
    assert bitmask.shape == (4 + 1, 1)  # a: root + 3 nodes; b: no drafts, one row
    assert bitmask[0, 0] == 4 and bitmask[1, 0] == (1 << 3) | (1 << 4)  # root: 'a'; after 'a': 'b' or 'c'
    assert bitmask[2, 0] == bitmask[3, 0] == (1 << 2) | (1 << 5)  # after "ab" and "ac": 'a' again or 'd'


def test_one_call_tree_walk_gives_the_node_by_node_rows(compiled, monkeypatch):
    """xgrammar's traverse_draft_tree (one C++ call) and the node-by-node walk (other backends) give the same rows,
    refused nodes, -1 tokens and the stop token (a terminated grammar's full-mask row) included, and leave the
    grammar where it was."""
    from ubtree_vllm.vllm import structured_output

    rng = random.Random(11)
    alphabet = [2, 3, 4, 5, 1, 6, -1]  # 1: the stop token '</s>', valid after 'd'
    ended = 0
    for _ in range(200):
        n = rng.randrange(1, 30)
        parents = [rng.randrange(0, j + 1) for j in range(n)]
        tokens, paths = [], [[]]
        for j in range(n):  # mostly grammar-valid tokens, so that long paths and the stop token are reached
            row = expected_row(compiled, paths[parents[j]], False)
            valid = [t for t in range(len(VOCAB)) if row is not None and (int(row[0]) >> t) & 1]
            tokens.append(rng.choice(valid) if valid and rng.random() < 0.75 else rng.choice(alphabet))
            paths.append(paths[parents[j]] + [tokens[-1]])
        rows = {}
        for walk in ("one call", "node by node"):
            if walk == "node by node":
                monkeypatch.setattr(structured_output, "xgrammar_tree_traversal", lambda _grammar: None)
            m = manager(n + 1 + 2, lambda _r, _p: (0, 0))
            m._grammar_bitmask.fill_(0x5A5A5A5A)  # stale rows of an earlier step
            g = grammar(compiled)
            request = types.SimpleNamespace(request_id="r", structured_output_request=types.SimpleNamespace(grammar=g))
            fill_tree_rows(m, request, tokens, parents, base=2)
            assert g.num_processed_tokens == 0 and not g.is_terminated() and g.validate_tokens([2, 3]) == [2, 3]
            rows[walk] = m._grammar_bitmask[2:].clone()
        monkeypatch.undo()
        assert torch.equal(rows["one call"], rows["node by node"]), (tokens, parents)
        ended += int((rows["one call"] == -1).all(dim=1).sum())
    assert ended > 20  # terminated grammars were walked
