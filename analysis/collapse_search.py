"""The natural-collapse search: per stage, a table of its runs, a summary JSON and a figure.

``python -m analysis.collapse_search --results R --stage {pilot,grid,ablation,lever} --figure F``
reads ``R/search/<stage>/manifest.json`` (cells, axes, the pilot rule and the decision rule as
the config wrote them) and each cell's ``config.json``, ``metrics.jsonl`` and ``summary.json``.
Verdicts are recomputed with each run's own thresholds (:func:`rpa.train.collapse.run_verdict`).

* **pilot**: one row per cell with its step-1 reward, entropy and mismatch, its initial reward
  (mean of the first ``reward_steps`` steps); ``eligible`` = entropy >= ``min_entropy`` and
  initial reward in [``reward_low``, ``reward_high``]; ``chosen`` = the eligible cell with the
  largest step-1 mismatch (none if no cell is eligible: the JSON then says so).
* **grid / ablation / lever**: one row per run and one per group (every axis but the seed):
  collapsed / runs with an exact (Clopper-Pearson) interval, unconfirmed runs, median collapse
  step, final reward, and the mismatch and phantom-clip rate *before* the collapse (the mean
  over the steps before the collapse step; all steps of a run that did not collapse).
* **decision** (grid, and the lever stage, judged by the same rule): at each rung (``rung_axis`` label) the stock-BF16 reference "collapses
  naturally" when it collapses in at least ``min_reference_collapsed`` seeds, the control
  (FP32) in at most ``max_control_collapsed``, and, pooled over the paired (rung, seed) cells,
  the reference collapses more often than the control. Otherwise the outcome is "does not, up
  to" the largest pre-collapse mismatch and phantom-clip rate the reference reached, with the
  exact upper bound on its collapse probability.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from rpa.train.collapse import CollapseThresholds, run_verdict  # noqa: E402
from rpa.core.jsonfiles import atomic_path, read_jsonl, write_text  # noqa: E402

MISMATCH = "mismatch/mean_abs_dlogp"
PHANTOM = "mismatch/phantom_clip_rate"
RUN_SETTINGS = ("learning_rate", "temperature", "max_completion_length", "steps", "updates_per_generation")
"""Run-config values every run row carries (from its ``config.json``, as ``config_<name>``: an axis
label may have the same name): what the envelope reports."""
FINAL_STEPS = 10
"""``final_entropy``: the mean policy entropy over a run's last this many logged steps."""


def _first(m: pd.DataFrame, key: str):
    return float(m[key].iloc[0]) if key in m and len(m) and pd.notna(m[key].iloc[0]) else None


def _mean(m: pd.DataFrame, key: str):
    return float(m[key].mean()) if key in m and m[key].notna().any() else None


def _max(m: pd.DataFrame, key: str):
    return float(m[key].max()) if key in m and m[key].notna().any() else None


