"""Tree rejection sampler and feature store (no engine).

Tree attention is tested against its reference in tests/triton.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from vllm.v1.sample.logits_processor import LogitsProcessor, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                     MinTokensLogitsProcessor)
from vllm.v1.sample.metadata import SamplingMetadata

from ubtree_vllm.vllm.features import ContextFeatureStore
from ubtree_vllm.vllm.sampler import (TreeRejectionSampler, check_supported, node_output_tokens, processed_node_logits,
                                      sampling_tensors)
from vllm_batches import make_batch

VOCAB = 32
BLOCK_SIZE = 4  # the drafter block size: bounds the trees of vllm_batches.make_batch


def metadata(num_reqs: int, temperature=None, top_k=None, generators=None, **overrides) -> SamplingMetadata:
    values = dict(
        temperature=temperature, all_greedy=temperature is None, all_random=temperature is not None,
        top_p=None, top_k=top_k, generators=generators or {}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(num_reqs), presence_penalties=torch.zeros(num_reqs),
        repetition_penalties=torch.ones(num_reqs), output_token_ids=[[] for _ in range(num_reqs)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    values.update(overrides)
    return SamplingMetadata(**values)


def peaked_logits(argmax_per_row: list[int]) -> torch.Tensor:
    logits = torch.randn(len(argmax_per_row), VOCAB)
    logits[torch.arange(len(argmax_per_row)), torch.tensor(argmax_per_row)] = 10.0
    return logits


def test_greedy_walk_emits_accepted_tokens_then_the_bonus():
    plan = make_batch().plan  # r0 nodes 1..5 = tokens 11..15, r1 root only, r2 nodes 1..3 = 21..23
    # Rows: r0 nodes 0..5, r1 root, r2 nodes 0..3 (vLLM's logits_indices order).
    argmax = [12, 0, 7, 0, 0, 0] + [5] + [22, 0, 23, 9]
    output, result = TreeRejectionSampler(BLOCK_SIZE)(plan, plan.to_device(torch.device("cpu")), peaked_logits(argmax),
                                            metadata(3))
    assert output.sampled_token_ids.dtype == torch.int32
    assert output.sampled_token_ids.tolist() == [[12, 7, -1, -1, -1, -1], [5, -1, -1, -1, -1, -1],
                                                 [22, 23, 9, -1, -1, -1]]
    assert output.logprobs_tensors is None
    assert result.num_accepted.tolist() == [1, 0, 2]
    assert result.accepted_path.tolist() == [[0, 2, -1, -1], [0, -1, -1, -1], [0, 2, 3, -1]]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits"])
def test_logprobs_of_each_output_token_come_from_the_node_that_drew_it(mode):
    """Slot k's logprobs are those of the accepted node at depth k: for r0 (accepts node 2) the rows of
    nodes 0 and 2, for r1 its root, for r2 nodes 0, 2, 3; laid out like sampled_token_ids."""
    plan = make_batch().plan
    argmax = [12, 0, 7, 0, 0, 0] + [5] + [22, 0, 23, 9]
    logits = peaked_logits(argmax)
    output, _ = TreeRejectionSampler(BLOCK_SIZE, mode)(plan, plan.to_device(torch.device("cpu")), logits,
                                                      metadata(3, max_num_logprobs=3))
    lp = output.logprobs_tensors
    max_nodes = output.sampled_token_ids.shape[1]
    assert lp.logprob_token_ids.shape == (3 * max_nodes, 4) and lp.logprobs.shape == (3 * max_nodes, 4)
    values = logits.log_softmax(-1) if mode == "raw_logprobs" else logits
    drawn_at = {(0, 0): 0, (0, 1): 2, (1, 0): 6, (2, 0): 7, (2, 1): 9, (2, 2): 10}  # (request, slot) -> logits row
    for (r, k), row in drawn_at.items():
        flat = r * max_nodes + k
        token = int(output.sampled_token_ids[r, k])
        assert int(lp.logprob_token_ids[flat, 0]) == token  # the sampled token first, then the top-3
        torch.testing.assert_close(lp.logprobs[flat, 0], values[row, token])
        top = values[row].topk(3)
        torch.testing.assert_close(lp.logprobs[flat, 1:], top.values)
        assert lp.logprob_token_ids[flat, 1:].tolist() == top.indices.tolist()
        assert int(lp.selected_token_ranks[flat]) == 1  # the peaked argmax
    with pytest.raises(ValueError, match="logprobs_mode must be one of"):
        TreeRejectionSampler(BLOCK_SIZE, "processed_logprobs")


def test_node_output_tokens_append_each_nodes_path():
    plan = make_batch().plan  # r0: 0 -> 1 -> {2 -> {3, 4}, 5}? (vllm_batches.make_batch), r1 root only, r2 a chain
    lists = node_output_tokens(plan, [[7, 8], [9], []])
    n = plan.max_nodes
    for r, base in enumerate(([7, 8], [9], [])):
        count = int(plan.num_nodes[r])
        for j in range(n):
            node, path = min(j, count - 1), []
            while node > 0:
                path.append(int(plan.tokens[r, node]))
                node = int(plan.parents[r, node])
            assert lists[r * n + j] == base + path[::-1], (r, j)


@pytest.mark.parametrize("temperature", [None, 1.0], ids=["greedy", "random"])
def test_penalties_apply_along_each_nodes_path(temperature):
    """Each node's draw sees vLLM's penalties over the request's outputs plus the node's path: compared with
    apply_all_penalties on that node's row alone, with that path appended."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    plan = make_batch().plan
    torch.manual_seed(0)
    logits = torch.randn(11, VOCAB)
    outputs = [[11, 3], [5], [21]]
    pen = dict(no_penalties=False, prompt_token_ids=torch.tensor([[1, 2, VOCAB], [3, VOCAB, VOCAB], [4, 5, 6]]),
               presence_penalties=torch.tensor([0.5, 0.0, 1.0]), frequency_penalties=torch.tensor([0.3, 0.2, 0.0]),
               repetition_penalties=torch.tensor([1.3, 1.0, 1.1]), output_token_ids=outputs)
    temp = None if temperature is None else torch.full((3,), temperature)
    meta = metadata(3, temp, **pen)
    start = np.cumsum(plan.num_nodes) - plan.num_nodes
    index = torch.tensor([[start[r] + min(j, plan.num_nodes[r] - 1) for j in range(plan.max_nodes)] for r in range(3)])
    got = processed_node_logits(logits, index, meta, plan)
    lists = node_output_tokens(plan, outputs)
    for r in range(3):
        for j in range(plan.max_nodes):
            row = logits[index[r, j]][None].clone()
            want = apply_all_penalties(row, pen["prompt_token_ids"][r:r + 1], pen["presence_penalties"][r:r + 1],
                                       pen["frequency_penalties"][r:r + 1], pen["repetition_penalties"][r:r + 1],
                                       [lists[r * plan.max_nodes + j]])
            torch.testing.assert_close(got[r, j], want[0])
    assert not torch.equal(got, logits[index])  # the penalties changed something
    if temperature is None:  # greedy: slot 0 is drawn at the root, from the penalised logits
        output, _ = TreeRejectionSampler(BLOCK_SIZE)(plan, plan.to_device(torch.device("cpu")), logits, meta)
        assert output.sampled_token_ids[:, 0].tolist() == got[:, 0].argmax(-1).tolist()


