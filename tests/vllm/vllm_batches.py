"""A small synthetic verification batch shared by the component tests.

Three requests in vLLM's flattened layout (block size 32):

* r0: 37 context tokens, a tree of 6 nodes (parents [-1, 0, 0, 1, 1, 3]), blocks [3, 7, 1];
* r1: a 5-token prefill chunk, no drafts, block [2];
* r2: 3 context tokens, a tree of 4 nodes (parents [-1, 0, 0, 2]), block [5].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ubtree_vllm.vllm.tree_plan import RequestTree, TreeStepPlan, build_plan

BLOCK_SIZE = 32
REQ_IDS = ["r0", "r1", "r2"]
NUM_COMPUTED = np.array([37, 0, 3])
NUM_SCHEDULED = np.array([6, 5, 4])
QUERY_START_LOC = np.array([0, 6, 11, 15])
BLOCK_TABLE = torch.tensor([[3, 7, 1], [2, 0, 0], [5, 0, 0]], dtype=torch.int32)
PARENTS = {"r0": [-1, 0, 0, 1, 1, 3], "r2": [-1, 0, 0, 2]}
DEPTHS = {"r0": [0, 1, 1, 2, 2, 3], "r2": [0, 1, 1, 2]}
DRAFTS = {"r0": [11, 12, 13, 14, 15], "r2": [21, 22, 23]}


def slot(req: int, pos: int) -> int:
    return int(BLOCK_TABLE[req, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE


@dataclass
class Batch:
    plan: TreeStepPlan
    # [15] KV slot of each scheduled row (linear positions)
    slot_mapping: torch.Tensor
    # per request: [context_len] slots of its committed context
    context_slots: list[torch.Tensor]


def make_batch() -> Batch:
    trees = {r: RequestTree(draft_tokens=DRAFTS[r], parents=np.array(PARENTS[r]), depth=np.array(DEPTHS[r]))
             for r in PARENTS}
    input_ids = np.arange(100, 115)
    plan = build_plan(REQ_IDS, QUERY_START_LOC, NUM_SCHEDULED, NUM_COMPUTED, input_ids, DRAFTS, trees)
    slots = [slot(r, int(NUM_COMPUTED[r]) + j) for r in range(3) for j in range(int(NUM_SCHEDULED[r]))]
    context = [torch.tensor([slot(r, p) for p in range(int(NUM_COMPUTED[r]))], dtype=torch.long) for r in range(3)]
    return Batch(plan=plan, slot_mapping=torch.tensor(slots, dtype=torch.long), context_slots=context)


def ancestors(parents: list[int], node: int) -> list[int]:
    """Root-first path to ``node``."""
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]
