"""`ubtree bench e2e --sampling-options` (issue 18's cost per option): flag checks, the run order of a cell, the
cost records and the report section, without an engine (tests/vllm/test_vllm_bench.py runs one)."""
from __future__ import annotations

import pytest
from bench_args import e2e_args

from ubtree_vllm.bench import records as rec
from ubtree_vllm.bench.engines import cells
from ubtree_vllm.bench.prompts import PromptSet
from ubtree_vllm.bench.recorder import OptionLedger
from ubtree_vllm.bench.report import render
from ubtree_vllm.bench.sampling_options import (ADDED_METRIC, NEEDS_TOKENIZER, ROUND_METRIC, SAMPLING_OPTIONS,
                                                check_sampling_options, describe, option_records)
from ubtree_vllm.bench.settings import BenchArgumentError, E2ESettings, settings_from_args


def test_options_are_checked_and_run_after_none():
    settings = settings_from_args(e2e_args(methods="ar,ngram", sampling_options="penalties,logprobs"))
    assert settings.sampling_options == ("none", "penalties", "logprobs")  # the baseline first, added
    assert settings_from_args(e2e_args(methods="ar", sampling_options="logprobs,none")).sampling_options == (
        "none", "logprobs")
    assert settings_from_args(e2e_args(methods="ar")).sampling_options == ()  # the mode is off
    with pytest.raises(BenchArgumentError, match="--sampling-options: unknown sampling option 'beam'; allowed: none, "
                                                 "logprobs, penalties, bad_words"):
        settings_from_args(e2e_args(methods="ar", sampling_options="beam"))
    with pytest.raises(BenchArgumentError, match="--sampling-options lists an option twice"):
        settings_from_args(e2e_args(methods="ar", sampling_options="min_p,min_p"))
    with pytest.raises(BenchArgumentError, match="--agreement and --sampling-options are separate modes"):
        settings_from_args(e2e_args(methods="ar", temperatures="0", agreement=True, sampling_options="min_p"))
    with pytest.raises(BenchArgumentError, match="--stage-timing and --sampling-options are separate modes"):
        settings_from_args(e2e_args(methods="ar", stage_timing=True, sampling_options="min_p"))
    with pytest.raises(ValueError, match="allowed: none, logprobs"):
        check_sampling_options("--x", ["json"])


def test_every_option_describes_what_it_sends():
    assert describe("none") == "no option"
    assert describe("penalties") == "presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2"
    assert set(NEEDS_TOKENIZER) <= set(SAMPLING_OPTIONS)
    assert all(SAMPLING_OPTIONS[name] for name in SAMPLING_OPTIONS if name != "none")


def test_structured_options_become_vllms_params():
    pytest.importorskip("vllm")
    from vllm import SamplingParams

    from ubtree_vllm.bench.sampling_options import sampling_kwargs

    for name in SAMPLING_OPTIONS:  # each is a valid SamplingParams
        SamplingParams(temperature=0.0, max_tokens=8, **sampling_kwargs(name, 8))
    params = SamplingParams(**sampling_kwargs("json_schema", 8))
    assert sampling_kwargs("min_tokens", 8)["min_tokens"] == 8
    assert sampling_kwargs("min_tokens", 256)["min_tokens"] == 64
    assert params.structured_outputs.json["required"] == ["answer", "confidence"]
    assert SamplingParams(**sampling_kwargs("json_object", 8)).structured_outputs.json_object is True


def test_a_cell_runs_none_then_each_option():
    a, b = PromptSet("a", ((1, 2),)), PromptSet("b", ((3,),))
    settings = E2ESettings(temperatures=(0.0, 1.0), sampling_options=("none", "min_p"))
    assert [(p.dataset, t, o) for p, t, o in cells([a, b], settings)] == [
        ("a", 0.0, "none"), ("a", 0.0, "min_p"), ("a", 1.0, "none"), ("a", 1.0, "min_p"),
        ("b", 0.0, "none"), ("b", 0.0, "min_p"), ("b", 1.0, "none"), ("b", 1.0, "min_p")]
    assert [o for _, _, o in cells([a], E2ESettings(temperatures=(0.0,)))] == [None]  # the mode off


def _run(method: str, tokens_per_s: float, tpot: float, tau: float | None) -> dict:
    return {"method": method, "dataset": "toy", "temperature": 0.0, "concurrency": 1,
            "output_tokens_per_s": tokens_per_s,
            "tpot_ms": tpot, "tau": tau, "target": "t", "drafter": None if method == "ar" else "d", "tree_budget": None}


def test_ledger_pairs_each_option_with_ar_and_with_its_own_engine_without_it():
    ledger = OptionLedger()
    ar_none = ledger.records("ar", None, _run("ar", 400.0, 2.5, None), "none")
    ar_pen = ledger.records("ar", None, _run("ar", 380.0, 2.6, None), "penalties")
    tree_none = ledger.records("ubtree:64", "d", _run("ubtree", 1200.0, 0.75, 4.0), "none")
    tree_pen = ledger.records("ubtree:64", "d", _run("ubtree", 950.0, 0.9, 3.8), "penalties")
    assert [r["metric"] for r in ar_none] == [ROUND_METRIC]  # the baseline adds nothing to itself
    assert ar_none[0]["value"] == 2.5 and ar_none[0]["speedup_vs_ar"] == 1.0  # ar: a plain step
    assert [r["metric"] for r in ar_pen] == [ROUND_METRIC, ADDED_METRIC]
    assert ar_pen[1]["value"] == pytest.approx(0.1)
    assert tree_none[0]["value"] == pytest.approx(3.0) and tree_none[0]["speedup_vs_ar"] == 3.0
    round_ms, added = tree_pen
    assert round_ms["value"] == pytest.approx(0.9 * 3.8) and added["value"] == pytest.approx(0.9 * 3.8 - 3.0)
    assert round_ms["speedup_vs_ar"] == pytest.approx(950.0 / 380.0)  # ar with the same option
    assert round_ms["sampling_options"] == added["sampling_options"] == "penalties"
    assert "presence_penalty=0.5" in round_ms["notes"] and added["tau"] == 3.8
    for record in [*ar_none, *ar_pen, *tree_none, *tree_pen]:
        rec.validate_record({**record, "kind": "microbench"})
    # another engine (another drafter) has its own baseline
    other = ledger.records("ubtree:64", "d2", _run("ubtree", 900.0, 1.0, 3.0), "penalties")
    assert [r["metric"] for r in other] == [ROUND_METRIC]
    assert option_records(_run("ar", 1.0, None, None), "none", None, None, {}) == []  # no TPOT: nothing measured


def test_report_tabulates_the_options_apart_from_other_microbenchmarks():
    ledger = OptionLedger()
    rows = []
    for option, tpot in (("none", 2.5), ("logit_bias", 2.7)):
        for record in ledger.records("ar", None, _run("ar", 400.0, tpot, None), option):
            rows.append(rec.make_record({**record, "hardware": "1x NVIDIA H200", "commit": "abc1234"}))
    text = render(rows)
    section = text.split("## Sampling options: cost per round", 1)[1]
    assert "| ar | – | toy | 0.0 | 1 | logit_bias | – | 2.70 | 0.20 | 1.00 |" in section
    assert "| ar | – | toy | 0.0 | 1 | none | – | 2.50 | – | 1.00 |" in section
    assert "## Microbenchmarks" not in text  # the option records stay out of the generic table
