"""Model Runner V2 form (the default on CUDA) against vLLM 0.32's real config objects, on the CPU: the "dflash"
presentation with the proposer-only copy builds a vLLM engine config that MRV2 accepts, and
UBTreeSpeculator constructs from it with the gamma / B split (nothing runs: no GPU)."""
from __future__ import annotations

import dataclasses

import torch
from vllm.engine.arg_utils import EngineArgs

from ubtree_vllm.drafter.io import export_dflash_proposer
from ubtree_vllm.vllm.config import ADDITIONAL_CONFIG_KEY, TargetInfo, from_vllm_config, parse_speculative_config


def mrv2_engine_config(target, drafter, tmp_path, budget=8):
    """What the rewrite hands vLLM on CUDA with UBTREE_VLLM_RUNNER=mrv2 (built here without faking CUDA)."""
    common = dict(model=str(target), skip_tokenizer_init=True, dtype="float32", max_model_len=512)
    target_info = TargetInfo.from_model_config(EngineArgs(**common).create_model_config())
    spec = parse_speculative_config({"method": "ubtree", "model": str(drafter), "num_speculative_tokens": budget,
                                     "beam_width": 3, "top_k": 4}, target_info)
    proposer = export_dflash_proposer(drafter, tmp_path / "proposer")
    return EngineArgs(**common, speculative_config={"method": "dflash", "model": str(proposer),
                                                    "num_speculative_tokens": budget},
                      additional_config={ADDITIONAL_CONFIG_KEY: dataclasses.replace(spec, runner="mrv2")
                                         .to_additional_config()}).create_engine_config()


def test_dflash_form_builds_a_config_model_runner_v2_accepts(tiny_target, tiny_drafter, tmp_path):
    config = mrv2_engine_config(tiny_target, tiny_drafter, tmp_path)
    spec = config.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("dflash", 8)
    assert spec.draft_model_config.architectures == ["DFlashDraftModel"]
    assert config._get_v2_model_runner_unsupported_features() == []  # MRV2 is chosen wherever Triton runs
    ours = from_vllm_config(config)
    assert ours is not None and ours.runner == "mrv2" and ours.drafter_dir == str(tiny_drafter)


def test_speculator_splits_the_block_from_the_draft_slots(tiny_target, tiny_drafter, tmp_path):
    from vllm.config import set_current_vllm_config

    from ubtree_vllm.vllm.mrv2.speculator import UBTreeSpeculator

    config = mrv2_engine_config(tiny_target, tiny_drafter, tmp_path)
    with set_current_vllm_config(config):
        speculator = UBTreeSpeculator(config, torch.device("cpu"))
    max_reqs = config.scheduler_config.max_num_seqs
    assert (speculator.gamma, speculator.tree_budget) == (4, 8)
    assert (speculator.num_speculative_steps, speculator.num_query_per_req) == (4, 5)  # the DFlash block: gamma
    assert tuple(speculator.draft_tokens.shape) == (max_reqs, 8)  # the verified slots: B
    assert tuple(speculator.topology.parents.shape) == (max_reqs + 1, 9)  # + the scratch slot of padding rows
    assert speculator._num_graph_context_tokens(2) == 18  # B + 1 target rows per request
    parents = speculator.topology.parents
    assert bool((parents[:, 0] == -1).all()) and bool((parents[:, 1:] == -2).all())  # every slot a lone root
