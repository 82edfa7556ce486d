"""Keep each tree's topology on the scheduler's request when the drafts arrive.

``Scheduler.update_draft_token_ids(draft_token_ids)`` receives the runner's drafts and has
the grammar validate them as a chain. The UBTree V1 runner sends
:class:`ubtree_vllm.vllm.structured_output.TreeDraftTokenIds` (the drafts plus each tree's
parents); the wrapper stores the parents on every structured-output request first
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

    def update_draft_token_ids(self: Any, draft_token_ids: Any) -> None:
        keep_tree_parents(self.requests, draft_token_ids)
        return original(self, draft_token_ids)

    replace_attr(Scheduler, "update_draft_token_ids", update_draft_token_ids, NAME)
