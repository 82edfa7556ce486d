"""Benchmark records (records.jsonl) and the generated benchmark report."""
