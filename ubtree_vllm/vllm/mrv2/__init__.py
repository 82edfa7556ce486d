"""Device-side pieces of the UBTree port to vLLM's Model Runner V2 (``docs/design/mrv2.md``).

Fixed-shape torch code over MRV2's ``InputBatch`` tensors, free of host syncs (e.g.
:mod:`.tree_layout`: tree positions, attention rows, KV commit pairs, hidden-state
permutation). Not wired into any runner yet; the V1 runner does not use it.
"""
