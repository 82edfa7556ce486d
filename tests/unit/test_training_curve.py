"""The report's tau-against-cumulative-training curve, from records in file order."""
from test_round_cost import e2e

from ubtree_vllm.bench.training_curve import curve_points, curve_section


def test_tau_curve_follows_the_train_records_of_the_shipped_drafter():
    shipped = "checkpoints/d"

    def tau(value, method="ubtree-mrv2", drafter=shipped, budget=64):
        return {**e2e(method, 1.0, value, budget=budget), "drafter": drafter}

    records = [tau(9.0),  # before any train record of the folder: no training amount known
               {"kind": "train", "drafter": shipped, "tokens_seen": 100, "cumulative_label_rows": None},
               tau(2.0), tau(3.0, method="ubtree"), tau(5.0, budget=32), tau(7.0, drafter="runs/ablation"),
               {"kind": "train", "drafter": shipped, "tokens_seen": 50, "cumulative_label_rows": 150},
               tau(4.0)]
    assert curve_points(records) == [{"dataset": "mt_bench", "temperature": 0.0, "label_rows": 100, "tau": 2.5},
                                     {"dataset": "mt_bench", "temperature": 0.0, "label_rows": 150, "tau": 4.0}]
    assert "| 0 | mt_bench | 150 | 4.00 |" in curve_section(records)
