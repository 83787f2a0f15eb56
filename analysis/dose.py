"""The positive control's dose-response: collapse, reward and accuracy vs the *measured*
trainer-sampler mismatch, per importance-sampling correction and old-logprob setting.

Reads ``RESULTS/dose/manifest.json`` and the run of each cell it lists
(``dose/<arm>/<correction>-<old>/seed<N>``, :func:`analysis.runs.runs_table`). Verdicts are recomputed from ``metrics.jsonl`` with the thresholds of each
run's config (:func:`rpa.train.collapse.run_verdict`), so the tables follow the current
definition: ``stable``, ``unconfirmed`` (a drop the run ended too soon to judge; counted in its
own column, never as stable) or ``collapsed``; grad-norm spikes and recoveries are reported
beside them. Writes

* ``dose_runs.csv`` -- one row per run (:data:`RUN_COLUMNS`), with its verdict under each
  variation of :func:`rpa.train.collapse.sensitivity_settings`, the rule version that produced
  it (``rule_version``), whether the run's ``summary.json`` holds an earlier rule's different
  verdict (``summary_superseded``), and beside the smoothed final reward the raw terminal reward
  and the absorbing end state (:func:`rpa.train.collapse.terminal_state`);
* ``dose.csv`` -- one row per arm x correction x old logprobs (means over seeds);
* ``dose_sensitivity.csv`` -- per arm x correction x old logprobs, the collapsed (and
  unconfirmed) counts under each variation of the collapse thresholds;
* ``dose.md`` -- all of them, the collapse threshold per curve and where the BF16 arms sit;
* a figure: collapse fraction, final reward and phantom-clip rate vs measured mismatch.

**The dose** (x-axis) of a run is its mismatch over a fixed *early window*: the mean of
``mismatch/mean_abs_dlogp`` (and of every other ``mismatch/*`` column) over steps
1..K (``--mismatch-steps``, default :data:`MISMATCH_STEPS`), the same window for every run and
ending before any run of the committed grid collapsed. The mismatch of a collapsing run rises
after its collapse (a collapsed policy is further from the sampler's), so a mean over all steps
would place collapsed runs further right partly *because* they collapsed.
``pre_drop_mean_abs_dlogp`` (steps before the run's collapse or unconfirmed drop; all steps
otherwise) is reported beside it.

Threshold: the dose at which half the runs of a curve collapse, from a logistic fit on
x = log10(dose) (``logit p = b (x - theta)``, ``b >= 0``), with a profile-likelihood 95%
interval for theta: every theta on a fine grid over the doses tried whose profile
log-likelihood (maximised over b) is within 3.841/2 of the maximum; where that set reaches the
smallest or largest dose tried, that side is unbounded ("beyond the doses tried"). A
bootstrap over runs reports how many resamples are degenerate (one class only, or perfectly
separated: no finite fit), a measure of how thin the overlap is. Where the runs separate
perfectly the fit has no finite slope and the threshold is the bracket between the largest
stable and the smallest collapsed dose. Unconfirmed runs are left out of the fit (counted).
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

from analysis.runs import (SENSITIVITY_LABELS, SPIKE_COLUMNS, flags, grid_table,  # noqa: E402
                           sensitivity_column)
from rpa.core.jsonfiles import atomic_path, write_text  # noqa: E402
from rpa.train.collapse import RULE_VERSION, TERMINAL_STEPS, CollapseThresholds, rule_text  # noqa: E402

MISMATCH_STEPS = 4
"""Default early window (steps 1..K) over which a run's mismatch is averaged for the dose axis.
In the committed grid (``results/reference/cpu/dose``, 40 steps per run) the earliest collapse
is at step 10 (perturb-mantissa1, old=sampler, seed 0, IS off and TIS), and the earliest drop
under any sensitivity variation at step 9 (drop fraction 0.6). The smoothed reward at that drop
averages steps 5-9 (``smoothing_window`` 5), so K = 9 - 5 = 4 is the largest window in which no
step belongs to the low stretch of any run's drop, under the rule or any of its variations (the
mismatch of a falling run already climbs during that stretch). ``dose.md`` reports the earliest
collapse step of the grid it reads and warns when K reaches it."""

MISMATCH_COLUMNS = {"mean_abs_dlogp": "mismatch/mean_abs_dlogp", "kl_k3": "mismatch/kl_k3",
                    "seq_log_ratio_mean_abs": "mismatch/seq_log_ratio_mean_abs",
                    "phantom_clip_rate": "mismatch/phantom_clip_rate"}
"""Mismatch columns averaged over the early window (run column: metrics key)."""


INVALID_REASON = ("invalid: IS correction applied twice (old logprobs from the sampler make PPO's ratio pi/mu, and "
                  "TRL multiplies the loss by its clipped pi_old/mu again); such runs are refused now")


def invalid_setting(correction: str, old: str) -> bool:
    """A grid setting whose runs were invalid: an IS correction with old logprobs from the
    sampler (``rpa.train.config`` refuses it now; committed runs are kept and marked)."""
    return correction != "off" and old == "sampler"


RUN_COLUMNS = ("arm", "dose_bits", "is_correction", "old_logprobs", "seed", "invalid", "status", "verdict",
               "collapsed",
               "collapse_step", "unconfirmed_drop_step", "recovered_step", "grad_spikes", "first_grad_spike_step",
               "max_grad_spike_factor", "steps", "peak_reward", "final_reward", "terminal_reward", "absorbing",
               "rule_version", "summary_superseded", "final_eval_accuracy",
               "final_eval_reward", "mismatch_steps", *MISMATCH_COLUMNS, "pre_drop_mean_abs_dlogp",
               "all_steps_mean_abs_dlogp", "clip_ratio", "sync_over_tolerance_steps",
               *(sensitivity_column(label) for label in SENSITIVITY_LABELS))
INT_COLUMNS = ("dose_bits", "collapse_step", "unconfirmed_drop_step", "recovered_step", "grad_spikes",
               "first_grad_spike_step", "steps", "mismatch_steps", "sync_over_tolerance_steps")
ANCHORS = ("fp32", "bf16-none", "bf16-all", "fp16")
GROUP_KEYS = ["arm", "dose_bits", "is_correction", "old_logprobs"]


def window_means(metrics: list[dict], k: int, before_step: int | None = None) -> dict[str, float]:
    """Means of the mismatch columns over steps 1..k, and of ``mean_abs_dlogp`` over the steps
    before ``before_step`` (all steps if None) and over all steps."""
    m = pd.DataFrame(metrics)
    early = m[m["step"] <= k]
    pre = m if before_step is None else m[m["step"] < before_step]
    out = {col: early[key].mean() if key in m else np.nan for col, key in MISMATCH_COLUMNS.items()}
    key = MISMATCH_COLUMNS["mean_abs_dlogp"]
    out["pre_drop_mean_abs_dlogp"] = pre[key].mean() if key in m and len(pre) else np.nan
    out["all_steps_mean_abs_dlogp"] = m[key].mean() if key in m else np.nan
    return out


def dose_rows(results: Path, mismatch_steps: int = MISMATCH_STEPS) -> pd.DataFrame:
    """One row per cell of the positive control (``results/dose/manifest.json``, read by
    :func:`analysis.runs.runs_table`; a cell that never ran: status ``missing``), in the order of the
    cells' folders, columns :data:`RUN_COLUMNS`. The arm is the cell's label; the IS correction, the
    old-logprob source and the dose what the run's config ran (the cell's labels and the manifest's
    ``doses`` for a cell without a config)."""
    if mismatch_steps < 1:
        raise ValueError(f"mismatch_steps must be >= 1, got {mismatch_steps}")
    table = grid_table(results, "dose")
    doses = table.manifest.get("doses") or {}
    rows = []
    for entry in sorted(table, key=lambda e: Path(e.cell["cell"])):  # the table's order: its runs' folders
        run, labels = entry.run, entry.labels
        cfg = run.config
        if cfg is not None:  # what the run ran, not its folder's name
            correction, old = cfg["is_correction"], cfg["old_logprobs"]
            bits = (cfg["numerics"].get("sampler_perturbation") or {}).get("mantissa_bits")
        else:
            correction, old, bits = labels["is_correction"], labels["old_logprobs"], doses.get(labels["arm"])
        row = {**entry.row, "arm": labels["arm"], "dose_bits": bits, "is_correction": correction,
               "old_logprobs": old, "invalid": invalid_setting(correction, old),
               "status": run.status or "missing", "mismatch_steps": mismatch_steps}
        verdict = run.verdict or {}
        if run.judged:
            row.update({k: verdict.get(k) for k in SPIKE_COLUMNS})
        if run.metrics:
            m = pd.DataFrame(run.metrics)
            drop = verdict.get("collapse_step") or verdict.get("unconfirmed_drop_step")
            row.update(window_means(run.metrics, mismatch_steps, drop),
                       clip_ratio=m["clip_ratio/region_mean"].mean(),
                       sync_over_tolerance_steps=int(m.get("sync/over_tolerance", pd.Series(dtype=float)).sum()))
        if run.evals:
            row.update(final_eval_accuracy=run.evals[-1]["eval/accuracy"], final_eval_reward=run.evals[-1]["eval/reward"])
        rows.append(row)
    if not rows:
        raise SystemExit(f"no dose runs under {results}/dose")
    out = pd.DataFrame(rows).reindex(columns=list(RUN_COLUMNS))
    for col in INT_COLUMNS:
        out[col] = pd.to_numeric(out[col]).astype("Int64")
    return out


def counted(runs: pd.DataFrame) -> pd.DataFrame:
    """``collapsed`` as 0/1, so that a group of one run sums to a count, not a bool; likewise
    ``unconfirmed`` (verdict ``unconfirmed``) and ``recovered`` (a recovery step)."""
    verdict = runs["verdict"] if "verdict" in runs else pd.Series("", index=runs.index)
    spikes = pd.to_numeric(runs["grad_spikes"], errors="coerce") if "grad_spikes" in runs else \
        pd.Series(np.nan, index=runs.index)
    recovered = runs["recovered_step"].notna() if "recovered_step" in runs else pd.Series(False, index=runs.index)
    absorbing = runs["absorbing"] if "absorbing" in runs else pd.Series(False, index=runs.index)
    return runs.assign(collapsed=flags(runs["collapsed"]).astype(int),
                       absorbing=flags(absorbing).astype(int),
                       unconfirmed=(verdict == "unconfirmed").astype(int), recovered=recovered.astype(int),
                       grad_spikes=spikes.fillna(0).astype(int), grad_spike_runs=(spikes.fillna(0) > 0).astype(int))


def mismatch_steps_of(runs: pd.DataFrame) -> int | None:
    """The early window K the runs' mismatch columns were averaged over (None for an old table
    without it)."""
    if "mismatch_steps" not in runs or runs["mismatch_steps"].dropna().empty:
        return None
    ks = set(runs["mismatch_steps"].dropna().astype(int))
    if len(ks) > 1:
        raise ValueError(f"runs averaged over different early windows: {sorted(ks)}")
    return ks.pop()


def window_text(k: int | None) -> str:
    return "mean |dlogp| over all steps" if k is None else f"mean |dlogp| over steps 1-{k}"


def groups(runs: pd.DataFrame) -> pd.DataFrame:
    ok = counted(runs[runs["status"] != "missing"])
    g = ok.groupby(GROUP_KEYS, dropna=False, sort=False)
    extra = {c: (c, "mean") for c in ("pre_drop_mean_abs_dlogp", "all_steps_mean_abs_dlogp") if c in ok}
    out = g.agg(runs=("seed", "size"), collapsed=("collapsed", "sum"), unconfirmed=("unconfirmed", "sum"),
                recovered=("recovered", "sum"), grad_spike_runs=("grad_spike_runs", "sum"),
                grad_spikes=("grad_spikes", "sum"),
                mean_abs_dlogp=("mean_abs_dlogp", "mean"), **extra,
                seq_log_ratio_mean_abs=("seq_log_ratio_mean_abs", "mean"),
                phantom_clip_rate=("phantom_clip_rate", "mean"), final_reward=("final_reward", "mean"),
                final_reward_sd=("final_reward", "std"),
                **({"terminal_reward": ("terminal_reward", "mean"), "absorbing": ("absorbing", "sum")}
                   if "terminal_reward" in ok else {}),
                final_eval_accuracy=("final_eval_accuracy", "mean"),
                final_eval_accuracy_sd=("final_eval_accuracy", "std")).reset_index()
    out["collapse_fraction"] = out["collapsed"] / out["runs"]
    missing = runs[runs["status"] == "missing"].groupby(["arm", "is_correction", "old_logprobs"]).size()
    out["missing_runs"] = [int(missing.get((a, c, o), 0)) for a, c, o in
                           zip(out["arm"], out["is_correction"], out["old_logprobs"])]
    out["mismatch_steps"] = mismatch_steps_of(runs)
    out["invalid"] = [invalid_setting(c, o) for c, o in zip(out["is_correction"], out["old_logprobs"])]
    out["rule_version"] = RULE_VERSION
    return out.sort_values(["is_correction", "old_logprobs", "mean_abs_dlogp"]).reset_index(drop=True)


def sensitivity_table(runs: pd.DataFrame) -> pd.DataFrame:
    """Per arm x correction x old logprobs: runs, collapsed/unconfirmed under the run's own
    thresholds, and collapsed (``collapsed[<variation>]``) and unconfirmed counts under each
    variation of :func:`rpa.train.collapse.sensitivity_settings`."""
    ok = counted(runs[runs["status"] != "missing"])
    cols = {}
    for label in SENSITIVITY_LABELS:
        v = ok[sensitivity_column(label)]
        cols[f"collapsed[{label}]"] = (v == "collapsed").astype(int)
        cols[f"unconfirmed[{label}]"] = (v == "unconfirmed").astype(int)
    ok = ok.assign(**cols)
    out = ok.groupby(GROUP_KEYS, dropna=False, sort=False).agg(
        runs=("seed", "size"), collapsed=("collapsed", "sum"), unconfirmed=("unconfirmed", "sum"),
        mean_abs_dlogp=("mean_abs_dlogp", "mean"), **{c: (c, "sum") for c in cols}).reset_index()
    out["mismatch_steps"] = mismatch_steps_of(runs)
    out["invalid"] = [invalid_setting(c, o) for c, o in zip(out["is_correction"], out["old_logprobs"])]
    return out.sort_values(["is_correction", "old_logprobs", "mean_abs_dlogp"]).reset_index(drop=True)


# ------------------------------------------------------------------------ threshold

CHI2_1_95 = 3.841
"""95% quantile of chi-square with one degree of freedom (the profile-likelihood cut)."""


def _separated(x: np.ndarray, y: np.ndarray) -> bool:
    """One class only, or the classes separated on x: no finite maximum-likelihood slope."""
    return bool(y.min() == y.max() or x[y == 0].max() < x[y == 1].min() or x[y == 1].max() < x[y == 0].min())


def _logistic_fit(x: np.ndarray, y: np.ndarray, iters: int = 50) -> tuple[float, float] | None:
    """(intercept, slope) of P(y) = sigmoid(a + b x) by Newton's method; None if no finite fit."""
    if _separated(x, y):
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


