"""Tree rejection sampler for Model Runner V2 (docs/design/mrv2.md §5), installed by ``UBTreeModelRunnerV2``.

Replaces ``GPUModelRunner.rejection_sampler`` (MRV2 calls it as
``rejection_sampler(logits, input_batch, draft_logits, invalid_drafts)``). The logits rows
of request r are its tree nodes 0..n_r-1 (node 0 = the root = the last sampled token,
node j >= 1 = draft j; the scheduler may truncate, and a parents-first prefix is a tree).

1. Every node's input token and position (depth position, written by the runner's tree
   layout) are gathered from the batch; draft rows of a request still inside its prefill
   are placeholders (-1), as in vLLM's ``gather_draft_sampled``.
2. vLLM's own ``Sampler.apply_sampling_params`` processes the logits (temperature, min_p,
   top-k/top-p, logit bias) and the target's token is drawn at every node with vLLM's
   ``gumbel_sample``: noise keyed on (request seed, position), a plain argmax at T = 0. A
   node at depth d of the accepted path is at position root + d, so its draw is the one
   non-speculative MRV2 makes at that position given the same prefix.
3. :func:`ubtree_vllm.verify.accept.accept_tree` walks each tree (lossless rule, see there). On
   CUDA the scatter of the flat logits rows to per-request nodes, the walk and MRV2's counts are
   one launch, :func:`ubtree_vllm.triton_ops.tree_accept.tree_accept_rows`; the torch steps are
   its test oracle and the CPU path.

Output (MRV2's ``SamplerOutput``): ``sampled_token_ids [R, max_depth + 1]`` = accepted draft
tokens then the bonus, ``num_sampled = accepted + 1``, ``num_rejected = n_r - num_sampled``
(both 0 for a chunked-prefill row), and where a request asked for ``logprobs`` or ``logprob_token_ids``,
vLLM's per-row ``LogprobsTensors`` with output slot i of each request scored on the row of the node that drew it
(``accepted_path[r, i]``; vLLM's chain sampler scores row i). The :class:`AcceptResult` of the step is kept in
``last_accept`` for the KV commit and the drafter's context. No host sync: fixed-shape
torch ops plus vLLM's kernels; ``idx_mapping_np`` / ``seq_lens_cpu_upper_bound`` are host
arrays vLLM already holds.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ubtree_vllm.triton_ops.node_inputs import node_inputs
from ubtree_vllm.triton_ops.tree_accept import tree_accept_rows
from ubtree_vllm.verify.accept import AcceptResult, walk_trees
from ubtree_vllm.vllm.mrv2.tree_layout import root_rows_of

# draw(processed_logits [L, V], expanded_idx_mapping [L], temperature [max_reqs], seeds [max_reqs], pos [L],
#      use_fp64) -> [L]
DrawFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]


def vllm_gumbel_draw(processed_logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, temperature: torch.Tensor,
                     seeds: torch.Tensor, pos: torch.Tensor, use_fp64: bool = False) -> torch.Tensor:
    """vLLM MRV2's draw (CUDA): temperature already applied by ``apply_sampling_params``."""
    from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample

    return gumbel_sample(processed_logits, expanded_idx_mapping, temperature, seeds, pos,
                         apply_temperature=False, is_drafting=False, use_fp64=use_fp64)


@dataclass
class TokenIdsRequest:
    """Which rows ask for ``logprob_token_ids``: vLLM's ``LogprobTokenIdsState`` (per request slot), the request slot
    of each row ([L]) and the batch's largest count (0: none; then the top-``num_logprobs`` fast path)."""

    state: Any
    expanded_idx_mapping: torch.Tensor
    max_per_req: int


# scores(logits rows [L, V], num_logprobs, sampled token per row [L], cu_num_logits or None, logits_mode,
#        token ids request) -> LogprobsTensors
ScoresFn = Callable[[torch.Tensor, int, torch.Tensor, Any, bool, TokenIdsRequest], Any]


def vllm_topk_scores(logits: torch.Tensor, num_logprobs: int, sampled: torch.Tensor, cu_num_logits: Any,
                     logits_mode: bool, token_ids: TokenIdsRequest) -> Any:
    """vLLM MRV2's logprobs of the sampled token and the top ``num_logprobs`` per row, or of each request's
    ``logprob_token_ids`` where it set them (CUDA; vLLM's own non-speculative scoring)."""
    from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

    return compute_topk_scores(logits, num_logprobs, sampled, cu_num_logits,
                               logprob_token_ids_state=token_ids.state,
                               expanded_idx_mapping=token_ids.expanded_idx_mapping,
                               max_per_req_token_ids=token_ids.max_per_req, logits_mode=logits_mode)


