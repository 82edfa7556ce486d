"""What the hybrid-target tests (Gated DeltaNet, Mamba2) share: random trees, and the engine-level checks
that greedy UBTree equals plain decoding of the same engine (imported by name, like vllm_engines)."""
from __future__ import annotations

import gc
import random
from pathlib import Path
from typing import Any

import numpy as np
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from ubtree_vllm.bench.engines import stop_engine
from vllm_engines import TINY_TREE, spec_counts
from vllm_oracle import ReferenceOracle, engine_runner, install_oracle


def random_tree(num_nodes: int, rng: random.Random) -> tuple[np.ndarray, np.ndarray]:
    """(parents, depth) [num_nodes] of a random parents-first tree, node 0 the root."""
    parents = np.array([-1] + [rng.randrange(j) for j in range(1, num_nodes)], dtype=np.int64)
    depth = np.zeros(num_nodes, dtype=np.int64)
    for j in range(1, num_nodes):
        depth[j] = depth[parents[j]] + 1
    return parents, depth


def spec_step(trees: list[tuple[np.ndarray, np.ndarray]], num_accepted: list[int], slots: Any,
              device: Any) -> tuple[Any, Any]:
    """(step plan, GDNAttentionMetadata) of a step whose requests verify ``trees`` [(parents, depth)] as their
    speculative sequences (all rows speculative), resuming from ``num_accepted``, with state ``slots`` [Q, 1 + S]:
    what a linear layer's forward reads during a UBTree step (Gated DeltaNet and KDA layers share the metadata)."""
    import types

    import torch
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

    num_nodes = np.array([len(p) for p, _ in trees])
    width = int(num_nodes.max())
    plan = types.SimpleNamespace(
        num_nodes=num_nodes, parents=np.stack([np.pad(p, (0, width - len(p)), constant_values=-2) for p, _ in trees]),
        depth=np.stack([np.pad(d, (0, width - len(d))) for _, d in trees]))
    total = int(num_nodes.sum())
    masks = torch.ones(len(trees), dtype=torch.bool)
    metadata = GDNAttentionMetadata(
        num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0, num_spec_decodes=len(trees),
        num_spec_decode_tokens=total, num_actual_tokens=total,
        spec_query_start_loc=torch.tensor(np.concatenate([[0], np.cumsum(num_nodes)]), dtype=torch.int32).to(device),
        spec_state_indices_tensor=slots.to(torch.int32).to(device), spec_sequence_masks=masks.to(device),
        spec_sequence_masks_cpu=masks, spec_token_indx=torch.arange(total, device=device),
        non_spec_token_indx=torch.empty(0, dtype=torch.int64, device=device),
        num_accepted_tokens=torch.tensor(num_accepted, dtype=torch.int32).to(device))
    return plan, metadata


def layer_step(spec: int, rng: random.Random, width: int, conv_state: Any, ssm_state: Any) -> tuple[Any, ...]:
    """The first step of the CUDA layer tests (GDN, KDA): three requests with slots ``1 ..`` [3, 1 + spec] verifying a
    random tree of 1 + spec nodes, a fixed branching one and a root alone, resuming after 3, 1 and 6 accepted tokens.
    Returns (slots, trees, num_accepted, resumed): ``resumed[i]`` the (conv window [dim, width - 1], state) request i
    resumes from per vLLM's chain convention, read from ``conv_state`` [slots, dim, state_len] / ``ssm_state``."""
    import torch

    slots = torch.arange(1, 3 * (spec + 1) + 1).view(3, spec + 1)
    trees = [random_tree(spec + 1, rng), (np.array([-1, 0, 0, 0, 1, 1, 2]), np.array([0, 1, 1, 1, 2, 2, 2])),
             (np.array([-1]), np.array([0]))]
    num_accepted = [3, 1, 6]
    conv0, ssm0 = conv_state.clone(), ssm_state.clone()
    resumed = [(conv0[slots[i, 0], :, n - 1:n - 1 + width - 1], ssm0[slots[i, n - 1]])
               for i, n in enumerate(num_accepted)]
    return slots, trees, num_accepted, resumed