def _loglik(eta: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Bernoulli log-likelihood of logits ``eta`` (last axis: runs)."""
    return (y * eta - np.logaddexp(0.0, eta)).sum(axis=-1)


def profile_loglik(x: np.ndarray, y: np.ndarray, thetas: np.ndarray, b_max: float = 1e3,
                   iters: int = 80) -> np.ndarray:
    """max over 0 <= b <= b_max of the log-likelihood of ``logit p = b (x - theta)``, per theta.

    The log-likelihood is concave in b, so its maximiser is 0 where the derivative at 0 is not
    positive and otherwise the root of the derivative, found by bisection (b_max where the
    derivative is still positive: the data are separated at that theta)."""
    d = x[None, :] - thetas[:, None]

    def slope(b: np.ndarray) -> np.ndarray:
        p = 0.5 * (1 + np.tanh(b[:, None] * d / 2))  # sigmoid, without overflow
        return ((y - p) * d).sum(axis=1)

    lo, hi = np.zeros(len(thetas)), np.full(len(thetas), b_max)
    for _ in range(iters):
        mid = (lo + hi) / 2
        up = slope(mid) > 0
        lo, hi = np.where(up, mid, lo), np.where(up, hi, mid)
    b = np.where(slope(np.zeros(len(thetas))) <= 0, 0.0, (lo + hi) / 2)
    return _loglik(b[:, None] * d, y)


def threshold(curve: pd.DataFrame, boot: int = 1000, seed: int = 0, grid: int = 4001) -> dict:
    """Dose at which half the runs of one curve collapse (see the module doc)."""
    d = curve.dropna(subset=["mean_abs_dlogp", "collapsed"])
    judged = d[d["verdict"] != "unconfirmed"] if "verdict" in d else d
    x = np.log10(judged["mean_abs_dlogp"].to_numpy(float))
    y = judged["collapsed"].astype(bool).to_numpy(float)
    out = {"runs": int(len(judged)), "collapsed": int(y.sum()), "unconfirmed_left_out": int(len(d) - len(judged)),
           "interval": None, "estimate": None, "low": None, "high": None, "bootstrap_degenerate": None,
           "boot": None, "extrapolated": None}
    if not len(x):
        return {**out, "kind": "no runs"}
    if y.sum() == 0:
        return {**out, "kind": "none collapsed", "low": float(10 ** x.max())}
    if y.sum() == len(y):
        return {**out, "kind": "all collapsed", "high": float(10 ** x.min())}
    rng = np.random.default_rng(seed)
    degenerate = sum(_separated(x[idx], y[idx]) for idx in (rng.integers(0, len(x), len(x)) for _ in range(boot)))
    out.update(bootstrap_degenerate=int(degenerate), boot=int(boot))
    fit = _logistic_fit(x, y)
    stable_max, collapsed_min = x[y == 0].max(), x[y == 1].min()
    if fit is None:
        return {**out, "kind": "bracket", "interval": "bracket", "low": float(10 ** min(stable_max, collapsed_min)),
                "high": float(10 ** max(stable_max, collapsed_min))}
    if fit[1] <= 0:
        return {**out, "kind": "no increasing trend"}
    est = -fit[0] / fit[1]
    thetas = np.linspace(x.min(), x.max(), grid)
    prof = profile_loglik(x, y, thetas)
    l_hat = max(float(_loglik(fit[0] + fit[1] * x, y)), float(prof.max()))
    inside = 2 * (l_hat - prof) <= CHI2_1_95
    i = int(np.clip(np.searchsorted(thetas, est), 0, grid - 1))
    if not inside[i]:  # the estimate lies beyond the doses tried: start from that edge
        i = 0 if est < thetas[0] else grid - 1
    lo_i, hi_i = i, i
    while lo_i > 0 and inside[lo_i - 1]:
        lo_i -= 1
    while hi_i < grid - 1 and inside[hi_i + 1]:
        hi_i += 1
    return {**out, "kind": "logistic", "interval": "profile-likelihood 95%", "estimate": float(10 ** est),
            "extrapolated": bool(est < x.min() or est > x.max()),
            "low": None if lo_i == 0 and inside[0] else float(10 ** thetas[lo_i]),
            "high": None if hi_i == grid - 1 and inside[-1] else float(10 ** thetas[hi_i])}


def dose_arms(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs of the dose curves: stock BF16 and the perturbed samplers (not the anchors,
    which ran only with IS off and would skew that curve alone)."""
    valid = ~pd.Series([invalid_setting(c, o) for c, o in zip(runs["is_correction"], runs["old_logprobs"])],
                       index=runs.index, dtype=bool)
    return runs[(runs["status"] != "missing") & valid
                & (runs["arm"].str.startswith("perturb-") | (runs["arm"] == "bf16-none"))]


def thresholds(runs: pd.DataFrame, boot: int = 1000) -> pd.DataFrame:
    rows = []
    for (correction, old), curve in dose_arms(runs).groupby(["is_correction", "old_logprobs"]):
        rows.append({"is_correction": correction, "old_logprobs": old, **threshold(curve, boot=boot),
                     "mismatch_steps": mismatch_steps_of(runs)})
    ran = runs[(runs["status"] != "missing")]
    for (correction, old), curve in ran.groupby(["is_correction", "old_logprobs"]):
        if invalid_setting(correction, old):
            rows.append({"is_correction": correction, "old_logprobs": old, "runs": int(len(curve)),
                         "collapsed": int(counted(curve)["collapsed"].sum()), "unconfirmed_left_out": 0,
                         "kind": "invalid", "estimate": None, "low": None, "high": None,
                         "mismatch_steps": mismatch_steps_of(runs)})
    out = pd.DataFrame(rows).sort_values(["is_correction", "old_logprobs"]).reset_index(drop=True)
    for col in ("bootstrap_degenerate", "boot", "interval", "extrapolated"):
        if col not in out:
            out[col] = None
    for col in ("bootstrap_degenerate", "boot", "mismatch_steps"):
        out[col] = out[col].astype("Int64")
    return out


def sensitivity_thresholds(runs: pd.DataFrame) -> pd.DataFrame:
    """Per curve and variation of the collapse thresholds: collapsed/runs and the threshold
    (point estimate or bracket; no bootstrap)."""
    rows = []
    for label in SENSITIVITY_LABELS:
        v = runs[sensitivity_column(label)]
        varied = runs.assign(verdict=v, collapsed=v == "collapsed")
        for _, t in thresholds(varied, boot=0).iterrows():
            rows.append({"variation": label, "is_correction": t["is_correction"], "old_logprobs": t["old_logprobs"],
                         "runs": t["runs"], "collapsed": t["collapsed"],
                         "unconfirmed_left_out": t["unconfirmed_left_out"], "kind": t["kind"],
                         "estimate": t["estimate"], "extrapolated": t["extrapolated"], "low": t["low"],
                         "high": t["high"]})
    return pd.DataFrame(rows)


def anchor_positions(runs: pd.DataFrame) -> pd.DataFrame:
    """Where the anchor arms sit, per IS correction and old-logprob setting (``bf16-none`` ran
    with every correction; ``fp32``, ``fp16`` and ``bf16-all`` with IS off only)."""
    ok = counted(runs[(runs["status"] != "missing") & runs["arm"].isin(ANCHORS)])
    return ok.groupby(["arm", "is_correction", "old_logprobs"]).agg(
        mean_abs_dlogp=("mean_abs_dlogp", "mean"), collapsed=("collapsed", "sum"),
        unconfirmed=("unconfirmed", "sum"), runs=("seed", "size")).reset_index()


def _anchor(anchors: pd.DataFrame, arm: str, correction: str, old: str) -> float | None:
    hit = anchors[(anchors["arm"] == arm) & (anchors["old_logprobs"] == old)
                  & (anchors["is_correction"] == correction if "is_correction" in anchors else True)]
    return float(hit["mean_abs_dlogp"].iloc[0]) if len(hit) else None


def _true(v: object) -> bool:
    return isinstance(v, (bool, np.bool_)) and bool(v)


def _g(v: float | None, unbounded: str) -> str:
    return unbounded if v is None or (isinstance(v, float) and np.isnan(v)) else f"{v:.2g}"


def statement(th: pd.DataFrame, anchors: pd.DataFrame) -> list[str]:
    """One line per curve. Each curve is compared with its *own* ``bf16-none`` runs (same IS
    correction and old-logprob setting); ``bf16-all`` ran with IS off only, and is quoted as such."""
    lines = []
    for _, t in th.iterrows():
        correction, old = t["is_correction"], t["old_logprobs"]
        k = t.get("mismatch_steps")
        k = None if k is None or pd.isna(k) else int(k)
        dose = window_text(k)
        curve = f"IS {correction}, old logprobs from the {old}"
        none = _anchor(anchors, "bf16-none", correction, old)
        bf16_all = _anchor(anchors, "bf16-all", "off", old)
        all_txt = None if bf16_all is None else \
            f"BF16 all {bf16_all:.2g}" + ("" if correction == "off" else " (run with IS off only)")
        bf16 = ", ".join(s for s in (None if none is None else f"BF16 none of this curve {none:.2g}", all_txt) if s)
        n, c, u = (int(t[f]) for f in ("runs", "collapsed", "unconfirmed_left_out"))
        counts = f"{c}/{n} collapsed" + (f"; {u} unconfirmed runs left out" if u else "")
        boot = "" if pd.isna(t["boot"]) else \
            f"bootstrap: {int(t['bootstrap_degenerate'])}/{int(t['boot'])} resamples degenerate, no finite fit"
        if t["kind"] == "invalid":
            lines.append(f"- {curve}: {INVALID_REASON} ({counts}; no threshold).")
        elif t["kind"] == "none collapsed":
            lines.append(f"- {curve}: no run collapsed ({counts}, up to mismatch {t['low']:.2g}, {dose})"
                         + (f"; the BF16 arms ({bf16}) sit below every dose tried." if bf16 else "."))
        elif t["kind"] == "all collapsed":
            lines.append(f"- {curve}: every run collapsed ({counts}, from mismatch {t['high']:.2g}, {dose}).")
        elif t["kind"] in ("no runs", "no increasing trend"):
            lines.append(f"- {curve}: no threshold ({t['kind']}; {counts}).")
        elif t["kind"] == "bracket":
            ratio = "" if none is None else \
                f"; BF16 none of this curve ({none:.2g}) is {t['low'] / none:.0f}x below the lower end"
            lines.append(f"- {curve}: half-collapse threshold between mismatch {t['low']:.2g} and {t['high']:.2g} "
                         f"({dose}; runs separate perfectly: {counts}; {boot}){ratio}.")
        else:
            low, high = _g(t["low"], "below the doses tried"), _g(t["high"], "beyond the doses tried")
            if none is None:
                ratio = ""
            elif t["low"] is None or pd.isna(t["low"]):
                ratio = (f"; BF16 none of this curve ({none:.2g}) is {t['estimate'] / none:.0f}x below the estimate, "
                         f"but the interval does not exclude a threshold at or below it")
            else:
                ratio = (f"; BF16 none of this curve ({none:.2g}) is {t['estimate'] / none:.0f}x below the estimate "
                         f"and {t['low'] / none:.0f}x below the interval's lower end")
            if _true(t.get("extrapolated")):
                ratio += "; the estimate lies beyond the doses tried (an extrapolation of the fit)"
            lines.append(f"- {curve}: half of the runs collapse at mismatch {t['estimate']:.2g} ({dose}; "
                         f"profile-likelihood 95% interval {low} to {high}; {boot}; {counts}){ratio}.")
    return lines


def earliest_collapse_step(runs: pd.DataFrame) -> int | None:
    steps = pd.concat([pd.to_numeric(runs[c], errors="coerce") for c in ("collapse_step", "unconfirmed_drop_step")])
    return None if steps.dropna().empty else int(steps.min())


def _sensitivity_markdown(sens: pd.DataFrame, sens_th: pd.DataFrame) -> str:
    labels = ["own rule", *SENSITIVITY_LABELS]
    show = sens.copy()
    show["own rule"] = [f"{c}/{n}" + (f" (+{u} unc.)" if u else "") for c, u, n in
                        zip(show["collapsed"], show["unconfirmed"], show["runs"])]
    for label in SENSITIVITY_LABELS:
        show[label] = [f"{c}/{n}" + (f" (+{u} unc.)" if u else "") for c, u, n in
                       zip(show[f"collapsed[{label}]"], show[f"unconfirmed[{label}]"], show["runs"])]
    show["runs of"] = [f"{a}/{c}-{o}" for a, c, o in zip(show["arm"], show["is_correction"], show["old_logprobs"])]
    flagged = listed(sens)
    curves = []
    for (correction, old), rows in sens_th.groupby(["is_correction", "old_logprobs"], sort=False):
        cells = []
        for _, r in rows.iterrows():
            beyond = ", extrapolated beyond the doses tried" if _true(r["extrapolated"]) else ""
            where = (f"{r['estimate']:.2g}{beyond}"
                     if r["kind"] == "logistic" else
                     f"{r['low']:.2g}-{r['high']:.2g}" if r["kind"] == "bracket" else r["kind"])
            cells.append(f"{r['variation']}: {r['collapsed']}/{r['runs']} ({where})")
        curves.append(f"- IS {correction}, old={old}: " + "; ".join(cells) + ".")
    left = sens.loc[~flagged]
    return ("Collapsed count (and unconfirmed) per arm x IS correction x old logprobs (one row per run folder "
            "`dose/<arm>/<IS>-<old>/`) under the run's own thresholds and under each variation of "
            "them (`rpa.train.collapse.sensitivity_settings`: drop fraction 0.4/0.5/0.6 at the run's persistence "
            f"window; the run's drop fraction at half and twice that window). Listed: the {int(flagged.sum())} of "
            f"{len(sens)} run folders with a collapsed or unconfirmed run under the rule or any variation; the other "
            f"{len(left)} ({int(left['runs'].sum())} runs) have 0 collapsed and 0 unconfirmed under every "
            "variation (all of them: `dose_sensitivity.csv`).\n\n"
            + show.loc[flagged, ["runs of", *labels]].to_markdown(index=False)
            + "\n\nPer curve (dose arms), collapsed/judged runs and the half-collapse threshold (point estimate, "
              "or bracket where the runs separate) under each variation:\n\n" + "\n".join(curves))


def listed(sens: pd.DataFrame) -> pd.Series:
    """The rows of the sensitivity table that ``dose.md`` lists: a collapsed or unconfirmed run
    under the run's own thresholds or under any variation."""
    counts = sens[["collapsed", "unconfirmed"] + [c for c in sens if c.startswith(("collapsed[", "unconfirmed["))]]
    return counts.apply(pd.to_numeric, errors="coerce").fillna(0).sum(axis=1) > 0


def collapse_rule(results: Path) -> str:
    """The collapse rule in words, written from the runs' thresholds (all runs of the grid share them)."""
    found = {json.dumps(e.run.config["collapse"], sort_keys=True) for e in grid_table(results, "dose")
             if e.run.config is not None}
    if len(found) != 1:
        return f"The runs' collapse thresholds differ ({len(found)} settings; see each config.json)."
    return rule_text(CollapseThresholds(**json.loads(found.pop())))


def _superseded_text(runs: pd.DataFrame) -> str:
    """Which runs' ``summary.json`` verdicts (an earlier rule's) these tables supersede."""
    if "summary_superseded" not in runs:
        return ""
    old = runs[flags(runs["summary_superseded"])]
    if old.empty:
        return "every run's `summary.json` verdict agrees with it."
    names = ", ".join(f"{a}/{c}-{o}/seed{s}" for a, c, o, s in
                      zip(old["arm"], old["is_correction"], old["old_logprobs"], old["seed"]))
    return (f"the `summary.json` of {len(old)} runs holds a verdict written by the trainer under an earlier rule that "
            f"differs from this one (`summary_superseded`; the tables' verdict is the one to read): {names}.")


def markdown(runs: pd.DataFrame, per_group: pd.DataFrame, th: pd.DataFrame, anchors: pd.DataFrame,
             sens: pd.DataFrame | None = None, sens_th: pd.DataFrame | None = None, rule: str = "") -> str:
    k = mismatch_steps_of(runs)
    dose = window_text(k)
    names = {"mean_abs_dlogp": f"mean abs dlogp, steps 1-{k}", "seq_log_ratio_mean_abs": f"seq log ratio, steps 1-{k}",
             "phantom_clip_rate": f"phantom clip, steps 1-{k}", "kl_k3": f"kl k3, steps 1-{k}",
             "pre_drop_mean_abs_dlogp": "mean abs dlogp, pre-drop", "all_steps_mean_abs_dlogp":
             "mean abs dlogp, all steps", "mismatch_steps": "K", "final_reward": "final reward (smoothed)",
             "terminal_reward": f"raw reward, last {TERMINAL_STEPS} steps"}
    cols = ["arm", "is_correction", "old_logprobs", "runs", "collapsed", "unconfirmed", "recovered",
            "grad_spike_runs", "missing_runs", "mean_abs_dlogp", "pre_drop_mean_abs_dlogp", "all_steps_mean_abs_dlogp",
            "seq_log_ratio_mean_abs", "phantom_clip_rate", "final_reward", "final_reward_sd", "terminal_reward",
            "absorbing", "final_eval_accuracy"]
    run_cols = ["arm", "is_correction", "old_logprobs", "seed", "status", "verdict", "collapse_step",
                "unconfirmed_drop_step", "recovered_step", "grad_spikes", "first_grad_spike_step", "mean_abs_dlogp",
                "pre_drop_mean_abs_dlogp", "all_steps_mean_abs_dlogp", "phantom_clip_rate", "peak_reward",
                "final_reward", "terminal_reward", "absorbing", "summary_superseded", "final_eval_accuracy"]
    first = earliest_collapse_step(runs)
    window = (f"The dose (x-axis) is the **{dose}** of `mismatch/mean_abs_dlogp` (K = {k}, `--mismatch-steps`; the "
              f"other mismatch columns over the same window), the same early window for every run: a collapsing "
              f"run's mismatch rises after its collapse, so a mean over all steps would be partly caused by the "
              f"collapse. The earliest collapse (or unconfirmed drop) step in these runs is "
              f"{first if first is not None else 'none'}"
              + ("" if first is None or k is None or k < first else
                 " -- **warning: the window reaches it, so some doses include post-collapse steps**")
              + ". `pre_drop` = mean over the steps before the run's collapse or unconfirmed drop (all steps "
                "otherwise); `all steps` = mean over the whole run (as the tables reported before).")
    return ("## Dose-response (positive control)\n\nSampler-only perturbation (`perturb-mantissa<K>`: the "
            "sampler's region outputs rounded to K mantissa bits), mismatch measured in training. " + window
            + "\n\nVerdicts recomputed from `metrics.jsonl` (`stable` / `unconfirmed` / `collapsed`; grad-norm "
              "spikes are events, not collapses) under collapse rule " + RULE_VERSION
            + " (`rpa.train.collapse.RULE_VERSION`, column `rule_version`): "
            + _superseded_text(runs) + " " + rule
            + f" Beside the smoothed final reward, the raw reward of each run's last {TERMINAL_STEPS} logged steps, "
              "and `absorbing`: runs that end with a raw reward about 0 in groups without reward variance "
              f"(`rpa.train.collapse.terminal_state`; {int(flags(pd.Series(runs.get('absorbing'))).sum())} "
              "here), whatever the rule says."
            + "\n\n### Threshold\n\nHalf-collapse dose per curve (dose arms: bf16-none and perturb-mantissa*, "
              "each curve with its own IS correction and old-logprob setting), from a logistic fit on "
              f"log10({dose}); profile-likelihood 95% interval (a side that reaches the smallest or largest dose "
              "tried is unbounded); `bootstrap_degenerate`: resamples (of `boot`) with one class only or perfectly "
              "separated classes, which have no finite fit.\n\n"
            + "\n".join(statement(th, anchors)) + "\n\n"
            + th.rename(columns=names).to_markdown(index=False, floatfmt=".3g")
            + "\n\n### Per arm (mean over seeds)\n\n"
            + per_group[cols].rename(columns=names).to_markdown(index=False, floatfmt=".3g")
            + ("" if sens is None else "\n\n### Sensitivity of the verdicts\n\n" + _sensitivity_markdown(sens, sens_th))
            + "\n\n### Anchors\n\n`bf16-none` ran with every IS correction; `fp32`, `fp16` and `bf16-all` with IS "
              "off only.\n\n" + anchors.rename(columns=names).to_markdown(index=False, floatfmt=".3g")
            + "\n\n### Per run\n\n(All columns, incl. the sensitivity verdicts: `dose_runs.csv`.)\n\n"
            + runs[run_cols].rename(columns=names).to_markdown(index=False, floatfmt=".3g") + "\n")


CURVE_COLORS = {"off": "tab:blue", "token_truncate": "tab:orange", "sequence_mask": "tab:green"}
IS_NAMES = {"off": "IS off", "token_truncate": "TIS", "sequence_mask": "MIS"}
ANCHOR_COLORS = {"fp16": "tab:brown", "bf16-all": "tab:purple", "bf16-none": "black"}
OLD_STYLES = {"sampler": "-", "trainer": "--"}
ANCHOR_SPANS = {"sampler": (0.5, 1.0), "trainer": (0.0, 0.5)}
"""Anchors of the two old-logprob settings sit at nearly the same dose: each is drawn over half
of the axis height (old=sampler upper half, solid; old=trainer lower half, dashed), so neither
hides the other."""


def _intervals(runs: pd.DataFrame | None, curve: pd.DataFrame, col: str) -> tuple[np.ndarray, np.ndarray] | None:
    """Per point of ``curve`` (one arm of one setting), the 95% interval of ``col``: exact
    (Clopper-Pearson) for the collapse fraction, a t-interval over the seeds for the rest."""
    from analysis.collapse_search import clopper_pearson
    from analysis.paired import t975

    if runs is None:
        return None
    low, high = [], []
    for _, point in curve.iterrows():
        of = counted(runs[(runs["status"] != "missing") & (runs["arm"] == point["arm"])
                          & (runs["is_correction"] == point["is_correction"])
                          & (runs["old_logprobs"] == point["old_logprobs"])])
        if col == "collapse_fraction":
            lo, hi = clopper_pearson(int(of["collapsed"].sum()), len(of))
        else:
            v = pd.to_numeric(of[col], errors="coerce").dropna()
            half = t975(len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else np.nan
            lo, hi = v.mean() - half, v.mean() + half
            if col == "final_reward":
                lo, hi = max(lo, 0.0), min(hi, 1.0)
            lo = max(lo, 0.0)
        low.append(lo)
        high.append(hi)
    return np.array(low, dtype=float), np.array(high, dtype=float)


def _fit_curve(ax, runs: pd.DataFrame | None, th: pd.DataFrame | None, correction: str, old: str, color,
               style: str) -> None:
    """On the collapse-fraction panel: the curve's logistic fit (``logit p = a + b log10 x``) over
    the doses tried and its half-collapse dose x50, or the bracket where the runs separate."""
    if runs is None or th is None:
        return
    row = th[(th["is_correction"] == correction) & (th["old_logprobs"] == old)]
    if row.empty:
        return
    t = row.iloc[0]
    if t["kind"] == "logistic":
        d = dose_arms(runs)
        d = d[(d["is_correction"] == correction) & (d["old_logprobs"] == old)].dropna(subset=["mean_abs_dlogp"])
        d = d[d["verdict"] != "unconfirmed"]
        x = np.log10(d["mean_abs_dlogp"].to_numpy(float))
        fit = _logistic_fit(x, d["collapsed"].astype(bool).to_numpy(float))
        if fit is None:
            return
        grid = np.linspace(x.min(), x.max(), 200)
        ax.plot(10 ** grid, 1 / (1 + np.exp(-(fit[0] + fit[1] * grid))), style, color=color, lw=0.9, alpha=0.6)
        ax.plot([t["estimate"]], [0.5], marker="x", ms=9, mew=2, color=color, ls="none")
        ax.annotate(f"x50 = {t['estimate']:.2g}", (t["estimate"], 0.5), xytext=(6, -12), textcoords="offset points",
                    fontsize=10, color=color)
        if pd.notna(t["low"]) or pd.notna(t["high"]):
            lo = t["low"] if pd.notna(t["low"]) else 10 ** x.min()
            hi = t["high"] if pd.notna(t["high"]) else 10 ** x.max()
            ax.plot([lo, hi], [0.5, 0.5], color=color, lw=3, alpha=0.35, solid_capstyle="butt")
    elif t["kind"] == "bracket":
        ax.plot([t["low"], t["high"]], [0.5, 0.5], color=color, lw=3, alpha=0.35, solid_capstyle="butt")


def figure(per_group: pd.DataFrame, anchors: pd.DataFrame, path: Path, runs: pd.DataFrame | None = None,
           th: pd.DataFrame | None = None) -> None:
    """Fig. 5: collapse fraction, final reward and phantom-clip rate vs the early-window dose,
    sized for a paper's text width (12 x 3.8 in, fonts scaled to read at about half size). With
    ``runs``, each point has its 95% interval (exact for the collapse fraction, a t-interval over
    the seeds otherwise); with ``th`` too, the collapse panel shows each curve's logistic fit
    and its x50 (a bar: its profile-likelihood interval, or the bracket of separated runs)."""
    k = per_group["mismatch_steps"].dropna()
    k = int(k.iloc[0]) if len(k) else None
    dose = window_text(k)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    doses = per_group[~per_group["arm"].isin(["fp32", "bf16-all", "fp16"]) & ~per_group["invalid"].astype(bool)]
    handles = []
    for (correction, old), curve in doses.groupby(["is_correction", "old_logprobs"]):
        curve = curve.sort_values("mean_abs_dlogp")
        color = CURVE_COLORS.get(correction)
        for ax, col in zip(axes, ["collapse_fraction", "final_reward", "phantom_clip_rate"]):
            (line,) = ax.plot(curve["mean_abs_dlogp"], curve[col], OLD_STYLES.get(old, ":"), color=color, marker="o",
                              ms=5, lw=1.6, mfc=color if old == "sampler" else "white",
                              label=f"{IS_NAMES.get(correction, correction)}, old={old}")
            bounds = _intervals(runs, curve, col)
            if bounds is not None:
                y = curve[col].to_numpy(float)
                ax.errorbar(curve["mean_abs_dlogp"], y, yerr=[np.clip(y - bounds[0], 0, None),
                                                              np.clip(bounds[1] - y, 0, None)],
                            fmt="none", ecolor=color, elinewidth=0.8, capsize=2, alpha=0.7)
        _fit_curve(axes[0], runs, th, correction, old, color, OLD_STYLES.get(old, ":"))
        handles.append(line)
    shown = anchors[anchors["arm"].isin(ANCHOR_COLORS) & (anchors["is_correction"] == "off")]
    anchor_handles = {}
    for _, a in shown.iterrows():
        low, high = ANCHOR_SPANS.get(a["old_logprobs"], (0, 1))
        for ax in axes:
            anchor_handles[a["arm"]] = ax.axvline(a["mean_abs_dlogp"], ymin=low, ymax=high, lw=1.4,
                                                  color=ANCHOR_COLORS[a["arm"]], ls=OLD_STYLES.get(a["old_logprobs"]),
                                                  label=a["arm"])
    titles = ["collapse fraction (bars: exact 95%; fit, x50)" if runs is not None else "collapse fraction",
              "final reward (smoothed; bars: 95% t)" if runs is not None else "final reward (smoothed)",
              "phantom-clip rate" + ("" if k is None else f", steps 1-{k}")]
    lo = shown["mean_abs_dlogp"].min() if len(shown) else np.nan
    for ax, title in zip(axes, titles):
        ax.set_xscale("log")
        if np.isfinite(lo):
            ax.set_xlim(left=lo / 1.6)
        ax.set_xlabel(dose, fontsize=12)
        ax.set_title(title, fontsize=13)
        ax.tick_params(labelsize=11)
        ax.grid(alpha=0.25, lw=0.5)
    fp32 = anchors[(anchors["arm"] == "fp32") & (anchors["is_correction"] == "off")]["mean_abs_dlogp"]
    note = f"; fp32 at {fp32.max():.0e}, off the axis" if len(fp32) else ""
    fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 0.0), ncol=3, fontsize=10.5, frameon=False,
               title="dose curves (solid, filled: old logprobs from the sampler; dashed, open: from the trainer)",
               title_fontsize=10.5, handlelength=2.4, columnspacing=1.0)
    proxies = [plt.Line2D([], [], color=ANCHOR_COLORS[a], lw=1.4, label=a)
               for a in ANCHOR_COLORS if a in anchor_handles]
    fig.legend(handles=proxies, loc="lower right",
               bbox_to_anchor=(1.0, 0.0), ncol=3, fontsize=10.5, frameon=False,
               title=f"anchors, IS off (upper half: old=sampler;\nlower half: old=trainer{note})",
               title_fontsize=10.5, handlelength=2.0, columnspacing=1.0)
    fig.tight_layout(rect=(0, 0.23, 1, 1), w_pad=1.0)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=200)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--figure", required=True, type=Path)
    parser.add_argument("--mismatch-steps", type=int, default=MISMATCH_STEPS,
                        help=f"early window: the dose is the mean mismatch over steps 1..K (default {MISMATCH_STEPS})")
    args = parser.parse_args()
    runs = dose_rows(args.results, args.mismatch_steps)
    per_group, sens = groups(runs), sensitivity_table(runs)
    th, anchors, sens_th = thresholds(runs), anchor_positions(runs), sensitivity_thresholds(runs)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out_dir / "dose_runs.csv") as tmp:
        runs.to_csv(tmp, index=False)
    with atomic_path(args.out_dir / "dose.csv") as tmp:
        per_group.to_csv(tmp, index=False)
    with atomic_path(args.out_dir / "dose_sensitivity.csv") as tmp:
        sens.to_csv(tmp, index=False)
    write_text(args.out_dir / "dose.md", markdown(runs, per_group, th, anchors, sens, sens_th,
                                                   collapse_rule(args.results)))
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    figure(per_group, anchors, args.figure, runs, th)
    print("\n".join(statement(th, anchors)))


if __name__ == "__main__":
    main()
