"""The natural-collapse search: per stage, a table of its runs, a summary JSON and a figure.

``python -m analysis.collapse_search --results R --stage {pilot,grid,ablation,lever} --figure F``
reads ``R/search/<stage>/manifest.json`` (cells, axes, the pilot rule and the decision rule as
the config wrote them) and each cell's run (:func:`analysis.runs.runs_table`). Verdicts are recomputed
with each run's own thresholds (:func:`rpa.train.collapse.run_verdict`). The statistics are in
:mod:`analysis.collapse_stats`, the figures in :mod:`analysis.collapse_figures`; this module writes the
tables (CSV, Markdown, JSON) and their text.

* **pilot**: one row per cell with its step-1 reward, entropy and mismatch, its initial reward
  (mean of the first ``reward_steps`` steps); ``eligible`` = entropy >= ``min_entropy`` and
  initial reward in [``reward_low``, ``reward_high``]; ``chosen`` = the eligible cell with the
  largest step-1 mismatch (none if no cell is eligible: the JSON then says so).
* **grid / ablation / lever**: one row per run and one per group (every axis but the seed):
  collapsed / runs with an exact (Clopper-Pearson) interval, unconfirmed runs, median collapse
  step, final reward (smoothed) beside the raw terminal reward (mean of the last
  :data:`rpa.train.collapse.TERMINAL_STEPS` logged rewards) and the runs that end in an
  absorbing state (raw reward about 0 in groups without reward variance,
  :func:`rpa.train.collapse.terminal_state`, reported whatever the rule says), and the mismatch
  and phantom-clip rate *before* the collapse (the mean over the steps before the collapse
  step; all steps of a run that did not collapse) and *before any drop* (also before the first
  step whose raw reward dipped below the rule's level, :func:`rpa.train.collapse.first_dip_step`).
  Every verdict is under the current rule (``rule_version``); ``summary_superseded`` marks a run
  whose ``summary.json`` holds a verdict of an earlier rule that differs from it. Beside them,
  the sensitivity companion: each group's collapsed (and unconfirmed) count under every
  variation of :func:`rpa.train.collapse.sensitivity_settings` (per run: ``verdict_<variation>``).
* **decision** (grid, and the lever stage, judged by the same rule): at each rung (``rung_axis`` label) the stock-BF16 reference "collapses
  naturally" when it collapses in at least ``min_reference_collapsed`` seeds, the control
  (FP32) in at most ``max_control_collapsed``, and, pooled over the paired (rung, seed) cells,
  the reference collapses more often than the control. Otherwise the outcome is "does not, up
  to" the largest pre-collapse mismatch and phantom-clip rate the reference reached, with the
  exact upper bound on its collapse probability. Each rung gets its own exact interval (the
  pooled one assumes a single collapse probability across the rungs), and the statement says
  what the rule can detect (:func:`rule_power`: the probability that it finds a true per-run
  collapse rate of 30% or 50% at every rung, the control stable).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.collapse_figures import (_cells, _figure_grid, _figure_paired_pilot, _figure_pilot,  # noqa: F401
                                       runs_per_arm)
from analysis.collapse_stats import (DECIDED_STAGES, ENTROPY_BINS, MISMATCH, PHANTOM, POST_HOC_OUTCOMES,  # noqa: F401
                                     POWER_RATES, ZERO_DIFFERENCE, binomial_tail, clopper_pearson, comparison,
                                     contrast_weights, decision, effects, entropy_matched_ratio, envelope,
                                     final_window, fisher_exact, fisher_one_sided, fisher_power, groups,
                                     mismatch_ratios, paired_contrast, paired_pilot, pilot, post_hoc, questions,
                                     rule_power, search_rows, sensitivity_groups, sign_test, signed_rank_interval,
                                     signed_rank_null, signed_rank_p, signed_rank_power, smallest_detectable_effect,
                                     smallest_detectable_rate)
from analysis.dose.response import dose_response
from analysis.refusal import run
from analysis.runs import RUN_SETTINGS, SENSITIVITY_LABELS, flags, read_manifest, sensitivity_column  # noqa: F401
from rpa.core.jsonfiles import atomic_path, write_text
from rpa.train.collapse import ABSORBING_MAX_REWARD, ABSORBING_MAX_REWARD_STD, RULE_VERSION, TERMINAL_STEPS


def _sensitivity_markdown(sens: pd.DataFrame, axes: list[str]) -> str:
    def cell(k, u, n):
        return f"{k}/{n}" + (f" (+{u} unc.)" if u else "")

    show = sens[axes].copy()
    show["own rule"] = [cell(k, u, n) for k, u, n in zip(sens["collapsed"], sens["unconfirmed"], sens["finished"])]
    for label in SENSITIVITY_LABELS:
        show[label] = [cell(k, u, n) for k, u, n in
                       zip(sens[f"collapsed[{label}]"], sens[f"unconfirmed[{label}]"], sens["finished"])]
    return ("### Sensitivity of the verdicts\n\nCollapsed / finished runs per group (and unconfirmed drops) under "
            "each run's own thresholds and under each variation of them (`rpa.train.collapse.sensitivity_settings`: "
            "drop fraction 0.4/0.5/0.6 at the run's persistence window; the run's drop fraction at half and twice "
            "that window); per run: the `verdict_*` columns of the CSV.\n\n" + show.to_markdown(index=False) + "\n")


def _shift_text(shift: dict | None) -> str:
    """The Hodges-Lehmann shift and its exact interval as the grid's statement gives it ('' when none)."""
    if not shift:
        return ""
    zeros = shift.get("zeros") or 0
    dropped = f", {zeros} zero difference{'s' if zeros > 1 else ''} dropped" if zeros else ""
    return (f"; Hodges-Lehmann shift {shift['estimate']:.3g}, exact {100 * shift['coverage']:.1f}% interval "
            f"{shift['low']:.3g} to {shift['high']:.3g} (the signed-rank test inverted; {shift['pairs']} pairs"
            f"{dropped}, as in its p)")