def load_runs(results: Path, manifest: dict, reward_steps: int = 3) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per expected cell, per-step metrics of every run with a log)."""
    rows, curves = [], []
    for c in manifest["cells"]:
        run = results / "search" / c["cell"]
        row = {**c["labels"], "seed": c["seed"], "cell": c["cell"], "state": "missing"}
        summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else None
        # only a run that ended (with a summary) counts: a killed or running run's partial log would make
        # a "missing" row carry numbers that the exported reference results cannot reproduce
        metrics = read_jsonl(run / "metrics.jsonl") if summary is not None else []
        if summary is not None:
            row.update(state="failed" if summary.get("status") == "error" else "finished",
                       status=summary.get("status"), wall_s=summary.get("wall_s"))
        if summary is not None and (metrics or summary.get("status") == "collapsed"):
            cfg = json.loads((run / "config.json").read_text())
            v = run_verdict(metrics, CollapseThresholds(**cfg["collapse"]), summary)
            row.update({f"config_{k}": cfg.get(k) for k in RUN_SETTINGS})
            row.update({k: v.get(k) for k in ("verdict", "collapsed", "collapse_step", "unconfirmed_drop_step",
                                              "recovered_step", "grad_spikes", "steps", "peak_reward",
                                              "final_reward", "reward_auc")})
        if metrics:
            m = pd.DataFrame(metrics)
            stop = row.get("collapse_step") if row.get("collapsed") else None
            before = m[m["step"] < stop] if stop is not None else m
            row.update(step1_reward=_first(m, "reward"), step1_entropy=_first(m, "entropy"),
                       step1_mismatch=_first(m, MISMATCH), step1_phantom_clip=_first(m, PHANTOM),
                       initial_reward=float(m["reward"].head(reward_steps).mean()),
                       entropy=_mean(m, "entropy"), final_entropy=_mean(m.tail(FINAL_STEPS), "entropy"),
                       pre_collapse_mismatch=_mean(before, MISMATCH),
                       max_pre_collapse_mismatch=_max(before, MISMATCH),
                       pre_collapse_phantom_clip=_mean(before, PHANTOM),
                       max_pre_collapse_phantom_clip=_max(before, PHANTOM))
            curves.append(m.assign(**c["labels"], seed=c["seed"]))
        rows.append(row)
    return pd.DataFrame(rows), (pd.concat(curves, ignore_index=True) if curves else pd.DataFrame())


# ------------------------------------------------------------------------------ pilot


def pilot(runs: pd.DataFrame, rule: dict) -> tuple[pd.DataFrame, dict]:
    """The pilot table with ``eligible`` and ``chosen``, and the choice."""
    lo, hi, min_entropy = rule.get("reward_low", 0.3), rule.get("reward_high", 0.7), rule.get("min_entropy", 0.3)
    done = runs["step1_entropy"].notna() if "step1_entropy" in runs else pd.Series(False, index=runs.index)
    eligible = done & (runs.get("step1_entropy", np.nan) >= min_entropy) & \
        runs.get("initial_reward", np.nan).between(lo, hi)
    out = runs.assign(eligible=eligible.fillna(False).astype(bool), chosen=False)
    choice = {"rule": {"min_entropy": min_entropy, "reward_low": lo, "reward_high": hi,
                       "reward_steps": rule.get("reward_steps", 3)},
              "cells": int(len(out)), "finished": int(done.sum()), "eligible": int(out["eligible"].sum())}
    if out["eligible"].any():
        best = out[out["eligible"]]["step1_mismatch"].idxmax()
        out.loc[best, "chosen"] = True
        choice["chosen"] = out.loc[best, "cell"]
        choice["chosen_row"] = dict(out.loc[best].items())
    else:
        choice["chosen"] = None
    return out, choice


# ---------------------------------------------------------------------- grid-like stages


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k + 1))


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Exact two-sided binomial interval for k successes in n (bisection on the CDF)."""
    if n == 0:
        return 0.0, 1.0
    alpha = (1 - confidence) / 2

    def solve(f) -> float:
        a, b = 0.0, 1.0
        for _ in range(80):
            mid = (a + b) / 2
            a, b = (mid, b) if f(mid) else (a, mid)
        return (a + b) / 2

    low = 0.0 if k == 0 else solve(lambda p: 1 - _binom_cdf(k - 1, n, p) < alpha)
    high = 1.0 if k == n else solve(lambda p: _binom_cdf(k, n, p) > alpha)
    return low, high


