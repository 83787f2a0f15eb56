"""The natural-collapse search's statistics: each run's row (:func:`search_rows`) and the stages' rules.

What each stage computes is described in :mod:`analysis.collapse_search` (the command that writes the
tables); the figures are in :mod:`analysis.collapse_figures`. Every function here takes the rows of
:func:`search_rows` (and the curves it returns) and a rule as the manifest holds it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.runs import RUN_SETTINGS, SENSITIVITY_LABELS, flags, runs_table, sensitivity_column  # noqa: F401
from rpa.train.collapse import RULE_VERSION, CollapseThresholds  # noqa: F401

MISMATCH = "mismatch/mean_abs_dlogp"
PHANTOM = "mismatch/phantom_clip_rate"
POWER_RATES = (0.3, 0.5)
"""True per-run collapse rates at which the decision statement gives the rule's power."""
ENTROPY_BINS = 10
"""Entropy-matched mismatch ratio: equal-width bins of log entropy over the steps of both arms."""




def _first(m: pd.DataFrame, key: str):
    return float(m[key].iloc[0]) if key in m and len(m) and pd.notna(m[key].iloc[0]) else None


def _mean(m: pd.DataFrame, key: str):
    return float(m[key].mean()) if key in m and m[key].notna().any() else None


def _max(m: pd.DataFrame, key: str):
    return float(m[key].max()) if key in m and m[key].notna().any() else None


def final_window(run) -> int:
    """``final_entropy``'s window: the run's own smoothing window (``collapse.smoothing_window`` of its
    config), the window of its smoothed final reward, so both "final" values cover the same logged steps."""
    return int(((run.config or {}).get("collapse") or {}).get("smoothing_window",
                                                               CollapseThresholds().smoothing_window))


def _last(m: pd.DataFrame, steps: int, key: str):
    """The mean of ``key`` over the last ``steps`` logged steps; None where the run logged fewer (a window
    longer than the run is refused, not shortened: it would silently average the whole run)."""
    return _mean(m.tail(steps), key) if steps <= len(m) else None


def search_rows(results: Path, manifest: dict | Path, reward_steps: int = 3,
                section: str = "search") -> tuple[pd.DataFrame, pd.DataFrame]:
    """(one row per expected cell, per-step metrics of every run with a log) of a search stage or a
    ``grids:`` entry (``section="grids"``, :mod:`analysis.grid_summary`): each cell's row of
    :func:`analysis.runs.runs_table` and, from its log, these statistics. Windows: ``initial_reward`` is the
    mean of the first ``reward_steps`` logged steps, ``final_entropy`` the mean over the last
    :func:`final_window` logged steps (``final_entropy_steps``, the window), left empty where the run logged
    fewer steps than its window (:func:`_last`); ``last_entropy`` the last logged step's."""
    rows, curves = [], []
    for entry in runs_table(manifest, results, section):
        run, row = entry.run, dict(entry.row)
        if run.metrics:
            m = pd.DataFrame(run.metrics)
            stop = row.get("collapse_step") if row.get("collapsed") else None
            before = m[m["step"] < stop] if stop is not None else m
            drop = min((s for s in (stop, row.get("first_dip_step")) if s is not None and pd.notna(s)), default=None)
            before_drop = m[m["step"] < drop] if drop is not None else m
            last = final_window(run)
            row.update(step1_reward=_first(m, "reward"), step1_entropy=_first(m, "entropy"),
                       step1_mismatch=_first(m, MISMATCH), step1_phantom_clip=_first(m, PHANTOM),
                       initial_reward=float(m["reward"].head(reward_steps).mean()),
                       entropy=_mean(m, "entropy"), final_entropy=_last(m, last, "entropy"),
                       final_entropy_steps=last, last_entropy=_last(m, 1, "entropy"),
                       pre_collapse_mismatch=_mean(before, MISMATCH),
                       max_pre_collapse_mismatch=_max(before, MISMATCH),
                       pre_collapse_phantom_clip=_mean(before, PHANTOM),
                       max_pre_collapse_phantom_clip=_max(before, PHANTOM),
                       max_pre_drop_mismatch=_max(before_drop, MISMATCH),
                       max_pre_drop_phantom_clip=_max(before_drop, PHANTOM))
            # a metric an arm does not log is all missing in its runs: left out, so that the runs' curves
            # concatenate by the columns they have (pandas' dtype rule for all-missing columns is changing)
            curves.append(m.dropna(axis=1, how="all").assign(**entry.labels, seed=entry.cell["seed"]))
        if run.evals:  # held-out reward and accuracy (eval_temperature; 0: greedy) at the first and last evaluation
            first, last = run.evals[0], run.evals[-1]
            row.update(first_eval_step=first["step"], first_eval_reward=first["eval/reward"],
                       first_eval_accuracy=first["eval/accuracy"], first_eval_prompts=first.get("eval/prompts"),
                       final_eval_step=last["step"], final_eval_reward=last["eval/reward"],
                       final_eval_accuracy=last["eval/accuracy"])
        rows.append(row)
    return pd.DataFrame(rows), (pd.concat(curves, ignore_index=True) if curves else pd.DataFrame())


# ------------------------------------------------------------------------------ pilot


