"""The study across sizes: collapse and mismatch tables, reward / accuracy / mismatch curves
and a collapse heatmap, from ``RESULTS/study/manifest.json`` and the run directories it lists.

Every expected cell appears: a run without a summary is ``missing``, one that ended in an
error is ``failed``; neither is dropped. Verdicts are recomputed from each run's
``metrics.jsonl`` with the thresholds of its config (:func:`rpa.collapse.run_verdict`).

Tables (CSV, Markdown, LaTeX/booktabs) under ``RESULTS/tables``:

* ``study_collapse``: per model x arm: runs, finished, collapsed, median collapse step,
  peak and final (smoothed) reward, final eval accuracy (mean +- sd over seeds);
* ``study_mismatch``: per model x arm: the offline probe's ``mean_abs_dlogp`` and ``kl_k3``
  on identical tokens (where a probe configuration has the arm's name) with the change vs
  the reference arm and its paired bootstrap 95% interval over sequences, and the same two
  metrics measured during training (mean over steps, mean +- sd over seeds).

Figures under ``RESULTS/figures``: ``study_rewards`` (reward and eval accuracy vs step per
size, mean and band over seeds), ``study_mismatch_curves`` (in-training mismatch, log
scale), ``study_heatmap`` (collapsed share per size x arm; missing cells grey).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.latex import booktabs  # noqa: E402
from rpa.collapse import CollapseThresholds, run_verdict  # noqa: E402

BOOTSTRAP = 2000


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def load_runs(results: Path, manifest: dict) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(one row per expected cell, per-step metrics of finished runs, eval records)."""
    rows, curves, evals = [], [], []
    for c in manifest["cells"]:
        run = results / "study" / c["cell"]
        row = {"model": c["model"], "arm": c["arm"], "seed": c["seed"], "state": "missing"}
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
        metrics = _jsonl(run / "metrics.jsonl")
        if summary is not None:
            row["state"] = "failed" if summary.get("status") == "error" else "finished"
            row["status"] = summary.get("status")
            row["error"] = summary.get("error")
            if metrics or summary.get("status") == "collapsed":  # a blow-up may stop a run before a step is logged
                cfg = json.loads((run / "config.json").read_text())
                v = run_verdict(metrics, CollapseThresholds(**cfg["collapse"]), summary)
                row.update({k: v.get(k) for k in ("collapsed", "verdict", "collapse_step", "steps", "peak_reward",
                                                  "final_reward")})
        if summary is not None and metrics:
            m = pd.DataFrame(metrics)
            row.update(train_mean_abs_dlogp=m["mismatch/mean_abs_dlogp"].mean(), train_kl_k3=m["mismatch/kl_k3"].mean())
            curves.append(m.assign(model=c["model"], arm=c["arm"], seed=c["seed"]))
        e = _jsonl(run / "eval.jsonl")
        if e:
            row["final_eval_accuracy"] = e[-1]["eval/accuracy"]
            evals.append(pd.DataFrame(e).assign(model=c["model"], arm=c["arm"], seed=c["seed"]))
        rows.append(row)
    return (pd.DataFrame(rows), pd.concat(curves, ignore_index=True) if curves else pd.DataFrame(),
            pd.concat(evals, ignore_index=True) if evals else pd.DataFrame())


def _mean_sd(values: pd.Series) -> str:
    v = values.dropna()
    if v.empty:
        return "--"
    return f"{v.mean():.3g}" if len(v) == 1 else f"{v.mean():.3g} ± {v.std():.2g}"


def collapse_table(runs: pd.DataFrame, manifest: dict) -> pd.DataFrame:
    rows = []
    for model in manifest["models"]:
        for arm in manifest["arms"]:
            g = runs[(runs.model == model) & (runs.arm == arm)]
            done = g[g.state == "finished"]
            collapsed = done["collapsed"].fillna(False).astype(bool) if "collapsed" in done else pd.Series(dtype=bool)
            rows.append({"model": model, "arm": arm, "runs": len(g), "finished": len(done),
                         "failed": int((g.state == "failed").sum()), "missing": int((g.state == "missing").sum()),
                         "collapsed": f"{int(collapsed.sum())}/{len(done)}" if len(done) else "--",
                         "median_collapse_step": float(done.loc[collapsed, "collapse_step"].median())
                         if collapsed.any() else None,
                         "peak_reward": _mean_sd(done.get("peak_reward", pd.Series(dtype=float))),
                         "final_reward": _mean_sd(done.get("final_reward", pd.Series(dtype=float))),
                         "final_eval_accuracy": _mean_sd(done.get("final_eval_accuracy", pd.Series(dtype=float)))})
    return pd.DataFrame(rows)


def _per_sequence(tokens: pd.DataFrame) -> pd.DataFrame:
    d = tokens["logp_trainer"] - tokens["logp_sampler"]
    frame = pd.DataFrame({"seq": tokens["seq"], "abs": d.abs(), "k3": np.exp(d) - 1 - d})
    return frame.groupby("seq").agg(abs_sum=("abs", "sum"), k3_sum=("k3", "sum"), n=("abs", "size"))


