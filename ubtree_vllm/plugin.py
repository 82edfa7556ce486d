"""vLLM plugin entry point (``vllm.general_plugins`` -> ``ubtree = ubtree_vllm.plugin:register``).

vLLM calls :func:`register` in every process it starts (API server, engine
core, each worker), before it builds any config.  The contract, following
vLLM's plugin-loader docstring:

* idempotent: a module-level guard makes the second and later calls no-ops;
* cheap: importing this module imports neither vLLM nor torch, and neither
  does :func:`register` on a version mismatch or with an empty patch manifest;
  with the real manifest it imports the vLLM config/argument modules it patches
  (vLLM has already loaded them when it calls this);
* safe: on an unsupported vLLM version it logs one warning and changes
  nothing, so an upgraded vLLM keeps working without speculative trees
  instead of crashing in a patched internal;
* fork-safe: it only applies process-global ``"engine"`` patches (they import
  vLLM's config/argument modules, already loaded when vLLM calls this, and change
  behaviour only for engines configured with ``"method": "ubtree"``); patches that
  touch CUDA or worker state are the ``"worker"`` stage of :mod:`ubtree_vllm.patches`,
  applied by the UBTree worker classes (:mod:`ubtree_vllm.vllm.cpu_worker`,
  :mod:`ubtree_vllm.vllm.gpu_worker`) when a 'ubtree' worker starts.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

_lock = threading.Lock()
# True once register() has run in this process, whatever its outcome.
_registered = False


def register() -> None:
    """Register UBTree with vLLM in this process; later calls do nothing."""
    global _registered
    with _lock:
        if _registered:
            return
        _registered = True

        from ubtree_vllm import compat

        try:
            version = compat.check_vllm_version()
        except RuntimeError as exc:
            logger.warning("ubtree_vllm plugin disabled: %s", exc)
            return

        # Everything UBTree changes in vLLM (the "ubtree" speculative method,
        # its proposer and tree verification) is a manifest entry applied here.
        from ubtree_vllm import patches

        applied = patches.apply("engine")
        logger.debug("ubtree_vllm registered with vLLM %s; engine patches: %s", version, applied)
