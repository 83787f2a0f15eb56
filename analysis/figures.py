"""Figures of a pipeline run (seaborn), from the tables written by :mod:`analysis.aggregate`.

* ``mismatch``: mean |dlogp| per numerics configuration and model (log scale), with the
  trainer's own batch-vs-batch-1 variance beside it;
* ``dlogp_vs_prob``: mean |dlogp| against the sampling probability of the token (binned
  by log10 p), one line per configuration, from the per-token tables;
* ``layers``: per-layer, per-region-boundary mean |diff| of hidden states, vLLM vs trainer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on a cluster node

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402


def save_grid(grid, path: Path, title: str | None = None) -> None:
    """Write a seaborn FacetGrid to ``path`` and free it."""
    if title:
        grid.figure.suptitle(title, y=1.02)
    grid.savefig(path, bbox_inches="tight")
    plt.close(grid.figure)


def mismatch_figure(probe: pd.DataFrame, path: Path) -> None:
    long = probe.melt(id_vars=["model", "config"],
                      value_vars=["mean_abs_dlogp", "batch_vs_single_mean_abs_dlogp"],
                      var_name="gap", value_name="mean |dlogp|")
    long["gap"] = long.gap.map({"mean_abs_dlogp": "vLLM vs trainer (batch 1)",
                                "batch_vs_single_mean_abs_dlogp": "trainer: padded batch vs batch 1"})
    grid = sns.catplot(data=long, kind="bar", x="config", y="mean |dlogp|", hue="gap", col="model",
                       height=4, aspect=1.6)
    grid.set(yscale="log")
    grid.set_xticklabels(rotation=60, ha="right")
    save_grid(grid, path, "Mismatch per numerics configuration (same tokens for every configuration)")


def dlogp_vs_prob_figure(results: Path, configs: list[str], path: Path) -> None:
    frames = []
    for tokens in sorted(results.glob("probe/*/*/tokens.csv")):
        model, config = tokens.parts[-3], tokens.parts[-2]
        if config not in configs:
            continue
        df = pd.read_csv(tokens, usecols=["logp_trainer", "logp_sampler", "p_sampler"])
        df["abs_dlogp"] = (df.logp_trainer - df.logp_sampler).abs()
        df["log10_p"] = np.log10(df.p_sampler.clip(lower=1e-12))
        df["bin"] = (df.log10_p * 2).round() / 2  # half-decade bins
        frames.append(df.assign(model=model, config=config))
    data = pd.concat(frames, ignore_index=True)
    grid = sns.relplot(data=data, kind="line", x="bin", y="abs_dlogp", hue="config", col="model", marker="o",
                       errorbar=None, height=4, aspect=1.3)
    grid.set(yscale="log", xlabel="log10 sampling probability (half-decade bins)", ylabel="mean |dlogp|")
    save_grid(grid, path)


def layers_figure(diagnose: pd.DataFrame, path: Path) -> None:
    diagnose = diagnose.copy()
    diagnose["where"] = diagnose.layer.astype(str) + " " + diagnose.boundary
    floor = diagnose.mean_abs_diff[diagnose.mean_abs_diff > 0].min() / 10 if (diagnose.mean_abs_diff > 0).any() else 1e-9
    diagnose["mean |diff| (0 drawn at floor)"] = diagnose.mean_abs_diff.clip(lower=floor)
    grid = sns.relplot(data=diagnose, kind="line", x="step", y="mean |diff| (0 drawn at floor)", hue="config",
                       col="model", marker="o", height=4, aspect=1.8)
    grid.set(yscale="log")
    for ax, (_, group) in zip(grid.axes.flat, diagnose.groupby("model", sort=False)):
        ticks = group.drop_duplicates("step").sort_values("step")
        ax.set_xticks(ticks.step, ticks["where"], rotation=70, ha="right", fontsize=7)
    save_grid(grid, path, "Hidden-state divergence vLLM vs trainer along the forward pass")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--format", default="png", choices=("png", "pdf", "svg"))
    parser.add_argument("--dlogp-configs", nargs="+", default=["none", "all"])
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sns.set_theme(style="whitegrid", context="paper")
    tables = args.results / "tables"
    probe = pd.read_csv(tables / "probe.csv")
    mismatch_figure(probe, args.out_dir / f"mismatch.{args.format}")
    dlogp_vs_prob_figure(args.results, args.dlogp_configs, args.out_dir / f"dlogp_vs_prob.{args.format}")
    try:
        diagnose = pd.read_csv(tables / "diagnose.csv")
    except pd.errors.EmptyDataError:  # the config asked for no diagnosis
        diagnose = pd.DataFrame()
    if diagnose.empty:
        print("figures: no diagnosis rows, no layers figure")
    else:
        layers_figure(diagnose, args.out_dir / f"layers.{args.format}")
    print(f"figures -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