def emitted_rows(accepted_path: torch.Tensor, output_tokens: torch.Tensor, num_sampled: torch.Tensor,
                 cu_num_logits: torch.Tensor, num_logits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For vLLM's per-row logprobs layout (output slot i of request r at flat row ``cu[r] + i``): the logits row
    that drew each output token -- slot i of request r was drawn at node ``accepted_path[r, i]`` -- and the token.
    Returns (rows [L] int64, tokens [L] int64); slots past ``num_sampled`` keep their own row and token 0."""
    cu = cu_num_logits.long()  # [R + 1]
    flat = torch.arange(num_logits, device=cu.device)
    req = torch.searchsorted(cu[1:], flat, right=True).clamp(max=cu.shape[0] - 2)  # [L] batch index of each row
    slot = flat - cu[req]
    emitted = slot < num_sampled.long()[req]
    slot_in_path = slot.clamp(max=accepted_path.shape[1] - 1)
    rows = cu[req] + torch.where(emitted, accepted_path[req, slot_in_path].clamp(min=0), slot)
    return rows, torch.where(emitted, output_tokens[req, slot_in_path], 0)


@dataclass
class TreeTopology:
    """Per-request draft-tree topology, indexed by MRV2's req_state_idx (owned by the speculator)."""

    # [max_reqs, B + 1] int32 parent of each node: -1 at the root, -2 = no node
    parents: torch.Tensor
    # [max_reqs, B + 1] int32 depth of each node (0 at the root)
    depth: torch.Tensor


def gather_node_inputs(input_ids: torch.Tensor, positions: torch.Tensor, logits_indices: torch.Tensor,
                       expanded_idx_mapping: torch.Tensor, expanded_local_pos: torch.Tensor,
                       prefill_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [L], pos [L]) of each logits row, in the dtypes of ``input_ids`` / ``positions`` (as vLLM's
    ``gather_draft_sampled``: its sampling kernels, e.g. bad words, compile for those); draft rows of a
    still-prefilling request are -1. On CUDA one launch (``triton_ops/node_inputs.py``; these torch
    steps are its test oracle).

    vLLM's ``gather_draft_sampled`` rule (local pos j > 0 with ``pos - j < prefill_len``) in tree form:
    positions are root + depth here, so the test is on the root's position (row i - j).
    """
    if input_ids.is_cuda:
        return node_inputs(input_ids, positions, logits_indices, expanded_idx_mapping, expanded_local_pos,
                           prefill_len)
    token = input_ids[logits_indices]  # [L]
    pos = positions[logits_indices]  # [L]
    local = expanded_local_pos.long()
    root_rows = root_rows_of(logits_indices, expanded_local_pos)  # [L]
    placeholder = (local > 0) & (positions[root_rows].long() < prefill_len[expanded_idx_mapping].long())
    return torch.where(placeholder, -1, token), pos


def per_request_nodes(values: torch.Tensor, cu_num_logits: torch.Tensor, num_nodes: int,
                      fill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter flat per-logits-row ``values [L]`` to ``[R, num_nodes]`` (``fill`` past a request's rows).

    Returns (nodes [R, num_nodes], present [R, num_nodes] bool)."""
    start = cu_num_logits[:-1].long()  # [R]
    count = cu_num_logits[1:].long() - start  # [R]
    j = torch.arange(num_nodes, device=values.device)  # [n]
    present = j[None, :] < count[:, None]  # [R, n]
    index = (start[:, None] + j[None, :]).clamp(max=max(values.shape[0] - 1, 0))  # [R, n]
    return torch.where(present, values[index], fill), present


def sampled_and_rejected(num_accepted: torch.Tensor, cu_num_logits: torch.Tensor, seq_lens: torch.Tensor,
                         idx_mapping: torch.Tensor, prefill_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MRV2's (num_sampled, num_rejected), int32 [R]: 0 and 0 for a chunked-prefill row (seq_len < prefill_len)."""
    num_logits = (cu_num_logits[1:] - cu_num_logits[:-1]).int()
    num_sampled = (num_accepted + 1).int()
    chunked = seq_lens < prefill_len[idx_mapping]
    num_sampled = torch.where(chunked, 0, num_sampled)
    num_rejected = torch.where(chunked, 0, num_logits - num_sampled)
    return num_sampled.int(), num_rejected.int()


def accept_rows_torch(tokens: torch.Tensor, draws: torch.Tensor, cu_num_logits: torch.Tensor,
                      idx_mapping: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor, seq_lens: torch.Tensor,
                      prefill_len: torch.Tensor, max_depth: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor,
                                                                          torch.Tensor]:
    """Torch form of :func:`ubtree_vllm.triton_ops.tree_accept.tree_accept_rows` (same result; also takes the
    topology's ``depth [max_reqs, n]``, which ``accept_tree`` reads): flat logits rows to per-request nodes
    (placeholder tokens and unscheduled nodes are padding), the walk, MRV2's counts."""
    num_nodes = parents.shape[1]
    node_tokens, present = per_request_nodes(tokens.long(), cu_num_logits, num_nodes, -1)  # [R, n]
    node_draws, _ = per_request_nodes(draws.long(), cu_num_logits, num_nodes, -1)
    req = idx_mapping[:node_tokens.shape[0]].long()
    node_parents = parents[req].long()  # [R, n]
    valid = present & (node_tokens >= 0)
    valid[:, 0] = present[:, 0]
    node_parents = torch.where(valid, node_parents, -2)
    node_parents[:, 0] = -1
    result = walk_trees(node_parents, node_tokens, depth[req].long(), node_draws, max_depth)
    num_sampled, num_rejected = sampled_and_rejected(result.num_accepted, cu_num_logits, seq_lens[:req.shape[0]],
                                                     req, prefill_len)
    return (result.accepted_path, result.num_accepted, result.output_tokens, result.last_node), num_sampled, \
        num_rejected


class UBTreeRejectionSampler:
    """MRV2 rejection sampler over draft trees (see the module docstring)."""

    enable_adaptive_verification = False  # read (and toggled) by vLLM's warmup_kernels

    def __init__(self, sampler: Any, topology: TreeTopology, max_depth: int, draw: DrawFn = vllm_gumbel_draw,
                 scores: ScoresFn = vllm_topk_scores):
        self.sampler = sampler  # vLLM's MRV2 Sampler: apply_sampling_params, sampling_states, req_states
        self.topology = topology
        self.max_depth = max_depth  # the drafter's block size gamma: no tree is deeper
        self.draw = draw
        self.scores = scores
        self.last_accept: AcceptResult | None = None

    def __call__(self, logits: torch.Tensor, input_batch: Any, draft_logits: torch.Tensor | None = None,
                 invalid_drafts: torch.Tensor | None = None) -> Any:
        from vllm.v1.worker.gpu.sample.output import SamplerOutput

        if draft_logits is not None:
            raise RuntimeError("ubtree drafts greedily: the rejection sampler takes no draft logits")
        prefill_len = self.sampler.req_states.prefill_len.gpu  # [max_reqs]
        tokens, pos = gather_node_inputs(input_batch.input_ids, input_batch.positions, input_batch.logits_indices,
                                         input_batch.expanded_idx_mapping, input_batch.expanded_local_pos,
                                         prefill_len)
        if invalid_drafts is not None:  # structured output marks drafts its grammar rejects
            tokens = tokens.masked_fill(invalid_drafts, -1)
        processed = self.sampler.apply_sampling_params(
            logits, input_batch.expanded_idx_mapping, input_batch.idx_mapping, input_batch.idx_mapping_np, pos,
            tokens, input_batch.expanded_local_pos, input_batch.seq_lens_cpu_upper_bound.numpy())
        states = self.sampler.sampling_states
        draws = self.draw(processed, input_batch.expanded_idx_mapping, states.temperature.gpu, states.seeds.gpu, pos,
                          bool(getattr(self.sampler, "use_fp64_gumbel", False)))
        num_reqs = input_batch.num_reqs  # seq_lens is padded to the graph's request count
        rows = (tokens, draws, input_batch.cu_num_logits, input_batch.idx_mapping)
        seq_lens, parents = input_batch.seq_lens[:num_reqs], self.topology.parents
        if draws.is_cuda:  # one launch (triton_ops/tree_accept.py)
            walk, num_sampled, num_rejected = tree_accept_rows(*rows, parents, seq_lens, prefill_len, self.max_depth)
        else:  # the torch steps (the kernel's test oracle)
            walk, num_sampled, num_rejected = accept_rows_torch(*rows, parents, self.topology.depth, seq_lens,
                                                                prefill_len, self.max_depth)
        result = self.last_accept = AcceptResult(*walk)
        return SamplerOutput(sampled_token_ids=result.output_tokens, num_nans=None, num_sampled=num_sampled,
                             num_rejected=num_rejected,
                             logprobs_tensors=self._logprobs(logits, processed, result, num_sampled, input_batch))

    def _logprobs(self, logits: torch.Tensor, processed: torch.Tensor, result: AcceptResult, num_sampled: torch.Tensor,
                  input_batch: Any) -> Any:
        """vLLM's LogprobsTensors of the emitted tokens, each from the node row that drew it (None: no request
        asked), with the top ``logprobs`` or the request's ``logprob_token_ids``, as vLLM's non-speculative
        sampler reports them. Raw or processed logits by the engine's logprobs_mode."""
        from vllm.config.model import PROCESSED_LOGPROBS_MODES

        dims = self.sampler.get_logprobs_dims(input_batch.idx_mapping_np)  # host arrays
        if dims is None:
            return None
        num_logprobs, max_token_ids = dims
        mode = self.sampler.logprobs_mode
        source = processed if mode in PROCESSED_LOGPROBS_MODES else logits
        rows, tokens = emitted_rows(result.accepted_path, result.output_tokens, num_sampled,
                                    input_batch.cu_num_logits[:input_batch.num_reqs + 1], logits.shape[0])
        per_row = logits.shape[0] != input_batch.num_reqs
        # a row stays inside its request (rows[i] and i share a request), so the row -> slot map is the batch's
        token_ids = TokenIdsRequest(self.sampler.logprob_token_ids_state, input_batch.expanded_idx_mapping,
                                    max_token_ids)
        return self.scores(source[rows], num_logprobs, tokens, input_batch.cu_num_logits_np.tolist() if per_row
                           else None, mode in ("raw_logits", "processed_logits"), token_ids)
