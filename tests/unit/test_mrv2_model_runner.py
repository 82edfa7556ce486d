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


def test_drafts_handler_hands_each_trees_parents_to_the_scheduler(monkeypatch):
    """Structured-output batches: the host copy of the drafts carries node j + 1's parent for each request's slot
    (topology column j + 1); other batches copy nothing and get vLLM's placeholders. CUDA streams faked (CPU)."""
    import contextlib
    from types import SimpleNamespace

    import torch
    from vllm.v1.outputs import DraftTokenIds

    from ubtree_vllm.vllm.mrv2.tree_drafts_handler import TreeDraftTokensHandler
    from ubtree_vllm.vllm.structured_output import TreeDraftTokenIds

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    parents = torch.full((5, 5), -2, dtype=torch.int32)  # [max_reqs + 1, B + 1], slot 4 the scratch row
    parents[:, 0] = -1
    parents[3] = torch.tensor([-1, 0, 0, 1, 2])  # a tree
    parents[1] = torch.tensor([-1, 0, 1, 2, 3])  # a chain
    handler = TreeDraftTokensHandler.__new__(TreeDraftTokensHandler)  # no CUDA stream here
    handler.device, handler.parents, handler.parents_np = None, parents, None
    handler.copy_stream = SimpleNamespace(wait_stream=lambda stream: None)
    handler.copy_event = SimpleNamespace(record=lambda: None, synchronize=lambda: None)
    batch = SimpleNamespace(req_ids=["a", "b"], idx_mapping=torch.tensor([3, 1]), has_structured_output_reqs=True)
    handler.set_draft_tokens(batch, torch.tensor([[7, 8, 9], [4, 5, 6]]))  # the scheduled 3 of B = 4 nodes
    drafts = handler.get_draft_tokens()
    assert isinstance(drafts, TreeDraftTokenIds)
    assert drafts.req_ids == ["a", "b"] and drafts.draft_token_ids == [[7, 8, 9], [4, 5, 6]]
    assert drafts.parents == [[0, 0, 1], [0, 1, 2]]
    batch.has_structured_output_reqs = False
    handler.set_draft_tokens(batch, torch.tensor([[7, 8, 9], [4, 5, 6]]))
    drafts = handler.get_draft_tokens()
    assert type(drafts) is DraftTokenIds and drafts.draft_token_ids == [[-1] * 3] * 2


def test_drafts_and_topologies_must_pair_up():
    import numpy as np
    from vllm.v1.outputs import DraftTokenIds

    from ubtree_vllm.vllm.mrv2.tree_drafts_handler import with_tree_parents

    drafts = DraftTokenIds(["a", "b"], [[1], [2]])
    assert with_tree_parents(drafts, None) is drafts
    with pytest.raises(RuntimeError, match="1 tree topologies for 2 drafting requests"):
        with_tree_parents(drafts, np.zeros((1, 1), dtype=np.int32))