def contrast_text(c: dict) -> str:
    """A comparison as written: ```a` + `b` (mean) - `c``` for ``a``/``b``, else the weighted arms."""
    if "a" in c:
        return (f"{' + '.join(f'`{x}`' for x in c['a'])}{' (mean)' if len(c['a']) > 1 else ''} - `{c['b']}`")
    return " ".join(f"{'+' if w > 0 else '-'} {'' if abs(w) == 1 else f'{abs(w):g} '}`{arm}`"
                    for arm, w in c["contrast"].items()).lstrip("+ ")


def _test_cells(c: dict) -> str:
    """A paired contrast's table cells: pairs, mean, how many below 0, signed-rank p, the shift with its
    interval and coverage."""
    if c.get("not_computed"):
        return f"{c.get('pairs', 0)} | -- | -- | -- | not computed: {c['not_computed']}"
    sh = c["shift"]
    shift = "--" if not sh else (f"{sh['estimate']:+.3f} [{sh['low']:+.3f}, {sh['high']:+.3f}] "
                                  f"({100 * sh['coverage']:.1f}%)")
    p = "--" if c["signed_rank_p"] is None else f"{c['signed_rank_p']:.2g}"
    return f"{c['pairs']} | {c['mean_difference']:+.3f} | {c['a_lower']} of {c['pairs']} | {p} | {shift}"


def _effects_markdown(eff: dict) -> str:
    """The pre-registered effects of a factorial grid (``decision.effects``), one row each."""
    text = (f"### Pre-registered effects (outcome: {eff['outcome']})\n\n")
    if eff.get("unfinished"):
        return text + f"The grid is incomplete ({eff['unfinished']} runs unfinished): no effect is read from part of it.\n"
    if eff.get("refused"):
        return text + f"Not computed: {eff['refused']}.\n"
    text += ("Per seed the contrast of the arms' outcomes; exact two-sided signed-rank test (zero differences "
             "dropped, from the p and the interval alike) and the Hodges-Lehmann shift with the exact interval "
             "that inverts it.\n\n| effect | contrast | pairs | mean | below 0 | signed-rank p | Hodges-Lehmann "
             "shift, exact interval (coverage) |\n|:--|:--|--:|--:|--:|--:|:--|\n")
    for name, e in eff["effects"].items():
        text += f"| {name}: {e['question']} | {contrast_text(e)} | {_test_cells(e)} |\n"
    return text


