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
    point = {"lineage": "first", "tree": "drafter", "prompts": 4, "dataset": "mt_bench", "temperature": 0.0}
    assert curve_points(records) == [{**point, "label_rows": 100, "tau": 2.5}, {**point, "label_rows": 150, "tau": 4.0}]
    assert "| 0 | first | drafter | 4 | mt_bench | 150 | 4.00 |" in curve_section(records)


def test_the_lookup_branch_is_a_curve_of_its_own():
    """Copies from the context lift tau without the drafter: never averaged with the drafter-only trees."""
    shipped = "checkpoints/d"

    def tau(value, method):
        return {**e2e(method, 1.0, value, budget=64), "drafter": shipped}

    records = [{"kind": "train", "drafter": shipped, "tokens_seen": 100, "cumulative_label_rows": 100},
               tau(3.0, "ubtree-mrv2"), tau(4.0, "ubtree-mrv2-lookup"), tau(5.0, "ubtree-lookup")]
    got = [(p["tree"], p["tau"]) for p in curve_points(records)]
    assert got == [("drafter", 3.0), ("drafter + lookup", 4.5)]
    assert "| 0 | first | drafter + lookup | 4 | mt_bench | 100 | 4.50 |" in curve_section(records)


def test_a_different_sample_of_a_set_is_a_curve_of_its_own():
    shipped = "checkpoints/d"

    def tau(value, prompts):
        return {**e2e("ubtree-mrv2", 1.0, value, budget=64), "drafter": shipped, "num_prompts": prompts}

    records = [{"kind": "train", "drafter": shipped, "tokens_seen": 100, "cumulative_label_rows": 100},
               tau(3.0, 10), tau(4.0, 80), tau(5.0, 80)]
    assert [(p["prompts"], p["tau"]) for p in curve_points(records)] == [(10, 3.0), (80, 4.5)]


def test_a_fresh_drafter_starts_a_new_lineage():
    shipped = "checkpoints/d"

    def tau(value):
        return {**e2e("ubtree-mrv2", 1.0, value, budget=64), "drafter": shipped}

    def train(rows, notes="", commit="a"):
        return {"kind": "train", "drafter": shipped, "tokens_seen": rows, "cumulative_label_rows": rows,
                "notes": notes, "date": "2026-12-01", "commit": commit}

    records = [train(100), tau(2.0), train(300), tau(2.2),
               train(50, "init=fresh", commit="b"), tau(2.5), train(80, "init=checkpoints/d", commit="c"), tau(2.6),
               train(40, commit="d"), tau(1.5)]  # fewer rows than before: also a new lineage
    got = [(p["lineage"], p["label_rows"], p["tau"]) for p in curve_points(records)]
    assert got == [("2026-12-01 a", 100, 2.0), ("2026-12-01 a", 300, 2.2), ("2026-12-01 b", 50, 2.5),
                   ("2026-12-01 b", 80, 2.6), ("2026-12-01 d", 40, 1.5)]


def test_a_measurement_naming_its_drafters_training_is_placed_there():
    """An A/B of the folder before and after a slice, the older drafter measured last: its tau goes to its amount."""
    shipped = "checkpoints/d"

    def tau(value, rows=None):
        return {**e2e("ubtree-mrv2", 1.0, value, budget=64), "drafter": shipped, "cumulative_label_rows": rows}

    records = [{"kind": "train", "drafter": shipped, "tokens_seen": 100, "cumulative_label_rows": 100},
               {"kind": "train", "drafter": shipped, "tokens_seen": 50, "cumulative_label_rows": 150},
               tau(3.0, rows=150), tau(2.0, rows=100), tau(4.0)]
    got = [(p["label_rows"], p["tau"]) for p in curve_points(records)]
    assert got == [(100, 2.0), (150, 3.5)]
