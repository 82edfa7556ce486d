"""UBTreeSpeculator (MRV2, docs/design/mrv2.md §2) on the CPU: what is checkable without a GPU.

The class itself needs a CUDA engine (vLLM's DFlash model, attention metadata, graphs). Here:
it imports on the CPU build and overrides DFlash methods with their signatures; its pure
helpers (tree drafting from the block's hidden states, the linearisation of a verified tree
step, the target embedding/LM head lookup) run on CPU tensors; and its glue
(``_generate_draft``'s row mapping and topology scatter, ``propose``'s pending permutation and
draft slots) runs on an instance whose vLLM parts are replaced by stubs.
"""
from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ubtree_vllm.config import UBTreeConfig
from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.io import save_drafter
from ubtree_vllm.drafter.proposer import UBTreeDrafter
from ubtree_vllm.types import DraftContext
from ubtree_vllm.vllm.config import UBTreeVllmConfig
from ubtree_vllm.vllm.mrv2 import speculator as spec_mod
from ubtree_vllm.vllm.mrv2.rejection_sampler import TreeTopology
from ubtree_vllm.vllm.mrv2.speculator import (
    UBTreeSpeculator,
    permute_target_rows,
    root_only_,
    target_embedding_and_head,
    tree_rows_from_hidden,
    ubtree_settings,
)
from ubtree_vllm.vllm.mrv2.tree_layout import linear_logits_positions_, linearise_rows
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

VOCAB, HIDDEN, GAMMA, B = 97, 64, 4, 12
TREE = UBTreeConfig(tree_budget=B, beam_width=4, top_k=6, block_size=GAMMA)
OVERRIDES = {"__init__", "load_draft_model", "init_cudagraph_manager", "_generate_draft",
             "_num_graph_context_tokens", "propose"}


def drafter_config() -> DrafterConfig:
    return DrafterConfig(target_name="tiny", vocab_size=VOCAB, hidden_size=HIDDEN, target_num_layers=4,
                         target_layer_ids=(1, 2), block_size=GAMMA, top_k=6, num_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=128, selector_rank=8,
                         selector_hidden=32)


def make_drafter(device: str = "cpu") -> UBTreeDrafter:
    torch.manual_seed(0)
    drafter = UBTreeDrafter(drafter_config()).to(device)
    drafter.bind_target(torch.randn(VOCAB, HIDDEN, device=device), torch.randn(VOCAB, HIDDEN, device=device))
    return drafter.eval()


def context(lengths: list[int], num_features: int, seed: int) -> DraftContext:
    gen = torch.Generator().manual_seed(seed)
    width = max(lengths)
    positions = torch.arange(width)[None, :].expand(len(lengths), -1)
    return DraftContext(anchor=torch.randint(VOCAB, (len(lengths),), generator=gen),
                        anchor_pos=torch.tensor(lengths), features=torch.randn(len(lengths), width, num_features,
                                                                               generator=gen),
                        positions=positions, valid=positions < torch.tensor(lengths)[:, None],
                        tokens=torch.zeros_like(positions))


# ---- class shape -----------------------------------------------------------------------------

def test_is_a_dflash_speculator():
    assert issubclass(UBTreeSpeculator, DFlashSpeculator)
    assert UBTreeSpeculator._speculator_name == "UBTree"


def test_overrides_exist_on_the_base_with_its_signature():
    own = {name for name, value in vars(UBTreeSpeculator).items()
           if callable(value) and hasattr(DFlashSpeculator, name)}
    assert own == OVERRIDES
    for name in sorted(OVERRIDES):
        ours = inspect.signature(getattr(UBTreeSpeculator, name)).parameters
        base = inspect.signature(getattr(DFlashSpeculator, name)).parameters
        assert list(ours) == list(base), name
        for param in base:
            assert ours[param].kind == base[param].kind, (name, param)
            assert ours[param].default == base[param].default, (name, param)


def test_settings_checks_name_both_numbers():
    settings = UBTreeVllmConfig(drafter_dir="unused", tree=UBTreeConfig(tree_budget=3, beam_width=2, top_k=6,
                                                                        block_size=GAMMA), drafter=drafter_config())
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3,
                                                                     enable_adaptive_verification=False),
                                  parallel_config=SimpleNamespace(tensor_parallel_size=1))
    with pytest.raises(ValueError, match=r"num_speculative_tokens = 3.*gamma \(4\)"):
        UBTreeSpeculator._check_settings(vllm_config, settings)
    vllm_config.speculative_config.num_speculative_tokens = 5
    with pytest.raises(ValueError, match="must equal the UBTree tree budget"):
        UBTreeSpeculator._check_settings(vllm_config, settings)