def paired_change(arm_tokens: pd.DataFrame, ref_tokens: pd.DataFrame, seed: int = 0) -> dict:
    """Relative change of the token-mean |dlogp| and kl_k3 vs the reference on the same
    tokens, with a paired bootstrap over sequences (95% percentile interval)."""
    a, r = _per_sequence(arm_tokens), _per_sequence(ref_tokens)
    common = a.index.intersection(r.index)
    a, r = a.loc[common], r.loc[common]
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(common), (BOOTSTRAP, len(common)))
    out = {}
    for key, col in (("mean_abs_dlogp", "abs_sum"), ("kl_k3", "k3_sum")):
        num_a, num_r, n = a[col].to_numpy(), r[col].to_numpy(), a["n"].to_numpy()
        point = num_a.sum() / num_r.sum() - 1
        boot = num_a[idx].sum(1) / num_r[idx].sum(1) - 1
        lo, hi = np.percentile(boot, [2.5, 97.5])
        out[key] = {"value": float(num_a.sum() / n.sum()), "change": float(point), "low": float(lo),
                    "high": float(hi)}
    return out


def mismatch_table(results: Path, runs: pd.DataFrame, manifest: dict) -> pd.DataFrame:
    ref = manifest["reference_arm"]
    rows = []
    for model in manifest["models"]:
        ref_path = results / "probe" / model / ref / "tokens.csv"
        ref_tokens = pd.read_csv(ref_path) if ref_path.exists() else None
        for arm in manifest["arms"]:
            row = {"model": model, "arm": arm}
            path = results / "probe" / model / arm / "tokens.csv"
            if path.exists() and ref_tokens is not None:
                change = paired_change(pd.read_csv(path), ref_tokens)
                for key, c in change.items():
                    row.update({f"probe_{key}": c["value"], f"probe_{key}_change": c["change"],
                                f"probe_{key}_low": c["low"], f"probe_{key}_high": c["high"]})
            else:
                row["probe_mean_abs_dlogp"] = None  # this arm's numerics equal another arm's (e.g. an IS arm)
            done = runs[(runs.model == model) & (runs.arm == arm) & (runs.state == "finished")]
            row["train_mean_abs_dlogp"] = _mean_sd(done.get("train_mean_abs_dlogp", pd.Series(dtype=float)))
            row["train_kl_k3"] = _mean_sd(done.get("train_kl_k3", pd.Series(dtype=float)))
            rows.append(row)
    cols = ["model", "arm"] + [f"probe_{k}{s}" for k in ("mean_abs_dlogp", "kl_k3") for s in ("", "_change", "_low",
                                                                                          "_high")] + \
        ["train_mean_abs_dlogp", "train_kl_k3"]
    return pd.DataFrame(rows).reindex(columns=cols)


def readable_mismatch(table: pd.DataFrame) -> pd.DataFrame:
    """The mismatch table for people: each change as ``+x.x% [lo, hi]``."""
    out = table[["model", "arm"]].copy()
    for key in ("mean_abs_dlogp", "kl_k3"):
        out[f"probe {key}"] = table[f"probe_{key}"]
        out[f"{key} change (95% CI)"] = [
            "--" if pd.isna(c) else f"{100 * c:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]"
            for c, lo, hi in zip(table[f"probe_{key}_change"], table[f"probe_{key}_low"], table[f"probe_{key}_high"])]
    out["train mean_abs_dlogp"] = table["train_mean_abs_dlogp"]
    out["train kl_k3"] = table["train_kl_k3"]
    return out


# --------------------------------------------------------------------------- figures


def arm_colors(arms: list[str]) -> dict[str, tuple]:
    """One colour per arm, the same in every panel and figure, no two arms alike (tab10 repeats
    after ten; the study has twelve arms)."""
    cmap = plt.get_cmap("tab10" if len(arms) <= 10 else "tab20")
    return {arm: cmap(i % cmap.N) for i, arm in enumerate(arms)}


def _band(ax, frame: pd.DataFrame, x: str, y: str, label: str, color, window: int = 1, log: bool = False) -> None:
    """Mean over seeds and a band of one standard deviation; with ``log``, both in log10 space
    (geometric mean, band x/÷ 10^sd), so that the band of a log-scale axis never crosses zero."""
    frame = frame.sort_values(x)
    if window > 1:
        frame = frame.assign(**{y: frame.groupby("seed")[y].transform(lambda s: s.rolling(window, 1).mean())})
    if log:
        frame = frame[frame[y] > 0].assign(**{y: lambda f: np.log10(f[y])})
    stats = frame.groupby(x)[y].agg(["mean", "std"]).reset_index()
    low, high = stats["mean"] - stats["std"].fillna(0), stats["mean"] + stats["std"].fillna(0)
    mean = stats["mean"]
    if log:
        mean, low, high = 10 ** mean, 10 ** low, 10 ** high
    ax.plot(stats[x], mean, label=label, lw=1.2, color=color)
    ax.fill_between(stats[x], low, high, alpha=0.15, color=color)