def groups(runs: pd.DataFrame, axes: list[str], confidence: float) -> pd.DataFrame:
    rows = []
    for key, g in runs.groupby(axes, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        done = g[g["state"] == "finished"]
        collapsed = done["collapsed"].fillna(False).astype(bool) if "collapsed" in done else pd.Series(dtype=bool)
        k, n = int(collapsed.sum()), len(done)
        low, high = clopper_pearson(k, n, confidence)
        rows.append({**dict(zip(axes, key)), "runs": len(g), "finished": n,
                     "failed": int((g["state"] == "failed").sum()), "missing": int((g["state"] == "missing").sum()),
                     "collapsed": k, "collapse_rate_low": low, "collapse_rate_high": high,
                     "unconfirmed": int((done.get("verdict") == "unconfirmed").sum()) if n else 0,
                     "median_collapse_step": float(done.loc[collapsed, "collapse_step"].median()) if k else None,
                     "final_reward": done["final_reward"].mean() if n else None,
                     "final_reward_sd": done["final_reward"].std() if n > 1 else None,
                     "reward_auc": done["reward_auc"].mean() if n and "reward_auc" in done else None,
                     "entropy": done["entropy"].mean() if n else None,
                     "pre_collapse_mismatch": done["pre_collapse_mismatch"].mean() if n else None,
                     "max_pre_collapse_mismatch": done["max_pre_collapse_mismatch"].max() if n else None,
                     "pre_collapse_phantom_clip": done["pre_collapse_phantom_clip"].mean() if n else None,
                     "max_pre_collapse_phantom_clip": done["max_pre_collapse_phantom_clip"].max() if n else None})
    return pd.DataFrame(rows)


DECIDED_STAGES = ("grid", "lever")
"""Stages the decision rule judges: the grid, and the further lever tried if the grid does not collapse."""


def decision(runs: pd.DataFrame, rule: dict) -> dict:
    """The grid's (or the lever stage's) outcome under the decision rule of the config (see the module doc)."""
    arm, rung = rule.get("arm_axis", "arm"), rule.get("rung_axis", "lr")
    ref, ctl = rule.get("reference_arm", "none"), rule.get("control_arm", "fp32")
    need, allow = rule.get("min_reference_collapsed", 3), rule.get("max_control_collapsed", 0)
    confidence = rule.get("confidence", 0.95)
    done = runs[runs["state"] == "finished"].assign(
        collapsed=lambda d: d["collapsed"].fillna(False).astype(bool))
    rungs, collapsing = [], []
    for label, g in done.groupby(rung, sort=False):
        r, c = g[g[arm] == ref], g[g[arm] == ctl]
        entry = {"rung": label, "reference": f"{int(r.collapsed.sum())}/{len(r)}",
                 "control": f"{int(c.collapsed.sum())}/{len(c)}",
                 "meets": bool(int(r.collapsed.sum()) >= need and int(c.collapsed.sum()) <= allow)}
        rungs.append(entry)
        if entry["meets"]:
            collapsing.append(label)
    paired = done[done[arm].isin([ref, ctl])].pivot_table(index=[rung, "seed"], columns=arm, values="collapsed",
                                                          aggfunc="first").dropna()
    pooled = {"pairs": int(len(paired)),
              "reference_collapsed": int(paired[ref].sum()) if ref in paired else 0,
              "control_collapsed": int(paired[ctl].sum()) if ctl in paired else 0}
    more_often = pooled["reference_collapsed"] > pooled["control_collapsed"]
    ref_runs = done[done[arm] == ref]
    k, n = int(ref_runs.collapsed.sum()), len(ref_runs)
    low, high = clopper_pearson(k, n, confidence)
    out = {"rule": {"arm_axis": arm, "rung_axis": rung, "reference_arm": ref, "control_arm": ctl,
                    "min_reference_collapsed": need, "max_control_collapsed": allow, "confidence": confidence},
           "rungs": rungs, "pooled": pooled, "reference_collapsed": k, "reference_runs": n,
           "reference_collapse_rate_interval": [low, high]}
    per_rung = "; ".join(f"{e['rung']}: {ref} {e['reference']}, {ctl} {e['control']}" for e in rungs)
    unfinished = int((runs["state"] != "finished").sum())
    if unfinished:  # the rule is over the whole grid: no verdict from a part of it
        out.update(outcome="incomplete", unfinished=unfinished)
        out["statement"] = (f"The grid is incomplete: {len(runs) - unfinished} of {len(runs)} runs finished "
                            f"({per_rung or 'none yet'}); the decision rule is applied once every run has finished.")
        return out
    if collapsing and more_often:
        out["outcome"] = "collapses naturally"
        out["collapsing_rungs"] = collapsing
        out["statement"] = (f"Stock BF16 ({ref}) collapses naturally at {', '.join(map(str, collapsing))}: "
                            f"{per_rung}; "
                            f"pooled over {pooled['pairs']} paired cells {ref} {pooled['reference_collapsed']} vs "
                            f"{ctl} {pooled['control_collapsed']}.")
    else:
        mismatch, clip = ref_runs["max_pre_collapse_mismatch"].max(), ref_runs["max_pre_collapse_phantom_clip"].max()
        entropy = ref_runs["entropy"].mean()
        out.update(outcome="does not collapse naturally", max_mismatch=None if pd.isna(mismatch) else float(mismatch),
                   max_phantom_clip=None if pd.isna(clip) else float(clip),
                   mean_entropy=None if pd.isna(entropy) else float(entropy))
        out["statement"] = (f"Stock BF16 ({ref}) does not collapse naturally at this scale: {k}/{n} runs collapsed "
                            f"(exact {100 * confidence:.0f}% interval for its collapse probability "
                            f"{low:.2f}-{high:.2f}), {ctl} {pooled['control_collapsed']}/{pooled['pairs']} paired; "
                            f"up to a pre-collapse mismatch of {mismatch:.3g} (mean |dlogp|, step maximum) and a "
                            f"phantom-clip rate of {clip:.3g}, at a mean policy entropy of {entropy:.2f} nats/token.")
    return out


def fisher_exact(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided Fisher exact p for k1/n1 against k2/n2 (tables no likelier than the one seen)."""
    total, ks = n1 + n2, k1 + k2

    def prob(a: int) -> float:
        return math.comb(n1, a) * math.comb(n2, ks - a) / math.comb(total, ks)

    seen = prob(k1)
    return min(1.0, sum(prob(a) for a in range(max(0, ks - n2), min(ks, n1) + 1) if prob(a) <= seen * (1 + 1e-9)))


def sign_test(k: int, n: int) -> float | None:
    """Two-sided exact sign test: ``k`` of ``n`` pairs one way, under p = 1/2."""
    if n == 0:
        return None
    tail = sum(math.comb(n, i) for i in range(min(k, n - k) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def comparison(runs: pd.DataFrame, rule: dict) -> dict:
    """Beside the decision, not part of it (exploratory): collapses of the treatment (aligned) arm
    against the reference (stock BF16) with Fisher's exact p, and, paired by (rung, seed), in how
    many cells the reference's reward AUC is below the control's and the treatment's (sign test)."""
    arm, rung = rule.get("arm_axis", "arm"), rule.get("rung_axis", "lr")
    ref, ctl, treat = rule.get("reference_arm", "none"), rule.get("control_arm", "fp32"), rule.get("treatment_arm", "all")
    done = runs[runs["state"] == "finished"]
    collapsed = done["collapsed"].fillna(False).astype(bool) if "collapsed" in done else pd.Series(False, done.index)
    r, t = collapsed[done[arm] == ref], collapsed[done[arm] == treat]
    out = {"reference_arm": ref, "treatment_arm": treat, "reference": [int(r.sum()), len(r)],
           "treatment": [int(t.sum()), len(t)],
           "fisher_p": fisher_exact(int(t.sum()), len(t), int(r.sum()), len(r)) if len(r) and len(t) else None,
           "reward_auc_paired": {}}
    if "reward_auc" not in done or rung not in done:
        return out
    auc = done.pivot_table(index=[rung, "seed"], columns=arm, values="reward_auc", aggfunc="first")
    for other in (ctl, treat):
        if ref in auc and other in auc:
            pairs = auc[[ref, other]].dropna()
            differ = pairs[pairs[ref] != pairs[other]]  # a sign test leaves ties out
            lower = int((differ[ref] < differ[other]).sum())
            out["reward_auc_paired"][other] = {"pairs": int(len(pairs)), "ties": int(len(pairs) - len(differ)),
                                               "reference_lower": lower, "sign_test_p": sign_test(lower, len(differ))}
    return out


def envelope(runs: pd.DataFrame, rule: dict, manifest: dict) -> dict:
    """What the reference (stock BF16) arm's finished runs explored: models, settings, step-1 and
    final entropy, the largest mismatch and phantom-clip rate before any collapse."""
    arm, ref = rule.get("arm_axis", "arm"), rule.get("reference_arm", "none")
    done = runs[(runs["state"] == "finished") & (runs[arm] == ref)]
    models = sorted({c["model"] for c in manifest["cells"] if c["cell"] in set(done["cell"])})

    def values(col):
        return sorted({v for v in done[col].dropna().tolist()}) if col in done else []

    def span(col, how):
        return None if col not in done or done[col].isna().all() else float(getattr(done[col], how)())

    return {"arm": ref, "runs": int(len(done)), "models": models,
            **{k: values(f"config_{k}") for k in RUN_SETTINGS}, "logged_steps": values("steps"),
            "step1_entropy": [span("step1_entropy", "min"), span("step1_entropy", "max")],
            "final_entropy": [span("final_entropy", "min"), span("final_entropy", "max")],
            "mean_entropy": span("entropy", "mean"),
            "max_pre_collapse_mismatch": span("max_pre_collapse_mismatch", "max"),
            "max_pre_collapse_phantom_clip": span("max_pre_collapse_phantom_clip", "max")}


# ------------------------------------------------------------------------------ output


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
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=130)
    plt.close(fig)


def _figure_grid(curves: pd.DataFrame, manifest: dict, path: Path, rule: dict) -> None:
    arm, rung = rule.get("arm_axis", "arm"), rule.get("rung_axis", "lr")
    axes_names = list(manifest["axes"])
    if curves.empty or arm not in curves:
        fig, ax = plt.subplots(figsize=(6, 3))
        ax.text(0.5, 0.5, "no runs logged yet", ha="center")
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=100)
        plt.close(fig)
        return
    panels = list(manifest["axes"].get(rung, [None])) if rung in axes_names else [None]
    fig, axs = plt.subplots(2, len(panels), figsize=(max(4.2 * len(panels), 6.0), 6.5), squeeze=False)
    arms = list(manifest["axes"][arm])
    for j, panel in enumerate(panels):
        part = curves if panel is None else curves[curves[rung] == panel]
        for i, a in enumerate(arms):
            g = part[part[arm] == a]
            if g.empty:
                continue
            for row, key, log in ((0, "reward", False), (1, MISMATCH, True)):
                s = g.groupby("step")[key].agg(["mean", "min", "max"]).reset_index()
                axs[row, j].plot(s["step"], s["mean"], color=f"C{i}", label=a, lw=1.2)
                axs[row, j].fill_between(s["step"], s["min"], s["max"], color=f"C{i}", alpha=0.12)
                if log:
                    axs[row, j].set_yscale("log")
        axs[0, j].set(title=str(panel) if panel is not None else "", ylabel="reward (mean, band: min-max over seeds)")
        axs[1, j].set(xlabel="step", ylabel="mean |dlogp|")
    legend = {}  # from every panel: the first may have no runs yet
    for ax in axs[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center", ncol=len(arms), fontsize=8)
    fig.suptitle("\n".join(textwrap.wrap(f"{manifest['label']}: {manifest['stage']}", 45 * len(panels))))
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)