def test_settings_from_additional_config(tmp_path):
    save_drafter(UBTreeDrafter(drafter_config()), tmp_path / "drafter")
    values = {"drafter": str(tmp_path / "drafter"), **TREE.to_dict(), "runner": "mrv2"}
    vllm_config = SimpleNamespace(speculative_config=SimpleNamespace(method="dflash", model=str(tmp_path / "p"),
                                                                     num_speculative_tokens=B),
                                  additional_config={"ubtree": values})
    settings = ubtree_settings(vllm_config)
    assert settings.tree == TREE and settings.drafter_dir == str(tmp_path / "drafter")
    assert settings.runner == "mrv2"
    with pytest.raises(ValueError, match="additional_config"):
        ubtree_settings(SimpleNamespace(speculative_config=vllm_config.speculative_config, additional_config={}))


# ---- pure helpers -------------------------------------------------------------------------------

def test_tree_rows_agree_with_draft_tree():
    drafter = make_drafter()
    for seed, lengths in enumerate([[5], [9, 3, 20], [40, 41, 42, 7]]):
        ctx = context(lengths, drafter.cfg.num_features, seed)
        with torch.no_grad():
            want = drafter.draft_tree(ctx, TREE)
            hidden = drafter.block_hidden(ctx.anchor[:, None], ctx.anchor_pos[:, None], ctx.features,
                                          ctx.positions, ctx.valid)[:, 0]  # [R, gamma, H]
            tokens, parents, depth = tree_rows_from_hidden(drafter, TREE, hidden, ctx.anchor.int())
        assert tokens.dtype == torch.int64 and tokens.shape == (len(lengths), B)
        assert parents.dtype == depth.dtype == torch.int32 and parents.shape == (len(lengths), B + 1)
        assert torch.equal(tokens, want.tokens[:, 1:])
        assert torch.equal(parents, want.parents.int())
        assert torch.equal(depth, want.depth.int())


def test_root_only():
    parents, depth = torch.zeros(3, 5, dtype=torch.int32), torch.ones(3, 5, dtype=torch.int32)
    root_only_(parents, depth)
    assert parents.tolist() == [[-1, -2, -2, -2, -2]] * 3 and not depth.any()


def tree_step_batch():
    """Three requests: p (prefill, rows 0-2, one logits row), a and b (trees of 5 nodes at rows 3-7, 8-12).

    a: parents [-1, 0, 0, 1, 2], root position 10, accepted path 0 -> 2 -> 4.
    b: a chain at root position 30, accepted path 0 -> 1.
    """
    linear = torch.tensor([0, 1, 2, 10, 11, 12, 13, 14, 30, 31, 32, 33, 34, 0, 0])  # T_pad = 15
    tree = linear.clone()
    tree[3:8] = torch.tensor([10, 11, 11, 12, 12])  # root + depth
    batch = SimpleNamespace(num_tokens=13, positions=tree, logits_indices=torch.tensor([2, *range(3, 13)]),
                            cu_num_logits=torch.tensor([0, 1, 6, 11], dtype=torch.int32),
                            expanded_local_pos=torch.tensor([0, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4], dtype=torch.int32))
    accepted_path = torch.tensor([[0, -1, -1, -1, -1], [0, 2, 4, -1, -1], [0, 1, -1, -1, -1]])
    num_accepted = torch.tensor([0, 2, 1])
    return batch, linear, accepted_path, num_accepted


def test_linear_positions_restored():
    batch, linear, _, _ = tree_step_batch()
    linear_logits_positions_(batch.positions, batch.logits_indices, batch.expanded_local_pos)
    assert torch.equal(batch.positions, linear)


def step_permutation(batch, accepted_path, num_accepted) -> torch.Tensor:
    """The permutation the runner's commit hands over (torch oracle of commit_accepted_paths), positions restored."""
    return linearise_rows(batch.num_tokens, batch.logits_indices, batch.cu_num_logits, accepted_path, num_accepted,
                          GAMMA, positions=batch.positions, expanded_local_pos=batch.expanded_local_pos)


