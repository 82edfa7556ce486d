"""round_over_plain_step from the e2e records of one invocation."""
from ubtree_vllm.bench.round_cost import METRIC, round_cost_records


def e2e(method, tpot, tau, dataset="mt_bench", temperature=0.0, concurrency=1, budget=None):
    return {"kind": "e2e", "method": method, "target": "t", "drafter": None, "dataset": dataset, "num_prompts": 4,
            "max_new_tokens": 8, "temperature": temperature, "batch_size": concurrency, "concurrency": concurrency,
            "tree_budget": budget, "tpot_ms": tpot, "tau": tau}


def test_round_cost_is_tpot_times_tau_over_the_plain_step_of_the_same_cell():
    records = [e2e("ar", 2.0, None), e2e("ar", 3.0, None, concurrency=4),
               e2e("ubtree-mrv2", 1.5, 2.4, budget=64), e2e("ngram", 1.0, 2.0, concurrency=4, budget=8),
               e2e("ubtree-mrv2", 1.0, 3.0, dataset="humaneval", budget=64)]  # no ar cell: skipped
    out = round_cost_records(records)
    assert [(r["method"], r["concurrency"], r["metric"]) for r in out] == [("ubtree-mrv2", 1, METRIC),
                                                                            ("ngram", 4, METRIC)]
    assert out[0]["value"] == 1.8 and out[0]["tree_budget"] == 64 and out[0]["unit"] == "plain steps"
    assert abs(out[1]["value"] - 2.0 / 3.0) < 1e-4

