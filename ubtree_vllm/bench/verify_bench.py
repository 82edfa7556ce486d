"""`ubtree bench microbench --which verify-forward`: a 65-token tree verification forward vs a 17-token chain.

What it measures: the dense cost of one target forward over N new query tokens on top of
a cached context of C = 1024 tokens, through vLLM's own stack (engine step, scheduler,
model runner with CUDA graphs, FlashAttention causal over the new tokens, LM head, one
sampled token), on a Qwen3-8B-shaped target with dummy weights:

  verify_forward_chain17_ms   N = 17: the root + a 16-token chain (a chain drafter's step)
  verify_forward_tree65_ms    N = 65: the root + a 64-node tree (UBTree's B = 64 step)
  tree_verify_over_chain16    their ratio

How: write a Qwen3-8B `config.json` (no tokenizer, `skip_tokenizer_init=True`) into a
temporary folder, build `vllm.LLM(load_format="dummy", enable_prefix_caching=True,
max_model_len=4096, gpu_memory_utilization=0.85)` with CUDA graphs on (the default), warm
the prefix cache with a C-token prompt (max_tokens=1), then time `LLM.generate` of that
prompt + N fresh tokens with max_tokens=1: the C context tokens hit the prefix cache, so
only the N new tokens are computed (checked through `RequestOutput.num_cached_tokens`).
Each iteration appends different new tokens (a distinct first new token, so no iteration
hits an earlier one's cached block); chain and tree iterations alternate; the figure is
the median wall time (`time.perf_counter`) of the timed iterations. Nothing is subtracted:
the per-step engine overhead (scheduling, engine-core IPC, sampling one token) is in both.

Why this and not one speculative step inside the engine: isolating a single verification
step would need the model runner's internals (building a tree batch by hand); a prompt
extension with a warm prefix cache runs exactly one target forward over N new tokens with
vLLM's real kernels. The tree mask's own extra cost (our Triton kernel on top of
FlashAttention's causal pass) is not in this figure; `tree-attention-vs-flash` measures it.
vLLM pads each step to its next CUDA-graph capture size, as it does in serving.

Needs a GPU: the dummy 8B weights take about 16 GB (bf16).
"""
from __future__ import annotations

import json
import statistics
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CHAIN_TOKENS = 17  # root + 16 chain nodes
TREE_TOKENS = 65  # root + 64 tree nodes
CONTEXT_LEN = 1024

# Qwen/Qwen3-8B config.json fields that shape the forward (no tokenizer files are written).
QWEN3_8B_CONFIG: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}


