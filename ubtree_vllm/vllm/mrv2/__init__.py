"""Device-side pieces of the UBTree port to vLLM's Model Runner V2 (``docs/design/mrv2.md``).

:mod:`.model_runner` (the default runner on CUDA, see ``UBTREE_VLLM_RUNNER``),
:mod:`.speculator` (tree drafting), :mod:`.rejection_sampler` (the tree walk) and
:mod:`.tree_layout` (tree positions, attention rows, KV commit pairs, hidden-state
permutation): fixed-shape device work over MRV2's ``InputBatch`` tensors, free of host syncs;
on CUDA the per-step bookkeeping is one Triton launch per stage (``triton_ops``).
"""
