"""The study's rows and statistics: one row per expected cell (:func:`study_rows`, from
:func:`analysis.runs.runs_table`), the collapse and sensitivity counts per model x arm, and the
mismatch per model x arm with its paired changes vs the reference arm (offline: the probe's paired
bootstrap over sequences; in training: paired by seed, :mod:`analysis.paired`). What each column
means: :mod:`analysis.study`, which writes the tables; the figures are in :mod:`analysis.study.figures`.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.paired import paired_change, positions_only, seed_log_ratio, t_change
from analysis.runs import flags, probe_folder, probe_result, probe_tokens, runs_table
from rpa.train.collapse import RULE_VERSION, CollapseThresholds, sensitivity_settings


def study_rows(results: Path, manifest: dict,
               section: str = "study") -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(one row per expected cell, per-step metrics of finished runs, eval records): each cell's row of
    :func:`analysis.runs.runs_table` (its runs under ``results/<section>``: ``study``, or ``grids`` for a
    ``grids:`` entry of kind study) with the study's own columns: ``error``, ``sensitivity`` (the verdict under
    each variation, by label), ``persistence`` (the run's window), the run's ``numerics`` and its in-training
    mismatch means."""
    rows, curves, evals = [], [], []
    for entry in runs_table(manifest, results, section):
        run, c = entry.run, entry.cell
        row = dict(entry.row)
        if run.summary is not None:
            row["error"] = run.summary.get("error")
        if run.config is not None:
            row["numerics"] = run.config.get("numerics")
        if run.judged:
            row["sensitivity"] = run.sensitivity
            row["persistence"] = run.thresholds.min_steps_after_drop
        if run.metrics:
            m = pd.DataFrame(run.metrics)
            row.update(train_mean_abs_dlogp=m["mismatch/mean_abs_dlogp"].mean(), train_kl_k3=m["mismatch/kl_k3"].mean())
            curves.append(m.assign(model=c["model"], arm=c["arm"], seed=c["seed"]))
        if run.evals:
            row["final_eval_accuracy"] = run.evals[-1]["eval/accuracy"]
            evals.append(pd.DataFrame(run.evals).assign(model=c["model"], arm=c["arm"], seed=c["seed"]))
        rows.append(row)
    return (pd.DataFrame(rows), pd.concat(curves, ignore_index=True) if curves else pd.DataFrame(),
            pd.concat(evals, ignore_index=True) if evals else pd.DataFrame())


def arms_of(manifest: dict, model: str) -> list[str]:
    """The arms ``model`` ran, in table order (a size may run arms of its own: ``size_arms``)."""
    ran = {c["arm"] for c in manifest["cells"] if c["model"] == model}
    return [a for a in manifest["arms"] if a in ran]


def _mean_sd(values: pd.Series) -> str:
    v = values.dropna()
    if v.empty:
        return "--"
    return f"{v.mean():.3g}" if len(v) == 1 else f"{v.mean():.3g} ± {v.std():.2g}"


def _verdict_count(done: pd.DataFrame, verdict: str) -> int:
    return int((done["verdict"] == verdict).sum()) if "verdict" in done else 0


def collapse_table(runs: pd.DataFrame, manifest: dict) -> pd.DataFrame:
    """Per model x arm: runs, finished, failed, missing, ``collapsed`` (``k/n`` of the finished
    runs), ``unconfirmed`` (finished runs whose drop reached the end before the persistence
    window), ``grad_spikes`` (spike events summed over the finished runs), median collapse step,
    peak / final reward and final eval accuracy (mean +- sd over seeds)."""
    rows = []
    for model in manifest["models"]:
        for arm in arms_of(manifest, model):
            g = runs[(runs.model == model) & (runs.arm == arm)]
            done = g[g.state == "finished"]
            collapsed = flags(done["collapsed"]) if "collapsed" in done else pd.Series(dtype=bool)
            spikes = done["grad_spikes"].dropna() if "grad_spikes" in done else pd.Series(dtype=float)
            rows.append({"model": model, "arm": arm, "runs": len(g), "finished": len(done),
                         "failed": int((g.state == "failed").sum()), "missing": int((g.state == "missing").sum()),
                         "collapsed": f"{int(collapsed.sum())}/{len(done)}" if len(done) else "--",
                         "unconfirmed": _verdict_count(done, "unconfirmed") if len(done) else None,
                         "grad_spikes": int(spikes.sum()) if len(spikes) else None,
                         "median_collapse_step": float(done.loc[collapsed, "collapse_step"].median())
                         if collapsed.any() else None,
                         "peak_reward": _mean_sd(done.get("peak_reward", pd.Series(dtype=float))),
                         "final_reward": _mean_sd(done.get("final_reward", pd.Series(dtype=float))),
                         "terminal_reward": _mean_sd(done.get("terminal_reward", pd.Series(dtype=float))),
                         "absorbing": int(flags(done["absorbing"]).sum())
                         if len(done) and "absorbing" in done else None,
                         "final_eval_accuracy": _mean_sd(done.get("final_eval_accuracy", pd.Series(dtype=float))),
                         "rule_version": RULE_VERSION})
    return pd.DataFrame(rows).astype({"unconfirmed": "Int64", "grad_spikes": "Int64", "absorbing": "Int64"})


