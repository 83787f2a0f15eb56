"""Figures of a pipeline run (seaborn), from the tables written by :mod:`analysis.aggregate`.

* ``mismatch``: mean |dlogp| per numerics configuration (log scale), one panel per model
  (two per row, in the config's model order: ``--models``, else the study manifest's, else
  the probe table's), blue bars vLLM vs trainer at batch 1, orange bars beside them the
  trainer's own padded-batch-vs-batch-1 variance, each bar with its 95% interval (a bootstrap
  over the probe's sequences of the token-mean, from ``tokens.csv``, where the probe wrote one);
* ``dlogp_vs_prob``: mean |dlogp| against the sampling probability of the token (binned
  by log10 p), one line per configuration, from the per-token tables;
* ``layers``: per-layer, per-region-boundary mean |diff| of hidden states, vLLM vs trainer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import seaborn as sns

from analysis.plots import save_figure
from analysis.refusal import run
from analysis.runs import MANIFEST, probe_token_tables, probe_tokens, read_manifest, read_tokens


def save_grid(grid, path: Path, title: str | None = None) -> None:
    """Write a seaborn FacetGrid to ``path`` and free it."""
    if title:
        grid.figure.suptitle(title, y=1.02)
    save_figure(grid.figure, path, bbox_inches="tight", dpi=150)  # what FacetGrid.savefig does


GAPS = {"mean_abs_dlogp": ("vLLM vs trainer (batch 1)", "tab:blue"),
        "batch_vs_single_mean_abs_dlogp": ("trainer: padded batch vs batch 1", "tab:orange")}
GAP_TOKENS = {"mean_abs_dlogp": ("logp_trainer", "logp_sampler"),
              "batch_vs_single_mean_abs_dlogp": ("logp_trainer_batch", "logp_trainer")}
"""The two ``tokens.csv`` columns whose absolute difference is each gap's per-token |dlogp|."""
FIGURE_BOOTSTRAP = 2000
"""Resamples of a bar's interval (a figure's error bar, not a reported bound)."""


def bar_interval(tokens: pd.DataFrame, a: str, b: str, resamples: int = FIGURE_BOOTSTRAP,
                 seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the token-mean |tokens[a] - tokens[b]|, bootstrapping sequences."""
    d = (tokens[a] - tokens[b]).abs()
    per = pd.DataFrame({"seq": tokens["seq"], "d": d}).groupby("seq")["d"].agg(["sum", "size"])
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(per), (resamples, len(per)))
    boot = per["sum"].to_numpy()[idx].sum(1) / per["size"].to_numpy()[idx].sum(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return float(lo), float(hi)


def bar_intervals(results: Path, probe: pd.DataFrame) -> dict[tuple[str, str, str], tuple[float, float]]:
    """(model, config, gap) -> the bar's interval, for every probe with a ``tokens.csv`` holding
    the gap's columns."""
    out = {}
    for model, config in zip(probe["model"], probe["config"]):
        tokens = probe_tokens(results, model, config)
        if tokens is None:
            continue
        for gap, (a, b) in GAP_TOKENS.items():
            if {a, b, "seq"} <= set(tokens) and len(tokens):
                out[(model, config, gap)] = bar_interval(tokens, a, b)
    return out


def model_order(results: Path, present: list[str], models: list[str] | None = None) -> list[str]:
    """The models of ``present`` in the config's order: ``models`` where given, else the study
    manifest's (smallest first), then any other in the order of ``present``."""
    if not models:
        manifest = results / "study" / MANIFEST
        models = read_manifest(manifest).get("models", []) if manifest.exists() else []
    present = list(dict.fromkeys(present))
    return [m for m in models if m in present] + [m for m in present if m not in models]


def mismatch_figure(probe: pd.DataFrame, path: Path, models: list[str] | None = None,
                    results: Path | None = None) -> None:
    """The probe's bars per model (see the module doc); with ``results``, each bar's 95% interval."""
    intervals = bar_intervals(results, probe) if results is not None else {}
    long = probe.melt(id_vars=["model", "config"], value_vars=list(GAPS), var_name="gap", value_name="mean |dlogp|")
    long["gap"] = long.gap.map({k: name for k, (name, _) in GAPS.items()})
    order, configs = models or list(dict.fromkeys(probe["model"])), list(dict.fromkeys(probe["config"]))
    grid = sns.catplot(data=long, kind="bar", x="config", y="mean |dlogp|", hue="gap", col="model",
                       col_order=order, col_wrap=min(2, len(order)), order=configs,
                       palette={name: colour for name, colour in GAPS.values()}, height=2.6, aspect=1.45,
                       sharex=True, errorbar=None)
    for ax, model in zip(grid.axes.flat, order):
        for k, gap in enumerate(GAPS):
            for i, config in enumerate(configs):
                value = probe[(probe["model"] == model) & (probe["config"] == config)][gap]
                if (model, config, gap) not in intervals or value.empty or not np.isfinite(value.iloc[0]):
                    continue
                lo, hi = intervals[(model, config, gap)]
                v = float(value.iloc[0])
                ax.errorbar(i + (k - 0.5) * 0.4, v, yerr=[[max(v - lo, 0)], [max(hi - v, 0)]], fmt="none",
                            ecolor="black", elinewidth=0.7, capsize=1.5)
    grid.set(yscale="log", xlabel="")
    grid.set_titles("{col_name}")
    for ax in grid.axes.flat:
        ax.set_xticks(range(len(configs)), configs, rotation=60, ha="right", rotation_mode="anchor", fontsize=7)
        ax.tick_params(axis="y", labelsize=7)
    # one legend for every panel, above them (the rotated labels are below), titled with the figure's title
    sns.move_legend(grid, "lower center", bbox_to_anchor=(0.5, 1.0), ncol=2, frameon=False,
                    title="Mismatch per numerics configuration (same tokens for every configuration)"
                          + ("; bars: 95% interval, bootstrap over sequences" if intervals else ""))
    grid.figure.tight_layout()
    save_grid(grid, path)


def dlogp_vs_prob_figure(results: Path, configs: list[str], path: Path) -> None:
    frames = []
    for model, config, tokens in probe_token_tables(results):
        if config not in configs:
            continue
        df = read_tokens(tokens, usecols=["logp_trainer", "logp_sampler", "p_sampler"])
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
    parser.add_argument("--models", nargs="+", default=None,
                        help="model order of the panels (default: the study manifest's, else the probe table's)")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    sns.set_theme(style="whitegrid", context="paper")
    tables = args.results / "tables"
    probe = pd.read_csv(tables / "probe.csv")
    mismatch_figure(probe, args.out_dir / f"mismatch.{args.format}",
                    model_order(args.results, list(probe["model"]), args.models), args.results)
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
    raise SystemExit(run(main))
