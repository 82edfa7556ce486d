"""Everything of ubtree_vllm that talks to vLLM (0.32, V1 model runner).

Pipeline of one speculative round inside a vLLM worker, one module per stage:

* :mod:`.config`       -- ``"method": "ubtree"`` parsed and validated once, before any
  memory is taken; carried to every process in ``VllmConfig.additional_config``.
* :mod:`.proposer`     -- the UBTree drafter bound to the target's embedding and LM head;
  turns the per-request context features into draft trees.
* :mod:`.features`     -- per-request buffer of the target's aux hidden states (the
  drafter's conditioning), written with the committed rows of every step.
* :mod:`.tree_plan`    -- one step's trees laid out over the flattened token batch
  (rows, parents, depths, positions); published to the attention backends.
* :mod:`.attention`    -- CPU / CUDA attention backends that apply the ancestor mask to
  tree rows, and stash the fresh K/V of tree rows for the commit.
* :mod:`.sampler`      -- tree rejection sampler (node-wise acceptance) in vLLM's
  output format.
* :mod:`.kv_commit`    -- copies the accepted path's KV to contiguous slots.
* :mod:`.recurrent` -- recurrent layers of hybrid targets (Gated DeltaNet, Kimi Delta Attention, Mamba2): the
  step's trees through vLLM's own kernels, and the commit of the accepted path's recurrent states.
* :mod:`.request_support` -- which sampling options tree verification serves exactly.
* :mod:`.runner`       -- the V1 model-runner subclasses (CPU, GPU) wiring the stages together.
* :mod:`.cpu_worker`, :mod:`.gpu_worker` -- the workers vLLM starts for 'ubtree' engines
  (``ParallelConfig.worker_cls``); they apply the worker stage of ``ubtree_vllm.patches``.

Importing this package imports neither vLLM nor torch; each module imports what it needs.
"""
