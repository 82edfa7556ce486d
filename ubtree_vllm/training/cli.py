"""Argument definitions and entry points of `ubtree gen-data`, `ubtree train` and `ubtree eval-tau`.

Exit status: 0 done, 1 error (one line on stderr), 3 stopped at the time budget
(`--max-minutes`): run the same command again to resume. A shell `&&` chain therefore stops
at an unfinished step.

The top level imports only argparse: `ubtree_vllm.cli` builds every subparser on each
invocation. The `run_*` functions import torch and the training modules when called.
Settings come from a run YAML (`--config`, sections `data:` / `train:`), then from the
dedicated flags, then from `--set KEY=VALUE` overrides (see training/run_config.py).
"""
from __future__ import annotations

import argparse

from ubtree_vllm.errors import CommandError

EXIT_PAUSED = 3


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="YAML", default=None, help="run file with data:/train: sections")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
                        help="override one setting (value parsed as YAML; repeatable; drafter.X reaches drafter)")
    parser.add_argument("--target", default=None,
                        help="target HF folder ('default': the embedded SmolLM2-135M-Instruct)")


def add_gen_data_args(parser: argparse.ArgumentParser) -> None:
    _add_config_args(parser)
    parser.add_argument("--out", dest="out_dir", default=None, help="dataset folder to write (resumable)")
    parser.add_argument("--backend", choices=("hf", "vllm"), default=None)
    parser.add_argument("--num-prompts", type=int, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None, help="T_train (1.0 recipe, 0.0 ablation)")
    parser.add_argument("--data-root", default=None, help="folder with the training prompt files")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop after the shard crossing this budget")


def add_train_args(parser: argparse.ArgumentParser) -> None:
    _add_config_args(parser)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--output-dir", default=None)
    parser.add_argument("--max-minutes", type=float, default=None, help="pause (checkpoint) after this budget")


def add_eval_tau_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, help="exported drafter folder")
    parser.add_argument("--target", default="default")
    parser.add_argument("--datasets", default="spec_bench,mt_bench,humaneval",
                        help="comma-separated: spec_bench, mt_bench, humaneval, spec_bench:TASK (one Spec-Bench task)")
    parser.add_argument("--methods", default="single,ubtree", help="comma-separated: single, ubtree")
    parser.add_argument("--temperatures", default="0,1", help="comma-separated")
    parser.add_argument("--num-prompts", type=int, default=None, help="per dataset (default: all)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--tree-budget", type=int, default=64, help="B")
    parser.add_argument("--beam-width", type=int, default=12, help="W")
    parser.add_argument("--top-k", type=int, default=64, help="K")
    parser.add_argument("--data-dir", default="../shared/data")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--records", default="docs/benchmarks/records.jsonl")
    parser.add_argument("--no-record", action="store_true", help="do not append records")
    parser.add_argument("--ceiling", action="store_true",
                        help="instead of decoding: the expected tau of the drafter's B-node tree and of the best B-node "
                             "tree (the target's own probabilities) at contexts of the target's rollouts "
                             "(training/ceiling.py); --methods is ignored")
    parser.add_argument("--every", type=int, default=32,
                        help="--ceiling: an anchor every N response tokens of each rollout")
    parser.add_argument("--coupled-samples", type=int, default=8,
                        help="--ceiling at T > 0: noise draws per context for the coupled tree's tau (0: not scored)")
    parser.add_argument("--coupled-edge-weights", default=None, metavar="W[,W...]",
                        help="--ceiling at T > 0: score the coupled tree at each coupled edge weight w, all under the "
                             "same noise draws (default: the serving default, config.DEFAULT_COUPLED_EDGE_WEIGHT)")


def _settings(args: argparse.Namespace, section: str, flags: dict[str, object]) -> dict[str, object]:
    from ubtree_vllm.training.run_config import apply_overrides, read_section

    values = read_section(args.config, section)
    values.update({k: v for k, v in flags.items() if v is not None})
    return apply_overrides(values, args.overrides)


def _command_error(exc: Exception):
    return CommandError(str(exc))


