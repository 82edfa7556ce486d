"""Recurrent layers of hybrid targets under tree verification: each node's state from its parent's, its conv window
from its ancestors' inputs, and the commit of the accepted path (docs/design/hybrid.md).

* :mod:`.nodes` -- what every tree form shares: the step's node bookkeeping as device index tensors, per-node conv
  windows, the conv-buffer roll, per-depth state forks, root -> leaf chains;
* the tree forms, each reached through a patch of the vLLM layer it serves: :mod:`.gdn_cpu` (Gated DeltaNet on the
  CPU), :mod:`.gdn_cuda` (Gated DeltaNet on CUDA), :mod:`.kda_cuda` (Kimi Delta Attention on CUDA), :mod:`.mamba2`
  (Mamba2, both platforms);
* :mod:`.commit` -- the accepted path's states and conv inputs moved into vLLM's chain slots after acceptance;
* :mod:`.memory` -- what the per-node state slots cost, and the largest budget that fits.
"""