def _post_hoc_markdown(ph: dict) -> str:
    """The post-hoc section of the grid's table: labelled as such, apart from the registered questions."""
    text = ("### Post hoc (not pre-registered)\n\nWritten after the grid ran (config `post_hoc`); exploratory, "
            "not verdicts. Paired by seed, exact two-sided signed-rank test (zero differences dropped, from the "
            "p and the interval alike) and the Hodges-Lehmann shift with the exact interval that inverts it.\n\n"
            "| comparison | a - b | outcome | pairs | mean | a lower | signed-rank p | Hodges-Lehmann shift, exact "
            "interval (coverage) |\n|:--|:--|:--|--:|--:|--:|--:|:--|\n")
    for name, c in ph["comparisons"].items():
        text += f"| {name} | {contrast_text(c)} | {c['outcome']} | {_test_cells(c)} |\n"
    for name, c in ph["comparisons"].items():
        if c.get("reward_gap_by_step"):
            text += (f"\n{name}: raw training reward a - b by logged step, mean over seeds: "
                     + ", ".join(f"{v:+.3f}" for v in c["reward_gap_by_step"].values()) + ".\n")
    text += ("\nPer arm, means over seeds (training reward at T = 1; reward gain = raw terminal reward, the mean of "
             f"the last {TERMINAL_STEPS} logged steps, minus the step-1 reward; the first held-out evaluation is "
             "greedy, so where it is identical over seeds it is one measurement of the arm, not one per seed):\n\n"
             "| arm | runs | step-1 reward | reward gain | entropy step 1 -> last (nats/token) | runs whose entropy "
             "fell | last-step entropy, range | first held-out accuracy |\n|:--|--:|--:|--:|:--|--:|:--|:--|\n")
    for name, a in ph["arms"].items():
        acc = a["first_eval_accuracy"]
        solved = "/".join(str(k) for k in a["first_eval_solved"])
        value = f"{solved}/{a['eval_prompts']}" if a["eval_prompts"] and solved else "/".join(f"{v:.3f}" for v in acc)
        shown = ("--" if not acc else value + (" (identical over seeds: one measurement)"
                                               if a["first_eval_one_measurement"] else " (over seeds)"))
        text += (f"| `{name}` | {a['runs']} | {a['step1_reward']:.3f} | {a['reward_gain']:.3f} | "
                 f"{a['step1_entropy']:.2f} -> {a['last_entropy']:.2f} | {a['entropy_fell']} of {a['runs']} | "
                 f"{a['last_entropy_range'][0]:.2f}-{a['last_entropy_range'][1]:.2f} | {shown} |\n")
    return text


def _g3(value) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _range(values: list) -> str:
    values = [v for v in values if v is not None]
    return "n/a" if not values else f"{min(values):.2f}" if min(values) == max(values) else \
        f"{min(values):.2f}-{max(values):.2f}"


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


def decided(runs: pd.DataFrame, curves: pd.DataFrame, manifest: dict, rule: dict) -> dict:
    """What a grid's registered decision ``rule`` says of its runs: the decision, the comparison, the envelope and,
    where the rule has them, its questions and its effects (a search stage's, a ``grids:`` entry's)."""
    summary = {"decision": decision(runs, rule), "comparison": comparison(runs, rule, curves),
               "envelope": envelope(runs, rule, manifest)}
    if rule.get("questions"):
        summary["questions"] = questions(runs, rule)
    if rule.get("effects"):
        summary["effects"] = effects(runs, curves, rule)
    if rule.get("dose_response"):
        summary["dose_response"] = dose_response(runs, rule["dose_response"], rule)
    return summary


