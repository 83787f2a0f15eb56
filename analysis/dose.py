"""The positive control's dose-response: collapse, reward and accuracy vs the *measured*
trainer-sampler mismatch, per importance-sampling correction and old-logprob setting.

Reads ``RESULTS/dose/<arm>/<correction>-<old>/seed<N>/{config.json,metrics.jsonl,eval.jsonl,
summary.json}``. Verdicts are recomputed from ``metrics.jsonl`` with the thresholds of each
run's config (:func:`rpa.collapse.run_verdict`), so the tables follow the current
definition. Writes

* ``dose_runs.csv`` -- one row per run (:data:`RUN_COLUMNS`);
* ``dose.csv`` -- one row per arm x correction x old logprobs (means over seeds);
* ``dose.md`` -- both, the collapse threshold per curve and where the BF16 arms sit;
* a figure: collapse fraction, final reward and phantom-clip rate vs measured mismatch.

Threshold: the mismatch (mean over steps of ``mismatch/mean_abs_dlogp``) at which half the
runs of a curve collapse, from a logistic fit on log10(mismatch) with a bootstrap 95%
interval over runs; where the runs separate perfectly (no overlap of collapsed and stable
runs) the fit has no finite slope and the threshold is reported as the bracket between the
largest stable and the smallest collapsed mismatch.
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

from rpa.collapse import CollapseThresholds, run_verdict  # noqa: E402

RUN_COLUMNS = ("arm", "dose_bits", "is_correction", "old_logprobs", "seed", "status", "verdict", "collapsed",
               "collapse_step", "steps", "peak_reward", "final_reward", "final_eval_accuracy", "final_eval_reward",
               "mean_abs_dlogp", "kl_k3", "seq_log_ratio_mean_abs", "phantom_clip_rate", "clip_ratio",
               "sync_over_tolerance_steps")
ANCHORS = ("fp32", "bf16-none", "bf16-all", "fp16")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def load_runs(results: Path) -> pd.DataFrame:
    rows = []
    for cfg_path in sorted(results.glob("dose/*/*/seed*/config.json")):
        run = cfg_path.parent
        arm, setting, seed = run.parts[-3], run.parts[-2], int(run.name.removeprefix("seed"))
        correction, old = setting.rsplit("-", 1)
        cfg = json.loads(cfg_path.read_text())
        metrics = _read_jsonl(run / "metrics.jsonl")
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
        evals = _read_jsonl(run / "eval.jsonl")
        row = {"arm": arm, "dose_bits": (cfg["numerics"].get("sampler_perturbation") or {}).get("mantissa_bits"),
               "is_correction": correction, "old_logprobs": old, "seed": seed,
               "status": summary.get("status", "missing")}
        if metrics or summary.get("status") == "collapsed":  # a blow-up may stop a run before a step is logged
            verdict = run_verdict(metrics, CollapseThresholds(**cfg["collapse"]), summary)
            row.update({k: verdict.get(k) for k in ("verdict", "collapsed", "collapse_step", "steps", "peak_reward",
                                                    "final_reward")})
        if metrics:
            m = pd.DataFrame(metrics)
            row.update(mean_abs_dlogp=m["mismatch/mean_abs_dlogp"].mean(), kl_k3=m["mismatch/kl_k3"].mean(),
                       seq_log_ratio_mean_abs=m["mismatch/seq_log_ratio_mean_abs"].mean(),
                       phantom_clip_rate=m["mismatch/phantom_clip_rate"].mean(),
                       clip_ratio=m["clip_ratio/region_mean"].mean(),
                       sync_over_tolerance_steps=int(m.get("sync/over_tolerance", pd.Series(dtype=float)).sum()))
        if evals:
            row.update(final_eval_accuracy=evals[-1]["eval/accuracy"], final_eval_reward=evals[-1]["eval/reward"])
        rows.append(row)
    if not rows:
        raise SystemExit(f"no dose runs under {results}/dose")
    return pd.DataFrame(rows).reindex(columns=list(RUN_COLUMNS))


def counted(runs: pd.DataFrame) -> pd.DataFrame:
    """``collapsed`` as 0/1, so that a group of one run sums to a count, not a bool."""
    return runs.assign(collapsed=runs["collapsed"].astype("boolean").fillna(False).astype(int))


def groups(runs: pd.DataFrame) -> pd.DataFrame:
    ok = counted(runs[runs["status"] != "missing"])
    g = ok.groupby(["arm", "dose_bits", "is_correction", "old_logprobs"], dropna=False, sort=False)
    out = g.agg(runs=("seed", "size"), collapsed=("collapsed", "sum"),
                mean_abs_dlogp=("mean_abs_dlogp", "mean"), seq_log_ratio_mean_abs=("seq_log_ratio_mean_abs", "mean"),
                phantom_clip_rate=("phantom_clip_rate", "mean"), final_reward=("final_reward", "mean"),
                final_reward_sd=("final_reward", "std"), final_eval_accuracy=("final_eval_accuracy", "mean"),
                final_eval_accuracy_sd=("final_eval_accuracy", "std")).reset_index()
    out["collapse_fraction"] = out["collapsed"] / out["runs"]
    missing = runs[runs["status"] == "missing"].groupby(["arm", "is_correction", "old_logprobs"]).size()
    out["missing_runs"] = [int(missing.get((a, c, o), 0)) for a, c, o in
                           zip(out["arm"], out["is_correction"], out["old_logprobs"])]
    return out.sort_values(["is_correction", "old_logprobs", "mean_abs_dlogp"]).reset_index(drop=True)


# ------------------------------------------------------------------------ threshold


def _logistic_fit(x: np.ndarray, y: np.ndarray, iters: int = 50) -> tuple[float, float] | None:
    """(intercept, slope) of P(y) = sigmoid(a + b x) by Newton's method; None if no finite fit."""
    if y.min() == y.max() or x[y == 0].max() < x[y == 1].min() or x[y == 1].max() < x[y == 0].min():
        return None  # one class, or perfectly separated: no finite maximum-likelihood slope
    a, b = 0.0, 0.0
    design = np.stack([np.ones_like(x), x], axis=1)
    for _ in range(iters):
        p = 1 / (1 + np.exp(-(a + b * x)))
        w = p * (1 - p) + 1e-9
        grad = design.T @ (y - p)
        hess = design.T @ (design * w[:, None])
        step = np.linalg.solve(hess + 1e-9 * np.eye(2), grad)
        a, b = a + step[0], b + step[1]
        if not np.isfinite([a, b]).all() or abs(b) > 1e4:
            return None
    return a, b


