"""Tree-aware subclasses of vLLM's attention backends and their hand-over state.

* :mod:`.state`     -- the step's tree plan published by the runner; K/V stash for the commit.
* :mod:`.cpu`       -- CPU_ATTN: tree rows on virtual per-node sequences, same C++ kernel.
* :mod:`.cpu_mla`   -- CPU_MLA (multi-head latent attention): the multi-token rows' new-token attention under the
  tree's ancestor mask, vLLM's context chunks and merge kept.
* :mod:`.tree_rows` -- what both CUDA backends add after their stock kernel: one launch of the Triton kernel
  :func:`ubtree_vllm.triton_ops.tree_attention` per layer over the tree rows.
* :mod:`.flash`     -- FLASH_ATTN (CUDA, bf16/fp16 targets), with the "flash_merge" context mode.
* :mod:`.exact_rows` -- "flash_exact" (Model Runner V2, FlashAttention 3): every row of a uniform decode step a
  one-row FlashAttention sequence of its own over scratch pages, split as plain decoding would split it.
* :mod:`.triton_attn` -- TRITON_ATTN (CUDA, float32 targets).

The backend modules import vLLM's backend classes; they are imported by vLLM's attention
registry (see ``ubtree_vllm.patches.worker.patch_attention_backends``), not here.
"""
