"""`ubtree bench microbench --which projection`: the drafter it builds and the report's projected speedups (CPU)."""
from __future__ import annotations

import torch

from ubtree_vllm.bench.projection import TARGET, projection_drafter_config, random_prompts
from ubtree_vllm.bench.projection_table import PROJECTED_TAUS
from ubtree_vllm.bench.records import make_record
from ubtree_vllm.bench.report import render
from ubtree_vllm.bench.verify_bench import QWEN3_8B_CONFIG
from ubtree_vllm.drafter.config import DrafterConfig
from ubtree_vllm.drafter.io import save_drafter
from ubtree_vllm.drafter.proposer import UBTreeDrafter


def test_drafter_matches_the_qwen3_8b_shape():
    cfg = projection_drafter_config(QWEN3_8B_CONFIG)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.target_num_layers, cfg.block_size) == (4096, 151936, 36, 16)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert cfg.target_layer_ids == (0, 8, 17, 26, 34)  # spread over the target's depth, the post-norm layer excluded


def test_tiny_drafter_builds_and_round_trips(tmp_path):
    tiny = {**QWEN3_8B_CONFIG, "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 512}
    cfg = projection_drafter_config(tiny, block_size=4)
    drafter = UBTreeDrafter(cfg).eval()
    folder = save_drafter(drafter, tmp_path / "drafter")
    assert DrafterConfig.load(folder) == cfg
    prompts = random_prompts(512, count=3, length=7)
    assert len(prompts) == 3 and all(len(p) == 7 and all(0 <= t < 512 for t in p) for p in prompts)
    assert prompts == random_prompts(512, count=3, length=7)  # seeded


def test_report_projects_speedups_from_round_cost_records():
    base = {"kind": "microbench", "metric": "round_over_plain_step", "unit": "plain steps", "method": "ubtree-mrv2-lookup",
            "target": TARGET, "drafter": "untrained", "dataset": "random-tokens", "temperature": 0.0,
            "hardware": "1x NVIDIA H200", "commit": "abc1234", "tau": 1.02}
    records = [make_record({**base, "tree_budget": 64, "concurrency": 1, "value": 1.25}),
               make_record({**base, "tree_budget": 64, "concurrency": 32, "value": 2.0}),
               make_record({**base, "target": "smollm2-135m-instruct", "tree_budget": 64, "concurrency": 1,
                            "value": 1.9})]
    text = render(records)
    assert "## Projection: speedup on a Qwen3-8B-shaped target" in text and "**A projection" in text
    section = text.split("## Projection")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ubtree-mrv2-lookup")]
    assert len(rows) == 2  # the SmolLM2 record is not projected
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    assert cells[:4] == ["ubtree-mrv2-lookup", "64", "1", "1.25"]
    assert cells[4:4 + len(PROJECTED_TAUS)] == [f"{tau / 1.25:.2f}" for tau in PROJECTED_TAUS]
    assert torch.isclose(torch.tensor(float(cells[4])), torch.tensor(3.2))


def test_cli_projection_budgets_reach_the_run_and_bad_ones_are_refused(monkeypatch):
    import argparse

    import pytest

    from ubtree_vllm.bench import microbench
    from ubtree_vllm.bench.cli import _add_microbench_args
    from ubtree_vllm.bench.settings import BenchArgumentError

    seen = {}
    monkeypatch.setattr(microbench, "_cuda_device", lambda settings, name: None)
    monkeypatch.setattr("ubtree_vllm.bench.projection.run_projection", lambda **kw: seen.update(kw) or [])
    parser = argparse.ArgumentParser()
    _add_microbench_args(parser)

    def settings(*argv):
        args = parser.parse_args(["--which", "projection", *argv])
        return microbench.MicrobenchSettings(projection_budgets=microbench.parse_list(
            "--projection-budgets", args.projection_budgets, int, "integers"))

    microbench.projection(settings())
    assert seen["budgets"] == (16, 32, 64)
    microbench.projection(settings("--projection-budgets", "64"))
    assert seen["budgets"] == (64,)
    with pytest.raises(BenchArgumentError, match="--projection-budgets"):
        microbench.projection(settings("--projection-budgets", "0,64"))