def test_permute_target_rows_moves_the_accepted_path():
    batch, linear, accepted_path, num_accepted = tree_step_batch()
    perm = step_permutation(batch, accepted_path, num_accepted)
    assert torch.equal(batch.positions, linear)
    aux = [torch.arange(15.0)[:, None].expand(-1, 3) + 100 * i for i in range(2)]  # [T_pad, 3], row id in column
    last = torch.randn(15, 3)
    new_aux, new_last = permute_target_rows(batch.num_tokens, aux, last, perm)
    assert new_last is last
    want_rows = [0, 1, 2, 3, 5, 7, 6, 7, 8, 9, 10, 11, 12]  # a: row 4 <- node 2 (row 5), row 5 <- node 4 (row 7)
    for i, h in enumerate(new_aux):
        assert h.shape == (13, 3)
        assert h[:, 0].tolist() == [r + 100 * i for r in want_rows]
    _, new_last = permute_target_rows(batch.num_tokens, None, last, perm)
    assert torch.equal(new_last, last[want_rows])
    # with DFlash's combine: the aux states combined as DFlash would, then one permutation; no aux states left
    fc = nn.Linear(6, 3)
    no_aux, combined = permute_target_rows(batch.num_tokens, aux, last, perm, combine=fc)
    assert no_aux is None
    with torch.no_grad():
        torch.testing.assert_close(combined, fc(torch.cat(aux, dim=-1)[:13])[want_rows], rtol=0, atol=0)