def threshold(curve: pd.DataFrame, boot: int = 1000, seed: int = 0) -> dict:
    """Mismatch at which half the runs of one curve collapse (see the module doc)."""
    d = curve.dropna(subset=["mean_abs_dlogp", "collapsed"])
    x, y = np.log10(d["mean_abs_dlogp"].to_numpy(float)), d["collapsed"].to_numpy(float)
    out = {"runs": int(len(d)), "collapsed": int(y.sum())}
    if y.sum() == 0:
        return {**out, "kind": "none collapsed", "estimate": None, "low": float(10 ** x.max()) if len(x) else None,
                "high": None}
    if y.sum() == len(y):
        return {**out, "kind": "all collapsed", "estimate": None, "low": None, "high": float(10 ** x.min())}
    fit = _logistic_fit(x, y)
    stable_max, collapsed_min = x[y == 0].max(), x[y == 1].min()
    if fit is None or fit[1] <= 0:
        return {**out, "kind": "bracket", "estimate": None, "low": float(10 ** min(stable_max, collapsed_min)),
                "high": float(10 ** max(stable_max, collapsed_min))}
    rng = np.random.default_rng(seed)
    estimates = []
    for _ in range(boot):
        idx = rng.integers(0, len(x), len(x))
        f = _logistic_fit(x[idx], y[idx])
        if f is not None and f[1] > 0:
            estimates.append(-f[0] / f[1])
    est = -fit[0] / fit[1]
    lo, hi = (np.percentile(estimates, [2.5, 97.5]) if len(estimates) >= 50 else (np.nan, np.nan))
    return {**out, "kind": "logistic", "estimate": float(10 ** est), "low": float(10 ** lo), "high": float(10 ** hi),
            "bootstrap_fits": len(estimates)}


