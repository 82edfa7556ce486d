"""What the CPU can check of the MRV2 runner (it needs a GPU to run): it imports against vLLM 0.32's
MRV2 classes, and every method it overrides exists on vLLM's GPUModelRunner with the same parameters."""
from __future__ import annotations

import inspect

import pytest

from ubtree_vllm.vllm.attention.state import TreeForwardState


def test_overrides_match_vllm_model_runner_v2():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from ubtree_vllm.vllm.mrv2.model_runner import UBTreeModelRunnerV2

    assert issubclass(UBTreeModelRunnerV2, GPUModelRunner)
    own = {name for name, value in vars(UBTreeModelRunnerV2).items() if inspect.isfunction(value)}
    overrides = own & set(dir(GPUModelRunner))
    assert {"__init__", "load_model", "prepare_attn", "prepare_dummy_attn", "postprocess_sampled",
            "add_requests"} <= overrides
    # load_model and the stage-timed wrappers forward *args/**kwargs unchanged
    pass_through = {"load_model", "execute_model", "sample_tokens", "prepare_inputs", "sample"}
    assert pass_through <= overrides
    for name in overrides - pass_through:
        ours = list(inspect.signature(getattr(UBTreeModelRunnerV2, name)).parameters)
        theirs = list(inspect.signature(getattr(GPUModelRunner, name)).parameters)
        assert ours == theirs, (name, ours, theirs)


def test_refuses_an_engine_not_configured_for_ubtree_on_mrv2():
    from types import SimpleNamespace

    from ubtree_vllm.vllm.mrv2.model_runner import UBTreeModelRunnerV2

    config = SimpleNamespace(additional_config={}, speculative_config=SimpleNamespace(method="dflash"))
    with pytest.raises(ValueError, match="MRV2"):
        UBTreeModelRunnerV2(config, None)


def test_device_rows_switch_tree_attention_on_until_the_forward_ends():
    state = TreeForwardState()
    assert not state.has_tree_rows
    state.begin_device_rows()
    assert state.has_tree_rows
    state.end_forward()
    assert not state.has_tree_rows
