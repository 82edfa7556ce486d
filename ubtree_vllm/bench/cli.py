"""Argument definitions and entry point of `ubtree bench e2e` and `ubtree bench microbench`.

The top level imports only argparse and `ubtree_vllm.errors` (`ubtree_vllm.cli` builds every
subparser on each invocation); `run_bench` imports vLLM / torch and the bench modules when called.
Flag values are checked by `bench/settings.py` (e2e) and `bench/microbench.py`; a bad
value becomes a one-line `ubtree bench: error: --flag ...` message.
"""
from __future__ import annotations

import argparse

from ubtree_vllm.errors import CommandError
from ubtree_vllm.vllm.config import TREE_ATTENTION_MODES

DEFAULT_RECORDS = "docs/benchmarks/records.jsonl"
# Names of bench/microbench.py:MICROBENCHES (kept here so building the parser imports no torch;
# tests/unit/test_bench.py checks that both lists agree).
MICROBENCH_NAMES = ("draft-postprocess", "tree-attention-vs-flash", "tree-attention-numerics", "fa3-virtual-rows",
                    "verify-forward", "draft-stage", "projection", "grammar-rows", "tree-linear-state")


def _add_e2e_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default="default",
                        help="target HF folder ('default': the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None,
                        help="UBTree drafter folder (required unless --methods is only ar and ngram)")
    parser.add_argument("--compare-drafters", default=None, metavar="DIR,...",
                        help="comma-separated drafter folders: every method that drafts runs again with each, in "
                             "this invocation (one ar / ngram baseline for all: two drafters compared on one machine)")
    parser.add_argument("--datasets", default="spec_bench,mt_bench,humaneval",
                        help="comma-separated: spec_bench, mt_bench, humaneval, or one Spec-Bench task as "
                             "spec_bench:TASK (translation, summarization, qa, math_reasoning, rag)")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated sampling temperatures")
    parser.add_argument("--num-prompts", type=int, default=80, help="prompts per dataset")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--methods", default="ar,dflash-chain,ubtree",
                        help="comma-separated: ar (no speculation), ngram (vLLM's n-gram prompt lookup, no "
                             "drafter; see --ngram-*), dflash-chain (vLLM 'dflash' with the drafter's proposer), "
                             "ubtree (one engine per --tree-budgets value, V1 model runner), "
                             "ubtree-mrv2 (the same on Model Runner V2, the default CUDA runner; CUDA, B >= gamma), "
                             "ubtree-lookup (ubtree with the prompt-lookup branch, V1 runner), "
                             "ubtree-mrv2-lookup (the same branch on Model Runner V2; CUDA), "
                             "ubtree-mrv2-lookup-uncoupled (the same without coupled drafting at T > 0)")
    parser.add_argument("--tree-budgets", default="16,32,64", help="comma-separated tree budgets B for ubtree")
    parser.add_argument("--budget-schedule", default=None, metavar="FIRST-LAST:BUDGET,...",
                        help="load-adaptive tree budget for the tree methods (vLLM's num_speculative_tokens_per_batch"
                             "_size), e.g. 1-4:64,5-32:16: with 5-32 requests in flight each tree verifies 16 nodes")
    parser.add_argument("--fixed-budget", action="store_true",
                        help="budget_policy fixed: every tree verifies B nodes at every load (default: the serving "
                             "default, load-adaptive on Model Runner V2)")
    parser.add_argument("--tree-attention", default="auto",
                        help=f"comma-separated speculative_config.tree_attention modes (auto, "
                             f"{', '.join(TREE_ATTENTION_MODES)}; CUDA), each tree method runs once per mode; records "
                             "name the mode the engine serves: auto (the serving default) lets the engine choose "
                             "(flash_exact where it can serve it, else triton); triton walks each tree row's context; "
                             "flash_merge has FlashAttention attend the context and adds the path; "
                             "triton_stock_roots and flash_exact (Model Runner V2) have FlashAttention compute the "
                             "roots alone, flash_exact every tree row too, as plain decoding would; flashinfer "
                             "(Model Runner V2) computes every row of a step of up to 8 requests by one FlashInfer "
                             "call with the tree's mask")
    parser.add_argument("--coupled-edge-weight", default=None, metavar="W",
                        help="speculative_config.coupled_edge_weight of the coupled tree methods (ubtree-mrv2, "
                             "ubtree-mrv2-lookup) at T > 0 (default: the serving default)")
    parser.add_argument("--beam-width", type=int, default=12, help="W (capped at B)")
    parser.add_argument("--top-k", type=int, default=64, help="K")
    parser.add_argument("--ngram-k", type=int, default=8,
                        help="ngram: tokens proposed per round (vLLM num_speculative_tokens)")
    parser.add_argument("--ngram-lookup-max", type=int, default=4,
                        help="ngram: longest n-gram matched (vLLM prompt_lookup_max)")
    parser.add_argument("--ngram-lookup-min", type=int, default=2,
                        help="ngram: shortest n-gram matched (vLLM prompt_lookup_min, <= --ngram-lookup-max)")
    parser.add_argument("--mtp-k", type=int, default=4,
                        help="mtp: tokens per round of the target's MTP chain (vLLM num_speculative_tokens)")
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="dummy: every engine draws random weights (vLLM's dummy loader; e.g. for mtp on a "
                             "random hybrid whose saved weights lack MTP layers); the records' target says so")
    parser.add_argument("--concurrency", default="1",
                        help="comma-separated numbers of requests in flight (1 = batch size 1)")
    parser.add_argument("--records", default=DEFAULT_RECORDS, help=f"records file (default: {DEFAULT_RECORDS})")
    parser.add_argument("--no-record", action="store_true", help="measure and print only")
    parser.add_argument("--no-report", action="store_true", help="do not regenerate the report after appending")
    parser.add_argument("--data-dir", default="../shared/data", help="folder with the benchmark prompt files")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85,
                        help="share of device memory for vLLM (CPU backend: of host memory)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="fixed KV-cache size (overrides --gpu-memory-utilization)")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the target's")
    parser.add_argument("--dtype", default="auto", help="vLLM dtype")
    parser.add_argument("--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs")
    parser.add_argument("--seed", type=int, default=0, help="engine seed")
    parser.add_argument("--stage-timing", action="store_true",
                        help="time the UBTree runner's stages per engine step (device syncs at stage boundaries); "
                             "appends step-time microbench records instead of e2e records")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="vLLM tensor_parallel_size of every engine (the records' tp); UBTree on the V1 runner")
    parser.add_argument("--distributed-executor-backend", default=None, choices=("mp", "ray"),
                        help="vLLM's executor for tensor parallelism (default: vLLM's choice)")
    parser.add_argument("--agreement", action="store_true",
                        help="greedy outputs of every method compared with ar's on the same prompts (needs ar and "
                             "--temperatures 0): appends greedy_divergence_rate microbench records instead of e2e "
                             "records (bench/agreement.py)")
    parser.add_argument("--interleave", type=int, default=1, metavar="K",
                        help="start every engine at once and measure each cell's prompts in K chunks that the "
                             "engines run in turn, so a drift of the machine's speed falls on every method alike "
                             "(bench/interleave.py; the engines' memory shares add up); 1: one engine after the other")
    parser.add_argument("--sampling-options", default=None, metavar="NAME,...",
                        help="comma-separated sampling options (bench/sampling_options.py: logprobs, penalties, "
                             "bad_words, min_tokens, min_p, logit_bias, json_object, json_schema): every cell runs "
                             "without an option and once with each, on every request, and appends what each costs "
                             "per round (sampling_option_round_ms / sampling_option_added_ms microbench records) "
                             "instead of e2e records")
    parser.add_argument("--engine-core", default=None, choices=("process", "in-process"),
                        help="where vLLM's engine core runs: in a process of its own (vLLM's default, as `vllm serve` "
                             "runs it: the engine's output processing overlaps the next step) or in the engine's "
                             "process (VLLM_ENABLE_V1_MULTIPROCESSING=0, needed by --profile and --stage-timing); "
                             "default: as VLLM_ENABLE_V1_MULTIPROCESSING says; the records' notes name it")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="run every measurement under torch.profiler and write per-step host/device tables "
                             "(and each engine's first Chrome trace per sampling option) to DIR instead of records; "
                             "with --sampling-options, each option's runs too (bench/profile.py; "
                             "needs the engine in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0)")