def _of(frame: pd.DataFrame, model: str, arm: str) -> pd.DataFrame:
    return frame if frame.empty else frame[(frame.model == model) & (frame.arm == arm)]


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def reward_figure(curves: pd.DataFrame, evals: pd.DataFrame, manifest: dict, path: Path, label: str) -> None:
    models, colors = manifest["models"], arm_colors(manifest["arms"])
    fig, axes = plt.subplots(2, len(models), figsize=(4.2 * len(models), 7), squeeze=False)
    for j, model in enumerate(models):
        for arm in manifest["arms"]:
            for row, frame, key, window in ((0, curves, "reward", 5), (1, evals, "eval/accuracy", 1)):
                part = _of(frame, model, arm)
                if not part.empty:
                    _band(axes[row, j], part, "step", key, arm, colors[arm], window=window)
        axes[0, j].set(title=model, ylabel="reward (smoothed, 5 steps)")
        axes[1, j].set(xlabel="step", ylabel="held-out accuracy")
    axes[0, -1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{label}: reward and accuracy, mean and band (sd) over seeds")
    _save(fig, path)


def mismatch_figure(curves: pd.DataFrame, manifest: dict, path: Path, label: str) -> None:
    models, colors = manifest["models"], arm_colors(manifest["arms"])
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for j, model in enumerate(models):
        for arm in manifest["arms"]:
            part = _of(curves, model, arm)
            if not part.empty:
                _band(axes[0, j], part, "step", "mismatch/mean_abs_dlogp", arm, colors[arm], window=3, log=True)
        axes[0, j].set(yscale="log", title=model, xlabel="step")
    axes[0, 0].set_ylabel("in-training mean |dlogp|")
    axes[0, -1].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{label}: trainer-vs-sampler mismatch during training (geometric mean, band x/÷ one "
                 f"sd of log10 over seeds)")
    _save(fig, path)


def heatmap(runs: pd.DataFrame, manifest: dict, path: Path, label: str) -> None:
    models, arms = manifest["models"], manifest["arms"]
    share = np.full((len(models), len(arms)), np.nan)
    text = [["n/a"] * len(arms) for _ in models]
    for i, model in enumerate(models):
        for j, arm in enumerate(arms):
            done = runs[(runs.model == model) & (runs.arm == arm) & (runs.state == "finished")]
            if len(done):
                k = int(done["collapsed"].fillna(False).astype(bool).sum())
                share[i, j], text[i][j] = k / len(done), f"{k}/{len(done)}"
    fig, ax = plt.subplots(figsize=(1.0 * len(arms) + 2, 0.6 * len(models) + 1.8))
    cmap = plt.get_cmap("Reds").copy()
    cmap.set_bad("lightgrey")
    ax.imshow(np.ma.masked_invalid(share), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i in range(len(models)):
        for j in range(len(arms)):
            ax.text(j, i, text[i][j], ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(arms)), arms, rotation=45, ha="right", fontsize=8)
    ax.set_yticks(range(len(models)), models, fontsize=8)
    ax.set_title(f"{label}: collapsed runs / finished runs (grey: none finished)")
    _save(fig, path)


def write_table(df: pd.DataFrame, tables: Path, name: str, caption: str, readable: pd.DataFrame | None = None) -> None:
    """CSV (numbers), Markdown and LaTeX (``readable``, or the same table)."""
    df.to_csv(tables / f"{name}.csv", index=False)
    shown = df if readable is None else readable
    (tables / f"{name}.md").write_text(f"### {caption}\n\n" + shown.to_markdown(index=False, floatfmt=".3g") + "\n")
    (tables / f"{name}.tex").write_text(booktabs(shown, caption, f"tab:{name}"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--format", default="png")
    args = parser.parse_args()
    manifest = json.loads((args.results / "study" / "manifest.json").read_text())
    tables, fig_dir = args.results / "tables", args.results / "figures"
    tables.mkdir(parents=True, exist_ok=True)
    fig_dir.mkdir(parents=True, exist_ok=True)
    runs, curves, evals = load_runs(args.results, manifest)
    label = manifest["label"]
    write_table(collapse_table(runs, manifest), tables, "study_collapse",
                f"{label}: collapse per model and arm (verdicts recomputed from the metric logs)")
    mismatch = mismatch_table(args.results, runs, manifest)
    write_table(mismatch, tables, "study_mismatch",
                f"{label}: mismatch per arm, offline probe on identical tokens (change vs "
                f"{manifest['reference_arm']} with a paired bootstrap 95% interval) and during training",
                readable_mismatch(mismatch))
    reward_figure(curves, evals, manifest, fig_dir / f"study_rewards.{args.format}", label)
    mismatch_figure(curves, manifest, fig_dir / f"study_mismatch_curves.{args.format}", label)
    heatmap(runs, manifest, fig_dir / f"study_heatmap.{args.format}", label)
    states = runs.state.value_counts().to_dict()
    print(f"study: {len(runs)} cells: {states}")


if __name__ == "__main__":
    main()