class _Inner(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(rows, HIDDEN)


class _Target(nn.Module):
    def __init__(self, rows: int, tied: bool) -> None:
        super().__init__()
        self.model = _Inner(rows)
        self.lm_head = self.model.embed_tokens if tied else nn.Embedding(rows, HIDDEN)


def test_target_embedding_and_head():
    tied = _Target(VOCAB + 31, tied=True)  # vLLM pads the vocabulary
    embed, head = target_embedding_and_head(tied, VOCAB)
    assert embed.shape == head.shape == (VOCAB, HIDDEN) and embed.data_ptr() == head.data_ptr()
    untied = _Target(VOCAB, tied=False)
    embed, head = target_embedding_and_head(untied, VOCAB)
    assert torch.equal(head, untied.lm_head.weight) and torch.equal(embed, untied.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="tensor-parallel"):
        target_embedding_and_head(_Target(VOCAB // 2, tied=True), VOCAB)


# ---- glue, on an instance with stubbed vLLM parts -------------------------------------------------

MAX_REQS = 6


def stub_speculator(drafter: UBTreeDrafter, last_hidden: torch.Tensor) -> UBTreeSpeculator:
    """The attributes DFlash's constructor would set, then our buffer setup; `_run_model` returns `last_hidden`
    (on its device)."""
    spec = object.__new__(UBTreeSpeculator)
    device = last_hidden.device
    spec.device, spec.max_num_reqs, spec.max_num_tokens = device, MAX_REQS, 64
    spec.num_speculative_steps = B
    spec.tree_budget, spec.gamma, spec.tree_cfg = B, GAMMA, TREE
    spec.input_buffers = SimpleNamespace(input_ids=torch.zeros(64, dtype=torch.int32, device=device))
    spec.sample_indices = torch.zeros(MAX_REQS * B, dtype=torch.int64, device=device)
    spec.sample_pos = torch.zeros(MAX_REQS * B, dtype=torch.int64, device=device)
    spec.sample_idx_mapping = torch.full((MAX_REQS * B,), -1, dtype=torch.int32, device=device)
    spec.temperature = torch.zeros(MAX_REQS, dtype=torch.float32, device=device)
    spec.seeds = torch.zeros(MAX_REQS, dtype=torch.int64, device=device)
    spec.use_fp64_gumbel = False
    spec.draft_tokens = torch.zeros(MAX_REQS, B, dtype=torch.int64, device=device)
    spec._split_block_from_slots()
    spec._init_tree_buffers()
    spec.ubtree_drafter = drafter
    spec.pending_perm = None
    spec._run_model = lambda *args, **kwargs: last_hidden
    return spec


def fill_like_prepare_kernel(spec: UBTreeSpeculator, anchors: torch.Tensor) -> None:
    """What prepare_dflash_inputs writes: anchors at query row r * (1 + gamma), sample rows at offsets 1..gamma."""
    q = spec.num_query_per_req
    for r, token in enumerate(anchors.tolist()):
        spec.input_buffers.input_ids[r * q] = token
        for d in range(1, GAMMA + 1):
            spec.sample_indices[r * GAMMA + d - 1] = r * q + d


def test_block_and_slots_are_split():
    spec = stub_speculator(make_drafter(), torch.zeros(1, HIDDEN))
    assert spec.num_speculative_steps == GAMMA and spec.num_query_per_req == GAMMA + 1
    assert spec.sample_col.tolist() == list(range(GAMMA)) * MAX_REQS
    assert spec.draft_tokens.shape == (MAX_REQS, B)
    assert isinstance(spec.topology, TreeTopology)
    assert spec.topology.parents.shape == spec.topology.depth.shape == (MAX_REQS + 1, B + 1)  # + scratch slot
    assert spec.topology.parents.dtype == spec.topology.depth.dtype == torch.int32
    assert spec.topology.parents[:, 0].eq(-1).all() and spec.topology.parents[:, 1:].eq(-2).all()
    assert spec._num_graph_context_tokens(3) == 3 * (B + 1)
    assert spec._num_graph_context_tokens(5) == 64  # capped at max_num_batched_tokens


def test_generate_draft_reads_the_sample_rows_and_anchors_and_scatters_the_topology():
    drafter = make_drafter()
    num_reqs = 3
    last_hidden = torch.randn(num_reqs * (GAMMA + 1) + 2, HIDDEN)  # padded rows at the end
    spec = stub_speculator(drafter, last_hidden)
    anchors = torch.tensor([5, 17, 96])
    fill_like_prepare_kernel(spec, anchors)
    spec._draft_slots[:num_reqs] = torch.tensor([4, 0, 2])
    spec._generate_draft(num_reqs + 1, last_hidden.shape[0], None, None, None)  # + one graph-padding row
    rows = torch.tensor([[r * (GAMMA + 1) + d for d in range(1, GAMMA + 1)] for r in range(num_reqs)])
    with torch.no_grad():
        tokens, parents, depth = tree_rows_from_hidden(drafter, TREE, last_hidden[rows], anchors)
    assert torch.equal(spec.draft_tokens[:num_reqs], tokens)
    for b, slot in enumerate([4, 0, 2]):
        assert torch.equal(spec.topology.parents[slot], parents[b])
        assert torch.equal(spec.topology.depth[slot], depth[b])
    assert spec.topology.parents[spec.scratch_slot, 1:].ne(-2).any()  # the padding row's tree went there
    for slot in (1, 3, 5):
        assert spec.topology.parents[slot].tolist() == [-1] + [-2] * B


def fill_sampling_rows(spec: UBTreeSpeculator, slots: list[int], anchor_pos: list[int], temperature: list[float],
                       seeds: list[int]) -> None:
    """What prepare_dflash_inputs writes for sampling: each sample row's request slot and token position P, and the
    slots' temperatures and seeds."""
    index = torch.tensor(slots, device=spec.temperature.device)
    spec.temperature[index] = torch.tensor(temperature, device=index.device)
    spec.seeds[index] = torch.tensor(seeds, device=index.device)
    for r, (slot, pos) in enumerate(zip(slots, anchor_pos)):
        spec.sample_idx_mapping[r * GAMMA:(r + 1) * GAMMA] = slot
        spec.sample_pos[r * GAMMA:(r + 1) * GAMMA] = pos + torch.arange(1, GAMMA + 1, device=index.device)


def test_generate_draft_couples_each_tree_to_its_requests_noise():
    """coupled_drafting: each row's tree is drafted under the noise its request's draws will take (temperature and
    seed of its slot, keys at the sample rows' positions - 1, as prepare_dflash_inputs left them); a greedy request
    drafts the uncoupled tree."""
    from ubtree_vllm.drafter.coupling import CoupledNoise

    drafter = make_drafter()
    num_reqs = 3
    last_hidden = torch.randn(num_reqs * (GAMMA + 1) + 2, HIDDEN)
    spec = stub_speculator(drafter, last_hidden)
    spec.tree_cfg = dataclasses.replace(TREE, coupled_drafting=True)
    anchors, slots, anchor_pos = torch.tensor([5, 17, 96]), [4, 0, 2], [30, 7, 512]
    fill_like_prepare_kernel(spec, anchors)
    fill_sampling_rows(spec, slots, anchor_pos, [1.0, 0.0, 0.6], [11, 2 ** 40 + 1, 3])
    spec._draft_slots[:num_reqs] = torch.tensor(slots)
    spec._generate_draft(num_reqs + 1, last_hidden.shape[0], None, None, None)  # + one graph-padding row
    rows = torch.tensor([[r * (GAMMA + 1) + d for d in range(1, GAMMA + 1)] for r in range(num_reqs)])
    noise = CoupledNoise(temperature=torch.tensor([1.0, 0.0, 0.6]), seeds=torch.tensor([11, 2 ** 40 + 1, 3]),
                         key_pos=torch.tensor(anchor_pos)[:, None] + torch.arange(GAMMA)[None, :])
    with torch.no_grad():
        tokens, parents, depth = tree_rows_from_hidden(drafter, spec.tree_cfg, last_hidden[rows], anchors, None, noise)
        plain, _, _ = tree_rows_from_hidden(drafter, TREE, last_hidden[rows], anchors)
    assert torch.equal(spec.draft_tokens[:num_reqs], tokens)
    for b, slot in enumerate(slots):
        assert torch.equal(spec.topology.parents[slot], parents[b])
    assert torch.equal(tokens[1], plain[1])  # T = 0: the uncoupled tree
    assert not torch.equal(tokens[0], plain[0]) and not torch.equal(tokens[2], plain[2])


def test_propose_permutes_the_rows_and_drafts_into_the_batch_slots(monkeypatch):
    drafter = make_drafter()
    batch, linear, accepted_path, num_accepted = tree_step_batch()
    last_hidden = torch.randn(3 * (GAMMA + 1), HIDDEN)
    spec = stub_speculator(drafter, last_hidden)
    fill_like_prepare_kernel(spec, torch.tensor([1, 2, 3]))
    batch.num_reqs, batch.idx_mapping = 3, torch.tensor([4, 0, 2], dtype=torch.int32)
    seen = {}

    def dflash_propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                       *args, dummy_run=False, **kwargs):
        seen["aux"], seen["last"] = aux_hidden_states, last_hidden_states
        seen["slots"] = self._draft_slots.clone()
        self._generate_draft(input_batch.num_reqs, last_hidden.shape[0], None, None, None)
        return self.draft_tokens[:input_batch.num_reqs]

    monkeypatch.setattr(DFlashSpeculator, "propose", dflash_propose)
    spec.model = SimpleNamespace(combine_hidden_states=lambda x: x + 1000)  # DFlash's fc, row-wise
    aux = [torch.arange(15.0)[:, None].expand(-1, 3)]
    zeros = torch.zeros(3, dtype=torch.int32)

    def propose(dummy_run: bool):
        return spec.propose(batch, {}, {}, torch.zeros(15, 3), aux, zeros, zeros, zeros, zeros, zeros, zeros,
                            dummy_run=dummy_run)

    perm = spec.pending_perm = step_permutation(batch, accepted_path, num_accepted)
    drafts = propose(dummy_run=True)  # stale request slots: no permutation, every row drafts into scratch
    assert spec.pending_perm is perm and seen["aux"] is aux
    assert seen["slots"].eq(spec.scratch_slot).all()
    assert spec.topology.parents[:MAX_REQS, 1:].eq(-2).all()

    drafts = propose(dummy_run=False)
    assert spec.pending_perm is None
    # the aux states combined as DFlash would, then permuted once; DFlash gets them as its features
    assert seen["aux"] is None
    assert seen["last"][:, 0].tolist() == [1000 + r for r in [0, 1, 2, 3, 5, 7, 6, 7, 8, 9, 10, 11, 12]]
    assert seen["slots"][:3].tolist() == [4, 0, 2] and seen["slots"][3:].eq(spec.scratch_slot).all()
    assert drafts.shape == (3, B)
    for slot in (4, 0, 2):
        assert spec.topology.parents[slot, 1:].ne(-2).any()
    for slot in (1, 3, 5):
        assert spec.topology.parents[slot].tolist() == [-1] + [-2] * B
    spec.reset_request(0)
    assert spec.topology.parents[0].tolist() == [-1] + [-2] * B and not spec.topology.depth[0].any()

    batch.num_reqs = 1  # the batch shrank: the rows it left point at the scratch slot again
    propose(dummy_run=False)
    assert seen["slots"][:1].tolist() == [4] and seen["slots"][1:].eq(spec.scratch_slot).all()
    assert spec.topology.parents[0].tolist() == [-1] + [-2] * B


def test_propose_at_budget_zero_stores_the_context_and_drafts_nothing(monkeypatch):
    """num_speculative_tokens 0 (a zero range of the load-adaptive schedule): propose stores the drafter's context K/V
    of every target row (DFlash's input preparation per draft KV group, then _precompute_context_kv) without DFlash's
    propose, so no block forward runs and no tree or topology is written; the next propose at a budget drafts again."""
    drafter = make_drafter()
    last_hidden = torch.randn(3 * (GAMMA + 1), HIDDEN)
    spec = stub_speculator(drafter, last_hidden)
    fill_like_prepare_kernel(spec, torch.tensor([1, 2, 3]))
    runs, calls = [], []
    spec._run_model = lambda *args, **kwargs: runs.append(1) or last_hidden
    spec.model = SimpleNamespace(combine_hidden_states=lambda x: x + 1000)  # DFlash's fc, row-wise
    spec.hidden_states = torch.zeros(64, 3)
    spec.draft_kv_cache_group_ids = [0, 2]
    spec._context_slot_mappings = [torch.zeros(64, dtype=torch.int64)] * 2
    spec.block_tables = SimpleNamespace(slot_mappings={0: "slots0", 2: "slots2"},
                                        input_block_tables={0: "blocks0", 2: "blocks2"},
                                        block_sizes={0: 16, 2: 16}, cp_rank=0, cp_interleave=1)
    for name in ("context_positions", "sample_pos", "sample_idx_mapping", "temperature", "seeds", "dcp_size",
                 "parallel_drafting_token_id", "max_model_len", "sample_from_anchor"):
        setattr(spec, name, name)
    spec.prepare_context_anchor = lambda input_batch, num_rejected: calls.append("anchor")
    spec._precompute_context_kv = lambda start, end, dummy_run=False: calls.append(
        ("context", start, end, spec.hidden_states[:end, 0].tolist()))
    monkeypatch.setattr(spec_mod, "prepare_dflash_inputs",
                        lambda *args: calls.append(("prepare", args[1], args[3] is spec._context_slot_mappings[0],
                                                    args[16], args[9] is batch)))
    dflash = []
    monkeypatch.setattr(DFlashSpeculator, "propose", lambda self, *args, **kwargs: dflash.append(kwargs))
    batch = SimpleNamespace(num_reqs=3, num_tokens=3, idx_mapping=torch.tensor([4, 0, 2], dtype=torch.int32))
    zeros = torch.zeros(3, dtype=torch.int32)
    aux = [torch.arange(3.0)[:, None].expand(-1, 3)]

    drafts = spec.propose(batch, {}, {}, torch.zeros(3, HIDDEN), aux, zeros, zeros, zeros, zeros, zeros, zeros,
                          num_speculative_tokens=0)
    assert not dflash and not runs
    assert calls == ["anchor", ("prepare", "slots0", True, "blocks0", True), ("prepare", "slots2", True, "blocks2",
                                                                              True),
                     ("context", 0, 3, [1000.0, 1001.0, 1002.0])]
    assert drafts.shape == (3, B)
    assert spec.topology.parents[:MAX_REQS, 1:].eq(-2).all()
    spec.propose(batch, {}, {}, torch.zeros(3, HIDDEN), aux, zeros, zeros, zeros, zeros, zeros, zeros,
                 num_speculative_tokens=0, dummy_run=True)  # dummy runs (capture, profiling) keep DFlash's path
    assert len(dflash) == 1 and dflash[0]["num_speculative_tokens"] == 0


def test_context_only_prepares_inputs_as_dflashs_propose_does():
    """_store_context_only mirrors the context half of vLLM's DFlashSpeculator.propose: the same
    prepare_dflash_inputs arguments, expression for expression, so a vLLM upgrade that changes them fails here."""
    import ast
    import textwrap

    def prepare_call_args(function) -> list[str]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)
                 and getattr(node.func, "id", None) == "prepare_dflash_inputs"]
        assert len(calls) == 1, calls
        return [ast.unparse(arg) for arg in calls[0].args] + [ast.unparse(k) for k in calls[0].keywords]

    ours = prepare_call_args(UBTreeSpeculator._store_context_only)
    assert ours == prepare_call_args(DFlashSpeculator.propose)
    assert len(ours) == 28