def run_gen_data(args: argparse.Namespace) -> int:
    from ubtree_vllm.training.data import DataGenConfig, generate_dataset

    try:
        cfg = DataGenConfig.from_dict(_settings(args, "data", {
            "target": args.target, "out_dir": args.out_dir, "backend": args.backend, "num_prompts": args.num_prompts,
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "data_root": args.data_root,
            "max_minutes": args.max_minutes}))
        manifest = generate_dataset(cfg)
    except (ValueError, FileNotFoundError) as exc:
        raise _command_error(exc) from exc
    state = "complete" if manifest["complete"] else "incomplete (run again to resume)"
    print(f"{cfg.out_dir}: {manifest['num_samples']} samples, {manifest['num_response_tokens']} response tokens, "
          f"{state}")
    return 0 if manifest["complete"] else EXIT_PAUSED


def run_train(args: argparse.Namespace) -> int:
    from ubtree_vllm.training.run_config import read_section
    from ubtree_vllm.training.train import TrainConfig, train

    try:
        values = _settings(args, "train", {"target": args.target, "data_dir": args.data_dir,
                                           "output_dir": args.output_dir, "max_minutes": args.max_minutes})
        data = read_section(args.config, "data")
        # One run file: the train section defaults to the data section's target and output.
        for key, data_key in (("data_dir", "out_dir"), ("target", "target"), ("target_name", "target_name")):
            if key not in values and data_key in data:
                values[key] = data[data_key]
        result = train(TrainConfig.from_dict(values))
    except (ValueError, FileNotFoundError) as exc:
        raise _command_error(exc) from exc
    print(f"train: {result.status} at step {result.step}"
          + (f"; drafter: {result.drafter_dir}" if result.drafter_dir else "; run again to resume"))
    return 0 if result.status == "finished" else EXIT_PAUSED


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def run_eval_tau(args: argparse.Namespace) -> int:
    from ubtree_vllm.training.evaluate import evaluate

    if args.ceiling:
        return _run_ceiling(args)
    try:
        results = evaluate(
            args.drafter, target=args.target, datasets=_split(args.datasets), methods=_split(args.methods),
            temperatures=[float(t) for t in _split(args.temperatures)], num_prompts=args.num_prompts,
            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, tree_budget=args.tree_budget,
            beam_width=args.beam_width, top_k=args.top_k, data_dir=args.data_dir, device=args.device,
            seed=args.seed, records_path=None if args.no_record else args.records)
    except (ValueError, FileNotFoundError) as exc:
        raise _command_error(exc) from exc
    print("dataset       T    method   tau")
    for r in results:
        print(f"{r.dataset:<12} {r.temperature:<4g} {r.method:<8} {r.tau:.3f}")
    return 0


def _run_ceiling(args: argparse.Namespace) -> int:
    from ubtree_vllm.bench.settings import parse_list
    from ubtree_vllm.config import UBTreeConfig, check_coupled_edge_weight
    from ubtree_vllm.drafter.config import DrafterConfig
    from ubtree_vllm.training.ceiling import evaluate_ceiling

    try:
        gamma = DrafterConfig.load(args.drafter).block_size
        tree = UBTreeConfig(tree_budget=args.tree_budget, beam_width=min(args.beam_width, args.tree_budget),
                            top_k=args.top_k, block_size=gamma)
        weights = None if args.coupled_edge_weights is None else \
            [check_coupled_edge_weight("--coupled-edge-weights", w)
             for w in parse_list("--coupled-edge-weights", args.coupled_edge_weights, float, "numbers")]
        results = evaluate_ceiling(args.drafter, args.target, _split(args.datasets),
                                   [float(t) for t in _split(args.temperatures)], args.num_prompts, tree, args.every,
                                   args.max_new_tokens, args.data_dir, args.device, args.seed,
                                   None if args.no_record else args.records, coupled_samples=args.coupled_samples,
                                   coupled_weights=weights)
    except (ValueError, FileNotFoundError) as exc:
        raise _command_error(exc) from exc
    print("dataset       T    contexts  drafter tree  best tree  coupled tree")
    for r in results:
        coupled = "-" if r.coupled_tau is None else ", ".join(f"{tau:.3f} (w={w:g})" for w, tau in r.coupled_tau.items())
        print(f"{r.dataset:<12} {r.temperature:<4g} {r.num_contexts:<9d} {r.drafter_tau:<13.3f} {r.best_tau:<10.3f} "
              f"{coupled}")
    return 0
