"""Give vLLM's Ling-3.0 (``BailingMoeV3ForCausalLM``) the target-layer hidden states the drafter conditions on.

UBTree's drafter reads the hidden states entering chosen target layers, which vLLM's runners request through
``SupportsEagle3`` (``set_aux_hidden_state_layers``, a model forward that returns ``(hidden, [aux...])``). vLLM 0.32's
``BailingMoeV3ForCausalLM`` does not implement it (``model_executor/models/bailing_moe_v3.py``). The patch adds the
interface to the class and replaces ``BailingMoeV3Model.forward`` with vLLM's loop plus the taps: the residual stream
entering each tapped layer, ``hidden_states + residual`` as vLLM's DeepSeek-V2 taps it (the decoder layers thread
``(hidden_states, residual)``; the first layer's input is the embedding alone), and after the last layer when it is
tapped. Without taps (every engine that is not a UBTree or EAGLE-3 engine) vLLM's forward runs unchanged.
"""
from __future__ import annotations

from typing import Any

from ubtree_vllm.patches._eagle3 import add_eagle3_interface, check_not_obsolete
from ubtree_vllm.patches._patching import original_attr_name, replace_attr

NAME = "bailing_moe_v3_hidden_states"


def apply() -> None:
    from vllm.model_executor.models import bailing_moe_v3 as bailing

    model_cls, lm_cls = bailing.BailingMoeV3Model, bailing.BailingMoeV3ForCausalLM
    check_not_obsolete(lm_cls, NAME)

    def forward(self: Any, input_ids: Any, positions: Any, intermediate_tensors: Any = None,
                inputs_embeds: Any = None) -> Any:
        taps = self.ubtree_aux_layers
        if not taps:
            return getattr(model_cls, original_attr_name("forward"))(self, input_ids, positions, intermediate_tensors,
                                                                     inputs_embeds)
        if bailing.get_pp_group().world_size > 1:
            raise NotImplementedError(f"patch {NAME}: hidden-state taps with pipeline parallelism")
        hidden_states = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        aux_hidden_states = []
        for idx, layer in enumerate(self.layers[self.start_layer:self.end_layer], self.start_layer):
            if idx in taps:
                aux_hidden_states.append(hidden_states if residual is None else hidden_states + residual)
            hidden_states, residual = layer(hidden_states, positions, residual)
        if self.end_layer in taps:
            aux_hidden_states.append(hidden_states if residual is None else hidden_states + residual)
        if residual is not None:
            hidden_states, _ = self.norm(hidden_states, residual)
        else:
            hidden_states = self.norm(hidden_states)
        return hidden_states, aux_hidden_states

    if not replace_attr(model_cls, "forward", forward, NAME):
        return
    add_eagle3_interface(model_cls, lm_cls)
