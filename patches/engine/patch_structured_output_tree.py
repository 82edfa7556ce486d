"""Structured-output bitmasks and draft validation along each tree node's own path.

For requests whose drafts are a tree (topology kept by patch ``scheduler_tree_drafts``),
``StructuredOutputManager.grammar_bitmask`` fills each node's row with the grammar advanced along
root -> node, and ``validate_tokens`` keeps every node
(:mod:`ubtree_vllm.vllm.structured_output`); chain drafts of other methods take vLLM's code.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import replace_attr

NAME = "structured_output_tree"


def apply() -> None:
    from vllm.v1.structured_output import StructuredOutputManager

    from ubtree_vllm.vllm.structured_output import (batch_has_trees, tree_grammar_bitmask, tree_parents,
                                                    validate_tree_drafts)

    original_bitmask = StructuredOutputManager.grammar_bitmask
    original_validate = StructuredOutputManager.validate_tokens

    def grammar_bitmask(self: Any, requests: Any, structured_output_request_ids: list[str],
                        scheduled_spec_decode_tokens: Any) -> Any:
        if not structured_output_request_ids or not batch_has_trees(requests, structured_output_request_ids):
            return original_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)
        return tree_grammar_bitmask(self, requests, structured_output_request_ids, scheduled_spec_decode_tokens)

    def validate_tokens(self: Any, request: Any, spec_tokens: list[int]) -> list[int]:
        if request.use_structured_output and tree_parents(request) is not None:
            return validate_tree_drafts(spec_tokens)
        return original_validate(self, request, spec_tokens)

    replace_attr(StructuredOutputManager, "grammar_bitmask", grammar_bitmask, NAME)
    replace_attr(StructuredOutputManager, "validate_tokens", validate_tokens, NAME)