def _clean(value):
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating, float)):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--stage", required=True, choices=["pilot", "grid", "ablation", "lever"])
    parser.add_argument("--figure", required=True, type=Path)
    args = parser.parse_args(argv)
    manifest = json.loads((args.results / "search" / args.stage / "manifest.json").read_text())
    rule = manifest.get("pilot_rule") or {}
    runs, curves = load_runs(args.results, manifest, rule.get("reward_steps", 3))
    tables = args.results / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    stem = tables / f"search_{args.stage}"
    if args.stage == "pilot":
        table, summary = pilot(runs, rule)
        cols = [c for c in [*manifest["axes"], "seed", "state", "step1_reward", "initial_reward", "step1_entropy",
                            "step1_mismatch", "step1_phantom_clip", "eligible", "chosen", "wall_s"] if c in table]
        shown = table[cols]
        _figure_pilot(table, args.figure, manifest["label"])
        text = (f"### {manifest['label']}: pilot\n\nRule: eligible = step-1 entropy >= {summary['rule']['min_entropy']} "
                f"nats/token and initial reward (mean of the first {summary['rule']['reward_steps']} steps) in "
                f"[{summary['rule']['reward_low']}, {summary['rule']['reward_high']}]; chosen = the eligible cell with "
                f"the largest step-1 mean |dlogp|.\n\nChosen: **{summary['chosen'] or 'no cell is eligible'}**\n\n")
    else:
        axes = [a for a in manifest["axes"]]
        per_group = groups(runs, axes, (manifest.get("decision") or {}).get("confidence", 0.95))
        summary = {"groups": per_group.to_dict(orient="records")}
        if args.stage in DECIDED_STAGES:
            rule = manifest.get("decision") or {}
            summary.update(decision=decision(runs, rule), comparison=comparison(runs, rule), envelope=envelope(runs, rule, manifest))
        table = runs
        shown = per_group
        _figure_grid(curves, manifest, args.figure, manifest.get("decision") or {})
        text = f"### {manifest['label']}: {args.stage}\n\n"
        if "decision" in summary:
            text += (f"**Decision** (rule fixed in the config before the {args.stage} ran): "
                     f"{summary['decision']['statement']}\n\n")
        confidence = (manifest.get("decision") or {}).get("confidence", 0.95)
        text += (f"Per group: collapsed / finished runs with an exact {100 * confidence:.0f}% interval on the collapse rate; "
                 "mismatch and phantom-clip rate before the collapse (all steps of runs that did not collapse).\n\n")
    with atomic_path(f"{stem}.csv") as tmp:
        table.to_csv(tmp, index=False)
    write_text(Path(f"{stem}.md"), text + shown.to_markdown(index=False, floatfmt=".3g") + "\n"
                                  + ("\n### Runs\n\n" + runs.to_markdown(index=False, floatfmt=".3g") + "\n"
                                     if args.stage != "pilot" else ""))
    write_text(Path(f"{stem}.json"), json.dumps(_clean(summary), indent=1) + "\n")
    print(text.strip().splitlines()[-1] if text.strip() else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
