"""Tree rejection sampler: node-wise acceptance, emitted in vLLM's rejection-sampler format.

For every request of the step (trees, chains and requests without drafts alike) the
target's token is drawn at every verified node exactly as non-speculative decoding
would draw it at that node's position (:func:`ubtree_vllm.verify.sampling.processed_probs`:
temperature, top-k, top-p with vLLM's semantics; argmax at temperature 0), then the
tree is walked with :func:`ubtree_vllm.verify.accept.accept_tree` (on CUDA its one-launch
Triton form, :func:`ubtree_vllm.triton_ops.tree_accept.tree_accept`): accept the child
carrying the drawn token, stop at the first node without one and emit its draw as the
bonus token. That rule is lossless (see ``ubtree_vllm/verify/accept.py``).

Logits processing (:func:`processed_node_logits`), in the order of vLLM's
``Sampler.apply_logits_processors``: at a node of depth d, plain decoding would have generated
the request's output tokens and then the tokens of the node's path (depths 1..d), so each
node's row gets, over exactly those (:func:`node_output_tokens`, host lists built from the
step's host-side trees; no device read): the allowed-token mask, bad words (a bad word's last
token is banned where the path ends in its prefix), min_tokens (the stop tokens are banned
while len(output) + d < min_tokens), logit bias, then the presence/frequency/repetition
penalties. min_p (argmax invariant) is applied after temperature, before top-k/top-p, as
vLLM's sampler does (``verify/sampling.py:processed_probs``).

Randomness: one exponential race per node (argmax p / E, E ~ Exp(1)), with the
request's own ``torch.Generator`` when it has a seed (vLLM's
``SamplingMetadata.generators``), else the process RNG that vLLM seeds at start-up.

Output contract (``vllm.v1.sample.rejection_sampler.RejectionSampler``):
``sampled_token_ids [num_reqs, max_nodes]`` int32 holding the accepted draft tokens then
the bonus token, ``-1`` padded, so the scheduler's accounting (accepted = emitted - 1)
and spec-decode metrics need no change. The accepted node indices (for the KV commit
and the drafter's features) are returned alongside.

Logprobs (``logprobs`` or ``logprob_token_ids`` of a request): output slot k's token was drawn at the accepted node of
depth k, so its logprobs are taken from that node's logits row, exactly the row plain decoding
would have had at that position; laid out like ``sampled_token_ids`` ([num_reqs * max_nodes]
rows, filtered by vLLM's ``parse_output``). The raw modes only (``raw_logprobs``, the default,
and ``raw_logits``): the logits straight from the model, as vLLM's sampler reports them.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                     MinTokensLogitsProcessor)
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.penalties import apply_all_penalties
from vllm.v1.sample.sampler import Sampler

from ubtree_vllm.verify.accept import AcceptResult, walk_trees
from ubtree_vllm.verify.sampling import SamplingTensors, processed_probs
from ubtree_vllm.vllm.request_support import LOGPROBS_MODES
from ubtree_vllm.vllm.tree_plan import DeviceTrees, TreeStepPlan

# vLLM's threshold below which a temperature means greedy (vllm.v1.sample.sampler).
_SAMPLING_EPS = 1e-5


# vLLM's built-in logits processors, each applied per node below; any other (a user's custom
# processor) sees only a flat batch and cannot be applied along a tree's paths.
NODE_PROCESSORS = (MinTokensLogitsProcessor, LogitBiasLogitsProcessor)
ARGMAX_INVARIANT_PROCESSORS = (MinPLogitsProcessor,)


def check_supported(metadata: SamplingMetadata) -> None:
    """Defence in depth behind the admission check: refuse a batch the sampler cannot serve."""
    procs = metadata.logitsprocs
    problems = [type(p).__name__ for p in procs.non_argmax_invariant if not isinstance(p, NODE_PROCESSORS)]
    problems += [type(p).__name__ for p in procs.argmax_invariant if not isinstance(p, ARGMAX_INVARIANT_PROCESSORS)]
    if problems:
        raise RuntimeError(f"ubtree tree sampler got a batch using {problems}; such requests must be "
                           "rejected at admission (ubtree_vllm.patches sampling_params_spec_decode), and "
                           "custom logits processors cannot be applied along a tree's paths")


def sampling_tensors(metadata: SamplingMetadata, num_reqs: int, device: torch.device) -> SamplingTensors:
    """vLLM's batch sampling parameters as the algorithm core's SamplingTensors."""
    if metadata.all_greedy or metadata.temperature is None:
        temperature = torch.zeros(num_reqs, dtype=torch.float32, device=device)
    else:
        temp = metadata.temperature[:num_reqs].float()
        temperature = torch.where(temp < _SAMPLING_EPS, 0.0, temp)
    top_k = (metadata.top_k[:num_reqs].long() if metadata.top_k is not None
             else torch.zeros(num_reqs, dtype=torch.long, device=device))
    top_p = (metadata.top_p[:num_reqs].float() if metadata.top_p is not None
             else torch.ones(num_reqs, dtype=torch.float32, device=device))
    min_p = None
    for processor in metadata.logitsprocs.argmax_invariant:
        if isinstance(processor, MinPLogitsProcessor) and processor.min_p_count:
            min_p = processor.min_p[:num_reqs, 0].float()  # [N], 0 = off (vLLM's per-row state)
    return SamplingTensors(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)


def node_output_tokens(plan: TreeStepPlan, output_token_ids: list[list[int]]) -> list[list[int]]:
    """What plain decoding would have generated before each node's draw: the request's output tokens,
    then the node's path tokens (depths 1..d; the root is the last output token already).

    Returns [num_reqs * max_nodes] lists, request-major; padding nodes repeat their request's last node."""
    lists: list[list[int]] = []
    for r in range(plan.num_reqs):
        base = list(output_token_ids[r])
        count = int(plan.num_nodes[r])
        paths: list[list[int]] = [[]]
        for j in range(1, count):
            paths.append(paths[int(plan.parents[r, j])] + [int(plan.tokens[r, j])])
        lists += [base + paths[min(j, count - 1)] for j in range(plan.max_nodes)]
    return lists


