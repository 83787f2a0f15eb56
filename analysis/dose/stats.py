"""The positive control's rows and statistics (:mod:`analysis.dose` says what they mean): one row
per cell of the dose grid (:func:`dose_rows`, from :func:`analysis.runs.grid_table`) with its
early-window dose; the groups per arm x IS correction x old logprobs and their sensitivity counts;
the half-collapse threshold per curve (logistic fit on log10 of the dose, profile-likelihood
interval, :func:`threshold`) and where the anchor arms sit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.refusal import Refused
from analysis.runs import (SENSITIVITY_LABELS, SPIKE_COLUMNS, RunsTable, flags, grid_table, runs_table,
                           sensitivity_column)
from rpa.train.collapse import RULE_VERSION, CollapseThresholds, rule_text

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


def dose_table(results: Path, manifest: Path | None = None) -> RunsTable:
    """The runs of a positive control (:func:`analysis.runs.runs_table`) whose manifest is ``manifest``: the
    ``dose:`` section's (``results/dose/manifest.json``, the default) or a ``grids:`` entry's of kind dose
    (``results/grids/<entry>/manifest.json``)."""
    return grid_table(results, "dose") if manifest is None else runs_table(Path(manifest), results)


def dose_rows(results: Path, mismatch_steps: int = MISMATCH_STEPS, manifest: Path | None = None) -> pd.DataFrame:
    """One row per cell of the positive control (``manifest``: :func:`dose_table`; a cell that never ran:
    status ``missing``), in the order of the cells' folders, columns :data:`RUN_COLUMNS`. The arm is the
    cell's label; the IS correction, the old-logprob source and the dose what the run's config ran (the
    cell's labels and the manifest's ``doses`` for a cell without a config)."""
    if mismatch_steps < 1:
        raise ValueError(f"mismatch_steps must be >= 1, got {mismatch_steps}")
    table = dose_table(results, manifest)
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
        raise Refused(f"no dose runs in {manifest or Path(results) / 'dose/manifest.json'}")
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


def earliest_collapse_step(runs: pd.DataFrame) -> int | None:
    steps = pd.concat([pd.to_numeric(runs[c], errors="coerce") for c in ("collapse_step", "unconfirmed_drop_step")])
    return None if steps.dropna().empty else int(steps.min())


def listed(sens: pd.DataFrame) -> pd.Series:
    """The rows of the sensitivity table that ``dose.md`` lists: a collapsed or unconfirmed run
    under the run's own thresholds or under any variation."""
    counts = sens[["collapsed", "unconfirmed"] + [c for c in sens if c.startswith(("collapsed[", "unconfirmed["))]]
    return counts.apply(pd.to_numeric, errors="coerce").fillna(0).sum(axis=1) > 0


def collapse_rule(results: Path, manifest: Path | None = None) -> str:
    """The collapse rule in words, written from the runs' thresholds (all runs of the grid share them;
    ``manifest``: :func:`dose_table`)."""
    found = {json.dumps(e.run.config["collapse"], sort_keys=True) for e in dose_table(results, manifest)
             if e.run.config is not None}
    if len(found) != 1:
        return f"The runs' collapse thresholds differ ({len(found)} settings; see each config.json)."
    return rule_text(CollapseThresholds(**json.loads(found.pop())))