def _dose_text(d: dict) -> str:
    """The dose-response estimands as the tables print them."""
    if d.get("unfinished") or d.get("refused"):
        return f"**Dose-response**: not read ({d.get('refused') or str(d['unfinished']) + ' runs unfinished'}).\n\n"

    def est(e: dict) -> str:
        sh = e.get("shift")
        return ("n/a" if not sh else f"{sh['estimate']:+.3g} [{sh['low']:+.3g}, {sh['high']:+.3g}] "
                f"({100 * sh['coverage']:.1f}%, signed-rank p = {e['signed_rank_p']:.2g})")
    share = d.get("share") or {}
    share_text = ("n/a" if share.get("estimate") is None else
                  f"{share['estimate']:.2f} [{share['low']:.2f}, {share['high']:.2f}]"
                  + ("" if share.get("bounded") else " (the set reaches the searched range's end: unbounded)"))
    low = d.get("lowest_collapsing")
    return (f"**Dose-response** ({d['seeds']} seeds, outcome {d['outcome']} on the in-training mismatch over "
            f"{', '.join(d['doses'])}; floor {d['floor_arm']}): slope per unit mean |dlogp| {est(d['slope'])}; "
            f"gain predicted at zero mismatch minus {d['doses'][0]}'s {est(d['explained'])}; {d['floor_arm']} minus "
            f"{d['doses'][0]} {est(d['deficit'])}; share of the deficit the mismatch explains {share_text}; lowest "
            f"dose with a collapse: {'none' if low is None else low['arm'] + ' (mismatch ' + format(low['mismatch'], '.3g') + ')'}."
            "\n\n")


