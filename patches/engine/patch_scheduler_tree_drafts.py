"""Keep each tree's topology on the scheduler's request when the drafts arrive.

The scheduler receives the runner's drafts and has the grammar validate them as a chain, on one
of two paths: ``Scheduler.update_draft_token_ids(draft_token_ids)`` (synchronous scheduling) or
``Scheduler.update_draft_token_ids_in_output(draft_token_ids, scheduler_output)`` (async
scheduling: the drafts replace the placeholders of the step already scheduled). The UBTree
runners send :class:`ubtree_vllm.vllm.structured_output.TreeDraftTokenIds` (the drafts plus each
tree's parents: the V1 runner always, Model Runner V2 for batches with structured-output requests);
both wrappers store the parents on every structured-output request first
(:func:`~ubtree_vllm.vllm.structured_output.keep_tree_parents`), so the grammar can follow the
tree (patch ``structured_output_tree``). Other methods' drafts carry no topology and pass untouched.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._patching import replace_attr

NAME = "scheduler_tree_drafts"


def apply() -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from ubtree_vllm.vllm.structured_output import keep_tree_parents

    original = Scheduler.update_draft_token_ids
    original_in_output = Scheduler.update_draft_token_ids_in_output

    def update_draft_token_ids(self: Any, draft_token_ids: Any) -> None:
        keep_tree_parents(self.requests, draft_token_ids)
        return original(self, draft_token_ids)

    def update_draft_token_ids_in_output(self: Any, draft_token_ids: Any, scheduler_output: Any) -> None:
        keep_tree_parents(self.requests, draft_token_ids)
        return original_in_output(self, draft_token_ids, scheduler_output)

    replace_attr(Scheduler, "update_draft_token_ids", update_draft_token_ids, NAME)
    replace_attr(Scheduler, "update_draft_token_ids_in_output", update_draft_token_ids_in_output, NAME)
