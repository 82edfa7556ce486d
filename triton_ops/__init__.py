"""Triton kernels for tree speculative decoding (installed as ``ubtree_vllm.triton_ops``).

Public launchers only:

* :func:`tree_attention` -- tree rows attend to their committed paged context plus their
  ancestors-or-self among the fresh K/V (used by the CUDA attention backend,
  :mod:`ubtree_vllm.vllm.attention.flash`).
* :func:`kv_path_commit` -- moves the accepted tree nodes' K/V to the slots of their depths
  in every layer's paged cache, one launch for all layers (the V1 runner's FLASH_ATTN commit).
* :func:`tree_accept` -- the tree acceptance walk, one program per request (the V1 sampler's
  walk on CUDA; oracle ``verify.accept.accept_tree``).
* :func:`tree_search` -- tree construction (beam + global pruning), one program per request
  (``tree.search.construct_tree`` on CUDA; oracle ``tree.search.build_tree``).
* Model Runner V2's per-step bookkeeping, one launch each (oracles: the torch forms in
  ``vllm.mrv2``): :func:`tree_layout` (tree positions and the attention row buffers),
  :func:`tree_accept_rows` (the walk over MRV2's flat logits rows, with its counts),
  :func:`commit_accepted_paths` (the accepted paths' KV in every layer, their hidden-row
  permutation and linear positions), :func:`node_inputs` (each logits row's token and position for
  the sampler).
* :func:`lookup_chain_rows`, :func:`inject_chain_lattice` -- the prompt-lookup branch: each batch row's chain
  from MRV2's token history (``vllm.mrv2.speculator.lookup_chain`` on CUDA; oracle
  ``tree.lookup.lookup_continuation``) and its injection into the candidate lattice
  (``tree.lookup.inject_lookup_chain`` on CUDA; oracle ``tree.lookup.inject_chain``).
* :func:`vocab_top_k` -- the drafter's top K per block position in one read of the LM head's logits, with the
  log-sum-exp and, at T > 0, the target's own keyed Gumbel noise (coupled drafting, ``drafter/coupling.py``;
  twin ``reference.vocab_top_k_reference``).
* :func:`tree_penalties`, :func:`tree_bad_words` -- presence/frequency/repetition penalties and bad words
  at every node over the outputs plus the node's own path (Model Runner V2's sampler, in place of
  vLLM's chain forms).
* ``tree_attention: "flash_exact"`` (imported by module, not exported here; oracles: the torch forms in
  ``vllm.attention.exact_rows``): ``virtual_rows.virtual_rows_kernel`` (every row's virtual sequence, its copy
  lists and plain decoding's FA3 split count, once per forward) and ``scratch_rows.scratch_rows`` (the tree rows'
  scratch pages, once per layer).
* Hybrid / MLA targets (kernels with twins and tests, not yet called by the engine; issue 17):
  ``tree_delta_rule.tree_gated_delta_rule`` and ``tree_conv.tree_causal_conv1d`` (each node's
  recurrent state and conv window from its parent's), ``tree_mla_attention.tree_mla_attention``
  (MLA's absorbed attention under the tree mask, vLLM's latent cache layout).
* :func:`head_loss_rows` -- training: the proposer loss's per-row softmax statistics and its
  gradient w.r.t. the LM-head logits, two streaming passes (``training/head_loss.py``).

Each kernel comes as a private ``_*_kernel``, a public launcher in ``triton_ops/<op>.py``
that asserts its shape/stride/dtype contract and never syncs with the host, and a
pure-torch twin in :mod:`.reference` (the test oracle, ``tests/triton``);
:mod:`.tree_attention_inputs` builds random paged inputs for the kernel tests and the
tree-attention microbenchmark, and :mod:`.compile_check` compiles the kernels for Hopper
without a GPU (the interpreter accepts more than the compiler); neither is exported here.

Triton is imported directly and defensively (not through ``vllm.triton_utils``, which
disables Triton on CPU builds and would rule out the interpreter the CPU tests run
under, and which would make this package import vLLM): where triton is missing this
package still imports and the launchers raise a clear error when called. On CPU tensors
the kernels run under the Triton interpreter, which ``TRITON_INTERPRET=1`` selects when
set before triton is first imported.
"""
from ubtree_vllm.triton_ops.accepted_rows import commit_accepted_paths
from ubtree_vllm.triton_ops.head_loss_rows import head_loss_rows
from ubtree_vllm.triton_ops.kv_path_commit import kv_cache_pointers, kv_path_commit
from ubtree_vllm.triton_ops.lookup_chain import inject_chain_lattice, lookup_chain_rows
from ubtree_vllm.triton_ops.node_inputs import node_inputs
from ubtree_vllm.triton_ops.tree_accept import tree_accept, tree_accept_rows
from ubtree_vllm.triton_ops.tree_attention import tree_attention
from ubtree_vllm.triton_ops.tree_bad_words import tree_bad_words
from ubtree_vllm.triton_ops.tree_layout import tree_layout
from ubtree_vllm.triton_ops.tree_penalties import tree_penalties
from ubtree_vllm.triton_ops.tree_search import tree_search
from ubtree_vllm.triton_ops.vocab_top_k import vocab_top_k

__all__ = ["commit_accepted_paths", "head_loss_rows", "inject_chain_lattice", "kv_cache_pointers", "kv_path_commit",
           "lookup_chain_rows", "node_inputs", "tree_accept", "tree_accept_rows", "tree_attention", "tree_bad_words",
           "tree_layout", "tree_penalties", "tree_search", "vocab_top_k"]
