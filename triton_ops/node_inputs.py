"""Each MRV2 logits row's input token and position, in one launch (the fused form of
``vllm.mrv2.rejection_sampler.gather_node_inputs``: ~10 small kernels in torch).

Logits row ``m < L`` is node ``j = expanded_local_pos[m]`` of its request, at global row
``logits_indices[m]``; its root is logits row ``m - j``. Writes ``token[m] = input_ids[row]``
and ``pos[m] = positions[row]`` (the tree layout has already written depth positions), except
that a draft row (j > 0) of a request still inside its prefill -- its root's position below
``prefill_len[expanded_idx_mapping[m]]`` -- gets token -1, as vLLM's ``gather_draft_sampled``.

One program per ``BLOCK`` rows; the launcher reads no device value. Test oracle: the torch
``gather_node_inputs`` (``tests/triton/test_mrv2_rows.py``).
"""
from __future__ import annotations

import torch

try:  # optional at import time, as in tree_attention
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

BLOCK = 128

if triton is not None:
    @triton.jit(do_not_specialize=["num_logits"])
    def _node_inputs_kernel(token_ptr, pos_ptr, input_ids_ptr, positions_ptr, logits_indices_ptr, state_ptr,
                            local_pos_ptr, prefill_len_ptr, num_logits, BLOCK: tl.constexpr):
        m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] logits rows
        valid = m < num_logits
        node = tl.load(local_pos_ptr + m, mask=valid, other=0).to(tl.int64)
        row = tl.load(logits_indices_ptr + m, mask=valid, other=0).to(tl.int64)
        root_row = tl.load(logits_indices_ptr + (m - node), mask=valid, other=0).to(tl.int64)
        state = tl.load(state_ptr + m, mask=valid, other=0).to(tl.int64)
        token = tl.load(input_ids_ptr + row, mask=valid, other=0)
        pos = tl.load(positions_ptr + row, mask=valid, other=0)
        root_pos = tl.load(positions_ptr + root_row, mask=valid, other=0).to(tl.int64)
        prefill = tl.load(prefill_len_ptr + state, mask=valid, other=0).to(tl.int64)
        placeholder = (node > 0) & (root_pos < prefill)
        tl.store(token_ptr + m, tl.where(placeholder, -1, token).to(token_ptr.dtype.element_ty), mask=valid)
        tl.store(pos_ptr + m, pos, mask=valid)


def node_inputs(
        # [T_pad] int32 / [T_pad] int64: the batch's input ids and (tree) positions
        input_ids: torch.Tensor, positions: torch.Tensor,
        # [L] global row, request state slot and node index of each logits row (int32/int64)
        logits_indices: torch.Tensor, expanded_idx_mapping: torch.Tensor, expanded_local_pos: torch.Tensor,
        # [max_reqs] prompt length per request state slot
        prefill_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(token [L], pos [L]) in the dtypes of ``input_ids`` / ``positions``; see the module docstring."""
    num_logits = logits_indices.shape[0]
    for name, t in (("positions", positions), ("logits_indices", logits_indices),
                    ("expanded_idx_mapping", expanded_idx_mapping), ("expanded_local_pos", expanded_local_pos),
                    ("prefill_len", prefill_len)):
        assert t.device == input_ids.device, f"{name} is on {t.device}, input_ids on {input_ids.device}"
        assert not t.is_floating_point() and t.dim() == 1, f"{name} must be a 1-D integer tensor"
    for name, t in (("expanded_idx_mapping", expanded_idx_mapping), ("expanded_local_pos", expanded_local_pos)):
        assert t.shape == (num_logits,), f"{name} must be [L={num_logits}], got {tuple(t.shape)}"
    token = torch.empty(num_logits, dtype=input_ids.dtype, device=input_ids.device)
    pos = torch.empty(num_logits, dtype=positions.dtype, device=positions.device)
    if num_logits == 0:
        return token, pos
    if triton is None:
        raise RuntimeError("node_inputs needs Triton, which is not installed")
    _node_inputs_kernel[(triton.cdiv(num_logits, BLOCK),)](
        token, pos, input_ids, positions, logits_indices, expanded_idx_mapping, expanded_local_pos, prefill_len,
        num_logits, BLOCK=BLOCK)
    return token, pos