def _node_rows(plan: TreeStepPlan, num_nodes: int, per_request: dict[int, object]) -> list[tuple[int, int, object]]:
    """(flat node row, depth, value) for every node of every request in ``per_request`` (batch index -> value)."""
    return [(r * num_nodes + j, int(plan.depth[r, min(j, int(plan.num_nodes[r]) - 1)]), value)
            for r, value in per_request.items() if r < plan.num_reqs for j in range(num_nodes)]


def _fill(rows: torch.Tensor, row_idx: list[int], tok_idx: list[int], values: list[float] | float,
          add: bool = False) -> None:
    if not row_idx:
        return
    device = rows.device
    where = (torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device))
    if add:
        rows.index_put_(where, torch.tensor(values, dtype=rows.dtype, device=device), accumulate=True)
    else:
        rows[where] = values


def node_processing_needed(metadata: SamplingMetadata) -> bool:
    """Whether any node's row differs from the raw logits before temperature (no processing: argmax of raw rows)."""
    procs = metadata.logitsprocs.non_argmax_invariant
    return (not metadata.no_penalties or metadata.allowed_token_ids_mask is not None
            or bool(metadata.bad_words_token_ids)
            or any(isinstance(p, MinTokensLogitsProcessor) and p.min_toks for p in procs)
            or any(isinstance(p, LogitBiasLogitsProcessor) and p.biases for p in procs))