def _add_microbench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", default=None, help="UBTree drafter folder (required for draft-postprocess)")
    parser.add_argument("--which", default=MICROBENCH_NAMES[0],
                        help=f"comma-separated microbenchmarks: {', '.join(MICROBENCH_NAMES)}, or 'all' "
                             f"(default: {MICROBENCH_NAMES[0]}; the others need a CUDA device)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cuda, cpu")
    parser.add_argument("--context-lens", default="512,2048,8192",
                        help="comma-separated context lengths of tree-attention-vs-flash and tree-attention-numerics "
                             "(multiples of 16 for the latter)")
    parser.add_argument("--iters", type=int, default=50, help="timed rounds (after --warmup)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    parser.add_argument("--tree-budget", type=int, default=64, help="B (draft-postprocess, grammar-rows, tree-linear-state)")
    parser.add_argument("--beam-width", type=int, default=12, help="W (capped at B; draft-postprocess)")
    parser.add_argument("--top-k", type=int, default=64, help="K (draft-postprocess)")
    parser.add_argument("--num-reqs", type=int, default=1, help="requests drafted per round (draft-postprocess)")
    parser.add_argument("--projection-budgets", default="16,32,64",
                        help="comma-separated tree budgets of projection (one UBTree engine each, beside ar)")
    parser.add_argument("--records", default=DEFAULT_RECORDS, help=f"records file (default: {DEFAULT_RECORDS})")
    parser.add_argument("--no-record", action="store_true", help="measure and print only")
    parser.add_argument("--no-report", action="store_true", help="do not regenerate the report after appending")


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    _add_e2e_args(sub.add_parser(
        "e2e", help="vLLM end-to-end: tokens/s, TPOT, tau and speedup vs AR per method; appends e2e records",
        description="One vLLM engine per method (ubtree: per tree budget), every dataset x temperature x "
                    "concurrency; appends one e2e record per measurement and regenerates the report."))
    _add_microbench_args(sub.add_parser(
        "microbench", help="time UBTree's draft post-processing, tree attention vs FlashAttention, and the "
                           "tree vs chain verification forward; appends microbench records"))
    from ubtree_vllm.bench import random_hybrid  # argparse only; the module imports torch lazily

    random_hybrid.add_args(sub.add_parser(
        "random-hybrid", help="write a random-weight hybrid target (Qwen3-Next or NemotronH shapes) with the default "
                              "target's tokenizer and an untrained drafter, for bench e2e of the cost of forking"))


def run_bench(args: argparse.Namespace) -> int:
    from ubtree_vllm.bench.settings import BenchArgumentError

    try:
        if args.bench_command == "e2e":
            from ubtree_vllm.bench.e2e import run_cli
        elif args.bench_command == "random-hybrid":
            from ubtree_vllm.bench.random_hybrid import run_cli
        else:
            from ubtree_vllm.bench.microbench import run_cli
        return run_cli(args)
    except BenchArgumentError as exc:
        raise CommandError(str(exc)) from exc
