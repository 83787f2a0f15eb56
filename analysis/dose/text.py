"""The positive control's text (:mod:`analysis.dose`): the threshold statement per curve
(:func:`statement`, also the paper's) and ``dose.md`` (:func:`markdown`), from the tables of
:mod:`analysis.dose.stats`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.dose.stats import earliest_collapse_step, listed, mismatch_steps_of, window_text
from analysis.runs import SENSITIVITY_LABELS, flags
from rpa.train.collapse import RULE_VERSION, TERMINAL_STEPS


INVALID_REASON = ("invalid: IS correction applied twice (old logprobs from the sampler make PPO's ratio pi/mu, and "
                  "TRL multiplies the loss by its clipped pi_old/mu again); such runs are refused now")


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