def commit_paths_to_last_nodes(record: Any, trees: list[tuple[np.ndarray, np.ndarray]], spec: int,
                               device: Any) -> list[list[int]]:
    """Commit (recurrent.commit) each tree's root -> last-node path, off its depth in the random and branching trees;
    returns the paths."""
    import torch

    from ubtree_vllm.vllm.recurrent.commit import commit_accepted_states

    accepted = [path_to(p, len(p) - 1) for p, _ in trees]
    accepted_path = torch.tensor([p + [-1] * (spec + 1 - len(p)) for p in accepted]).to(device)
    commit_accepted_states([record], accepted_path, (accepted_path >= 0).sum(1) - 1)
    return accepted


def path_to(parents: np.ndarray, node: int) -> list[int]:
    """Root-first nodes of the root -> ``node`` path."""
    path = []
    while node >= 0:
        path.append(node)
        node = int(parents[node])
    return path[::-1]


def generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids), in prompt order."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def plain_references(target: Path, engine_kwargs: dict[str, Any], prompts: list[list[int]],
                     max_tokens: int) -> tuple[list[list[int]], list[list[int]]]:
    """Plain decoding's greedy outputs, one request at a time and as a batch; the engine is shut down now, not in
    a late finalizer (the engine stays reachable from the captured log records of the test that set a fixture
    up) that would tear vLLM's parallel state down under the next engine."""
    llm = LLM(model=str(target), **engine_kwargs)
    one, batch = [generate(llm, [p], max_tokens)[0] for p in prompts], generate(llm, prompts, max_tokens)
    stop_engine(llm)
    del llm
    gc.collect()
    return one, batch


def check_copying_drafter(llm: Any, prompts: list[list[int]], batch_reference: list[list[int]], vocab_size: int,
                          max_tokens: int) -> None:
    """The truth sits on the second depth-1 branch, cut at random depths: accepted nodes are off their depth, so
    every recurrent layer's commit moves states and conv inputs; the output must still be plain decoding's."""
    oracle = ReferenceOracle(prompts, batch_reference, engine_runner(llm).drafter.config.tree, vocab_size=vocab_size)
    drafts_before, accepted_before = spec_counts(llm)
    install_oracle(llm, oracle)
    try:
        assert generate(llm, prompts, max_tokens) == batch_reference
    finally:
        install_oracle(llm, None)
    drafts, accepted = spec_counts(llm)
    assert oracle.calls > 0
    assert 1 + (accepted - accepted_before) / (drafts - drafts_before) > 2.0


def check_load_adaptive_budget(target: Path, drafter: Path, engine_kwargs: dict[str, Any], prompts: list[list[int]],
                               batch_reference: list[list[int]], max_tokens: int) -> None:
    """With 8 requests in flight vLLM's scheduler picks B' = 3 of B = 8: steps of 4 < 1 + B tokens per request,
    where vLLM's own rolling of the conv buffer (it keeps state_len - q columns) would misplace the next window."""
    llm = LLM(model=str(target), speculative_config={"method": "ubtree", "model": str(drafter), **TINY_TREE,
                                                     "num_speculative_tokens_per_batch_size": [[1, 4, 8], [5, 16, 3]]},
              **engine_kwargs)
    try:
        assert generate(llm, prompts, max_tokens) == batch_reference
        totals = {m.name: float(m.value) for m in llm.get_metrics()
                  if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens")}
    finally:
        stop_engine(llm)
        del llm
    # mostly 3 nodes per round (8 in flight); 8 only once fewer than 5 requests are left
    assert totals["vllm:spec_decode_num_draft_tokens"] / totals["vllm:spec_decode_num_drafts"] < 5, totals
