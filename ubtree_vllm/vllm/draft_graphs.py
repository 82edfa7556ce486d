"""CUDA graphs of the whole drafting stage: backbone, LM head top-K, selector, tree search.

Eager, a drafting round is ~600 small kernels (most of them the tree search's per-depth
steps), so on a GPU its cost is host dispatch, not compute. :class:`DraftGraphs` captures
``UBTreeDrafter.draft_tree`` once per shape bucket and replays it: N drafting requests are
padded to the next power of two, the context width L to the next power of two >= 256.
Padding is exact: padded requests and padded context rows are invalid (masked out of the
drafter's attention), so a request's tree does not depend on the bucket, up to the
floating-point order of the attention sums. Drafts only steer speed; verification stays
lossless either way.

Graphs are captured lazily on first use of a bucket, in one private memory pool shared
by all buckets (replays never overlap). That memory is outside the KV budget vLLM profiled
at start-up. Engines with ``enforce_eager`` (or CUDA graphs off) draft eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.tree.topology import DraftTree
from ubtree_vllm.types import DraftContext

MIN_CONTEXT_BUCKET = 256
logger = logging.getLogger(__name__)


def bucket(size: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(size, minimum)."""
    return 1 << (max(size, minimum) - 1).bit_length()


@dataclass
class _Captured:
    # None: the same padded buffers, run eagerly (CPU, tests)
    graph: "torch.cuda.CUDAGraph | None"
    # static inputs: anchor/anchor_pos [N], features [N, L, F], valid [N, L], tokens [N, L]
    anchor: torch.Tensor
    anchor_pos: torch.Tensor
    features: torch.Tensor
    valid: torch.Tensor
    tokens: torch.Tensor
    # static output of the captured call (eager buckets: the last output)
    tree: DraftTree | None


class DraftGraphs:
    """``draft_tree`` through CUDA graphs, one per (request bucket, context bucket).

    ``capture=False`` keeps the bucketing and padding but runs eagerly (CPU; tests of the
    padding contract).
    """

    def __init__(self, drafter: UBTreeDrafter, tree_cfg: UBTreeConfig, device: torch.device,
                 capture: bool = True) -> None:
        self.drafter = drafter
        self.tree_cfg = tree_cfg
        self.device = device
        self.capture = capture
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _run(self, anchor: torch.Tensor, anchor_pos: torch.Tensor, features: torch.Tensor,
             valid: torch.Tensor, tokens: torch.Tensor) -> DraftTree:
        num_reqs, width = valid.shape
        positions = torch.arange(width, device=valid.device).expand(num_reqs, width)
        ctx = DraftContext(anchor=anchor, anchor_pos=anchor_pos, features=features, positions=positions,
                           valid=valid, tokens=tokens)
        return self.drafter.draft_tree(ctx, self.tree_cfg)

    def _buffers(self, num_reqs: int, width: int, features_dtype: torch.dtype,
                 num_features: int) -> tuple[torch.Tensor, ...]:
        """Static inputs of one bucket: anchor, anchor_pos [N]; features [N, L, F]; valid, tokens [N, L]."""
        device = self.device
        return (torch.zeros(num_reqs, dtype=torch.long, device=device),
                torch.zeros(num_reqs, dtype=torch.long, device=device),
                torch.zeros((num_reqs, width, num_features), dtype=features_dtype, device=device),
                torch.zeros((num_reqs, width), dtype=torch.bool, device=device),
                torch.zeros((num_reqs, width), dtype=torch.long, device=device))

    def _capture(self, num_reqs: int, width: int, features_dtype: torch.dtype, num_features: int) -> _Captured:
        device = self.device
        anchor, anchor_pos, features, valid, tokens = self._buffers(num_reqs, width, features_dtype, num_features)
        if not self.capture:
            return _Captured(None, anchor, anchor_pos, features, valid, tokens, tree=None)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the graph (lazy inits, autotuning)
            for _ in range(2):
                self._run(anchor, anchor_pos, features, valid, tokens)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            tree = self._run(anchor, anchor_pos, features, valid, tokens)
        return _Captured(graph, anchor, anchor_pos, features, valid, tokens, tree)

    def __call__(self, ctx: DraftContext) -> DraftTree:
        """Same contract as ``UBTreeDrafter.draft_tree(ctx, tree_cfg)`` (ctx.positions must be arange)."""
        num_reqs, width, num_features = ctx.features.shape
        key = (bucket(num_reqs), bucket(width, MIN_CONTEXT_BUCKET))
        captured = self._graphs.get(key)
        if captured is None:
            try:
                captured = self._capture(*key, ctx.features.dtype, num_features)
            except RuntimeError as err:  # e.g. out of memory for a large bucket: draft eagerly
                logger.warning("ubtree: CUDA graph capture of the drafting stage for %s requests x %s "
                               "context rows failed (%s); drafting eagerly for this bucket", *key, err)
                torch.cuda.synchronize(self.device)  # SYNC: once per failed bucket, error path
                captured = _Captured(None, *self._buffers(*key, ctx.features.dtype, num_features), tree=None)
            self._graphs[key] = captured
        captured.anchor[:num_reqs].copy_(ctx.anchor)
        captured.anchor[num_reqs:].zero_()
        captured.anchor_pos[:num_reqs].copy_(ctx.anchor_pos)
        captured.anchor_pos[num_reqs:].zero_()
        captured.features[:num_reqs, :width].copy_(ctx.features)
        captured.valid[:num_reqs, :width].copy_(ctx.valid)
        captured.valid[:num_reqs, width:].zero_()
        captured.valid[num_reqs:].zero_()
        if self.tree_cfg.prompt_lookup:  # only the lookup branch reads the tokens
            captured.tokens[:num_reqs, :width].copy_(ctx.tokens)
        if captured.graph is None:
            captured.tree = self._run(captured.anchor, captured.anchor_pos, captured.features, captured.valid,
                                      captured.tokens)
        else:
            captured.graph.replay()
        out = captured.tree
        assert out is not None
        # Clones: the next replay overwrites the static outputs.
        return DraftTree(tokens=out.tokens[:num_reqs].clone(), parents=out.parents[:num_reqs].clone(),
                         depth=out.depth[:num_reqs].clone(), scores=out.scores[:num_reqs].clone())
