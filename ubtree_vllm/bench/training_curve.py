"""Tau against cumulative training: does more training of the shipped drafter still pay?

Records are read in file order (the order they were measured). A `train` record of a drafter
folder sets that folder's cumulative label rows (`cumulative_label_rows`, or `tokens_seen` for
records from before that field); every later tree tau measurement of the same folder
(e2e records of the tree methods at B = 64, batch 1; bench and the reference decoder's
eval-tau alike) is a point of the curve at that training amount, until the next `train` record
of the folder. A measurement that names its drafter's training amount (`cumulative_label_rows`, written
since 2026-12-02) is placed there instead, whatever its place in the file (an A/B of the folder before
and after a slice, measured in either order). Only folders under `checkpoints/` (the shipped drafter)
are plotted.

The prompt-lookup branch (methods `ubtree-lookup`, `ubtree-mrv2-lookup`) adds candidates copied from
the context, so its tau is not the drafter's alone: each point carries its `tree` ("drafter", or
"drafter + lookup") and the two are separate curves. So does the number of prompts per set a tau was
measured on (`num_prompts`): 10 prompts and 80 prompts are different samples of a set, and a step
between them is not training's doing.

A train record of a fresh drafter (notes `init=fresh`, or fewer cumulative rows than the
folder had) starts a new *lineage*, named by that record's date and commit: a drafter trained
again from scratch is a new curve, not a step back on the old one.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ubtree_vllm.bench.drafter_goals import SHIPPED_PREFIX, of_shipped_drafter

# tree method -> which candidates its trees hold (a curve of its own)
TREE_KINDS = {"ubtree": "drafter", "ubtree-mrv2": "drafter",
              "ubtree-lookup": "drafter + lookup", "ubtree-mrv2-lookup": "drafter + lookup"}
BUDGET = 64


def _lineage_name(record: dict[str, Any]) -> str:
    return " ".join(str(record[k]) for k in ("date", "commit") if record.get(k)) or "first"


def curve_points(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """[{lineage, tree, prompts, dataset, temperature, label_rows, tau}] averaged over the measurements at each
    training amount of each lineage (module docstring)."""
    cumulative: dict[str, int] = {}
    lineage: dict[str, str] = {}
    order: dict[str, int] = {}  # lineage -> first appearance, to list lineages oldest first
    taus: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        if not of_shipped_drafter(r):
            continue
        drafter = r["drafter"]
        if r["kind"] == "train":
            rows = r.get("cumulative_label_rows") or r["tokens_seen"]
            if drafter not in lineage or "init=fresh" in (r.get("notes") or "") or rows < cumulative[drafter]:
                lineage[drafter] = _lineage_name(r)
                order.setdefault(lineage[drafter], len(order))
            cumulative[drafter] = rows
        elif (r["kind"] == "e2e" and drafter in cumulative and r.get("tau") and r.get("method") in TREE_KINDS
              and r.get("tree_budget") == BUDGET and r.get("concurrency") in (1, None)):
            rows = r.get("cumulative_label_rows") or cumulative[drafter]
            key = (lineage[drafter], TREE_KINDS[r["method"]], r.get("num_prompts") or 0, r["dataset"],
                   r["temperature"], rows)
            taus[key].append(r["tau"])
    return [{"lineage": name, "tree": tree, "prompts": n, "dataset": d, "temperature": t, "label_rows": rows,
             "tau": sum(v) / len(v)}
            for (name, tree, n, d, t, rows), v in sorted(
                taus.items(), key=lambda kv: (kv[0][4], order[kv[0][0]], kv[0][1], kv[0][3], kv[0][5], kv[0][2]))]


def curve_section(records: Sequence[dict[str, Any]]) -> list[str]:
    points = curve_points(records)
    if not points:
        return []
    lines = ["## Tau against cumulative training (shipped drafter)", "",
             f"Tree tau (B = {BUDGET}, batch 1) of the drafter in `{SHIPPED_PREFIX}` after each training slice, against "
             "the label rows trained on so far (every slice behind it). Mean over the tau measurements of that "
             "drafter state (bench e2e and eval-tau). A lineage is one drafter trained from scratch and continued "
             "slice by slice, named by the date and commit of its first slice. Tree: the drafter's candidates alone, "
             "or with the prompt-lookup branch (copies from the context; not the drafter's own tau). Prompts: per "
             "set, of the measurements behind the point (a different sample of the set is a different curve).", "",
             "| T | lineage | tree | prompts | dataset | cumulative label rows | tau |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {p['temperature']:g} | {p['lineage']} | {p['tree']} | {p['prompts'] or '?'} | {p['dataset']} "
              f"| {p['label_rows']:,} | {p['tau']:.2f} |" for p in points]
    return lines + [""]


def plot_training_curve(records: Sequence[dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per temperature: tau against cumulative label rows, a panel per tree kind; colour = dataset,
    line style = lineage, marker = prompts per set (one line per combination, a legend per property)."""
    points = curve_points(records)
    if not points:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    def style(values, styles):
        return {v: styles[i % len(styles)] for i, v in enumerate(values)}

    paths = []
    for temperature in sorted({p["temperature"] for p in points}):
        here = [p for p in points if p["temperature"] == temperature]
        trees = list(dict.fromkeys(p["tree"] for p in here))
        colors = style(sorted({p["dataset"] for p in here}), [f"C{i}" for i in range(10)])
        dashes = style(list(dict.fromkeys(p["lineage"] for p in here)), ["-", "--", ":", "-."])
        markers = style(sorted({p["prompts"] for p in here}),
                        ["o", "s", "^", "v", "D", "P", "X", "*", "h", "p", "<", ">"])
        fig, axes = plt.subplots(1, len(trees), figsize=(4.5 * len(trees) + 2.5, 4), sharey=True, squeeze=False)
        for ax, tree in zip(axes[0], trees):
            lines = dict.fromkeys((p["dataset"], p["lineage"], p["prompts"]) for p in here if p["tree"] == tree)
            for dataset, name, n in lines:
                row = [p for p in here
                       if (p["tree"], p["dataset"], p["lineage"], p["prompts"]) == (tree, dataset, name, n)]
                ax.plot([p["label_rows"] / 1e6 for p in row], [p["tau"] for p in row], color=colors[dataset],
                        linestyle=dashes[name], marker=markers[n], markersize=5)
            ax.set_title(tree, fontsize=9)
            ax.set_xlabel("cumulative label rows (millions)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(f"tree tau (B={BUDGET}, batch 1)")
        axes[0][0].set_ylim(1.0, 1.1 * max(p["tau"] for p in here))  # tau >= 1
        handles = ([Line2D([], [], color=c, label=d) for d, c in colors.items()]
                   + [Line2D([], [], color="k", linestyle=ls, label=f"lineage {name}") for name, ls in dashes.items()]
                   + [Line2D([], [], color="k", linestyle="", marker=m, label=f"{n or '?'} prompts")
                      for n, m in markers.items()])
        fig.legend(handles=handles, loc="center right", fontsize=7)
        fig.suptitle(f"Shipped drafter: tau vs training, T={temperature:g}")
        fig.tight_layout(rect=(0, 0, 1 - 2.3 / fig.get_figwidth(), 1))
        path = out_dir / f"tau_vs_training_T{temperature:g}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
