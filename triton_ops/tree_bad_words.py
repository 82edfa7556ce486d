"""Bad words at every tree node, matched against the outputs followed by the node's own path.

vLLM MRV2's bad-words kernel (``v1/worker/gpu/sample/bad_words.py``) bans a bad word's last token at
a logits row when the tokens before that row end with the word's other tokens; the tokens before
chain position p are the request's outputs then the drafts at positions 1..p (a chain). Here the
tokens before node ``j`` (row ``m``, request slot ``state[m]``, root row ``m - j``) are the outputs
(``all_token_ids[state, prompt_len : total_len]``, the root token included) then the tokens of the
nodes on the path root -> j, root excluded, ``j`` included; the sequence is read backwards from
node ``j`` through its ancestors into the outputs. A word longer than that sequence plus one is
skipped, as in vLLM.

One program per (row, bad word); the launcher reads no device value. Torch twin:
``reference.tree_bad_words_reference``.
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

if triton is not None:
    @triton.jit
    def _tree_bad_words_kernel(logits_ptr, logits_stride, state_ptr, local_pos_ptr, token_ptr, parents_ptr,
                               depth_ptr, topology_stride, word_tokens_ptr, word_tokens_stride, word_offsets_ptr,
                               word_offsets_stride, num_words_ptr, all_token_ids_ptr, all_token_ids_stride,
                               prompt_len_ptr, total_len_ptr):
        m = tl.program_id(0).to(tl.int64)
        word = tl.program_id(1)
        state = tl.load(state_ptr + m).to(tl.int64)
        if word >= tl.load(num_words_ptr + state):
            return
        node = tl.load(local_pos_ptr + m).to(tl.int64)
        root_row = m - node
        prompt_len = tl.load(prompt_len_ptr + state).to(tl.int64)
        output_len = tl.load(total_len_ptr + state).to(tl.int64) - prompt_len
        depth = tl.load(depth_ptr + state * topology_stride + node).to(tl.int64)
        start = tl.load(word_offsets_ptr + state * word_offsets_stride + word)
        end = tl.load(word_offsets_ptr + state * word_offsets_stride + word + 1)
        prefix_len = end - start - 1
        if prefix_len > output_len + depth:
            return
        words = word_tokens_ptr + state * word_tokens_stride
        outputs = all_token_ids_ptr + state * all_token_ids_stride + prompt_len
        match = 1
        output_idx = output_len - 1  # the newest output not read yet
        for back in tl.range(prefix_len):  # back = 0: the node itself, then its ancestors, then the outputs
            on_path = node > 0
            from_path = tl.load(token_ptr + root_row + node, mask=on_path, other=0)
            from_outputs = tl.load(outputs + output_idx, mask=node <= 0, other=0)
            actual = tl.where(on_path, from_path, from_outputs)
            expected = tl.load(words + start + prefix_len - 1 - back)
            match = match & (expected == actual)
            output_idx = tl.where(on_path, output_idx, output_idx - 1)
            parent = tl.load(parents_ptr + state * topology_stride + node, mask=on_path, other=0)
            node = tl.where(on_path, parent, 0).to(tl.int64)
        if match:
            last = tl.load(words + end - 1)
            tl.store(logits_ptr + m * logits_stride + last, -float("inf"))


def tree_bad_words(
        # [L, V] logits rows, masked in place
        logits: torch.Tensor,
        # [L] request state slot, node index and node token of each row (-1: placeholder, matches no word)
        expanded_idx_mapping: torch.Tensor, local_pos: torch.Tensor, node_tokens: torch.Tensor,
        # [max_reqs(+1), n] int32 parent (-1 at the root) and depth of each node, one stride
        parents: torch.Tensor, depth: torch.Tensor,
        # vLLM's BadWordsState: [max_reqs, T] flattened word tokens, [max_reqs, W + 1] offsets, [max_reqs] counts
        word_tokens: torch.Tensor, word_offsets: torch.Tensor, num_words: torch.Tensor,
        # vLLM's RequestState: [max_reqs, S] prompt + output tokens, [max_reqs] prompt and total lengths
        all_token_ids: torch.Tensor, prompt_len: torch.Tensor, total_len: torch.Tensor,
        max_num_words: int) -> None:
    """Ban, in place, each bad word's last token at the rows whose preceding tokens end with its others."""
    num_rows = logits.shape[0]
    assert parents.stride() == depth.stride() and parents.stride(1) == 1, "parents and depth: one row-major layout"
    for name, t in (("expanded_idx_mapping", expanded_idx_mapping), ("local_pos", local_pos),
                    ("node_tokens", node_tokens)):
        assert t.shape == (num_rows,), f"{name} must be [L={num_rows}], got {tuple(t.shape)}"
    if num_rows == 0 or max_num_words == 0:
        return
    _tree_bad_words_kernel[(num_rows, max_num_words)](
        logits, logits.stride(0), expanded_idx_mapping, local_pos, node_tokens, parents, depth, parents.stride(0),
        word_tokens, word_tokens.stride(0), word_offsets, word_offsets.stride(0), num_words, all_token_ids,
        all_token_ids.stride(0), prompt_len, total_len)
