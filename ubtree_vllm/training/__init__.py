"""Tree-native drafter training: data (data.py), objective (losses.py), trainer (train.py),
export (export.py) and acceptance-length evaluation (evaluate.py). See docs/training.md.

Importing this package imports nothing heavy; `training/cli.py` is argparse-only.
"""
