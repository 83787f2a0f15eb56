"""Summaries of a GRPO grid: one row per run, per-group means, and reward / mismatch curves.

Reads ``RESULTS/train/<model>/<setting>/<regions>/seed<N>/`` (:func:`analysis.runs.load_run`; the region set
is the run config's, not the folder's name); writes a CSV
(columns :data:`RUN_COLUMNS`), a Markdown table, and a figure of reward and mismatch vs step.
Collapse verdicts are recomputed from each ``metrics.jsonl`` with the run's own thresholds, so
the tables follow the current definition (e.g. the persistence window): ``rule_version`` names
it, and ``summary_superseded`` marks a run whose ``summary.json`` holds a different verdict of
an earlier rule. Beside the smoothed ``final_reward``, the raw ``terminal_reward`` (mean of the
last :data:`rpa.train.collapse.TERMINAL_STEPS` logged rewards) and ``absorbing`` (a raw reward
about 0 in groups without reward variance, whatever the rule says).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402

from analysis.figures import save_grid  # noqa: E402
from analysis.runs import flags, load_run  # noqa: E402
from rpa.core.jsonfiles import atomic_path, write_text  # noqa: E402

RUN_COLUMNS = ("model", "setting", "regions", "seed", "steps", "collapsed", "collapse_step", "collapse_reason",
               "peak_reward", "final_reward", "terminal_reward", "absorbing", "reward_auc", "mean_abs_dlogp", "kl_k3",
               "frac_ratio_outside", "rule_version", "summary_superseded", "status", "wall_s")


def load(results: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    runs, curves = [], []
    for path in sorted(results.glob("train/*/*/*/seed*/summary.json")):
        run = load_run(path.parent)
        model, setting, seed = path.parts[-5], path.parts[-4], int(path.parts[-2].removeprefix("seed"))  # its cell
        regions = run.config["numerics"]["regions"]  # what the run ran, not its folder's name
        metrics = pd.DataFrame(run.metrics)
        runs.append({"model": model, "setting": setting, "regions": regions, "seed": seed,
                     **{k: run.summary.get(k) for k in RUN_COLUMNS[4:]},
                     **{k: v for k, v in run.verdict.items() if k in RUN_COLUMNS},
                     "summary_superseded": run.superseded,
                     "mean_abs_dlogp": metrics["mismatch/mean_abs_dlogp"].mean(),
                     "kl_k3": metrics["mismatch/kl_k3"].mean(),
                     "frac_ratio_outside": metrics["mismatch/frac_ratio_outside"].mean()})
        curves.append(metrics.assign(model=model, setting=setting, regions=regions, seed=seed))
    if not runs:
        raise SystemExit(f"no runs under {results}/train")
    return pd.DataFrame(runs)[list(RUN_COLUMNS)], pd.concat(curves, ignore_index=True)


def markdown(runs: pd.DataFrame) -> str:
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


def figure(curves: pd.DataFrame, path: Path, window: int = 5) -> None:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-table", required=True, type=Path)
    parser.add_argument("--out-md", required=True, type=Path)
    parser.add_argument("--out-figure", required=True, type=Path)
    args = parser.parse_args(argv)
    sns.set_theme(style="whitegrid", context="paper")
    runs, curves = load(args.results)
    for p in (args.out_table, args.out_md, args.out_figure):
        p.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out_table) as tmp:
        runs.to_csv(tmp, index=False)
    write_text(args.out_md, markdown(runs))
    figure(curves, args.out_figure)
    print(f"train summary: {len(runs)} runs -> {args.out_table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