def dose_arms(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs of the dose curves: stock BF16 and the perturbed samplers (not the anchors,
    which ran only with IS off and would skew that curve alone)."""
    return runs[(runs["status"] != "missing") & (runs["arm"].str.startswith("perturb-") | (runs["arm"] == "bf16-none"))]


def thresholds(runs: pd.DataFrame) -> pd.DataFrame:
    rows = []
    for (correction, old), curve in dose_arms(runs).groupby(["is_correction", "old_logprobs"]):
        rows.append({"is_correction": correction, "old_logprobs": old, **threshold(curve)})
    return pd.DataFrame(rows)


def anchor_positions(runs: pd.DataFrame) -> pd.DataFrame:
    ok = counted(runs[(runs["status"] != "missing") & runs["arm"].isin(ANCHORS) & (runs["is_correction"] == "off")])
    return ok.groupby(["arm", "old_logprobs"]).agg(mean_abs_dlogp=("mean_abs_dlogp", "mean"),
                                                   collapsed=("collapsed", "sum"), runs=("seed", "size")).reset_index()


def statement(th: pd.DataFrame, anchors: pd.DataFrame) -> list[str]:
    lines = []
    for _, t in th.iterrows():
        curve = f"IS {t['is_correction']}, old logprobs from the {t['old_logprobs']}"
        where = anchors[anchors["old_logprobs"] == t["old_logprobs"]].set_index("arm")["mean_abs_dlogp"]
        bf16 = ", ".join(f"{a} {where[a]:.2g}" for a in ("bf16-none", "bf16-all") if a in where)
        if t["kind"] == "none collapsed":
            lines.append(f"- {curve}: no run collapsed ({t['runs']} runs, up to mismatch {t['low']:.2g})"
                         + (f"; the BF16 arms ({bf16}) sit below every dose tried." if bf16 else "."))
        elif t["kind"] == "all collapsed":
            lines.append(f"- {curve}: every run collapsed (from mismatch {t['high']:.2g}).")
        elif t["kind"] == "bracket":
            ratio = "" if "bf16-none" not in where else \
                f"; BF16 none ({where['bf16-none']:.2g}) is {t['low'] / where['bf16-none']:.0f}x below the lower end"
            lines.append(f"- {curve}: half-collapse threshold between mismatch {t['low']:.2g} and {t['high']:.2g} "
                         f"(runs separate perfectly: {t['collapsed']}/{t['runs']} collapsed){ratio}.")
        else:
            ratio = "" if "bf16-none" not in where else \
                f"; BF16 none ({where['bf16-none']:.2g}) is {t['estimate'] / where['bf16-none']:.0f}x below it"
            lines.append(f"- {curve}: half of the runs collapse at mismatch {t['estimate']:.2g} "
                         f"(95% bootstrap interval {t['low']:.2g}-{t['high']:.2g}, {t['collapsed']}/{t['runs']} "
                         f"collapsed){ratio}.")
    return lines


def markdown(runs: pd.DataFrame, per_group: pd.DataFrame, th: pd.DataFrame, anchors: pd.DataFrame) -> str:
    cols = ["arm", "is_correction", "old_logprobs", "runs", "collapsed", "missing_runs", "mean_abs_dlogp",
            "seq_log_ratio_mean_abs", "phantom_clip_rate", "final_reward", "final_reward_sd", "final_eval_accuracy"]
    return ("## Dose-response (positive control)\n\nSampler-only perturbation (`perturb-mantissa<K>`: the "
            "sampler's region outputs rounded to K mantissa bits); mismatch = mean over steps of "
            "`mismatch/mean_abs_dlogp` (measured in training). Verdicts recomputed from `metrics.jsonl`.\n\n"
            "### Threshold\n\n" + "\n".join(statement(th, anchors)) + "\n\n"
            + th.to_markdown(index=False, floatfmt=".3g") + "\n\n### Per arm (mean over seeds)\n\n"
            + per_group[cols].to_markdown(index=False, floatfmt=".3g") + "\n\n### Anchors (IS off)\n\n"
            + anchors.to_markdown(index=False, floatfmt=".3g") + "\n\n### Per run\n\n"
            + runs.to_markdown(index=False, floatfmt=".3g") + "\n")


def figure(per_group: pd.DataFrame, anchors: pd.DataFrame, path: Path) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    doses = per_group[~per_group["arm"].isin(["fp32", "bf16-all", "fp16"])]
    for (correction, old), curve in doses.groupby(["is_correction", "old_logprobs"]):
        curve = curve.sort_values("mean_abs_dlogp")
        label = f"IS {correction}, old={old}"
        style = "-" if old == "sampler" else "--"
        for ax, col in zip(axes, ["collapse_fraction", "final_reward", "phantom_clip_rate"]):
            ax.plot(curve["mean_abs_dlogp"], curve[col], style, marker="o", label=label)
    for ax, title in zip(axes, ["collapse fraction", "final reward (smoothed)", "phantom-clip rate"]):
        ax.set_xscale("log")
        ax.set_xlabel("measured mismatch: mean |dlogp| over steps")
        ax.set_title(title)
        for _, a in anchors[anchors["old_logprobs"] == "trainer"].iterrows():
            ax.axvline(a["mean_abs_dlogp"], color="grey", lw=0.8, ls=":")
            ax.text(a["mean_abs_dlogp"], ax.get_ylim()[1], a["arm"], rotation=90, va="top", fontsize=7)
    axes[0].legend(fontsize=7)
    fig.suptitle("Positive control: sampler-only mismatch dose vs collapse (anchors: dotted, old=trainer)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--figure", required=True, type=Path)
    args = parser.parse_args()
    runs = load_runs(args.results)
    per_group = groups(runs)
    th, anchors = thresholds(runs), anchor_positions(runs)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    runs.to_csv(args.out_dir / "dose_runs.csv", index=False)
    per_group.to_csv(args.out_dir / "dose.csv", index=False)
    (args.out_dir / "dose.md").write_text(markdown(runs, per_group, th, anchors))
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    figure(per_group, anchors, args.figure)
    print("\n".join(statement(th, anchors)))


if __name__ == "__main__":
    main()
