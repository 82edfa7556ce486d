"""What the hidden-state tap patches share: vLLM's EAGLE-3 interface added to a model class that lacks it.

UBTree's drafter reads the hidden states entering chosen target layers, which vLLM's runners request through
``SupportsEagle3`` (``set_aux_hidden_state_layers``, a model forward returning ``(hidden, [aux...])``). A tap patch
replaces the inner model's forward with vLLM's layer loop plus the taps in ``self.ubtree_aux_layers`` and calls
:func:`add_eagle3_interface` for the outer class.
"""
from __future__ import annotations

from typing import Any

# The EAGLE-3 interface members the class gets (vLLM's runtime-checkable SupportsEagle3 protocol).
ADDED = ("supports_eagle3", "has_own_lm_head", "has_own_embed_tokens", "set_aux_hidden_state_layers",
         "get_eagle3_default_aux_hidden_state_layers")


def check_not_obsolete(lm_cls: type, patch_name: str) -> None:
    """AttributeError when vLLM's class defines the interface itself (the patch has become obsolete)."""
    present = [name for name in ADDED if name in vars(lm_cls)]
    if present and not getattr(lm_cls, "_ubtree_hidden_state_taps", False):
        raise AttributeError(f"patch {patch_name}: vLLM's {lm_cls.__name__} already defines {present}; the patch is "
                             "obsolete (see ubtree_vllm.patches.MANIFEST)")


def add_eagle3_interface(model_cls: type, lm_cls: type) -> None:
    """The interface on ``lm_cls`` (whose ``.model`` is a ``model_cls`` with ``layers``); no taps by default."""
    model_cls.ubtree_aux_layers = ()

    def set_aux_hidden_state_layers(self: Any, layers: tuple[int, ...]) -> None:
        self.model.ubtree_aux_layers = tuple(sorted(set(layers)))

    def get_eagle3_default_aux_hidden_state_layers(self: Any) -> tuple[int, ...]:
        num_layers = len(self.model.layers)
        return (2, num_layers // 2, num_layers - 3)  # vLLM's SupportsEagle3 default

    lm_cls.supports_eagle3 = True
    lm_cls.has_own_lm_head = False
    lm_cls.has_own_embed_tokens = False
    lm_cls.set_aux_hidden_state_layers = set_aux_hidden_state_layers
    lm_cls.get_eagle3_default_aux_hidden_state_layers = get_eagle3_default_aux_hidden_state_layers
    lm_cls._ubtree_hidden_state_taps = True
