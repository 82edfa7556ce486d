"""`ubtree bench microbench --which projection`: the speedup a trained drafter would give on a production-sized target.

SmolLM2-135M's decode step is bound by the framework, not by the GPU, so its round cost says little about an
8B target. This entry measures the round cost where it matters and leaves tau as the variable:

* target: Qwen3-8B-shaped, dummy weights (``bench/verify_bench.py:QWEN3_8B_CONFIG``, vLLM ``load_format="dummy"``);
* drafter: an untrained UBTree drafter of the matching shape (:func:`projection_drafter_config`: gamma = 16,
  the target's hidden size, heads and vocabulary, two layers, aux layers spread over the target's depth);
* engines (``bench/e2e.py:run_e2e``, one invocation): ``ar`` and the default UBTree configuration (Model Runner
  V2 with the prompt-lookup branch, ``ubtree-mrv2-lookup``) per tree budget in :data:`BUDGETS`, T = 0, on
  :data:`NUM_PROMPTS` random-token prompts of :data:`PROMPT_LEN` tokens, :data:`NEW_TOKENS` new tokens, at
  each concurrency in :data:`CONCURRENCY`;
* records: the ``round_over_plain_step`` records of that run (``bench/round_cost.py``: TPOT x tau over the ar
  TPOT of the same cell, the cost of one draft + verify round in plain steps; the untrained drafter's tau,
  about 1, only sets how many rounds are timed). The e2e records of the run are not kept: their speed is that
  of an untrained drafter.

The report's "Projection" section turns each record into ``tau / round_over_plain_step`` at tau = 4, 6, 8
(``bench/projection_table.py``), labelled as a projection. GPU only (16 GB of dummy bf16 weights plus the drafter).
"""
from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ubtree_vllm.bench.projection_table import TARGET

METHOD = "ubtree-mrv2-lookup"  # the serving default on CUDA: MRV2, prompt lookup on
BUDGETS = (16, 32, 64)
CONCURRENCY = (1, 32)
NUM_PROMPTS = 32
PROMPT_LEN = 512
NEW_TOKENS = 128
NUM_AUX_LAYERS = 5


def projection_drafter_config(target: Mapping[str, Any], block_size: int = 16) -> Any:
    """The untrained drafter's shape for a Qwen3-style ``config.json`` dict (see the module docstring)."""
    from ubtree_vllm.drafter.config import DrafterConfig

    layers = int(target["num_hidden_layers"])
    last = layers - 2  # the last layer's HF hidden state is post-norm (DrafterConfig's rule)
    aux = tuple(sorted({round(i * last / (NUM_AUX_LAYERS - 1)) for i in range(NUM_AUX_LAYERS)}))
    return DrafterConfig(target_name=TARGET, vocab_size=int(target["vocab_size"]), hidden_size=int(target["hidden_size"]),
                         target_num_layers=layers, target_layer_ids=aux, block_size=block_size,
                         num_layers=2, num_attention_heads=int(target["num_attention_heads"]),
                         num_key_value_heads=int(target["num_key_value_heads"]), head_dim=int(target["head_dim"]),
                         intermediate_size=int(target["intermediate_size"]), rms_norm_eps=float(target["rms_norm_eps"]),
                         rope_theta=float(target["rope_theta"]), selector_hidden=int(target["hidden_size"]))


def random_prompts(vocab_size: int, count: int = NUM_PROMPTS, length: int = PROMPT_LEN,
                   seed: int = 0) -> tuple[tuple[int, ...], ...]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return tuple(tuple(row) for row in torch.randint(vocab_size, (count, length), generator=gen).tolist())


def run_projection(seed: int = 0, target_overrides: Mapping[str, Any] | None = None,
                   engine_kwargs: Mapping[str, Any] | None = None, budgets: tuple[int, ...] = BUDGETS,
                   concurrency: tuple[int, ...] = CONCURRENCY, num_prompts: int = NUM_PROMPTS,
                   new_tokens: int = NEW_TOKENS) -> Iterator[dict[str, Any]]:
    """The round-cost records of the projection run (see the module docstring), each yielded as soon as its cell is
    measured (a run cut off by a time limit keeps the cells done: on the H200 each 8B engine takes ~2.5 minutes to start
    and measure); nothing is appended here."""
    import torch

    from ubtree_vllm.bench.e2e import iter_e2e
    from ubtree_vllm.bench.prompts import PromptSet
    from ubtree_vllm.bench.round_cost import METRIC
    from ubtree_vllm.bench.settings import E2ESettings, validate
    from ubtree_vllm.bench.verify_bench import write_target_config
    from ubtree_vllm.drafter.io import save_drafter
    from ubtree_vllm.drafter.proposer import UBTreeDrafter

    with tempfile.TemporaryDirectory(prefix="ubtree-projection-") as folder:
        target_dir = write_target_config(Path(folder) / "target", target_overrides)
        target = json.loads((target_dir / "config.json").read_text())
        torch.manual_seed(seed)
        drafter_dir = save_drafter(UBTreeDrafter(projection_drafter_config(target)).eval(), Path(folder) / "drafter")
        settings = validate(E2ESettings(target=str(target_dir), drafter=str(drafter_dir), datasets=("random-tokens",),
                                        temperatures=(0.0,), num_prompts=num_prompts, max_new_tokens=new_tokens,
                                        methods=("ar", METHOD), tree_budgets=budgets, concurrency=concurrency,
                                        seed=seed, fixed_budget=True), check_datasets=False)
        prompts = PromptSet("random-tokens", random_prompts(int(target["vocab_size"]), num_prompts, seed=seed))
        # 0.3 of an H200 (42 GB) holds the 16 GB of weights, the graphs and the KV of 32 x 640 tokens; more would not
        # fit the later engines: each engine of the run left ~15-17 GB of the device in use after its stop (H200,
        # 2026-12-03), and vLLM refuses to start when the free memory is below its share
        kwargs = {"load_format": "dummy", "max_model_len": 4096, "gpu_memory_utilization": 0.3,
                  **(engine_kwargs or {})}
        note = (f"projection input: {TARGET} (dummy weights) with an untrained drafter of its shape, {num_prompts} "
                f"random-token prompts of {PROMPT_LEN} tokens, {new_tokens} new tokens")
        for r in iter_e2e(settings, [prompts], target_dir, kwargs):
            if r["kind"] == "microbench" and r["metric"] == METRIC:
                yield {**r, "drafter": "untrained", "notes": f"{note}; {r['notes']}"}
