"""Exceptions shared by the ``ubtree`` subcommands.

No imports, so every command module (``ubtree_vllm.cli``, ``bench/cli.py``,
``training/cli.py``, ``decoding/generate.py``) can import it at its top without
an import cycle through ``ubtree_vllm.cli``.
"""


class CommandError(Exception):
    """An expected failure of a subcommand, reported as one line without a traceback."""
