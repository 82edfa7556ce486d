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


def _input_batch(scheduled: list[int], num_logits: list[int], decode_graph_eligible: bool = True):
    import numpy as np
    from types import SimpleNamespace

    return SimpleNamespace(num_scheduled_tokens=np.array(scheduled, dtype=np.int32), num_tokens=sum(scheduled),
                           cu_num_logits_np=np.cumsum([0, *num_logits]), decode_graph_eligible=decode_graph_eligible)


def test_stock_roots_only_in_uniform_decode_steps():
    from ubtree_vllm.vllm.mrv2.model_runner import stock_roots_only

    assert stock_roots_only(_input_batch([65, 65], [65, 65]))  # uniform decode
    assert stock_roots_only(_input_batch([17], [17]))  # one request
    assert not stock_roots_only(_input_batch([65, 33], [65, 33]))  # drafts truncated by the token budget: not uniform
    assert not stock_roots_only(_input_batch([65, 40], [65, 1], decode_graph_eligible=False))  # a prefill chunk
    assert not stock_roots_only(_input_batch([65, 65], [65, 65], decode_graph_eligible=False))  # no decode graph
    assert not stock_roots_only(_input_batch([1, 1], [1, 1]))  # no drafts
    with pytest.raises(RuntimeError, match="every other row"):  # a uniform decode step with rows nobody would write
        stock_roots_only(_input_batch([65, 65], [65, 64]))


def test_stock_kernel_over_the_roots_only_when_the_entries_cover_the_rest(monkeypatch):
    """TreeRowsImpl.forward: the stock kernel runs over every row unless the buffers cover every row but the roots
    (eager: the step's flag; a capture: full_graphs_covered and more than one row per request), then over the roots
    alone; the tree launch runs whenever bound."""
    import torch
    from types import SimpleNamespace

    from ubtree_vllm.vllm.attention import tree_rows
    from ubtree_vllm.vllm.attention.state import RowBuffers

    calls: list[str] = []

    class Stock:
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *rest):
            calls.append("stock")
            return output

    class Impl(tree_rows.TreeRowsImpl, Stock):
        def __init__(self):  # no vLLM impl to build: the attributes forward reads
            self.attn_type, self.head_size, self.scale = tree_rows.AttentionType.DECODER, 4, 1.0

        def _stock_roots(self, query, key_cache, value_cache, attn_metadata, output):
            calls.append("roots")

    monkeypatch.setattr(tree_rows, "attend_tree_rows", lambda *args, **kwargs: calls.append("tree"))
    monkeypatch.setattr(tree_rows.tree_forward_state(), "_in_forward", True)
    impl, buffers = Impl(), RowBuffers.empty(8, 3, torch.device("cpu"))
    impl.ubtree_row_buffers = buffers
    meta = SimpleNamespace(block_table=None, max_query_len=65)
    tensors = [torch.zeros(8, 2, 4)] * 3 + [torch.zeros(2, 2, 4, 8)]

    def run(capturing: bool) -> list[str]:
        calls.clear()
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
        impl.forward(None, *tensors[:3], tensors[3], meta, torch.zeros(8, 2, 4))
        return list(calls)

    assert run(capturing=False) == ["stock", "tree"]
    buffers.covers_forward = True
    assert run(capturing=False) == ["roots", "tree"]
    assert run(capturing=True) == ["stock", "tree"]  # a capture follows full_graphs_covered, not the step's flag
    buffers.full_graphs_covered = True
    assert run(capturing=True) == ["roots", "tree"]
    meta.max_query_len = 1  # a FULL graph of one-row requests is not a tree step
    assert run(capturing=True) == ["stock", "tree"]
    impl.ubtree_row_buffers = None  # an engine without UBTree: stock only
    assert run(capturing=False) == ["stock"]


def test_impls_without_a_roots_only_call_refuse_it():
    from ubtree_vllm.vllm.attention.tree_rows import TreeRowsImpl

    with pytest.raises(NotImplementedError, match="computes no roots alone"):
        TreeRowsImpl._stock_roots(object(), None, None, None, None, None)


def test_root_context_lens():
    import torch

    from ubtree_vllm.vllm.attention.flash import root_context_lens

    lens = root_context_lens(torch.tensor([100, 17, 0], dtype=torch.int32), 17)  # the last: a padded request
    assert lens.tolist() == [84, 1, 0] and lens.dtype == torch.int32


def test_only_auto_declines_flash_exact_and_twice_is_harmless():
    """The engine core's decline (its scratch pages did not fit): a runner of "auto"'s flash_exact serves "triton"
    (also when its layers already refused flash_exact in the profiling run); a mode the user named is not changed."""
    from types import SimpleNamespace

    from ubtree_vllm.vllm.mrv2.model_runner import UBTreeModelRunnerV2

    def runner(auto):
        return SimpleNamespace(ubtree_config=SimpleNamespace(tree_attention="flash_exact", tree_attention_auto=auto),
                               _tree_attention="flash_exact")

    def stock_roots(fake):
        return UBTreeModelRunnerV2._stock_roots_mode.fget(fake)

    chosen = runner(auto=True)
    assert stock_roots(chosen)
    for _ in range(2):
        UBTreeModelRunnerV2.decline_exact_rows(chosen)
        assert (chosen._tree_attention, stock_roots(chosen)) == ("triton", False)
    named = runner(auto=False)
    with pytest.raises(RuntimeError, match="only tree_attention 'auto' can decline 'flash_exact'"):
        UBTreeModelRunnerV2.decline_exact_rows(named)
    assert named._tree_attention == "flash_exact"
