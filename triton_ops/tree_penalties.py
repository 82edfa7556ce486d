"""Presence, frequency and repetition penalties at every tree node, along the node's own path.

vLLM MRV2's penalties kernel (``v1/worker/gpu/sample/penalties.py``) counts, for the logits row of
chain position p, the request's output tokens plus the drafts at positions 1..p of the same
request: a chain. For a tree the drafts before a node in the flat batch are not its path, so this
kernel walks the node's ancestors instead: row ``m`` is node ``j = local_pos[m]`` of request slot
``state[m]``, its root is row ``m - j``, and the counted drafts are the tokens of the nodes on the
path root -> j, root excluded (the root token was sampled last step and is already in
``output_bin_counts``), ``j`` included. Everything else is vLLM's rule: repetition penalty on
tokens in the prompt or the counted outputs (divide positive logits, multiply negative ones),
then ``logits -= frequency * count`` and ``logits -= presence * (count > 0)``.

One program per (row, vocabulary block); rows whose request has no penalty return at once. The
launcher reads no device value. Torch twin: ``reference.tree_penalties_reference``.
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

BLOCK = 8192  # vocabulary entries per program (a multiple of 32: the prompt mask is packed 32 per int32)

if triton is not None:
    @triton.jit
    def _tree_penalties_kernel(logits_ptr, logits_stride, vocab_size, state_ptr, local_pos_ptr, token_ptr,
                               parents_ptr, parents_stride, repetition_ptr, frequency_ptr, presence_ptr,
                               prompt_mask_ptr, prompt_mask_stride, counts_ptr, counts_stride,
                               MAX_DEPTH: tl.constexpr, BLOCK: tl.constexpr):
        m = tl.program_id(0).to(tl.int64)
        state = tl.load(state_ptr + m).to(tl.int64)
        repetition = tl.load(repetition_ptr + state)
        frequency = tl.load(frequency_ptr + state)
        presence = tl.load(presence_ptr + state)
        if (repetition == 1.0) & (frequency == 0.0) & (presence == 0.0):
            return
        block_idx = tl.program_id(1)
        vocab = block_idx * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] token ids
        in_vocab = vocab < vocab_size
        logits = tl.load(logits_ptr + m * logits_stride + vocab, mask=in_vocab).to(tl.float32)
        counts = tl.load(counts_ptr + state * counts_stride + vocab, mask=in_vocab, other=0)
        node = tl.load(local_pos_ptr + m).to(tl.int64)
        root_row = m - node
        for _ in tl.static_range(MAX_DEPTH):  # no path is deeper than the drafter's block size
            on_path = node > 0
            token = tl.load(token_ptr + root_row + node, mask=on_path, other=-1)
            counts += ((vocab == token) & on_path).to(tl.int32)
            parent = tl.load(parents_ptr + state * parents_stride + node, mask=on_path, other=0)
            node = tl.where(on_path, parent, 0).to(tl.int64)
        seen = counts > 0
        packed_idx = block_idx * (BLOCK // 32) + tl.arange(0, BLOCK // 32)
        packed = tl.load(prompt_mask_ptr + state * prompt_mask_stride + packed_idx,
                         mask=packed_idx < tl.cdiv(vocab_size, 32), other=0)
        in_prompt = ((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1).to(tl.int1).reshape(BLOCK)
        scale = tl.where(in_prompt | seen, repetition, 1.0)
        logits *= tl.where(logits > 0, 1.0 / scale, scale)
        logits -= frequency * counts
        logits -= presence * seen
        tl.store(logits_ptr + m * logits_stride + vocab, logits, mask=in_vocab)


def tree_penalties(
        # [L, V] float32 logits rows, penalised in place
        logits: torch.Tensor,
        # [L] request state slot, node index and node token of each row (-1: placeholder, never counted)
        expanded_idx_mapping: torch.Tensor, local_pos: torch.Tensor, node_tokens: torch.Tensor,
        # [max_reqs(+1), n] int32 parent of each node (-1 at the root)
        parents: torch.Tensor,
        # [max_reqs] float32 penalties per request slot
        repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
        # [max_reqs, ceil(V / 32)] int32 packed prompt-token bits, [max_reqs, V] int32 output-token counts
        prompt_mask: torch.Tensor, output_counts: torch.Tensor, max_depth: int) -> None:
    """Penalise ``logits`` in place (see the module docstring); one launch."""
    num_rows, vocab_size = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "logits must be row-major float32"
    assert parents.stride(1) == 1 and output_counts.stride(1) == 1 and prompt_mask.stride(1) == 1
    for name, t in (("expanded_idx_mapping", expanded_idx_mapping), ("local_pos", local_pos),
                    ("node_tokens", node_tokens)):
        assert t.shape == (num_rows,), f"{name} must be [L={num_rows}], got {tuple(t.shape)}"
    if num_rows == 0:
        return
    _tree_penalties_kernel[(num_rows, triton.cdiv(vocab_size, BLOCK))](
        logits, logits.stride(0), vocab_size, expanded_idx_mapping, local_pos, node_tokens, parents,
        parents.stride(0), repetition, frequency, presence, prompt_mask, prompt_mask.stride(0), output_counts,
        output_counts.stride(0), MAX_DEPTH=max_depth, BLOCK=BLOCK)