def sensitivity_table(runs: pd.DataFrame, manifest: dict) -> pd.DataFrame:
    """Per model x arm and per variation of :func:`rpa.train.collapse.sensitivity_settings`: the
    number of finished runs collapsed (``<label> collapsed``) and unconfirmed
    (``<label> unconfirmed``) under it."""
    labels = [label for label, _ in sensitivity_settings(CollapseThresholds())]
    rows = []
    for model in manifest["models"]:
        for arm in arms_of(manifest, model):
            done = runs[(runs.model == model) & (runs.arm == arm) & (runs.state == "finished")]
            sens = [s for s in done.get("sensitivity", pd.Series(dtype=object)) if isinstance(s, dict)]
            row = {"model": model, "arm": arm, "finished": len(done), "judged": len(sens)}
            for label in labels:
                verdicts = [s.get(label, "missing") for s in sens]
                row[f"{label} collapsed"] = verdicts.count("collapsed")
                row[f"{label} unconfirmed"] = verdicts.count("unconfirmed")
            rows.append(row)
    return pd.DataFrame(rows)


def _probe_numerics(results: Path, model: str, config: str) -> dict | None:
    probe = probe_result(results, model, config)
    return None if probe is None else probe.summary["config"].get("numerics")


def _probe_entropy(results: Path, model: str, config: str) -> float | None:
    """The trainer's mean next-token entropy (nats) over the probe's completion tokens: mismatch
    tracks it, so each probe's mismatch is reported with it (None for probes made before it was
    recorded)."""
    probe = probe_result(results, model, config)
    return None if probe is None else probe.summary.get("entropy")


def _run_numerics(runs: pd.DataFrame, model: str, arm: str) -> dict | None:
    """The numerics of the first of ``model``'s runs of ``arm`` (in the manifest's order) with a config."""
    if "numerics" not in runs:
        return None
    found = runs[(runs.model == model) & (runs.arm == arm)]["numerics"]
    found = [n for n in found if isinstance(n, dict)]
    return found[0] if found else None


def train_change(curves: pd.DataFrame, runs: pd.DataFrame, model: str, arm: str, ref: str,
                 key: str = "mismatch/mean_abs_dlogp") -> dict:
    """The paired in-training change of ``key`` of ``arm`` vs ``ref`` for one model: per seed
    with both runs finished, the geometric-mean ratio over the steps both logged; then the mean
    log-ratio over seeds with a 95% t-interval (:func:`analysis.paired.t_change`)."""
    if curves.empty or key not in curves:
        return t_change([])
    finished = runs[(runs.model == model) & (runs.state == "finished")]
    seeds = sorted(set(finished.loc[finished.arm == arm, "seed"]) & set(finished.loc[finished.arm == ref, "seed"]))
    of = curves[curves.model == model]
    ratios = [seed_log_ratio(of[(of.arm == arm) & (of.seed == s)], of[(of.arm == ref) & (of.seed == s)], key)[0]
              for s in seeds]
    return t_change(ratios)


def mismatch_table(results: Path, runs: pd.DataFrame, manifest: dict,
                   curves: pd.DataFrame | None = None) -> pd.DataFrame:
    ref = manifest["reference_arm"]
    curves = pd.DataFrame() if curves is None else curves
    rows = []
    for model in manifest["models"]:
        ref_tokens = probe_tokens(results, model, ref)
        ref_numerics = _probe_numerics(results, model, ref) or _run_numerics(runs, model, ref)
        for arm in arms_of(manifest, model):
            row = {"model": model, "arm": arm, "probe_note": None,
                   "probe_entropy": _probe_entropy(results, model, arm)}
            tokens = probe_tokens(results, model, arm)
            numerics = _probe_numerics(results, model, arm) or _run_numerics(runs, model, arm)
            if arm != ref and positions_only(numerics, ref_numerics):
                row["probe_note"] = "n/a (unpadded probe)"
            elif tokens is not None and ref_tokens is not None:
                change = paired_change(tokens, ref_tokens)
                for key, c in change.items():
                    row.update({f"probe_{key}": c["value"], f"probe_{key}_change": c["change"],
                                f"probe_{key}_low": c["low"], f"probe_{key}_high": c["high"]})
                if arm == ref:
                    row["probe_note"] = "reference"
                    for key in change:
                        row.update({f"probe_{key}_change": None, f"probe_{key}_low": None, f"probe_{key}_high": None})
            elif tokens is not None or probe_folder(results, model, arm).exists():
                row["probe_note"] = f"no tokens.csv (or none for {ref})"
            else:  # no probe configuration of this arm's name (an IS arm: the numerics of another arm)
                same = numerics is not None and numerics == _run_numerics(runs, model, ref)
                row["probe_note"] = f"no probe (numerics of {ref})" if same and arm != ref else "no probe"
            done = runs[(runs.model == model) & (runs.arm == arm) & (runs.state == "finished")]
            row["train_mean_abs_dlogp"] = _mean_sd(done.get("train_mean_abs_dlogp", pd.Series(dtype=float)))
            row["train_kl_k3"] = _mean_sd(done.get("train_kl_k3", pd.Series(dtype=float)))
            if arm != ref:
                tc = train_change(curves, runs, model, arm, ref)
                row.update(train_mean_abs_dlogp_change=tc["change"], train_mean_abs_dlogp_low=tc["low"],
                           train_mean_abs_dlogp_high=tc["high"], train_paired_seeds=tc["pairs"])
            rows.append(row)
    cols = ["model", "arm"] + [f"probe_{k}{s}" for k in ("mean_abs_dlogp", "kl_k3") for s in ("", "_change", "_low",
                                                                                          "_high")] + \
        ["probe_note", "probe_entropy", "train_mean_abs_dlogp", "train_kl_k3", "train_mean_abs_dlogp_change", "train_mean_abs_dlogp_low",
         "train_mean_abs_dlogp_high", "train_paired_seeds"]
    return pd.DataFrame(rows).reindex(columns=cols).astype({"train_paired_seeds": "Int64"})
