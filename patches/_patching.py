"""Helper for the patch modules: replace one attribute, keep the original, never twice.

Contract of :func:`replace_attr`:

* the original value is kept on the owner as ``_ubtree_orig_<name>`` (so a wrapper can
  call it, and tests can restore it with :func:`restore_attr`);
* the replacement is marked with ``__ubtree_patch__ = <patch name>``; a second call for
  an attribute that already carries the mark does nothing and returns False, which
  makes every patch idempotent within a process;
* the replacement is logged at debug level.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

MARK = "__ubtree_patch__"


def original_attr_name(name: str) -> str:
    return f"_ubtree_orig_{name}"


def is_patched(owner: Any, name: str) -> bool:
    return getattr(getattr(owner, name, None), MARK, None) is not None


def replace_attr(owner: Any, name: str, new: Any, patch_name: str) -> bool:
    """Set ``owner.<name> = new`` keeping the original; False if already patched."""
    if is_patched(owner, name):
        return False
    if not hasattr(owner, name):
        raise AttributeError(f"patch {patch_name}: {owner!r} has no attribute {name!r} to replace "
                             "(vLLM changed; see ubtree_vllm.patches.MANIFEST)")
    setattr(owner, original_attr_name(name), getattr(owner, name))
    setattr(new, MARK, patch_name)
    setattr(owner, name, new)
    logger.debug("ubtree_vllm patch %s: replaced %r.%s", patch_name, owner, name)
    return True


def restore_attr(owner: Any, name: str) -> None:
    """Undo :func:`replace_attr` (tests only)."""
    if not is_patched(owner, name):
        return
    setattr(owner, name, getattr(owner, original_attr_name(name)))
    delattr(owner, original_attr_name(name))