def processed_node_logits(logits: torch.Tensor, index: torch.Tensor, metadata: SamplingMetadata,
                          plan: TreeStepPlan) -> torch.Tensor:
    """[N, n, V] float32 node logits after vLLM's logits processing along each node's path (module docstring).

    logits [T, V]; index [N, n] logits row of each node (padding nodes repeat the request's last node).
    Host-side lists only (the step's trees and vLLM's processor states); no device read.
    """
    num_reqs, num_nodes = index.shape
    rows = logits[index.flatten()].float()  # [N * n, V]
    paths: list[list[int]] | None = None

    def node_paths() -> list[list[int]]:
        nonlocal paths
        if paths is None:
            paths = node_output_tokens(plan, metadata.output_token_ids)
        return paths

    def per_node(values: torch.Tensor) -> torch.Tensor:
        return values[:num_reqs].repeat_interleave(num_nodes, dim=0)

    if metadata.allowed_token_ids_mask is not None:
        rows.masked_fill_(per_node(metadata.allowed_token_ids_mask), float("-inf"))
    if metadata.bad_words_token_ids:
        by_row = {row: words for row, _, words in _node_rows(plan, num_nodes, metadata.bad_words_token_ids)}
        apply_bad_words(rows, by_row, node_paths())
    for processor in metadata.logitsprocs.non_argmax_invariant:
        if isinstance(processor, MinTokensLogitsProcessor) and processor.min_toks:
            # stop tokens banned while the output before the node's draw, len(outputs) + depth, is short
            banned = [(row, tok) for row, depth, (min_toks, outputs, stops, _) in
                      _node_rows(plan, num_nodes, processor.min_toks) if len(outputs) + depth < min_toks
                      for tok in stops]
            _fill(rows, [b[0] for b in banned], [b[1] for b in banned], float("-inf"))
        elif isinstance(processor, LogitBiasLogitsProcessor) and processor.biases:
            biased = [(row, tok, bias) for row, _, lb in _node_rows(plan, num_nodes, processor.biases)
                      for tok, bias in lb.items()]
            _fill(rows, [b[0] for b in biased], [b[1] for b in biased], [b[2] for b in biased], add=True)
    if not metadata.no_penalties:
        rows = apply_all_penalties(rows, per_node(metadata.prompt_token_ids), per_node(metadata.presence_penalties),
                                   per_node(metadata.frequency_penalties), per_node(metadata.repetition_penalties),
                                   node_paths())
    return rows.view(num_reqs, num_nodes, -1)


