"""`ubtree bench microbench --which tree-linear-state`: the two state forms of a hybrid layer's tree step.

One verification step of a Gated DeltaNet layer over a draft tree, for 1 and 32 requests, at
Qwen3-Next-80B's shape (32 value heads, key and value head size 128, bf16 inputs, float32
states), a root and a B-node tree (B = --tree-budget, depth <= 16, beam-like:
``tree_attention_inputs.random_parents`` with window 12), then the commit of a deepest node:

  tree_delta_rule_node_states_ms     ``triton_ops.tree_delta_rule``: nodes in order, every node's
                                     state written ([N, 1 + B, H, Dk, Dv] float32) and re-read by its
                                     children; then ``commit_tree_state`` copies the accepted one
  tree_delta_rule_paths_ms           ``triton_ops.tree_delta_rule_paths``: every node recomputes its
                                     root path from the committed state, no state written; then
                                     ``commit_tree_state_by_path`` recomputes the accepted path once
  ..._peak_mib                       the step's peak of allocated device memory above what was
                                     allocated before it (torch.cuda.max_memory_allocated): the
                                     transient per-node states, or only the outputs

Each form is timed on the device alone (bench/timing.py ``time_launches``: CUDA graph replays,
median). Per layer; a target pays it once per linear-attention layer and step.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

import torch

MAX_DEPTH = 16  # the drafter's block size: no tree is deeper
WINDOW = 12  # the default beam width
NUM_REQS = (1, 32)


@dataclass(frozen=True)
class LinearStateShape:
    name: str
    num_heads: int  # value heads (queries and keys repeated to them, as the layer does before the kernel)
    key_dim: int
    value_dim: int


QWEN3_NEXT_GDN = LinearStateShape("Qwen3-Next-80B GDN layer", 32, 128, 128)


def tree_inputs(shape: LinearStateShape, num_reqs: int, budget: int, device: torch.device,
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta, parents, initial_state) of ``num_reqs`` random (1 + budget)-node trees."""
    from ubtree_vllm.triton_ops.tree_attention_inputs import random_parents

    gen = torch.Generator().manual_seed(seed)
    nodes, heads = budget + 1, shape.num_heads
    parents = torch.tensor([random_parents(budget, MAX_DEPTH, WINDOW, gen) for _ in range(num_reqs)])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def normal(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen)

    q = torch.nn.functional.normalize(normal(num_reqs, nodes, heads, shape.key_dim), dim=-1)
    k = torch.nn.functional.normalize(normal(num_reqs, nodes, heads, shape.key_dim), dim=-1)
    v = normal(num_reqs, nodes, heads, shape.value_dim)
    g = -torch.rand(num_reqs, nodes, heads, generator=gen) * 0.5
    beta = torch.rand(num_reqs, nodes, heads, generator=gen)
    h0 = normal(num_reqs, heads, shape.key_dim, shape.value_dim) * 0.1
    return (*(t.to(device, dtype) for t in (q, k, v, g, beta)), parents.to(device), h0.to(device))


def deepest_nodes(parents: torch.Tensor) -> torch.Tensor:
    """[N] each tree's last deepest node (a long accepted path: the commit's worst case)."""
    deepest = []
    for row in parents.tolist():
        depth = [0] * len(row)
        for t in range(1, len(row)):
            depth[t] = depth[row[t]] + 1
        deepest.append(max(range(len(row)), key=lambda t: (depth[t], t)))
    return torch.tensor(deepest, device=parents.device)


def step_functions(inputs: tuple[torch.Tensor, ...], scale: float, cache: torch.Tensor) -> dict[str, Any]:
    """{form: zero-argument step (the tree forward, then the commit of each tree's deepest node into slot n of
    ``cache`` [>= N, H, Dk, Dv])}."""
    from ubtree_vllm.triton_ops.tree_delta_rule import commit_tree_state, tree_gated_delta_rule
    from ubtree_vllm.triton_ops.tree_delta_rule_paths import commit_tree_state_by_path, tree_gated_delta_rule_paths

    q, k, v, g, beta, parents, h0 = inputs
    accepted = deepest_nodes(parents)
    slots = torch.arange(q.shape[0], device=q.device)

    def node_states() -> torch.Tensor:
        o, states = tree_gated_delta_rule(q, k, v, g, beta, parents, h0, scale)
        commit_tree_state(states, accepted, cache, slots)
        return o

    def paths() -> torch.Tensor:
        o = tree_gated_delta_rule_paths(q, k, v, g, beta, parents, h0, scale, MAX_DEPTH)
        commit_tree_state_by_path(q, k, v, g, beta, parents, h0, MAX_DEPTH, accepted, slots, cache)
        return o

    return {"node_states": node_states, "paths": paths}


def peak_mib(fn: Any, device: torch.device) -> float:
    """Peak allocated device memory of one call above what was allocated before it, MiB."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2 ** 20


def tree_linear_state(settings: Any, device: torch.device) -> list[dict[str, Any]]:
    """The records of both forms (module docstring) on the CUDA ``device``."""
    from ubtree_vllm.bench.records import hardware
    from ubtree_vllm.bench.timing import GRAPH_CLOCK, time_launches

    shape, budget = QWEN3_NEXT_GDN, settings.tree_budget
    records = []
    for num_reqs in NUM_REQS:
        inputs = tree_inputs(shape, num_reqs, budget, device, settings.seed)
        cache = torch.zeros_like(inputs[-1])
        for form, step in step_functions(inputs, shape.key_dim ** -0.5, cache).items():
            memory = peak_mib(step, device)
            times, clock = time_launches(step, device, settings.iters, settings.warmup)
            notes = (f"{shape.name}: {shape.num_heads} heads, Dk {shape.key_dim}, Dv {shape.value_dim}, bf16 inputs, "
                     f"float32 states; {num_reqs} request(s) of a root + {budget}-node random tree (depth <= "
                     f"{MAX_DEPTH}, window {WINDOW}); form {form}: the tree step and the commit of a deepest node; "
                     f"one layer; median of {settings.iters} samples after {settings.warmup} warm-up ({clock})")
            for metric, value, unit in ((f"tree_delta_rule_{form}_ms", statistics.median(times), "ms"),
                                        (f"tree_delta_rule_{form}_peak_mib", memory, "MiB")):
                records.append({"kind": "microbench", "method": "ubtree", "target": shape.name, "metric": metric,
                                "value": round(value, 5), "unit": unit, "batch_size": num_reqs,
                                "tree_budget": budget, "block_size": MAX_DEPTH,
                                "cuda_graphs": GRAPH_CLOCK in clock, "hardware": hardware("cuda"), "notes": notes})
    return records