def test_seeded_requests_are_reproducible_and_top_k_1_is_greedy():
    plan = make_batch().plan
    trees = plan.to_device(torch.device("cpu"))
    logits = torch.randn(11, VOCAB)
    temperature = torch.tensor([1.0, 1.0, 1.0])

    def run(seed):
        gens = {i: torch.Generator().manual_seed(seed + i) for i in range(3)}
        return TreeRejectionSampler(BLOCK_SIZE)(plan, trees, logits, metadata(3, temperature, generators=gens))[0]

    assert torch.equal(run(7).sampled_token_ids, run(7).sampled_token_ids)
    top1 = metadata(3, temperature, top_k=torch.tensor([1, 1, 1]))
    greedy = TreeRejectionSampler(BLOCK_SIZE)(plan, trees, logits, metadata(3))[0]
    assert torch.equal(TreeRejectionSampler(BLOCK_SIZE)(plan, trees, logits, top1)[0].sampled_token_ids,
                       greedy.sampled_token_ids)


def test_unsupported_batches_are_refused():
    check_supported(metadata(2))
    check_supported(metadata(2, bad_words_token_ids={0: [[1]]}, allowed_token_ids_mask=torch.zeros(2, VOCAB).bool()))
    check_supported(metadata(2, logprob_token_ids={0: [1]}))  # served: the requested ids' logprobs per node row

    class Custom(LogitsProcessor):  # a user's processor sees a flat batch: it cannot follow a tree's paths
        def __init__(self, *args):
            pass

        def is_argmax_invariant(self):
            return False

        def update_state(self, batch_update):
            pass

        def apply(self, logits):
            return logits

    with pytest.raises(RuntimeError, match=r"\['Custom'\].*custom logits processors"):
        check_supported(metadata(2, logitsprocs=LogitsProcessors([Custom()])))