def write_target_config(folder: str | Path, overrides: Mapping[str, Any] | None = None) -> Path:
    """Write QWEN3_8B_CONFIG (with `overrides`, e.g. fewer layers for tests) as `folder/config.json`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    unknown = sorted(set(overrides or {}) - set(QWEN3_8B_CONFIG))
    if unknown:
        raise ValueError(f"unknown Qwen3 config field(s) {unknown}")
    (folder / "config.json").write_text(json.dumps({**QWEN3_8B_CONFIG, **(overrides or {})}, indent=2) + "\n")
    return folder


def verify_prompts(context_len: int, new_tokens: Sequence[int], count: int, vocab_size: int,
                   seed: int = 0) -> tuple[list[int], dict[int, list[list[int]]]]:
    """(the C-token prefix, {N: `count` prompts of prefix + N new tokens}).

    The first new token of every prompt is distinct across all prompts (so no prompt's new
    block can hit another's cached block); the other tokens are random.
    """
    import torch

    if context_len < 1 or count < 1 or any(n < 1 for n in new_tokens):
        raise ValueError(f"need context_len, count and every N >= 1, got {context_len}, {count}, {list(new_tokens)}")
    if count * len(new_tokens) > vocab_size:
        raise ValueError(f"{count * len(new_tokens)} prompts need distinct first tokens but the vocabulary "
                         f"has {vocab_size}")
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(vocab_size, (context_len,), generator=gen).tolist()
    prompts: dict[int, list[list[int]]] = {}
    first = 0
    for n in new_tokens:
        extra = torch.randint(vocab_size, (count, n), generator=gen)
        extra[:, 0] = torch.arange(first, first + count)
        first += count
        prompts[n] = [prefix + row for row in extra.tolist()]
    return prefix, prompts


def time_verify_forward(model_dir: str | Path, *, context_len: int = CONTEXT_LEN,
                        new_tokens: Sequence[int] = (CHAIN_TOKENS, TREE_TOKENS), iters: int = 20,
                        warmup: int = 3, seed: int = 0, **engine_kwargs: Any) -> tuple[dict[int, float], int | None]:
    """({N: median ms of one generate call}, fewest prefix-cache hits of a timed request or None)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ubtree_vllm.bench.engines import release_memory, stop_engine

    kwargs = {"load_format": "dummy", "skip_tokenizer_init": True, "enable_prefix_caching": True,
              "max_model_len": 4096, "gpu_memory_utilization": 0.85, "seed": seed, **engine_kwargs}
    vocab_size = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    prefix, prompts = verify_prompts(context_len, new_tokens, warmup + iters, vocab_size, seed)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    release_memory()  # earlier entries' cached CUDA blocks count against gpu_memory_utilization
    llm = LLM(model=str(model_dir), **kwargs)
    block = llm.llm_engine.vllm_config.cache_config.block_size  # prefix-cache hits are whole blocks
    try:
        llm.generate([TokensPrompt(prompt_token_ids=prefix)], params, use_tqdm=False)  # warms the prefix cache
        times: dict[int, list[float]] = {n: [] for n in new_tokens}
        hits: list[int | None] = []
        for i in range(warmup + iters):
            for n in new_tokens:
                start = time.perf_counter()
                (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompts[n][i])], params, use_tqdm=False)
                elapsed_ms = 1000.0 * (time.perf_counter() - start)
                if i >= warmup:
                    times[n].append(elapsed_ms)
                    hits.append(out.num_cached_tokens)
    finally:
        stop_engine(llm)
        del llm
        release_memory()
    known = [h for h in hits if h is not None]
    min_hits = min(known) if known else None
    if min_hits is not None and min_hits < context_len // block * block:
        raise RuntimeError(f"verify-forward: a timed request hit only {min_hits} of its {context_len} context "
                           f"tokens in the prefix cache, so it recomputed context; the measurement is invalid")
    return {n: statistics.median(values) for n, values in times.items()}, min_hits


def verify_records(medians: Mapping[int, float], *, context_len: int, iters: int, warmup: int, hardware: str,
                   min_cache_hits: int | None, target: str = "qwen3-8b-dummy",
                   cuda_graphs: bool = True) -> list[dict[str, Any]]:
    """The three verify-forward records from {N: median ms} (N = CHAIN_TOKENS and TREE_TOKENS)."""
    chain, tree = medians[CHAIN_TOKENS], medians[TREE_TOKENS]
    hits = "unknown" if min_cache_hits is None else f"at least {min_cache_hits}"
    notes = (f"vLLM LLM.generate of a cached {context_len}-token prompt + N new tokens, max_tokens=1, dummy "
             f"weights, prefix caching (cache hits per timed request: {hits} tokens), CUDA graphs "
             f"{'on' if cuda_graphs else 'off'}; median wall time of {iters} calls per N after {warmup} warm-up, "
             f"chain/tree alternating; N = {CHAIN_TOKENS} (root + 16-token chain) vs N = {TREE_TOKENS} (root + "
             f"64-node tree); dense causal forward through vLLM (FlashAttention), the tree mask's extra cost is "
             f"the tree-attention-vs-flash microbenchmark; nothing subtracted (engine step overhead in both)")
    values = [("verify_forward_chain17_ms", chain, "ms"), ("verify_forward_tree65_ms", tree, "ms"),
              ("tree_verify_over_chain16", tree / chain, "x")]
    return [{
        "kind": "microbench", "method": "ubtree", "target": f"{target} (context {context_len})",
        "metric": metric, "value": round(value, 5), "unit": unit, "batch_size": 1, "tree_budget": TREE_TOKENS - 1,
        "block_size": CHAIN_TOKENS - 1, "cuda_graphs": cuda_graphs, "hardware": hardware, "notes": notes,
    } for metric, value, unit in values]