@pytest.mark.gpu
def test_tree_rows_capture_in_a_cuda_graph():
    drafter = make_drafter("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(5, GAMMA, HIDDEN, device="cuda", generator=gen)
    anchor = torch.randint(VOCAB, (5,), device="cuda", generator=gen, dtype=torch.int32)
    with torch.inference_mode():
        want = tree_rows_from_hidden(drafter, TREE, hidden, anchor)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            tree_rows_from_hidden(drafter, TREE, hidden, anchor)  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = tree_rows_from_hidden(drafter, TREE, hidden, anchor)
        graph.replay()
        torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.gpu
def test_generate_draft_with_its_topology_scatter_captures_in_a_cuda_graph():
    """The draft graph's body (tree rows, lookup gather, coupled drafting, topology index_copy_) captures and
    replays exactly."""
    drafter = make_drafter("cuda")
    num_reqs = 3
    last_hidden = torch.randn(num_reqs * (GAMMA + 1), HIDDEN, device="cuda")
    spec = stub_speculator(drafter, last_hidden)
    spec.tree_cfg = dataclasses.replace(LOOKUP_TREE, coupled_drafting=True)
    fill_sampling_rows(spec, [4, 0, 2], [30, 7, 512], [1.0, 0.0, 0.6], [11, 2 ** 40 + 1, 3])
    states = request_states(HISTORIES)
    spec.req_states = SimpleNamespace(all_token_ids=SimpleNamespace(gpu=states.all_token_ids.gpu.cuda()),
                                      total_len=SimpleNamespace(gpu=states.total_len.gpu.cuda()))
    anchors = torch.tensor([HISTORIES[s][-1] for s in (4, 0, 2)])
    fill_like_prepare_kernel(spec, anchors)
    spec._draft_slots[:num_reqs] = torch.tensor([4, 0, 2], device="cuda")
    with torch.inference_mode():
        spec._generate_draft(num_reqs + 1, last_hidden.shape[0], None, None, None)  # eager, + one padding row
        want = spec.draft_tokens.clone(), spec.topology.parents.clone(), spec.topology.depth.clone()
        root_only_(spec.topology.parents, spec.topology.depth)
        spec.draft_tokens.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            spec._generate_draft(num_reqs + 1, last_hidden.shape[0], None, None, None)
        root_only_(spec.topology.parents, spec.topology.depth)
        spec.draft_tokens.zero_()
        graph.replay()
        torch.cuda.synchronize()
    for got, expected in zip((spec.draft_tokens, spec.topology.parents, spec.topology.depth), want):
        assert torch.equal(got, expected)


def test_module_has_no_host_sync_in_drafting():
    """The captured path (tree_rows_from_hidden, _generate_draft, the coupled drafting it calls) reads no device
    value on the host."""
    from ubtree_vllm.drafter.coupling import couple_edges, coupled_candidates
    from ubtree_vllm.triton_ops.vocab_top_k import vocab_top_k, vocab_top_k_kernel

    for fn in (tree_rows_from_hidden, UBTreeSpeculator._generate_draft, permute_target_rows,
               linear_logits_positions_, UBTreeSpeculator._set_draft_slots, UBTreeSpeculator._target_noise,
               coupled_candidates, couple_edges, vocab_top_k, vocab_top_k_kernel):
        source = inspect.getsource(fn)
        for call in (".item()", ".tolist()", ".cpu()", "nonzero", ".numpy()"):
            assert call not in source, (fn.__name__, call)
    assert spec_mod.ROOT_PARENT == -1 and spec_mod.NO_NODE == -2


# ---- the prompt-lookup branch on MRV2 ------------------------------------------------------------

LOOKUP_TREE = UBTreeConfig(tree_budget=B, beam_width=4, top_k=6, block_size=GAMMA, prompt_lookup=True,
                           lookup_min_n=1, lookup_max_n=3)


def request_states(histories: dict[int, list[int]], width: int = 24) -> SimpleNamespace:
    """MRV2's RequestState as the lookup reads it: all_token_ids [slots, L] int32 with stale tails, total_len."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (MAX_REQS, width), generator=gen, dtype=torch.int32)  # stale everywhere
    total = torch.zeros(MAX_REQS, dtype=torch.int32)
    for slot, tokens in histories.items():
        ids[slot, :len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        total[slot] = len(tokens)
    return SimpleNamespace(all_token_ids=SimpleNamespace(gpu=ids), total_len=SimpleNamespace(gpu=total))


HISTORIES = {4: [10, 11, 12, 13, 14, 10, 11], 0: [20, 21, 22, 23], 2: [30, 31, 32, 30, 31, 32, 30, 31]}


def test_lookup_chain_matches_each_requests_history_as_the_v1_branch_does():
    states = request_states(HISTORIES)
    slots = torch.tensor([4, 0, 2])
    chain, chain_len = spec_mod.lookup_chain(states.all_token_ids.gpu, states.total_len.gpu, slots, LOOKUP_TREE)
    for b, slot in enumerate(slots.tolist()):  # the same history alone: prompt + output ending at the anchor
        history = torch.tensor([HISTORIES[slot]])
        want, want_len = spec_mod.lookup_continuation(history, torch.tensor([history.shape[1]]), GAMMA, 1, 3)
        assert torch.equal(chain[b], want[0]) and int(chain_len[b]) == int(want_len[0])
    assert chain[0].tolist() == [12, 13, 14, 10] and chain_len[0] == 4  # "10 11" at 0, then 12 13 14 10
    assert chain_len[1] == 0  # no earlier occurrence of any suffix
    assert chain[2, :3].tolist() == [32, 30, 31] and chain_len[2] == 3  # "32 30 31" at 2; the history ends after 3


def test_generate_draft_with_lookup_injects_each_rows_chain():
    drafter = make_drafter()
    num_reqs = 3
    last_hidden = torch.randn(num_reqs * (GAMMA + 1), HIDDEN)
    spec = stub_speculator(drafter, last_hidden)
    spec.tree_cfg = LOOKUP_TREE
    spec.req_states = request_states(HISTORIES)
    anchors = torch.tensor([HISTORIES[s][-1] for s in (4, 0, 2)])
    fill_like_prepare_kernel(spec, anchors)
    spec._draft_slots[:num_reqs] = torch.tensor([4, 0, 2])
    # + one graph-padding row: its scratch slot reads a (clamped) valid history
    spec._generate_draft(num_reqs + 1, last_hidden.shape[0], None, None, None)
    rows = torch.tensor([[r * (GAMMA + 1) + d for d in range(1, GAMMA + 1)] for r in range(num_reqs)])
    chain = spec_mod.lookup_chain(spec.req_states.all_token_ids.gpu, spec.req_states.total_len.gpu,
                                  torch.tensor([4, 0, 2]), LOOKUP_TREE)
    with torch.no_grad():
        tokens, parents, depth = tree_rows_from_hidden(drafter, LOOKUP_TREE, last_hidden[rows], anchors, chain)
        plain, _, _ = tree_rows_from_hidden(drafter, LOOKUP_TREE, last_hidden[rows], anchors)
    assert torch.equal(spec.draft_tokens[:num_reqs], tokens)
    assert all(torch.equal(spec.topology.parents[slot], parents[b]) for b, slot in enumerate([4, 0, 2]))
    assert not torch.equal(tokens, plain)  # the chains changed the trees
    # with edge log-prob 0 the whole chain is a root path of the tree: depth-1 node = chain[0], and so on
    for b in (0, 2):
        node, path = 0, []
        for d in range(int(chain[1][b])):
            kids = [j for j in range(1, B + 1) if int(parents[b, j]) == node and int(tokens[b, j - 1]) == int(chain[0][b, d])]
            assert kids, (b, d)
            node = kids[0]
            path.append(int(tokens[b, node - 1]))
        assert path == chain[0][b, :len(path)].tolist()


def test_propose_hands_the_batch_slots_to_the_lookup(monkeypatch):
    spec = stub_speculator(make_drafter(), torch.zeros(3 * (GAMMA + 1), HIDDEN))
    spec.tree_cfg = LOOKUP_TREE
    spec.req_states = request_states(HISTORIES)
    batch = SimpleNamespace(num_reqs=3, idx_mapping=torch.tensor([4, 0, 2], dtype=torch.int32))
    seen = {}

    def dflash_propose(self, input_batch, *args, dummy_run=False, **kwargs):
        seen["slots"] = self._draft_slots[:input_batch.num_reqs].clone()
        return self.draft_tokens[:input_batch.num_reqs]

    monkeypatch.setattr(DFlashSpeculator, "propose", dflash_propose)
    zeros = torch.zeros(3, dtype=torch.int32)
    spec.propose(batch, {}, {}, torch.zeros(15, 3), None, zeros, zeros, zeros, zeros, zeros, zeros, dummy_run=True)
    assert seen["slots"].eq(spec.scratch_slot).all()  # dummy runs name no request
    spec.propose(batch, {}, {}, torch.zeros(15, 3), None, zeros, zeros, zeros, zeros, zeros, zeros)
    assert seen["slots"].tolist() == [4, 0, 2]


def test_draft_graphs_ignore_the_load_adaptive_budget():
    """Every draft step queries 1 + gamma tokens per request: the draft's graph manager gets the engine config
    without ``num_speculative_tokens_per_batch_size`` (vLLM would add graphs of B' + 1 tokens per request, whose
    captures overran the draft's buffers on the H200), while the engine's own config keeps it for the target."""
    from vllm.config.speculative import SpeculativeConfig

    from ubtree_vllm.vllm.mrv2.speculator import draft_graph_config

    schedule = [[1, 4, 16], [5, 64, 5]]
    spec = SimpleNamespace(num_speculative_tokens=16, num_speculative_tokens_per_batch_size=schedule)
    engine = SimpleNamespace(speculative_config=spec, compilation_config=object(), scheduler_config=object())
    draft = draft_graph_config(engine)
    assert not SpeculativeConfig.uses_dynamic_speculative_decoding(draft.speculative_config)
    assert draft.speculative_config.num_speculative_tokens == 16
    assert draft.compilation_config is engine.compilation_config and draft.scheduler_config is engine.scheduler_config
    assert engine.speculative_config.num_speculative_tokens_per_batch_size == schedule  # the target keeps it
    assert SpeculativeConfig.uses_dynamic_speculative_decoding(engine.speculative_config)
    pinned = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens_per_batch_size=None))
    assert draft_graph_config(pinned) is pinned