def draw_node_tokens(logits: torch.Tensor, index: torch.Tensor, metadata: SamplingMetadata,
                     params: SamplingTensors, plan: TreeStepPlan) -> torch.Tensor:
    """The target's draw at every node: logits [T, V], index [N, n] (logits row of each node) -> [N, n] int64.

    All-greedy batches without logits processing take the argmax of the T rows and never gather
    [N, n, V] logits. Processing reads the step's host-side trees (`plan`).
    """
    processed = node_processing_needed(metadata)
    if metadata.all_greedy and not processed:
        return logits.argmax(dim=-1)[index]
    node_logits = processed_node_logits(logits, index, metadata, plan) if processed else logits[index]  # [N, n, V]
    greedy = node_logits.argmax(dim=-1)
    if metadata.all_greedy:
        return greedy
    probs = processed_probs(node_logits, params)  # [N, n, V] float32
    noise = torch.empty_like(probs).exponential_(1.0)
    # SYNC: host loop over the requests with their own seed only (a torch.Generator each; no device read).
    for req_idx, generator in metadata.generators.items():
        if req_idx < noise.shape[0]:
            noise[req_idx].exponential_(1.0, generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    return torch.where(params.temperature[:, None] > 0, sampled, greedy)


class TreeRejectionSampler:
    """Replaces the V1 runner's chain RejectionSampler for UBTree steps.

    block_size: the drafter's gamma, a static bound on tree depth. On CUDA the walk is the
    one-launch Triton kernel (:mod:`ubtree_vllm.triton_ops.tree_accept`), compiled for that
    bound once; on the CPU it is ``accept_tree``'s torch ops, bounded by the step's depth.
    """

    def __init__(self, block_size: int, logprobs_mode: str = "raw_logprobs",
                 share_draws: Callable[[torch.Tensor], torch.Tensor] | None = None):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES} with method 'ubtree', "
                             f"got {logprobs_mode!r}")
        self.block_size = block_size
        self.logprobs_mode = logprobs_mode
        # tensor parallelism: the driver rank's draws on every rank (vllm/tensor_parallel.py)
        self.share_draws = share_draws
        self._sampler: Sampler | None = None

    def __call__(self, plan: TreeStepPlan, trees: DeviceTrees, logits: torch.Tensor,
                 metadata: SamplingMetadata) -> tuple[SamplerOutput, AcceptResult]:
        """logits: [sum(num_nodes), V], request-major, node j of request r at start_r + j
        (vLLM's spec-decode ``logits_indices`` order)."""
        check_supported(metadata)
        device = logits.device
        num_reqs, max_nodes = plan.num_reqs, plan.max_nodes
        if logits.shape[0] != int(plan.num_nodes.sum()):
            raise RuntimeError(f"tree sampler expected {int(plan.num_nodes.sum())} logits rows, got {logits.shape[0]}")
        # [num_reqs, max_nodes] row of each node's logits (padding nodes repeat the last node).
        start = torch.from_numpy(plan.num_nodes.cumsum() - plan.num_nodes).to(device)
        last = torch.from_numpy(plan.num_nodes - 1).to(device)
        node = torch.arange(max_nodes, device=device)
        index = start[:, None] + torch.minimum(node[None, :], last[:, None])  # [num_reqs, max_nodes]
        params = sampling_tensors(metadata, num_reqs, device)
        draws = draw_node_tokens(logits, index, metadata, params, plan)  # [N, n] int64
        if self.share_draws is not None:
            draws = self.share_draws(draws)
        # the kernel is compiled per depth bound: a static one on CUDA, the step's own on the CPU
        bound = max(self.block_size, plan.max_depth) if logits.is_cuda else plan.max_depth
        result = walk_trees(trees.parents, trees.tokens, trees.depth, draws, bound)
        sampled = torch.full((num_reqs, max_nodes), -1, dtype=torch.int32, device=device)
        width = min(max_nodes, result.output_tokens.shape[1])
        sampled[:, :width] = result.output_tokens[:, :width].to(torch.int32)
        logprobs = None
        if metadata.max_num_logprobs is not None or metadata.logprob_token_ids:
            logprobs = self._logprobs(logits, index, result, sampled, metadata)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=logprobs), result

    def _logprobs(self, logits: torch.Tensor, index: torch.Tensor, result: AcceptResult, sampled: torch.Tensor,
                  metadata: SamplingMetadata) -> LogprobsTensors:
        """Logprobs of every output slot from the logits row of the node that drew it ([N * max_nodes] rows):
        the top ones, or (vLLM's preference when both are set) the requested ``logprob_token_ids``."""
        num_reqs, max_nodes = sampled.shape
        path = torch.zeros((num_reqs, max_nodes), dtype=torch.long, device=logits.device)
        width = min(max_nodes, result.accepted_path.shape[1])
        path[:, :width] = result.accepted_path[:, :width].clamp(min=0)  # slot k: the node at depth k
        rows = index.gather(1, path).flatten()  # [N * max_nodes]
        row_logits = logits[rows].float()
        values = Sampler.compute_logprobs(row_logits) if self.logprobs_mode == "raw_logprobs" else row_logits
        tokens = sampled.flatten().clamp(min=0).long()
        if metadata.logprob_token_ids:  # vLLM's own gather, over output slots (request r's are r * S .. r * S + S - 1)
            per_slot = {req * max_nodes + k: ids for req, ids in metadata.logprob_token_ids.items()
                        for k in range(max_nodes)}
            return self._vllm_sampler().gather_specific_token_logprobs(values, per_slot, tokens)
        return Sampler.gather_logprobs(values, metadata.max_num_logprobs, tokens)

    def _vllm_sampler(self) -> Sampler:
        """vLLM's sampler, built at the first request for ``logprob_token_ids``."""
        if self._sampler is None:
            self._sampler = Sampler(logprobs_mode=self.logprobs_mode)
        return self._sampler