def test_feature_store_positions_validity_and_rewrites():
    store = ContextFeatureStore(num_features=3, dtype=torch.float32, device=torch.device("cpu"), initial_capacity=2)
    store.write("a", 0, torch.ones(4, 3))
    store.write("a", 4, 2 * torch.ones(2, 3))  # grows past the initial capacity
    store.write("b", 3, torch.ones(1, 3))  # positions 0..2 were never computed (prefix-cache hit)
    features, valid = store.gather(["a", "b", "missing"], [5, 4, 2])
    assert features.shape == (3, 5, 3)
    assert valid.tolist() == [[True] * 5, [False, False, False, True, False], [False] * 5]
    assert features[0, 4].tolist() == [2.0, 2.0, 2.0]
    store.write("a", 2, torch.zeros(1, 3))  # recompute from position 2: later positions are stale
    _, valid = store.gather(["a"], [6])
    assert valid.tolist() == [[True, True, True, False, False, False]]
    store.drop("a")
    assert "a" not in store and "b" in store


def node_index(plan) -> torch.Tensor:
    start = np.cumsum(plan.num_nodes) - plan.num_nodes
    return torch.tensor([[start[r] + min(j, plan.num_nodes[r] - 1) for j in range(plan.max_nodes)]
                         for r in range(plan.num_reqs)])


