"""The table of a grid: one entry of ``grids:`` (docs/pipeline.md#grids), or the GRPO grid (``train:``).

``python -m analysis.grid_summary --results R --grid NAME --out-csv F --out-md F`` reads
``R/grids/NAME/manifest.json`` (its cells, axes and labels as the config wrote them) and each run
(:func:`analysis.runs.runs_table`, by :func:`analysis.collapse_stats.search_rows`: the same per-run
columns as a search stage). The CSV has one row per cell, missing and failed runs included
(``state``); the Markdown table one row per group (every axis but the seed: runs, finished,
collapsed with an exact interval at ``--confidence``, raw terminal reward, reward AUC, entropy,
mismatch before any collapse), then one per run. An entry with a ``decision`` (written in the config before the grid
runs, the keys of a search stage's) is read by that rule: its statement, each question's answer and the effects'
table come first, as a search stage's tables give them; without one the statistics are for the reader.

``python -m analysis.grid_summary --results R --train --out-csv F --out-md F --out-figure F`` (also
``python -m analysis.train_summary --results R --out-table F --out-md F --out-figure F``, its older name)
writes the GRPO grid's table from ``R/train/manifest.json``: one row per run that ended (columns
:data:`TRAIN_COLUMNS`, in the order of the runs' folders; the region set the run's config ran, not its
folder's name), a Markdown table per run and per group, and a figure of reward and mismatch vs step.
Collapse verdicts are recomputed from each run's log with its own thresholds, so the tables follow the
current definition (e.g. the persistence window): ``rule_version`` names it, and ``summary_superseded``
marks a run whose ``summary.json`` holds a different verdict of an earlier rule. Beside the smoothed
``final_reward``, the raw ``terminal_reward`` (mean of the last :data:`rpa.train.collapse.TERMINAL_STEPS`
logged rewards) and ``absorbing`` (a raw reward about 0 in groups without reward variance, whatever the
rule says).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from analysis.collapse_stats import groups, search_rows
from analysis.refusal import Refused, run
from analysis.runs import MANIFEST, flags, grid_table, read_manifest
from rpa.core.jsonfiles import atomic_path, write_text

RUN_COLUMNS = ("seed", "state", "status", "steps", "collapsed", "collapse_step", "terminal_reward", "reward_auc",
               "final_entropy", "pre_collapse_mismatch", "final_eval_accuracy", "wall_s")
"""The per-run columns of the Markdown table (after the axes), where the runs have them."""


def tables(results: Path, name: str, confidence: float = 0.95) -> tuple[pd.DataFrame, pd.DataFrame, dict, dict | None]:
    """(one row per cell, one row per group, the manifest, what its registered decision says or None) of grid
    ``name``: an entry with a ``decision`` is read by the rule a search stage's is (:func:`analysis.collapse_search.
    decided`: the decision, its questions and its effects)."""
    from analysis.collapse_search import decided

    manifest = read_manifest(results / "grids" / name / MANIFEST)
    runs, curves = search_rows(results, manifest, section="grids")
    rule = manifest.get("decision")
    return (runs, groups(runs, list(manifest["axes"]), confidence), manifest,
            decided(runs, curves, manifest, rule) if rule else None)


def markdown(runs: pd.DataFrame, per_group: pd.DataFrame, manifest: dict, confidence: float,
             decision: dict | None = None) -> str:
    from analysis.collapse_search import _effects_markdown, decided_text

    axes = list(manifest["axes"])
    shown = per_group[[c for c in [*axes, "runs", "finished", "failed", "missing", "collapsed", "collapse_rate_low",
                                   "collapse_rate_high", "terminal_reward", "reward_auc", "entropy",
                                   "pre_collapse_mismatch"] if c in per_group]]
    per_run = runs[[c for c in [*axes, *RUN_COLUMNS] if c in runs]]
    decided = "" if decision is None else decided_text(decision, f"grid {manifest['grid']}")
    effects = "" if decision is None or "effects" not in decision else "\n" + _effects_markdown(decision["effects"])
    return (f"### grid {manifest['grid']}\n\n{decided}Per group ({len(per_group)}; collapse rate: exact {confidence:.0%} "
            f"interval over the finished runs):\n\n{shown.to_markdown(index=False, floatfmt='.3g')}\n{effects}\n"
            f"Per run ({len(runs)}):\n\n{per_run.to_markdown(index=False, floatfmt='.3g')}\n")


# ------------------------------------------------------------------------------ the GRPO grid (train:)

TRAIN_COLUMNS = ("model", "setting", "regions", "seed", "steps", "collapsed", "collapse_step", "collapse_reason",
                 "peak_reward", "final_reward", "terminal_reward", "absorbing", "reward_auc", "mean_abs_dlogp", "kl_k3",
                 "frac_ratio_outside", "rule_version", "summary_superseded", "status", "wall_s")
"""The columns of the GRPO grid's table (``train.csv``)."""


def train_rows(results: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per run of the GRPO grid that ended, in the order of their folders; per-step metrics of
    each) from ``results/train/manifest.json``: the model and setting are the cell's, the region set its
    run config's."""
    runs, curves = [], []
    ended = sorted((e for e in grid_table(results, "train") if e.run.summary is not None),
                   key=lambda e: Path(e.cell["cell"]))  # the table's order: its runs' folders
    for entry in ended:
        run, seed = entry.run, entry.cell["seed"]
        model, setting = entry.cell["model"], entry.labels["setting"]
        regions = run.config["numerics"]["regions"]  # what the run ran, not its folder's name
        metrics = pd.DataFrame(run.metrics)
        runs.append({"model": model, "setting": setting, "regions": regions, "seed": seed,
                     **{k: run.summary.get(k) for k in TRAIN_COLUMNS[4:]},
                     **{k: v for k, v in (run.verdict or {}).items() if k in TRAIN_COLUMNS},
                     "summary_superseded": run.superseded,
                     "mean_abs_dlogp": metrics["mismatch/mean_abs_dlogp"].mean(),
                     "kl_k3": metrics["mismatch/kl_k3"].mean(),
                     "frac_ratio_outside": metrics["mismatch/frac_ratio_outside"].mean()})
        curves.append(metrics.assign(model=model, setting=setting, regions=regions, seed=seed))
    if not runs:
        raise Refused(f"no runs under {results}/train")
    return pd.DataFrame(runs)[list(TRAIN_COLUMNS)], pd.concat(curves, ignore_index=True)


def train_markdown(runs: pd.DataFrame) -> str:
    cols = ["model", "setting", "regions", "seed", "steps", "collapsed", "collapse_step", "peak_reward", "final_reward",
            "terminal_reward", "absorbing", "reward_auc", "mean_abs_dlogp", "kl_k3", "summary_superseded", "wall_s"]
    per_run = runs[cols].to_markdown(index=False, floatfmt=".3g")
    groups = runs.groupby(["model", "setting", "regions"], sort=False).agg(
        runs=("seed", "size"), collapsed=("collapsed", "sum"), final_reward=("final_reward", "mean"),
        terminal_reward=("terminal_reward", "mean"), absorbing=("absorbing", "sum"),
        reward_auc=("reward_auc", "mean"), mean_abs_dlogp=("mean_abs_dlogp", "mean")).reset_index()
    version = ", ".join(sorted(set(runs["rule_version"].dropna().astype(str)))) or "n/a"
    superseded = int(flags(runs["summary_superseded"]).sum())
    note = (f"Verdicts recomputed under collapse rule {version} (`rpa.train.collapse.RULE_VERSION`); "
            f"{superseded} run(s) whose `summary.json` holds an earlier rule's different verdict "
            f"(`summary_superseded`: read this table's). `final_reward`: smoothed over the rule's window; "
            f"`terminal_reward`: the raw mean of the last logged steps; `absorbing`: a raw reward about 0 in groups "
            f"without reward variance.\n\n")
    return (note + "### Per run\n\n" + per_run + "\n\n### Mean over seeds\n\n"
            + groups.to_markdown(index=False, floatfmt=".3g") + "\n")


def train_figure(curves: pd.DataFrame, path: Path, window: int = 5) -> None:
    """Reward and mismatch (smoothed over ``window`` logged steps) per step, a panel per setting, a line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import seaborn as sns

    from analysis.figures import save_grid

    curves = curves.sort_values("step").copy()
    key = ["model", "setting", "regions", "seed"]
    curves["reward (smoothed)"] = curves.groupby(key)["reward"].transform(lambda x: x.rolling(window, 1).mean())
    curves["mean |dlogp| (smoothed)"] = curves.groupby(key)["mismatch/mean_abs_dlogp"].transform(
        lambda x: x.rolling(window, 1).mean())
    long = curves.melt(id_vars=key + ["step"], value_vars=["reward (smoothed)", "mean |dlogp| (smoothed)"],
                       var_name="metric", value_name="value")
    grid = sns.relplot(data=long, kind="line", x="step", y="value", hue="regions", units="seed", estimator=None,
                       row="metric", col="setting", height=3, aspect=1.6, facet_kws={"sharey": "row"}, alpha=0.8)
    save_grid(grid, path, "GRPO on CPU: reward and vLLM-vs-trainer mismatch per step")


def write_train(results: Path, out_csv: Path, out_md: Path, out_figure: Path) -> int:
    """The GRPO grid's CSV, Markdown table and figure."""
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    runs, curves = train_rows(results)
    for p in (out_csv, out_md, out_figure):
        p.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_csv) as tmp:
        runs.to_csv(tmp, index=False)
    write_text(out_md, train_markdown(runs))
    train_figure(curves, out_figure)
    print(f"train summary: {len(runs)} runs -> {out_csv}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, type=Path)
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--grid", help="a name of the config's grids: section")
    which.add_argument("--train", action="store_true", help="the GRPO grid (train:), with its figure")
    parser.add_argument("--out-csv", required=True, type=Path)
    parser.add_argument("--out-md", required=True, type=Path)
    parser.add_argument("--out-figure", type=Path, help="the GRPO grid's figure (with --train)")
    parser.add_argument("--confidence", type=float, default=0.95, help="coverage of the collapse-rate intervals")
    args = parser.parse_args(argv)
    if args.train:
        if args.out_figure is None:
            parser.error("--train needs --out-figure")
        return write_train(args.results, args.out_csv, args.out_md, args.out_figure)
    if not (args.results / "grids" / args.grid / "manifest.json").is_file():
        parser.error(f"{args.results}/grids/{args.grid}/manifest.json: no such grid manifest "
                     f"(snakemake writes it: the grid {args.grid!r} of the config's grids: section)")
    runs, per_group, manifest, decision = tables(args.results, args.grid, args.confidence)
    for path in (args.out_csv, args.out_md):
        path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out_csv) as tmp:
        runs.to_csv(tmp, index=False)
    write_text(args.out_md, markdown(runs, per_group, manifest, args.confidence, decision))
    print(f"grid {args.grid}: {len(runs)} runs ({(runs['state'] == 'finished').sum()} finished) -> {args.out_csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
