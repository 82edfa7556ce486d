"""Give vLLM's Falcon-H1 the target-layer hidden states the drafter conditions on (the EAGLE-3 interface).

UBTree's drafter reads the hidden states entering chosen target layers, which vLLM's runners request through
``SupportsEagle3`` (``set_aux_hidden_state_layers``, a model forward that returns ``(hidden, [aux...])``).
vLLM 0.32's ``FalconH1ForCausalLM`` does not implement it, so a UBTree engine on a Falcon-H1 target failed at start
("Model does not support EAGLE3 interface but aux_hidden_state_outputs was requested", probe 2026-12-03), although
its Mamba2 mixers verify trees as NemotronH's do (patch ``mamba2_tree_decode``). The patch adds the interface
to the class and replaces ``FalconH1Model.forward`` with vLLM's loop plus the taps: the residual stream entering
each tapped layer (Falcon-H1's layers keep no residual between them, so that stream is their input), and after the
last layer when it is tapped -- vLLM's ``hidden_states + residual`` convention of the models that have it. Without
taps (every engine that is not a UBTree or EAGLE-3 engine) vLLM's forward runs unchanged.
"""
from __future__ import annotations

from itertools import islice
from typing import Any

from ubtree_vllm.patches._eagle3 import add_eagle3_interface, check_not_obsolete
from ubtree_vllm.patches._patching import original_attr_name, replace_attr

NAME = "falcon_h1_hidden_states"


def apply() -> None:
    from vllm.model_executor.models import falcon_h1

    model_cls, lm_cls = falcon_h1.FalconH1Model, falcon_h1.FalconH1ForCausalLM
    check_not_obsolete(lm_cls, NAME)

    def forward(self: Any, input_ids: Any, positions: Any, intermediate_tensors: Any = None,
                inputs_embeds: Any = None) -> Any:
        taps = self.ubtree_aux_layers
        if not taps:
            return getattr(model_cls, original_attr_name("forward"))(self, input_ids, positions, intermediate_tensors,
                                                                     inputs_embeds)
        from vllm.distributed import get_pp_group

        if get_pp_group().world_size > 1:
            raise NotImplementedError(f"patch {NAME}: hidden-state taps with pipeline parallelism")
        embeds = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        hidden_states = embeds * self.embedding_multiplier
        aux_hidden_states = []
        for idx, layer in enumerate(islice(self.layers, self.start_layer, self.end_layer), self.start_layer):
            if idx in taps:
                aux_hidden_states.append(hidden_states)
            hidden_states = layer(positions=positions, hidden_states=hidden_states)
        if self.end_layer in taps:
            aux_hidden_states.append(hidden_states)
        return self.final_layernorm(hidden_states), aux_hidden_states

    if not replace_attr(model_cls, "forward", forward, NAME):
        return
    add_eagle3_interface(model_cls, lm_cls)
