"""Random Model Runner V2 verification batches of draft trees, for the MRV2 tree-layout tests (torch and Triton).

Batches in MRV2's layout: per request some leading rows that produce no logits (prefill), then
its logits rows (root, then the first drafts of its state slot's tree). Trees: stars, chains,
deep branches, random, chains deeper than max_depth (a request reset to chain topology), with
padding nodes (parent -2) at the end or in the middle (their descendants are not tree rows
either), truncated drafts, root-only requests.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_REQS = 8
SEEDS = range(60)


@dataclass
class Request:
    slot: int  # request state index
    query_start: int
    num_scheduled: int
    num_logits: int  # 1 + scheduled drafts
    num_computed: int

    @property
    def root_row(self) -> int:
        return self.query_start + self.num_scheduled - self.num_logits

    @property
    def root_pos(self) -> int:
        return self.num_computed + self.num_scheduled - self.num_logits


@dataclass
class Batch:
    num_nodes: int  # B + 1
    max_depth: int
    reqs: list[Request]
    parents: list[list[int]]  # [MAX_REQS][B + 1]
    depths: list[list[int]]
    num_tokens: int
    padded_tokens: int

    def tensors(self) -> dict[str, torch.Tensor]:
        """MRV2's InputBatch tensors of the batch (dtypes as vLLM's)."""
        positions = torch.zeros(self.padded_tokens, dtype=torch.int64)
        logits_indices, local_pos, state, cu = [], [], [], [0]
        for r in self.reqs:
            rows = slice(r.query_start, r.query_start + r.num_scheduled)
            positions[rows] = torch.arange(r.num_scheduled) + r.num_computed
            logits_indices += [r.root_row + j for j in range(r.num_logits)]
            local_pos += list(range(r.num_logits))
            state += [r.slot] * r.num_logits
            cu.append(cu[-1] + r.num_logits)
        return {"positions": positions, "logits_indices": torch.tensor(logits_indices, dtype=torch.int64),
                "cu_num_logits": torch.tensor(cu, dtype=torch.int32),
                "expanded_idx_mapping": torch.tensor(state, dtype=torch.int64),
                "expanded_local_pos": torch.tensor(local_pos, dtype=torch.int32),
                "tree_parents": torch.tensor(self.parents, dtype=torch.int32),
                "tree_depth": torch.tensor(self.depths, dtype=torch.int32)}


def random_tree(rng: random.Random, num_nodes: int, max_depth: int) -> tuple[list[int], list[int]]:
    """Parents-first tree (depth <= max_depth, but for a reset chain), maybe with padding (parent -2, depth 0)."""
    kind = rng.choice(["star", "chain", "deep", "random", "reset_chain"])
    parents, depths = [-1], [0]
    for j in range(1, num_nodes):
        eligible = [p for p in range(j) if depths[p] < max_depth or kind == "reset_chain"]
        preferred = {"star": 0, "chain": j - 1, "reset_chain": j - 1, "random": rng.choice(eligible),
                     "deep": j - 1 if rng.random() < 0.7 else rng.choice(eligible)}[kind]
        parent = preferred if preferred in eligible else rng.choice(eligible)
        parents.append(parent)
        depths.append(depths[parent] + 1)
    if rng.random() < 0.5:  # padding: a tail, or one node in the middle (its subtree is cut off)
        start = rng.randrange(1, num_nodes)
        for j in range(start, num_nodes) if rng.random() < 0.5 else [start]:
            parents[j], depths[j] = -2, 0
    return parents, depths


def random_batch(seed: int) -> Batch:
    rng = random.Random(seed)
    num_drafts = rng.choice([1, 3, 5, 8])
    max_depth = rng.randint(1, num_drafts)
    trees = [random_tree(rng, num_drafts + 1, max_depth) for _ in range(MAX_REQS)]
    reqs, start = [], 0
    for slot in rng.sample(range(MAX_REQS), rng.randint(1, 6)):
        kind = rng.choice(["prefill", "root_only", "decode", "decode", "decode"])
        num_logits = rng.randint(2, num_drafts + 1) if kind == "decode" else 1
        leading = rng.randint(1, 7) if kind == "prefill" else rng.choice([0, 0, 2])
        reqs.append(Request(slot, start, leading + num_logits, num_logits, rng.randint(0, 100)))
        start += leading + num_logits
    return Batch(num_drafts + 1, max_depth, reqs, [t[0] for t in trees], [t[1] for t in trees], start,
                 start + rng.randint(0, 3))


def random_acceptance(batch: Batch, rng: random.Random, whole_tree: bool,
                      stale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """accepted_path [R, max_depth + 1] (random root-anchored path), num_accepted [R].

    whole_tree: the walk may enter nodes the scheduler truncated away (rows beyond the request);
    stale: entries past the path hold old node indices instead of -1 (a reused buffer).
    """
    paths = []
    for r in batch.reqs:
        parents, path = batch.parents[r.slot], [0]
        num_nodes = batch.num_nodes if whole_tree else r.num_logits
        while len(path) <= batch.max_depth:
            children = [c for c in range(1, num_nodes) if parents[c] == path[-1]]
            if not children or rng.random() < 0.1:
                break
            path.append(rng.choice(children))
        paths.append(path)
    pad = [[rng.randrange(batch.num_nodes) if stale else -1 for _ in range(batch.max_depth + 1 - len(p))]
           for p in paths]
    accepted_path = torch.tensor([p + tail for p, tail in zip(paths, pad)])
    return accepted_path, torch.tensor([len(p) - 1 for p in paths])


def run_layout_with(layout: Callable[..., None], batch: Batch, m_cap: int, device: str = "cpu",
                    cover_rows: bool = False) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``layout`` (``lay_out_tree_rows``' signature) over the batch on ``device``, into garbage-filled row
    buffers of ``m_cap`` entries; returns (buffers, positions after), on the CPU."""
    t = {name: v.to(device) for name, v in batch.tensors().items()}
    gen = torch.Generator().manual_seed(m_cap)
    bufs = {name: torch.randint(-5, 50, shape, generator=gen).to(device)
            for name, shape in (("row_index", (m_cap,)), ("row_req", (m_cap,)), ("row_context_len", (m_cap,)),
                                ("row_path", (m_cap, batch.max_depth + 1)))}
    layout(t["positions"], t["logits_indices"], t["cu_num_logits"], t["expanded_idx_mapping"], t["expanded_local_pos"],
           t["tree_parents"], t["tree_depth"], batch.max_depth,
           bufs["row_index"], bufs["row_req"], bufs["row_context_len"], bufs["row_path"], cover_rows=cover_rows)
    return {name: v.cpu() for name, v in bufs.items()}, t["positions"].cpu()
