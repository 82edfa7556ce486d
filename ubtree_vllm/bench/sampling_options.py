"""`ubtree bench e2e --sampling-options`: what each sampling option costs per round (issue 18).

Each named option is one set of `SamplingParams` keywords that every request of a measured run
carries (plain decoding and the tree alike). A tree round applies the option at every node along
that node's own path (penalties, bad words, the grammar) or at every node's depth position (allowed
ids, logit bias, min_p, min_tokens), so its cost grows with the tree; a plain step applies it to one
row. The records of this mode (kind microbench, `sampling_options` = the option's name):

  sampling_option_round_ms  TPOT x tau with the option: one round's time (a plain step's for ar),
                            with that run's tau, tok/s, TPOT and speedup over ar with the same option
  sampling_option_added_ms  round ms with the option - round ms without it ("none"), the same engine,
                            dataset, temperature and concurrency: what the option adds per round

Standard library only (the vLLM objects are built in `sampling_kwargs`), so the names are checked
before any engine starts.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

NONE = "none"
# A small schema every answer can fill (the tree's nodes are inside strings most of the time: the grammar's worst
# case for the number of allowed tokens, bench/grammar_bench.py).
JSON_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}, "confidence": {"type": "number"}},
               "required": ["answer", "confidence"]}
# name -> SamplingParams keywords ("structured_outputs" holds StructuredOutputsParams keywords)
SAMPLING_OPTIONS: dict[str, dict[str, Any]] = {
    NONE: {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.2},
    "bad_words": {"bad_words": [" sorry", " However,", " I cannot"]},
    "min_tokens": {"min_tokens": 64},  # capped at the run's max new tokens
    "min_p": {"min_p": 0.05},
    # ids below 32 exist in every vocabulary; the bias only has to make vLLM's logit-bias kernel run
    "logit_bias": {"logit_bias": {token: -2.0 for token in range(32)}},
    "json_object": {"structured_outputs": {"json_object": True}},
    "json_schema": {"structured_outputs": {"json": JSON_SCHEMA}},
}
# Options that need the engine's tokenizer (vLLM tokenizes bad words; grammars compile against the vocabulary).
NEEDS_TOKENIZER = ("bad_words", "json_object", "json_schema")
ROUND_METRIC = "sampling_option_round_ms"
ADDED_METRIC = "sampling_option_added_ms"
METRICS = (ROUND_METRIC, ADDED_METRIC)


def check_sampling_options(flag: str, names: Sequence[str]) -> tuple[str, ...]:
    """The names in run order, "none" first (every option is measured against it); ValueError naming ``flag`` and
    the allowed names on an unknown or repeated one."""
    for name in names:
        if name not in SAMPLING_OPTIONS:
            raise ValueError(f"{flag}: unknown sampling option {name!r}; allowed: {', '.join(SAMPLING_OPTIONS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"{flag} lists an option twice: {','.join(names)}")
    return (NONE, *(n for n in names if n != NONE))


def describe(name: str) -> str:
    """The option's keywords as one line (what the records' notes say was sent)."""
    options = SAMPLING_OPTIONS[name]
    return ", ".join(f"{key}={value}" for key, value in options.items()) if options else "no option"


def sampling_kwargs(name: str, max_tokens: int) -> dict[str, Any]:
    """SamplingParams keywords of option ``name`` for requests of at most ``max_tokens`` new tokens (min_tokens capped
    at it, as vLLM requires; structured output as vLLM's StructuredOutputsParams)."""
    options = dict(SAMPLING_OPTIONS[name])
    if "min_tokens" in options:
        options["min_tokens"] = min(options["min_tokens"], max_tokens)
    if "structured_outputs" in options:
        from vllm.sampling_params import StructuredOutputsParams

        options["structured_outputs"] = StructuredOutputsParams(**options["structured_outputs"])
    return options


def option_records(run_record: Mapping[str, Any], option: str, ar_tokens_per_s: float | None,
                   baseline_round_ms: float | None, carried: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The records of one measured run with ``option``: its round time, and (when the same engine measured "none" in
    this cell, ``baseline_round_ms``) what the option added. ``run_record``: the run's e2e record (bench/measurement.py:
    e2e_record); ``ar_tokens_per_s``: ar's with the same option in the same cell; ``carried``: the fields both records
    copy (method, target, budget ...)."""
    tpot, tau = run_record.get("tpot_ms"), run_record.get("tau") or 1.0
    if not tpot:
        return []
    round_ms = tpot * tau
    tokens_per_s = run_record["output_tokens_per_s"]
    speedup = tokens_per_s / ar_tokens_per_s if ar_tokens_per_s else None
    sent = describe(option)
    common = {**carried, "kind": "microbench", "sampling_options": option, "unit": "ms"}
    records = [{**common, "metric": ROUND_METRIC, "value": round(round_ms, 4), "tau": run_record.get("tau"),
                "output_tokens_per_s": tokens_per_s, "tpot_ms": tpot,
                "speedup_vs_ar": None if speedup is None else round(speedup, 4),
                "notes": (f"sampling option {option} ({sent}) on every request; round time = TPOT {tpot:.4g} ms x "
                          f"tau {tau:.4g} (a plain step for ar); speedup over ar with the same option, same "
                          f"invocation")}]
    if option != NONE and baseline_round_ms:
        records.append({**common, "metric": ADDED_METRIC, "value": round(round_ms - baseline_round_ms, 4),
                        "tau": run_record.get("tau"),
                        "notes": (f"round ms with {option} ({sent}) {round_ms:.4g} - without {baseline_round_ms:.4g}, "
                                  f"the same engine and cell, same invocation")})
    return records