def decided_text(summary: dict, what: str) -> str:
    """The decision's statement and each question's answer, as the tables print them (``what``: the grid, as the
    statement names it)."""
    text = ""
    if "decision" in summary:
        text += (f"**Decision** (rule fixed in the config before the {what} ran): "
                 f"{summary['decision']['statement']}\n\n")
    for name, q in (summary.get("questions") or {}).get("questions", {}).items():
        auc = q.get("reward_auc") or {}
        text += (f"**{name}** {q['question']} `{q['a']}` collapsed {q['a_collapsed'][0]}/{q['a_collapsed'][1]} "
                 f"vs `{q['b']}` {q['b_collapsed'][0]}/{q['b_collapsed'][1]} (one-sided Fisher p = "
                 f"{q['fisher_p'] if q['fisher_p'] is None else format(q['fisher_p'], '.3g')}): "
                 f"**{q['answer']}**; reward AUC `{q['a']}` - `{q['b']}` paired by seed: mean "
                 f"{auc.get('mean_difference') if auc.get('mean_difference') is None else format(auc['mean_difference'], '.3g')}, "
                 f"signed-rank p = {auc.get('signed_rank_p') if auc.get('signed_rank_p') is None else format(auc['signed_rank_p'], '.3g')}"
                 f"{_shift_text(auc.get('shift'))}.\n\n")
    if summary.get("dose_response"):
        text += _dose_text(summary["dose_response"])
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--stage", required=True, choices=["pilot", "grid", "ablation", "lever"])
    parser.add_argument("--figure", required=True, type=Path)
    args = parser.parse_args(argv)
    manifest = read_manifest(args.results / "search" / args.stage / "manifest.json")
    rule = manifest.get("pilot_rule") or {}
    runs, curves = search_rows(args.results, manifest, rule.get("reward_steps", 3))
    tables = args.results / "tables"
    tables.mkdir(parents=True, exist_ok=True)
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    stem = tables / f"search_{args.stage}"
    if args.stage == "pilot" and rule.get("kind") == "paired":
        table, summary = paired_pilot(runs, rule, curves.assign(cell=_cells(curves, manifest)) if len(curves)
                                      else curves)
        shown = table
        _figure_paired_pilot(table, args.figure, manifest["label"])
        r = summary["rule"]
        text = (f"### {manifest['label']}: pilot\n\nRule (written in the config before the pilot ran): a rung is "
                f"eligible when `{r['control_arm']}` learns -- the mean reward of the last {r['learn_fraction']:g} of its "
                f"logged steps exceeds that of the first {r['learn_fraction']:g} by at least {r['min_gain']} -- and stays stable "
                f"(finished, no collapse); chosen = the eligible rung whose `{r['reference_arm']}` run has the largest "
                f"step-1 mean |dlogp|.\n\nChosen: **{summary['chosen'] or ('pilot unfinished' if summary.get('unfinished') else 'no rung is eligible')}**\n\n")
        if summary.get("tied_with"):
            text += (f"Tied at the same step-1 mismatch (step 1 samples the same weights with the same seed): "
                     f"{', '.join(summary['tied_with'])}; the rule takes the first in the config's axis order.\n\n")
    elif args.stage == "pilot":
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
            summary.update(decided(runs, curves, manifest, rule))
            if manifest.get("post_hoc") and not summary["decision"].get("unfinished"):
                summary["post_hoc"] = post_hoc(runs, curves, manifest["post_hoc"], rule)
        sens = sensitivity_groups(runs, axes)
        summary["sensitivity"] = sens.to_dict(orient="records")
        ended = runs[flags(runs.get("absorbing", pd.Series(False, index=runs.index)))]
        summary["absorbing"] = [{"cell": r["cell"], "verdict": r["verdict"], "terminal_reward": r["terminal_reward"],
                                 "final_reward": r["final_reward"]} for _, r in ended.iterrows()]
        table = runs
        shown = per_group
        _figure_grid(curves, manifest, args.figure, manifest.get("decision") or {}, runs)
        text = f"### {manifest['label']}: {args.stage}\n\n" + decided_text(summary, args.stage)
        confidence = (manifest.get("decision") or {}).get("confidence", 0.95)
        absorbing = "; ".join(f"{a['cell']} (verdict {a['verdict']}, raw terminal reward {a['terminal_reward']:.3g}, "
                              f"smoothed final reward {a['final_reward']:.3g})" for a in summary["absorbing"]) or "none"
        text += (f"**Absorbing end states** (raw reward of the last {TERMINAL_STEPS} logged steps at most "
                 f"{ABSORBING_MAX_REWARD:g} in groups whose reward spread averages at most {ABSORBING_MAX_REWARD_STD:g}: "
                 f"no advantage, no gradient; reported whatever the collapse rule says): {absorbing}.\n\n")
        ratios = (summary.get("comparison") or {}).get("mismatch_ratio") or {}
        if ratios:
            c = summary["comparison"]
            text += (f"**Mismatch, `{c['treatment_arm']}` relative to `{c['reference_arm']}`** (beside the rule; mismatch "
                     "tracks the policy's entropy, so a ratio of means over the steps compares how far each arm's policy "
                     "moved as much as its numerics): " + "; ".join(
                         f"{rung}: at step 1 (same weights) {_range(list(r['step1'].values()))} per seed, at matched "
                         f"entropy {_g3(r['entropy_matched'])}, mean over the steps {_g3(r['mean_over_steps'])}"
                         for rung, r in ratios.items()) + ".\n\n")
        text += (f"Verdicts under collapse rule {RULE_VERSION} (`rpa.train.collapse.RULE_VERSION`), recomputed from each "
                 f"run's metric log; `summary_superseded` in the CSV marks a run whose `summary.json` holds an earlier "
                 f"rule's different verdict ({int(flags(runs.get('summary_superseded', pd.Series(dtype=bool))).sum())} "
                 f"here).\n\n")
        text += (f"Per group: collapsed / finished runs with an exact {100 * confidence:.0f}% interval on the collapse rate; "
                 f"final reward smoothed (the rule's window) and raw terminal reward (mean of the last {TERMINAL_STEPS} "
                 "logged steps); mismatch and phantom-clip rate before the collapse (all steps of runs that did not "
                 "collapse), and the largest mismatch before any drop (also before a first dip of the raw reward "
                 "below the rule's level).\n\n")
    with atomic_path(f"{stem}.csv") as tmp:
        table.to_csv(tmp, index=False)
    write_text(Path(f"{stem}.md"), text + shown.to_markdown(index=False, floatfmt=".3g") + "\n"
                                  + ("\n" + _sensitivity_markdown(sens, axes) if args.stage != "pilot" else "")
                                  + ("\n" + _effects_markdown(summary["effects"]) if "effects" in summary else "")
                                  + ("\n" + _post_hoc_markdown(summary["post_hoc"]) if "post_hoc" in summary else "")
                                  + ("\n### Runs\n\n" + runs.to_markdown(index=False, floatfmt=".3g") + "\n"
                                     if args.stage != "pilot" else ""))
    write_text(Path(f"{stem}.json"), json.dumps(_clean(summary), indent=1) + "\n")
    print(text.strip().splitlines()[-1] if text.strip() else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