def paired_pilot(runs: pd.DataFrame, rule: dict, curves: pd.DataFrame) -> tuple[pd.DataFrame, dict]:
    """The pilot of a paired rule (``kind: paired``): one row per rung (every axis but the arm and the
    seed) with the control's (FP32's) reward gain and stability and the reference's (stock BF16's)
    step-1 mismatch; ``eligible`` = the control learns -- the mean reward of the last ``learn_fraction``
    of its logged steps (at least one) exceeds that of the first by at least ``min_gain`` -- and stays stable
    (finished with status ok, no collapse verdict); ``chosen`` = the eligible rung whose reference has
    the largest step-1 mismatch."""
    arm, ref, ctl = rule.get("arm_axis", "arm"), rule.get("reference_arm", "none"), rule.get("control_arm", "fp32")
    fraction, gain_needed = rule.get("learn_fraction", 0.25), rule.get("min_gain", 0.05)
    rung_axes = [c for c in runs.columns if c not in (arm, "seed", "cell", "state", "status", "wall_s")
                 and c in rule.get("rung_axes", [])]
    rows = []
    for key, g in runs.groupby(rung_axes, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        r, c = g[g[arm] == ref], g[g[arm] == ctl]
        row = {**dict(zip(rung_axes, key)), "reference_cell": r["cell"].iloc[0] if len(r) else None,
               "control_cell": c["cell"].iloc[0] if len(c) else None}
        done = len(r) and len(c) and (r["state"] == "finished").all() and (c["state"] == "finished").all()
        if done:
            cell = c["cell"].iloc[0]
            m = curves[curves["cell"] == cell].sort_values("step") if "cell" in curves else pd.DataFrame()
            n = max(1, round(len(m) * fraction))  # several updates per generation log fewer steps
            first, last = (float(m["reward"].head(n).mean()), float(m["reward"].tail(n).mean())) if len(m) else (None, None)
            stable = bool((c["status"] == "ok").all() and not flags(c["collapsed"]).any())
            row.update(control_first_reward=first, control_last_reward=last,
                       control_gain=None if first is None else last - first, control_stable=stable,
                       control_step1_mismatch=float(c["step1_mismatch"].iloc[0]),
                       reference_step1_mismatch=float(r["step1_mismatch"].iloc[0]),
                       reference_step1_entropy=float(r["step1_entropy"].iloc[0]),
                       reference_initial_reward=float(r["initial_reward"].iloc[0]),
                       wall_s=float(g["wall_s"].sum()))
            row["eligible"] = bool(stable and row["control_gain"] is not None and row["control_gain"] >= gain_needed)
        else:
            row["eligible"] = False
        rows.append(row)
    out = pd.DataFrame(rows)
    out["chosen"] = False
    choice = {"rule": {"kind": "paired", "arm_axis": arm, "reference_arm": ref, "control_arm": ctl,
                       "learn_fraction": fraction, "min_gain": gain_needed, "rung_axes": rung_axes},
              "rungs": int(len(out)), "finished": int(out.get("control_stable", pd.Series(dtype=object)).notna().sum()),
              "eligible": int(out["eligible"].sum())}
    unfinished = int((runs["state"] != "finished").sum())
    if unfinished:
        choice.update(chosen=None, unfinished=unfinished)  # the rule is over the whole pilot
        return out, choice
    if out["eligible"].any():
        eligible = out[out["eligible"]]["reference_step1_mismatch"]
        best = eligible.idxmax()  # the first of equal maxima, in the config's axis order
        out.loc[best, "chosen"] = True
        choice["chosen"] = "/".join(str(out.loc[best, a]) for a in rung_axes)
        choice["chosen_row"] = dict(out.loc[best].items())
        # step 1 is sampled from the same weights with the same seed, so rungs that differ only in a
        # setting that acts after it (the learning rate) can tie exactly: say so beside the choice
        choice["tied_with"] = ["/".join(str(out.loc[i, a]) for a in rung_axes)
                               for i in eligible.index if i != best and eligible[i] == eligible[best]]
    else:
        choice["chosen"] = None
    return out, choice


def pilot(runs: pd.DataFrame, rule: dict) -> tuple[pd.DataFrame, dict]:
    """The pilot table with ``eligible`` and ``chosen``, and the choice."""
    lo, hi, min_entropy = rule.get("reward_low", 0.3), rule.get("reward_high", 0.7), rule.get("min_entropy", 0.3)
    done = runs["step1_entropy"].notna() if "step1_entropy" in runs else pd.Series(False, index=runs.index)
    eligible = done & (runs.get("step1_entropy", np.nan) >= min_entropy) & \
        runs.get("initial_reward", np.nan).between(lo, hi)
    out = runs.assign(eligible=flags(eligible), chosen=False)
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
        collapsed = flags(done["collapsed"]) if "collapsed" in done else pd.Series(dtype=bool)
        k, n = int(collapsed.sum()), len(done)
        low, high = clopper_pearson(k, n, confidence)
        rows.append({**dict(zip(axes, key)), "runs": len(g), "finished": n,
                     "failed": int((g["state"] == "failed").sum()), "missing": int((g["state"] == "missing").sum()),
                     "collapsed": k, "collapse_rate_low": low, "collapse_rate_high": high,
                     "unconfirmed": int((done.get("verdict") == "unconfirmed").sum()) if n else 0,
                     "median_collapse_step": float(done.loc[collapsed, "collapse_step"].median()) if k else None,
                     "final_reward": done["final_reward"].mean() if n else None,
                     "final_reward_sd": done["final_reward"].std() if n > 1 else None,
                     "terminal_reward": done["terminal_reward"].mean() if n and "terminal_reward" in done else None,
                     "absorbing": int(flags(done["absorbing"]).sum())
                     if n and "absorbing" in done else 0,
                     "reward_auc": done["reward_auc"].mean() if n and "reward_auc" in done else None,
                     "entropy": done["entropy"].mean() if n else None,
                     "pre_collapse_mismatch": done["pre_collapse_mismatch"].mean() if n else None,
                     "max_pre_collapse_mismatch": done["max_pre_collapse_mismatch"].max() if n else None,
                     "pre_collapse_phantom_clip": done["pre_collapse_phantom_clip"].mean() if n else None,
                     "max_pre_collapse_phantom_clip": done["max_pre_collapse_phantom_clip"].max() if n else None,
                     "max_pre_drop_mismatch": done["max_pre_drop_mismatch"].max()
                     if n and "max_pre_drop_mismatch" in done else None,
                     "rule_version": RULE_VERSION})
    return pd.DataFrame(rows)


def sensitivity_groups(runs: pd.DataFrame, axes: list[str]) -> pd.DataFrame:
    """The sensitivity companion: per group, finished runs, collapsed and unconfirmed under the
    run's own thresholds and (``collapsed[<variation>]``, ``unconfirmed[<variation>]``) under each
    variation of :func:`rpa.train.collapse.sensitivity_settings`."""
    rows = []
    for key, g in runs.groupby(axes, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        done = g[g["state"] == "finished"]
        row = {**dict(zip(axes, key)), "finished": len(done),
               "collapsed": int((done.get("verdict") == "collapsed").sum()) if len(done) else 0,
               "unconfirmed": int((done.get("verdict") == "unconfirmed").sum()) if len(done) else 0}
        for label in SENSITIVITY_LABELS:
            v = done.get(sensitivity_column(label), pd.Series(dtype=object))
            row[f"collapsed[{label}]"] = int((v == "collapsed").sum())
            row[f"unconfirmed[{label}]"] = int((v == "unconfirmed").sum())
        rows.append(row)
    return pd.DataFrame(rows)


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(max(k, 0), n + 1))


def rule_power(rate: float, need: int = 3, seeds: int = 4, rungs: int = 3) -> float:
    """The probability that the decision rule says "collapses naturally" when the reference
    collapses with a true per-run probability ``rate`` at every one of ``rungs`` rungs of
    ``seeds`` seeds each and the control never does: at least one rung with ``need`` or more
    reference collapses, rungs independent (with the control stable, the pooled condition
    follows)."""
    return 1 - (1 - binomial_tail(need, seeds, rate)) ** rungs


DECIDED_STAGES = ("grid", "lever")
"""Stages the decision rule judges: the grid, and the further lever tried if the grid does not collapse."""


def decision(runs: pd.DataFrame, rule: dict) -> dict:
    """The grid's (or the lever stage's) outcome under the decision rule of the config (see the module doc)."""
    arm, rung = rule.get("arm_axis", "arm"), rule.get("rung_axis", "lr")
    ref, ctl = rule.get("reference_arm", "none"), rule.get("control_arm", "fp32")
    need, allow = rule.get("min_reference_collapsed", 3), rule.get("max_control_collapsed", 0)
    confidence = rule.get("confidence", 0.95)
    done = runs[runs["state"] == "finished"].assign(
        collapsed=lambda d: flags(d["collapsed"]))
    rungs, collapsing = [], []
    for label, g in done.groupby(rung, sort=False):
        r, c = g[g[arm] == ref], g[g[arm] == ctl]
        entry = {"rung": label, "reference": f"{int(r.collapsed.sum())}/{len(r)}",
                 "control": f"{int(c.collapsed.sum())}/{len(c)}",
                 "reference_interval": list(clopper_pearson(int(r.collapsed.sum()), len(r), confidence)),
                 "control_interval": list(clopper_pearson(int(c.collapsed.sum()), len(c), confidence)),
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
    seeds = max((int(e["reference"].split("/")[1]) for e in rungs), default=0)
    out["power"] = {"seeds_per_rung": seeds, "rungs": len(rungs), "min_reference_collapsed": need,
                    "rates": {f"{rate:g}": rule_power(rate, need, seeds, len(rungs)) for rate in POWER_RATES}}
    power = ", ".join(f"{100 * rate:.0f}% with probability {100 * out['power']['rates'][f'{rate:g}']:.0f}%"
                      for rate in POWER_RATES)
    power_text = (f" What the rule can detect: with {seeds} seeds a rung and {len(rungs)} rung{'s' if len(rungs) != 1 else ''}, it finds a true "
                  f"per-run collapse rate of {power} (the control stable)." if seeds and rungs else "")
    per_rung = "; ".join(f"{e['rung']}: {ref} {e['reference']} (exact {100 * confidence:.0f}% interval "
                         f"{e['reference_interval'][0]:.2f}-{e['reference_interval'][1]:.2f}), {ctl} {e['control']}"
                         for e in rungs)
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
                            f"{ctl} {pooled['control_collapsed']}.{power_text}")
    else:
        mismatch, clip = ref_runs["max_pre_collapse_mismatch"].max(), ref_runs["max_pre_collapse_phantom_clip"].max()
        pre_drop = ref_runs["max_pre_drop_mismatch"].max() if "max_pre_drop_mismatch" in ref_runs else mismatch
        entropy = ref_runs["entropy"].mean()
        out.update(outcome="does not collapse naturally", max_mismatch=None if pd.isna(mismatch) else float(mismatch),
                   max_pre_drop_mismatch=None if pd.isna(pre_drop) else float(pre_drop),
                   max_phantom_clip=None if pd.isna(clip) else float(clip),
                   mean_entropy=None if pd.isna(entropy) else float(entropy))
        drop_text = ""
        if pd.notna(pre_drop) and pd.notna(mismatch) and pre_drop < mismatch:
            at = ref_runs.loc[ref_runs["max_pre_collapse_mismatch"].idxmax()]
            drop_text = (f"; {pre_drop:.3g} before any drop: the larger value is from {at['cell']}, after its raw "
                         f"reward dipped below the rule's level at step {int(at['first_dip_step'])}")
        out["statement"] = (f"Stock BF16 ({ref}) does not collapse naturally at this scale: per rung, {per_rung}; "
                            f"pooled, {k}/{n} runs collapsed (exact {100 * confidence:.0f}% interval "
                            f"{low:.2f}-{high:.2f} if the collapse probability were one and the same at every rung), "
                            f"{ctl} {pooled['control_collapsed']}/{pooled['pairs']} paired; "
                            f"up to a pre-collapse mismatch of {mismatch:.3g} (mean |dlogp|, step maximum{drop_text}) "
                            f"and a phantom-clip rate of {clip:.3g}, at a mean policy entropy of {entropy:.2f} "
                            f"nats/token.{power_text}")
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


def entropy_matched_ratio(arm: pd.DataFrame, ref: pd.DataFrame, bins: int = ENTROPY_BINS) -> float | None:
    """The treatment's mismatch relative to the reference's at the same policy entropy: the steps
    of both (columns ``entropy`` and the mismatch, positive) in ``bins`` equal-width bins of log
    entropy over their pooled range; per bin holding both, the difference of the mean log
    mismatch; the weighted mean of those (weight: the smaller of the two step counts),
    exponentiated. Mismatch tracks entropy, so a raw mean ratio compares entropies as much as
    numerics; None without a bin holding both."""
    frames = []
    for is_arm, m in ((1, arm), (0, ref)):
        m = m[(m[MISMATCH] > 0) & (m["entropy"] > 0)]
        frames.append(pd.DataFrame({"lm": np.log(m[MISMATCH].astype(float)), "lh": np.log(m["entropy"].astype(float)),
                                    "arm": is_arm}))
    x = pd.concat(frames, ignore_index=True)
    if x.empty or x["arm"].nunique() < 2:
        return None
    x["bin"] = pd.cut(x["lh"], bins)
    g = x.groupby(["bin", "arm"], observed=True)["lm"].agg(["mean", "size"]).unstack().dropna()
    if g.empty:
        return None
    w = np.minimum(g[("size", 0)], g[("size", 1)])
    return float(np.exp(((g[("mean", 1)] - g[("mean", 0)]) * w).sum() / w.sum()))


def mismatch_ratios(curves: pd.DataFrame, rule: dict) -> dict:
    """Per rung, the treatment's (aligned) in-training mismatch relative to the reference's:
    at step 1 (same warm start, same weights: the numerics alone), per seed, and at matched
    entropy (:func:`entropy_matched_ratio`, steps of every seed pooled); beside the means over
    the steps, which differ as much by how far each arm's policy moved as by its numerics."""
    arm, rung = rule.get("arm_axis", "arm"), rule.get("rung_axis", "lr")
    ref, treat = rule.get("reference_arm", "none"), rule.get("treatment_arm", "all")
    if curves.empty or arm not in curves or MISMATCH not in curves or "entropy" not in curves:
        return {}
    out = {}
    for label, g in curves.groupby(rung, sort=False) if rung in curves else [(None, curves)]:
        a, r = g[g[arm] == treat], g[g[arm] == ref]
        if a.empty or r.empty:
            continue
        step1 = {}
        for seed in sorted(set(a["seed"]) & set(r["seed"])):
            x, y = a[(a["seed"] == seed)].sort_values("step"), r[(r["seed"] == seed)].sort_values("step")
            if len(x) and len(y) and x["step"].iloc[0] == y["step"].iloc[0] and y[MISMATCH].iloc[0] > 0:
                step1[int(seed)] = float(x[MISMATCH].iloc[0] / y[MISMATCH].iloc[0])
        out[str(label)] = {"step1": step1, "entropy_matched": entropy_matched_ratio(a, r),
                           "mean_over_steps": float(a[MISMATCH].mean() / r[MISMATCH].mean())}
    return out


def comparison(runs: pd.DataFrame, rule: dict, curves: pd.DataFrame | None = None) -> dict:
    """Beside the decision, not part of it (exploratory): collapses of the treatment (aligned) arm
    against the reference (stock BF16) with Fisher's exact p; paired by (rung, seed), in how
    many cells the reference's reward AUC is below the control's and the treatment's (sign test);
    and, from the per-step ``curves``, the treatment's mismatch relative to the reference's at
    step 1 and at matched entropy (:func:`mismatch_ratios`)."""
    arm, rung = rule.get("arm_axis", "arm"), rule.get("rung_axis", "lr")
    ref, ctl, treat = rule.get("reference_arm", "none"), rule.get("control_arm", "fp32"), rule.get("treatment_arm", "all")
    done = runs[runs["state"] == "finished"]
    collapsed = flags(done["collapsed"]) if "collapsed" in done else pd.Series(False, done.index)
    r, t = collapsed[done[arm] == ref], collapsed[done[arm] == treat]
    out = {"reference_arm": ref, "treatment_arm": treat, "reference": [int(r.sum()), len(r)],
           "treatment": [int(t.sum()), len(t)],
           "fisher_p": fisher_exact(int(t.sum()), len(t), int(r.sum()), len(r)) if len(r) and len(t) else None,
           "reward_auc_paired": {}}
    if curves is not None:
        out["mismatch_ratio"] = mismatch_ratios(curves, rule)
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


# ------------------------------------------------------------------ the grid's questions (issue 31)


def fisher_one_sided(k1: int, n1: int, k2: int, n2: int) -> float:
    """One-sided Fisher exact p that group 1 collapses *more often* than group 2 (P[X >= k1] under
    the hypergeometric of the margins)."""
    total, ks = n1 + n2, k1 + k2

    def prob(a: int) -> float:
        return math.comb(n1, a) * math.comb(n2, ks - a) / math.comb(total, ks)

    return min(1.0, sum(prob(a) for a in range(k1, min(ks, n1) + 1)))


ZERO_DIFFERENCE = 1e-12
"""A paired difference this small is a zero (a tie): the float error of a contrast whose terms cancel
(weights of 1/3, an interaction of equal runs) is no evidence of a sign. The outcomes are rewards in [0, 1]."""


def _nonzero(x: float) -> bool:
    return abs(x) > ZERO_DIFFERENCE and not math.isnan(x)


def signed_rank_p(differences: list[float]) -> float | None:
    """Exact two-sided Wilcoxon signed-rank p of paired differences (zeros -- within :data:`ZERO_DIFFERENCE`
    -- dropped, average ranks for ties; the sign flips enumerated, so exact for the handful of seeds a CPU
    grid has)."""
    d = [x for x in differences if _nonzero(x)]
    n = len(d)
    if n == 0:
        return None
    order = sorted(range(n), key=lambda i: abs(d[i]))
    ranks = [0.0] * n
    i = 0
    while i < n:  # average ranks over ties of |d|
        j = i
        while j + 1 < n and abs(d[order[j + 1]]) == abs(d[order[i]]):
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    observed = sum(r for r, x in zip(ranks, d) if x > 0)
    mean = sum(ranks) / 2
    extreme = abs(observed - mean)
    count = 0
    for mask in range(1 << n):
        w = sum(ranks[b] for b in range(n) if mask >> b & 1)
        count += abs(w - mean) >= extreme - 1e-12
    return count / (1 << n)


def signed_rank_null(n: int) -> list[int]:
    """How many of the ``2**n`` sign assignments give each signed-rank sum W+ = 0 .. n(n+1)/2, ranks
    1..n without ties (the exact null distribution, by convolution)."""
    counts = [1]
    for rank in range(1, n + 1):
        counts = [(counts[w] if w < len(counts) else 0) + (counts[w - rank] if 0 <= w - rank < len(counts) else 0)
                  for w in range(len(counts) + rank)]
    return counts


def signed_rank_interval(differences: list[float], confidence: float = 0.95) -> dict | None:
    """The Hodges-Lehmann shift of paired differences (median of their Walsh averages) with the exact
    distribution-free interval that inverts the two-sided signed-rank test (Hollander & Wolfe): the k-th
    smallest and k-th largest Walsh average, k the largest with 2 P(W+ < k) <= 1 - confidence, so its
    coverage (returned, exact for continuous symmetric differences) is at least ``confidence``. None when
    no k reaches it (5 pairs or fewer at 95%: the same seeds for which the test cannot reject).

    Zero differences are dropped here as :func:`signed_rank_p` drops them (Wilcoxon's convention), so the
    estimate, the interval and the p come from the same ``pairs`` (returned, with the ``zeros`` dropped)."""
    zeros = sum(1 for x in differences if not math.isnan(x) and not _nonzero(x))
    d = [x for x in differences if _nonzero(x)]
    n = len(d)
    if n == 0:
        return None
    walsh = sorted((d[i] + d[j]) / 2 for i in range(n) for j in range(i, n))
    null, k, below = signed_rank_null(n), 0, 0
    while k < len(null) and 2 * (below + null[k]) / 2 ** n <= 1 - confidence:  # P(W+ <= k) within both tails' budget
        below += null[k]
        k += 1
    if k == 0:
        return None
    return {"estimate": float(np.median(walsh)), "low": walsh[k - 1], "high": walsh[-k],
            "coverage": 1 - 2 * below / 2 ** n, "confidence": confidence, "pairs": n, "zeros": zeros}


def fisher_power(n_a: int, n_b: int, rate_a: float, rate_b: float, alpha: float) -> float:
    """Power of the one-sided Fisher test (a collapses more often than b) at true rates ``rate_a``,
    ``rate_b`` with ``n_a``, ``n_b`` runs: the exact sum over every outcome."""
    power = 0.0
    for k1 in range(n_a + 1):
        p1 = math.comb(n_a, k1) * rate_a ** k1 * (1 - rate_a) ** (n_a - k1)
        for k2 in range(n_b + 1):
            p2 = math.comb(n_b, k2) * rate_b ** k2 * (1 - rate_b) ** (n_b - k2)
            if fisher_one_sided(k1, n_a, k2, n_b) < alpha:
                power += p1 * p2
    return power


def smallest_detectable_rate(n: int, alpha: float, power: float = 0.8, control_rate: float = 0.0) -> float | None:
    """The smallest true collapse rate of one arm that the one-sided Fisher test against ``n`` control
    runs (true rate ``control_rate``) detects with at least ``power``, on a 1% grid (None: none up to 1)."""
    for step in range(1, 101):
        rate = step / 100
        if fisher_power(n, n, rate, control_rate, alpha) >= power:
            return rate
    return None


def signed_rank_power(n: int, effect: float, alpha: float, draws: int = 2000, seed: int = 0) -> float:
    """Power of the exact two-sided signed-rank test on ``n`` paired differences drawn normal with a
    mean of ``effect`` standard deviations (a seeded Monte Carlo estimate)."""
    rng = np.random.default_rng(seed)
    hits = sum(1 for _ in range(draws) if (signed_rank_p(list(rng.normal(effect, 1.0, n))) or 1.0) < alpha)
    return hits / draws


def smallest_detectable_effect(n: int, alpha: float, power: float = 0.8) -> float | None:
    """The smallest mean paired difference (in standard deviations of the differences) the signed-rank
    test on ``n`` seeds detects with at least ``power`` (0.1 grid; None: none up to 3 sd)."""
    for step in range(1, 31):
        effect = step / 10
        if signed_rank_power(n, effect, alpha) >= power:
            return effect
    return None


def questions(runs: pd.DataFrame, rule: dict) -> dict:
    """Each pre-registered question of the grid (``rule["questions"]``): does arm ``a`` collapse more
    often than arm ``b`` (one-sided Fisher exact on the collapse counts, at ``alpha``) -- the verdict --
    and, beside it, the reward AUC of ``a`` minus ``b`` paired by seed (exact signed-rank, two-sided)."""
    arm, alpha = rule.get("arm_axis", "arm"), rule.get("alpha", 0.05)
    done = runs[runs["state"] == "finished"].assign(collapsed=lambda d: flags(d["collapsed"]))
    unfinished = int((runs["state"] != "finished").sum())
    out = {"alpha": alpha, "unfinished": unfinished, "questions": {}}
    for name, q in (rule.get("questions") or {}).items():
        a, b = done[done[arm] == q["a"]], done[done[arm] == q["b"]]
        ka, kb = int(a.collapsed.sum()), int(b.collapsed.sum())
        entry = {"question": q.get("question", name), "a": q["a"], "b": q["b"], "a_collapsed": [ka, len(a)],
                 "b_collapsed": [kb, len(b)],
                 "a_interval": list(clopper_pearson(ka, len(a))), "b_interval": list(clopper_pearson(kb, len(b)))}
        entry["fisher_p"] = fisher_one_sided(ka, len(a), kb, len(b)) if len(a) and len(b) else None
        auc = done[done[arm].isin([q["a"], q["b"]])].pivot_table(index="seed", columns=arm, values="reward_auc",
                                                                 aggfunc="first")
        if q["a"] in auc and q["b"] in auc:
            pairs = auc[[q["a"], q["b"]]].dropna()
            diff = (pairs[q["a"]] - pairs[q["b"]]).tolist()
            entry["reward_auc"] = {"pairs": len(diff), "mean_difference": float(np.mean(diff)) if diff else None,
                                   "a_lower": int(sum(x < -ZERO_DIFFERENCE for x in diff)), "signed_rank_p": signed_rank_p(diff),
                                   "shift": signed_rank_interval(diff, rule.get("confidence", 0.95))}
        if unfinished:
            entry["answer"] = "grid incomplete"
        else:
            entry["answer"] = "yes" if entry["fisher_p"] is not None and entry["fisher_p"] < alpha else "no"
        out["questions"][name] = entry
    return out


POST_HOC_OUTCOMES = ("reward_auc", "learning_gain")
"""A post-hoc comparison's per-run outcome: ``reward_auc``, or ``learning_gain`` = reward AUC minus the same
run's step-1 reward (the starting point taken out)."""


def _outcome(runs: pd.DataFrame, outcome: str) -> pd.Series:
    if outcome not in POST_HOC_OUTCOMES:
        raise ValueError(f"post_hoc outcome {outcome!r}: expected one of {', '.join(POST_HOC_OUTCOMES)}")
    return runs["reward_auc"] if outcome == "reward_auc" else runs["reward_auc"] - runs["step1_reward"]


def contrast_weights(c: dict) -> dict[str, float]:
    """A comparison's arms and weights per seed: ``contrast: {arm: weight}`` as written, or ``a`` (an arm, or
    a list pooled as their mean: weight 1/len each) minus ``b`` (weight -1), weights of a repeated arm added."""
    if "contrast" in c:
        return {str(k): float(v) for k, v in c["contrast"].items()}
    a = list(c["a"]) if isinstance(c["a"], (list, tuple)) else [c["a"]]
    weights: dict[str, float] = {}
    for x, w in [*((x, 1 / len(a)) for x in a), (c["b"], -1.0)]:
        weights[x] = weights.get(x, 0.0) + w
    return weights


def paired_contrast(done: pd.DataFrame, curves: pd.DataFrame, c: dict, arm: str, confidence: float,
                    rung: str | None = None) -> dict:
    """One paired comparison of finished runs: per pair -- a seed, within one rung where the grid has
    several (``rung``, an axis) -- the weighted sum of the arms' outcomes (:func:`contrast_weights`; pairs
    where every arm has one), its mean, how many pairs are below 0, the exact signed-rank p and the
    Hodges-Lehmann interval; with per-step curves, the same contrast of the raw training reward per logged
    step (mean over pairs). ``not_computed`` says why where an arm has no finished run with an outcome."""
    weights, outcome = contrast_weights(c), c.get("outcome", "reward_auc")
    index = [rung, "seed"] if rung and rung in done else ["seed"]
    table = done.assign(_v=_outcome(done, outcome)).pivot_table(index=index, columns=arm, values="_v",
                                                                aggfunc="first")
    entry: dict = {"contrast": weights, "outcome": outcome}
    if "contrast" not in c:
        entry.update(a=[x for x, w in weights.items() if w > 0], b=c["b"])
    missing = [x for x in weights if x not in table]
    if missing:
        return {**entry, "pairs": 0, "not_computed": f"no finished run with a {outcome} in {', '.join(missing)}"}
    pairs = table[list(weights)].dropna()
    diff = sum(pairs[x] * w for x, w in weights.items()).tolist() if len(pairs) else []
    entry.update(pairs=len(diff), mean_difference=float(np.mean(diff)) if diff else None,
                 a_lower=int(sum(x < -ZERO_DIFFERENCE for x in diff)), signed_rank_p=signed_rank_p(diff),
                 shift=signed_rank_interval(diff, confidence))
    if not diff:
        entry["not_computed"] = "no pair in which every arm has a finished run"
    if len(curves) and "reward" in curves:
        step_index = [*index, "step"] if set(index) <= set(curves) else ["seed", "step"]
        per = curves[curves[arm].isin(list(weights))].pivot_table(index=step_index, columns=arm, values="reward",
                                                                   aggfunc="first")
        per = per[[x for x in weights if x in per]].dropna() if all(x in per for x in weights) else per.iloc[0:0]
        if len(per):
            gap = sum(per[x] * w for x, w in weights.items()).groupby(level="step").mean()
            entry["reward_gap_by_step"] = {int(k): float(v) for k, v in gap.items()}
    return entry


def leave_one_out(done: pd.DataFrame, c: dict, arm: str, confidence: float, alpha: float,
                  rung: str | None = None) -> dict:
    """How far a paired contrast (:func:`paired_contrast`) rests on any one seed: computed again with each seed
    left out -- per seed its signed-rank p and interval, the range of the p, and the seeds whose removal changes
    the reading at ``alpha`` (interval and p, as :func:`paired_reading` reads them)."""
    full = paired_reading(paired_contrast(done, pd.DataFrame(), c, arm, confidence, rung), alpha)
    out: dict = {"reading": full, "without": {}}
    for seed in sorted(done["seed"].unique()):
        entry = paired_contrast(done[done["seed"] != seed], pd.DataFrame(), c, arm, confidence, rung)
        shift = entry.get("shift") or {}
        out["without"][int(seed)] = {"p": entry.get("signed_rank_p"), "low": shift.get("low"),
                                     "high": shift.get("high"), "reading": paired_reading(entry, alpha)}
    ps = [w["p"] for w in out["without"].values() if w["p"] is not None]
    out["p_range"] = [min(ps), max(ps)] if ps else None
    out["changes_reading"] = [s for s, w in out["without"].items() if w["reading"] != full]
    return out


def paired_reading(entry: dict, alpha: float) -> str:
    """A paired contrast read at ``alpha``: ``below 0`` (its interval's upper end < 0 and p < alpha), ``above 0``
    (the lower end > 0 and p < alpha), else ``not resolved``."""
    shift, p = entry.get("shift") or {}, entry.get("signed_rank_p")
    if not shift or p is None or p >= alpha:
        return "not resolved"
    return "below 0" if shift["high"] < 0 else "above 0" if shift["low"] > 0 else "not resolved"


def effects(runs: pd.DataFrame, curves: pd.DataFrame, rule: dict) -> dict:
    """The pre-registered paired effects of a factorial grid (``decision.effects``: each a ``contrast`` of
    arms on the rule's ``outcome``), computed as :func:`paired_contrast`; ``incomplete`` while any run is
    unfinished (no effect is read from part of the grid)."""
    arm, confidence = rule.get("arm_axis", "arm"), rule.get("confidence", 0.95)
    unfinished = int((runs["state"] != "finished").sum())
    out = {"outcome": rule.get("outcome", "learning_gain"), "unfinished": unfinished, "effects": {}}
    if unfinished:
        return out
    done = runs[runs["state"] == "finished"]
    types = sorted(done["cpu_type"].dropna().unique()) if "cpu_type" in done else []
    if len(types) > 1:  # BF16 bits differ between CPU types: arms compared across them are not comparable
        out["refused"] = f"the runs were made on {len(types)} CPU types ({'; '.join(types)}); compare within one"
        return out
    unrecorded = int(done["cpu_type"].isna().sum()) if "cpu_type" in done else 0
    if types and unrecorded:  # a run whose CPU is unknown may be of another type
        out["refused"] = (f"{unrecorded} of {len(done)} runs record no CPU beside runs of {types[0]}; "
                          "run them again where the others ran")
        return out
    out["cpu_type"] = types[0] if types else None
    for name, e in (rule.get("effects") or {}).items():
        spec = {"contrast": e["contrast"], "outcome": out["outcome"]}
        entry = paired_contrast(done, curves, spec, arm, confidence, rule.get("rung_axis"))
        out["effects"][name] = {"question": e.get("question", name), **entry}
    return out


def post_hoc(runs: pd.DataFrame, curves: pd.DataFrame, spec: dict, rule: dict) -> dict:
    """What the grid's data say beyond its registered questions, each item labelled post hoc: the
    comparisons of ``spec["comparisons"]`` (config ``post_hoc``, written after the grid ran: ``a`` an arm or a
    list of arms pooled per seed as their mean, ``b`` an arm, ``outcome`` of :data:`POST_HOC_OUTCOMES`),
    each paired by seed with the exact signed-rank p and Hodges-Lehmann interval of the questions, and the
    pooled reward gap per logged step; and per arm, means over seeds: step-1 training reward, raw reward gain
    from the first logged step to the terminal reward (mean of the last :data:`TERMINAL_STEPS`), entropy at
    the first and last logged step (runs whose entropy fell), the last step's entropy range, and the first
    held-out evaluation -- whether it is one measurement (identical over seeds) and how many prompts it
    solved."""
    arm, confidence = rule.get("arm_axis", "arm"), rule.get("confidence", 0.95)
    done = runs[runs["state"] == "finished"]
    out: dict = {"comparisons": {}, "arms": {}}
    for name, c in (spec.get("comparisons") or {}).items():
        out["comparisons"][name] = paired_contrast(done, curves, c, arm, confidence, rule.get("rung_axis"))
    for name, g in done.groupby(arm, sort=False):
        both = g[[c for c in ("first_eval_accuracy", "first_eval_prompts") if c in g]].dropna()
        evals = both["first_eval_accuracy"] if "first_eval_accuracy" in both else pd.Series(dtype=float)
        prompts = both["first_eval_prompts"] if "first_eval_prompts" in both else pd.Series(dtype=float)
        first, last = g["step1_entropy"], g["last_entropy"]
        out["arms"][str(name)] = {
            "runs": int(len(g)), "step1_reward": float(g["step1_reward"].mean()),
            "reward_gain": float((g["terminal_reward"] - g["step1_reward"]).mean()),
            "step1_entropy": float(first.mean()), "last_entropy": float(last.mean()),
            "entropy_fell": int((last < first).sum()),
            "last_entropy_range": [float(last.min()), float(last.max())],
            "first_eval_accuracy": sorted({float(v) for v in evals}),
            "first_eval_one_measurement": bool(len(evals) > 1 and evals.nunique() == 1),
            "first_eval_solved": sorted({round(float(v) * int(n)) for v, n in zip(evals, prompts)}),
            "eval_prompts": int(prompts.iloc[0]) if len(prompts) and prompts.nunique() == 1 else None}
    return out


def envelope(runs: pd.DataFrame, rule: dict, manifest: dict) -> dict:
    """What the reference (stock BF16) arm's finished runs explored: models, settings, step-1 and
    final entropy, the largest mismatch and phantom-clip rate before any collapse and before any
    drop (:func:`rpa.train.collapse.first_dip_step`)."""
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
            "final_entropy_steps": values("final_entropy_steps"),
            "mean_entropy": span("entropy", "mean"),
            "max_pre_collapse_mismatch": span("max_pre_collapse_mismatch", "max"),
            "max_pre_collapse_phantom_clip": span("max_pre_collapse_phantom_clip", "max"),
            "max_pre_drop_mismatch": span("max_pre_drop_mismatch", "max"),
            "max_pre_drop_phantom_clip": span("max_pre_drop_phantom_clip", "max")}