@pytest.mark.parametrize("temperature", [None, 1.0], ids=["greedy", "random"])
def test_allowed_tokens_bad_words_min_tokens_and_logit_bias_apply_along_each_nodes_path(temperature):
    """Each node's row gets what plain decoding's Sampler.apply_logits_processors would give it had the node's
    path been generated: the allowed mask, bad words over outputs + path, min_tokens while len(outputs) + depth
    < min_tokens, logit bias; checked row by row against vLLM's own ops on that row alone."""
    from vllm.v1.sample.ops.bad_words import apply_bad_words

    plan = make_batch().plan  # r0: a tree over tokens 11..15 (depths 1..), r1: root only, r2: chain 21, 22, 23
    torch.manual_seed(0)
    logits = torch.randn(11, VOCAB)
    outputs = [[11, 3], [5], [21]]
    allowed = torch.zeros(3, VOCAB, dtype=torch.bool)
    allowed[1, 20:] = True  # r1 may not draw tokens 20..31
    bad_words = {0: [[3, 11, 9], [12, 8], [4]], 2: [[21, 22, 7]]}  # r2: bans 7 right after the path 21 22
    min_tokens = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)
    min_tokens.min_toks = {0: (4, outputs[0], {2, 6}, False), 2: (2, outputs[2], {9}, False)}
    bias = LogitBiasLogitsProcessor.__new__(LogitBiasLogitsProcessor)
    bias.biases = {1: {4: 3.0, 5: -2.0}, 2: {22: 1.5}}
    meta = metadata(3, None if temperature is None else torch.full((3,), temperature), output_token_ids=outputs,
                    allowed_token_ids_mask=allowed, bad_words_token_ids=bad_words,
                    logitsprocs=LogitsProcessors([min_tokens, bias]))
    index = node_index(plan)
    got = processed_node_logits(logits, index, meta, plan)
    lists = node_output_tokens(plan, outputs)
    for r in range(3):
        for j in range(plan.max_nodes):
            row = logits[index[r, j]].clone()[None]
            past = lists[r * plan.max_nodes + j]
            row[0].masked_fill_(allowed[r], float("-inf"))
            if r in bad_words:
                apply_bad_words(row, {0: bad_words[r]}, [past])
            if r in min_tokens.min_toks:
                need, _, stops, _ = min_tokens.min_toks[r]
                if len(past) < need:  # past = outputs + the node's path
                    row[0, sorted(stops)] = float("-inf")
            for tok, value in bias.biases.get(r, {}).items():
                row[0, tok] += value
            torch.testing.assert_close(got[r, j], row[0], msg=f"request {r} node {j}")
    # the cases are live: r2's node 2 (path 22 after the output 21) bans 7, its sibling node 1 (path 21) does not;
    # min_tokens bans r0's stop tokens at nodes 0-2 (outputs + path shorter than 4) only, r2's at its root only
    assert got[2, 2, 7] == float("-inf") and got[2, 1, 7] > float("-inf") and got[2, 0, 7] > float("-inf")
    assert all(got[0, j, 2] == float("-inf") for j in (0, 1, 2)) and got[0, 3, 2] > float("-inf")
    assert got[2, 0, 9] == float("-inf") and got[2, 1, 9] > float("-inf")
    output, _ = TreeRejectionSampler(BLOCK_SIZE)(plan, plan.to_device(torch.device("cpu")), logits, meta)
    if temperature is None:  # the root's draw is the argmax of the processed row
        assert output.sampled_token_ids[:, 0].tolist() == got[:, 0].argmax(-1).tolist()


def test_min_p_reaches_the_node_draws_after_temperature():
    """min_p (argmax invariant, vLLM's MinPLogitsProcessor state) masks tokens below min_p x the top probability of the
    temperature-scaled row, before top-k/top-p; 0 leaves a request alone; greedy never sees it."""
    from ubtree_vllm.verify.sampling import SamplingTensors, processed_probs

    min_p = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
    min_p.min_p_count, min_p.min_p = 1, torch.tensor([[0.2], [0.0]])
    meta = metadata(2, torch.tensor([0.7, 0.7]), logitsprocs=LogitsProcessors([min_p]))
    params = sampling_tensors(meta, 2, torch.device("cpu"))
    assert params.min_p.tolist() == pytest.approx([0.2, 0.0])
    torch.manual_seed(1)
    logits = torch.randn(2, 3, VOCAB) * 2
    probs = processed_probs(logits, params)
    scaled = (logits / 0.7).softmax(-1)
    kept = scaled >= 0.2 * scaled.amax(-1, keepdim=True)
    assert torch.equal(probs[0] > 0, kept[0]) and kept[0].sum() < kept[0].numel()
    want = torch.where(kept[0], scaled[0], 0.0)
    torch.testing.assert_close(probs[0], want / want.sum(-1, keepdim=True))
    torch.testing.assert_close(probs[1], processed_probs(logits, SamplingTensors(
        params.temperature, params.top_k, params.top_p))[1])  # min_p 0: unchanged
    assert sampling_tensors(metadata(2, torch.tensor([0.7, 0.7])), 2, torch.device("cpu")).min_p is None
