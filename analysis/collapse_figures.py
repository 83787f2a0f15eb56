"""The natural-collapse search's figures: the pilot's scatter (single and paired rule) and a stage's
reward and mismatch curves per arm (:func:`figure_grid`), from the rows of :func:`analysis.collapse_stats.search_rows`."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pandas as pd

from analysis.collapse_stats import MISMATCH, _outcome
from analysis.plots import plt, save_figure


def _figure_pilot(table: pd.DataFrame, path: Path, label: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    d = table.dropna(subset=["step1_entropy", "step1_mismatch"])
    for _, r in d.iterrows():
        ax.scatter(r["step1_entropy"], r["step1_mismatch"], marker="*" if r["chosen"] else "o",
                   s=120 if r["chosen"] else 30, color="C3" if r["eligible"] else "C0")
        ax.annotate(r["cell"].split("/", 1)[1].rsplit("/", 1)[0], (r["step1_entropy"], r["step1_mismatch"]),
                    fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="step-1 entropy (nats/token)", ylabel="step-1 mean |dlogp|", yscale="log",
           title=f"{label}: pilot (red: eligible, star: chosen)")
    fig.tight_layout()
    save_figure(fig, path, dpi=130)


def _cells(curves: pd.DataFrame, manifest: dict) -> list[str]:
    """The cell of each curve row (its labels and seed, matched against the manifest's cells)."""
    by_key = {(tuple(sorted(c["labels"].items())), c["seed"]): c["cell"] for c in manifest["cells"]}
    names = list(manifest["axes"])
    return [by_key.get((tuple(sorted((a, row[a]) for a in names)), row["seed"])) for _, row in curves.iterrows()]


def _figure_paired_pilot(table: pd.DataFrame, path: Path, label: str) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    d = table.dropna(subset=["control_gain", "reference_step1_mismatch"]) if "control_gain" in table else table.iloc[:0]
    for _, r in d.iterrows():
        ax.scatter(r["control_gain"], r["reference_step1_mismatch"], marker="*" if r["chosen"] else "o",
                   s=120 if r["chosen"] else 30, color="C3" if r["eligible"] else "C0")
        ax.annotate(str(r.get("reference_cell", "")).split("/", 1)[-1].rsplit("/", 2)[0],
                    (r["control_gain"], r["reference_step1_mismatch"]), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    ax.set(xlabel="control (FP32) reward gain: last - first steps", ylabel="stock BF16 step-1 mean |dlogp|")
    ax.set_title(f"{label}: pilot\n(red: eligible, star: chosen)", fontsize=9)  # two lines: a long label fits
    fig.tight_layout()
    save_figure(fig, path, dpi=130)


def runs_per_arm(curves: pd.DataFrame, axes_names: list[str], arm: str) -> pd.Series:
    """How many runs of each arm the curves hold (a run: its labels and seed), for the grid figure's
    legend: an arm of an incomplete grid has fewer runs, and its band (min-max over seeds) is narrower."""
    runs = curves[[a for a in axes_names if a in curves] + ["seed"]].drop_duplicates()
    return runs[arm].value_counts()


def _figure_grid(curves: pd.DataFrame, manifest: dict, path: Path, rule: dict,
                 runs: pd.DataFrame | None = None) -> None:
    """Reward and mismatch per logged step, one line per arm (mean over seeds, band: their range), a panel per
    rung; where the rule has pre-registered ``effects``, a third row: each finished run's outcome (learning
    gain) per arm, one point per seed and the arm's mean."""
    arm, rung = rule.get("arm_axis", "arm"), rule.get("rung_axis", "lr")
    axes_names = list(manifest["axes"])
    if curves.empty or arm not in curves:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, "no runs logged yet", ha="center")
        save_figure(fig, path, dpi=100)
        return
    panels = list(manifest["axes"].get(rung, [None])) if rung in axes_names else [None]
    outcome_row = bool(rule.get("effects")) and runs is not None and "reward_auc" in runs
    rows = 3 if outcome_row else 2
    fig, axs = plt.subplots(rows, len(panels), figsize=(max(4.2 * len(panels), 6.0), 3.25 * rows), squeeze=False)
    arms = list(manifest["axes"][arm])
    runs_drawn = runs_per_arm(curves, axes_names, arm)
    for j, panel in enumerate(panels):
        part = curves if panel is None else curves[curves[rung] == panel]
        for i, a in enumerate(arms):
            g = part[part[arm] == a]
            if g.empty:
                continue
            for row, key, log in ((0, "reward", False), (1, MISMATCH, True)):
                s = g.groupby("step")[key].agg(["mean", "min", "max"]).reset_index()
                axs[row, j].plot(s["step"], s["mean"], color=f"C{i}", label=f"{a} ({runs_drawn.get(a, 0)} runs)", lw=1.2)
                axs[row, j].fill_between(s["step"], s["min"], s["max"], color=f"C{i}", alpha=0.12)
                if log:
                    axs[row, j].set_yscale("log")
        axs[0, j].set(title=str(panel) if panel is not None else "", ylabel="reward (mean, band: min-max over seeds)")
        axs[1, j].set(xlabel="step", ylabel="mean |dlogp|")
        if outcome_row:
            done = runs[runs["state"] == "finished"]
            done = done if panel is None else done[done[rung] == panel]
            outcome = rule.get("outcome", "learning_gain")
            for i, a in enumerate(arms):
                g = done[done[arm] == a]
                if g.empty:
                    continue
                values = _outcome(g, outcome)
                axs[2, j].scatter([i] * len(values), values, color=f"C{i}", s=14, alpha=0.7)
                axs[2, j].hlines(values.mean(), i - 0.3, i + 0.3, color=f"C{i}", lw=2)
            axs[2, j].set(xticks=range(len(arms)), xticklabels=arms,
                          ylabel=f"{outcome.replace('_', ' ')} per run (line: mean)")
    legend = {}  # from every panel: the first may have no runs yet
    for ax in axs[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=len(arms), fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(f"{manifest['label']}: {manifest['stage']}", 45 * len(panels))))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    save_figure(fig, path, dpi=120)
