"""`ubtree bench e2e` flags as the CLI parses them, for the unit tests of the bench's flag checks."""
from __future__ import annotations

import argparse

from ubtree_vllm.bench import cli as bench_cli


def e2e_args(**overrides) -> argparse.Namespace:
    """The parsed defaults of `ubtree bench e2e`, with ``overrides`` set on them."""
    parser = argparse.ArgumentParser()
    bench_cli._add_e2e_args(parser)
    args = parser.parse_args([])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args
