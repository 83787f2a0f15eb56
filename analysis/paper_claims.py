"""The paper's ``claims.tex`` (:func:`write_claims`; :mod:`analysis.paper` says what it holds): the
claims of the study as the result tables judge them, what holds at this scale and what does not
(:func:`findings`), the real-model grid in one passage, the positive control's table
(``dose_table.tex``) and threshold statements, and the rules and commits the results came from
(:mod:`analysis.paper_provenance`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from analysis.dose_stats import anchor_positions, groups, thresholds
from analysis.dose_text import statement
from analysis.latex import booktabs, escape, readable
from analysis.paired import fmt_change
from analysis.paper_provenance import commit_of, dose_rule, provenance, study_rule, study_old_logprobs
from analysis.paper_search import (arm_mismatch, arms_text, contrast_text, effect_reading, post_hoc_text,
                                   unfinished_runs)
from analysis.runs import MANIFEST, read_manifest
from rpa.core.jsonfiles import write_text
from rpa.train.collapse import RULE_VERSION, TERMINAL_STEPS


def _collapsed(cell: str) -> tuple[int, int] | None:
    if not isinstance(cell, str) or "/" not in cell:
        return None
    k, n = cell.split("/")
    return int(k), int(n)


def collapse_claim(table: pd.DataFrame, arm: str, claim: str, reference: str) -> str:
    """One claim ('aligning <arm> prevents the BF16 baseline's collapse'), judged per model
    against the ``reference`` arm (the BF16 baseline)."""
    verdicts = []
    for model, rows in table.groupby("model", sort=False):
        by = rows.set_index("arm")["collapsed"]
        base, treated = _collapsed(by.get(reference)), _collapsed(by.get(arm))
        if base is None or treated is None:
            verdicts.append((model, "missing", "runs missing"))
        elif base[0] == 0:
            verdicts.append((model, "untestable", f"the baseline did not collapse (0/{base[1]})"))
        elif treated[0] == 0:
            verdicts.append((model, "reproduced", f"baseline {base[0]}/{base[1]}, {arm} 0/{treated[1]}"))
        elif treated[0] / treated[1] < base[0] / base[1]:
            verdicts.append((model, "partly", f"baseline {base[0]}/{base[1]}, {arm} {treated[0]}/{treated[1]}"))
        else:
            verdicts.append((model, "not reproduced", f"baseline {base[0]}/{base[1]}, {arm} {treated[0]}/{treated[1]}"))
    kinds = {v for _, v, _ in verdicts}
    overall = ("reproduced" if kinds == {"reproduced"} else "could not be tested (no baseline collapsed)"
               if kinds == {"untestable"} else "not reproduced" if kinds == {"not reproduced"} else "mixed")
    detail = "; ".join(f"{m}: {why}" for m, _, why in verdicts)
    return f"\\item \\textbf{{{escape(claim)}}} --- {overall}. {escape(detail)}."


def _below_zero(rows: pd.DataFrame, prefix: str) -> tuple[int, int]:
    """(models whose 95% interval of the change lies below zero, models with an interval)."""
    rows = rows[rows[f"{prefix}_high"].notna()]
    return int((rows[f"{prefix}_high"] < 0).sum()), len(rows)


def _verdict(below: int, n: int) -> str:
    return "lower on every model (interval below zero)" if n and below == n else \
        f"lower with an interval below zero on {below} of {n} models"


def mismatch_claim(table: pd.DataFrame, arm: str, reference: str) -> str:
    """The mismatch claim, measured both ways: offline (the probe, identical tokens, paired
    bootstrap over sequences) and during training (paired by seed, t-interval over seeds)."""
    rows = table[(table["arm"] == arm) & table["probe_mean_abs_dlogp_change"].notna()]
    if rows.empty:
        return f"\\item No probe of {escape(arm)}."
    parts = [f"{m}: {fmt_change(c, lo, hi)}" for m, c, lo, hi in
             zip(rows["model"], rows["probe_mean_abs_dlogp_change"], rows["probe_mean_abs_dlogp_low"],
                 rows["probe_mean_abs_dlogp_high"])]
    text = (f"\\item \\textbf{{Aligning {escape(arm)} lowers the trainer-vs-sampler mismatch}} --- "
            f"offline (probe, identical tokens, change of mean $|\\Delta\\log p|$ vs {escape(reference)}, "
            f"paired bootstrap 95\\% interval over sequences): {_verdict(*_below_zero(rows, 'probe_mean_abs_dlogp'))}. "
            f"{escape('; '.join(parts))}.")
    train = table[(table["arm"] == arm) & table["train_mean_abs_dlogp_change"].notna()] \
        if "train_mean_abs_dlogp_change" in table else table.iloc[:0]
    if len(train):
        parts = [f"{m}: {fmt_change(c, lo, hi, resamples=0)}" for m, c, lo, hi in
                 zip(train["model"], train["train_mean_abs_dlogp_change"], train["train_mean_abs_dlogp_low"],
                     train["train_mean_abs_dlogp_high"])]
        text += (f" In training (per seed the geometric-mean ratio over the steps both runs logged, 95\\% "
                 f"t-interval over seeds): {_verdict(*_below_zero(train, 'train_mean_abs_dlogp'))}. "
                 f"{escape('; '.join(parts))}.")
    return text


def dose_parts(results: Path, out_dir: Path) -> str:
    runs_path = results / "tables" / "dose_runs.csv"
    if not runs_path.exists():
        return ""
    runs = pd.read_csv(runs_path)
    per_group = groups(runs)
    cols = ["arm", "is_correction", "old_logprobs", "invalid", "runs", "collapsed", "unconfirmed", "grad_spike_runs",
            "mean_abs_dlogp", "phantom_clip_rate", "final_reward", "terminal_reward"]
    window = int(per_group["mismatch_steps"].dropna().iloc[0]) if per_group["mismatch_steps"].notna().any() else None
    over = f"over steps 1-{window}" if window else "over all steps"
    write_text(out_dir / "dose_table.tex", booktabs(
        readable(per_group[[c for c in cols if c in per_group]],
                 {"terminal_reward": f"raw reward, last {TERMINAL_STEPS} steps"}),
        f"Positive control per arm (mean over seeds; mean |dlogp| and the phantom-clip rate {over} of each run, "
        f"before any collapse; runs with grad spikes: a gradient-norm spike is an event, not a collapse; "
        f"final reward smoothed over the rule's window, raw reward the mean of the last {TERMINAL_STEPS} logged steps; "
        f"invalid: IS with old logprobs from the sampler, which applied the correction twice; verdicts under "
        f"collapse rule {RULE_VERSION})",
        "tab:dose", placement="H"))
    lines = statement(thresholds(runs), anchor_positions(runs))
    return "\\begin{itemize}" + "".join(f"\\item {escape(line.removeprefix('- '))}" for line in lines) + \
        "\\end{itemize}"


def miniature_sensitivity(results: Path, manifest: dict, dose_results: Path | None) -> str:
    """Whether the study's runs could have seen a collapse at all: the positive control's
    outcome for the old-logprob setting the study ran with (from the committed dose runs)."""
    runs_path = (dose_results or results) / "tables" / "dose_runs.csv"
    olds = study_old_logprobs(results, manifest)
    if not runs_path.exists() or len(olds) != 1:
        return ""
    old = olds.pop()
    runs = pd.read_csv(runs_path)
    th = thresholds(runs, boot=0)
    curves = th[(th["old_logprobs"] == old) & (th["kind"] != "invalid")]
    if curves.empty or not (curves["kind"] == "none collapsed").all():
        return ""
    anchors = anchor_positions(runs)
    none = anchors[(anchors["arm"] == "bf16-none") & (anchors["old_logprobs"] == old)].set_index("is_correction")
    ratios = [t["low"] / none.loc[t["is_correction"], "mean_abs_dlogp"] for _, t in curves.iterrows()
              if t["is_correction"] in none.index]
    ratio = f"; {min(ratios):.0f}-{max(ratios):.0f}x its own stock BF16 runs'" if ratios else ""
    return (f"The miniature's runs take PPO's old log-probabilities from the {old} (every run's config), the setting in "
            f"which the positive control never collapsed at any dose: {int(curves['collapsed'].sum())} of "
            f"{int(curves['runs'].sum())} runs collapsed up to a mismatch of {curves['low'].min():.2g}-"
            f"{curves['low'].max():.2g} (mean |dlogp| over the early steps{ratio}). So a miniature without a collapse says "
            f"nothing about collapse: it could not have seen one.")


def findings(results: Path, manifest: dict, dose_results: Path | None = None,
             search_results: Path | None = None) -> dict[str, list[str]]:
    """What the committed results say, computed from their tables: what holds at this scale,
    what does not, and what could not be tested (the abstract and section 1)."""
    out: dict[str, list[str]] = {"holds": [], "does not": [], "untested": []}
    tables = results / "tables"
    ref = manifest["reference_arm"]
    collapse = pd.read_csv(tables / "study_collapse.csv")
    mismatch = pd.read_csv(tables / "study_mismatch.csv")
    rows = mismatch[mismatch["arm"] == "all"]
    if len(rows):
        probe, train = _below_zero(rows, "probe_mean_abs_dlogp"), _below_zero(rows, "train_mean_abs_dlogp")
        out["holds"].append(f"Aligning all three regions lowers the trainer-vs-sampler mismatch, with a 95% interval "
                            f"below zero on {probe[0]} of {probe[1]} miniature sizes offline (identical tokens) and on "
                            f"{train[0]} of {train[1]} during training.")
    dose = (dose_results or results) / "tables" / "dose_runs.csv"
    if dose.exists():
        runs = pd.read_csv(dose)
        th, anchors = thresholds(runs, boot=0), anchor_positions(runs)
        fit = th[(th["kind"] == "logistic") & (th["is_correction"] == "off")]
        for _, t in fit.iterrows():
            none = anchors[(anchors["arm"] == "bf16-none") & (anchors["is_correction"] == "off")
                           & (anchors["old_logprobs"] == t["old_logprobs"])]["mean_abs_dlogp"]
            times = f", {t['estimate'] / none.iloc[0]:.0f}x stock BF16's" if len(none) else ""
            out["holds"].append(f"The pipeline sees a collapse when one is caused: a sampler-only perturbation "
                                f"collapses half the runs at a mean |dlogp| of {t['estimate']:.2g}{times}, with PPO's "
                                f"old log-probabilities from the {t['old_logprobs']} and IS off.")
    base = collapse[collapse["arm"] == ref]["collapsed"].dropna().tolist()
    k = sum(int(c.split("/")[0]) for c in base if "/" in c)
    n = sum(int(c.split("/")[1]) for c in base if "/" in c)
    search = []
    for stage in ("grid", "lever"):
        path = None if search_results is None else search_results / "tables" / f"search_{stage}.json"
        if path is not None and path.exists():
            d = json.loads(path.read_text())["decision"]
            if d.get("reference_runs"):
                rates = (d.get("power") or {}).get("rates") or {}
                power = "" if not rates else (" (the rule finds a true per-run collapse rate of " + ", ".join(
                    f"{100 * float(r):.0f}% with probability {100 * v:.0f}%" for r, v in rates.items()) + ")")
                search.append(f"{d['reference_collapsed']}/{d['reference_runs']} in the search's {stage}{power}")
    out["does not"].append(f"Stock BF16 did not collapse by itself: {k}/{n} runs of the miniature"
                           + (f", {'; '.join(search)}" if search else "") + ".")
    if search_results is not None and (search_results / "tables" / "search_grid.json").exists():
        ended = json.loads((search_results / "tables" / "search_grid.json").read_text()).get("absorbing") or []
        for a in ended:
            out["does not"].append(f"The one search run that ends in an absorbing state is aligned ({a['cell']}: "
                                   f"verdict {a['verdict']}, raw reward {a['terminal_reward']:.2g} over its last "
                                   f"{TERMINAL_STEPS} steps, smoothed final reward {a['final_reward']:.2g}); with four "
                                   f"seeds a rung this is no evidence either way.")
    out["untested"].append("Whether aligning the three regions prevents the BF16 baseline's collapse, and whether RoPE "
                           "alone suffices: no baseline collapsed, so there was no collapse to prevent.")
    note = miniature_sensitivity(results, manifest, dose_results)
    if note:
        out["untested"].append(note)
    return out


def real_model_finding(real_search_results: Path | None) -> str | None:
    """The real-model grid in one passage (the abstract and section 1): each arm's collapse count, each
    question as its pre-registered test answers it, and beside the verdicts the paired reward-AUC shift
    with its exact interval -- or how much of the grid has run; None where no real-model grid ran."""
    path = None if real_search_results is None else real_search_results / "tables" / "search_grid.json"
    if path is None or not path.exists():
        return None
    grid = json.loads(path.read_text())
    qs, decision = (grid.get("questions") or {}).get("questions") or {}, grid["decision"]
    if decision.get("outcome") == "incomplete":
        return (f"On a real pretrained model (SmolLM2-135M-Instruct) the pre-registered grid has not finished "
                f"({decision['unfinished']} runs left); no question of it is answered yet.")
    counts = {}
    for q in qs.values():
        counts.setdefault(q["a"], q["a_collapsed"]), counts.setdefault(q["b"], q["b_collapsed"])
    arms = ", ".join(f"{arm} {k}/{n}" for arm, (k, n) in counts.items())
    answers = "; ".join(f"{name} (does {q['a']} collapse more often than {q['b']}?) {q['answer']}, one-sided Fisher "
                        f"p = {q['fisher_p']:.3g}" for name, q in qs.items())
    shifts = []
    for q in qs.values():
        shift = (q.get("reward_auc") or {}).get("shift")
        if shift:
            shifts.append(f"{q['a']} - {q['b']} {shift['estimate']:+.3f} ({100 * shift['coverage']:.1f}% interval "
                          f"{shift['low']:+.3f} to {shift['high']:+.3f})")
    env = grid.get("envelope") or {}
    reach = (f", stock BF16 reaching a mismatch of {env['max_pre_drop_mismatch']:.3g} (mean |dlogp|, before any "
             f"drop) at a mean entropy of {env['mean_entropy']:.2f} nats/token"
             if env.get("max_pre_drop_mismatch") is not None and env.get("mean_entropy") is not None else "")
    # each arm's own in-training mismatch: an arm meant as a mismatch-free control is read beside it
    own = arm_mismatch(grid)
    mismatch = ("; each arm's mean in-training mismatch (mean |dlogp| before any collapse): " + arms_text(own)
                if own else "")
    text = (f"On a real pretrained model (SmolLM2-135M-Instruct; the grid and its tests written before it ran) "
            f"collapsed runs per arm: {arms}{reach}{mismatch}. By the pre-registered tests: {answers}.")
    if shifts:
        text += (" Beside the verdicts, the reward AUC paired by seed (Hodges-Lehmann shift, the exact interval "
                 "of the signed-rank test): " + "; ".join(shifts) + ".")
    if post_hoc_text(grid):
        text += " " + post_hoc_text(grid)
    return text


def precision_finding(precision_results: Path | None) -> str | None:
    """The precision x mismatch grid in one passage (section 1 and the abstract): each pre-registered effect on
    the learning gain with its shift, exact interval and p, and its reading by the rule written in the config --
    or that the grid has not finished; None where it did not run."""
    path = None if precision_results is None else precision_results / "tables" / "search_grid.json"
    if path is None or not path.exists():
        return None
    grid = json.loads(path.read_text())
    if unfinished_runs(grid) is not None:
        return "The precision x mismatch grid on SmolLM2 has not finished; nothing of it is read."
    effects = grid["effects"]
    alpha = grid["questions"]["alpha"]
    own = arm_mismatch(grid)
    said = "; ".join(
        f"{name} ({contrast_text(e['contrast'])}) {e['shift']['estimate']:+.3f} "
        f"({100 * e['shift']['coverage']:.1f}% interval {e['shift']['low']:+.3f} to {e['shift']['high']:+.3f}, "
        f"p = {e['signed_rank_p']:.2g}): {effect_reading(e, alpha)}" for name, e in effects["effects"].items())
    return (f"Precision or mismatch (a grid on SmolLM2 crossing trainer precision with the mismatch, its effects "
            f"written before it ran; learning gain paired by seed): {said}. Each arm's mean in-training mismatch: "
            + arms_text(own)
            + "; the FP32 trainer's mismatch is of another kind than stock BF16's (its sampler's BF16 weights lag "
              "the FP32 updates), so the grid prices that mismatch, not stock BF16's own.")


def write_claims(results: Path, out_dir: Path, dose_results: Path | None = None,
                 search_results: Path | None = None, real_search_results: Path | None = None,
                 precision_results: Path | None = None) -> Path:
    manifest = read_manifest(results / "study" / MANIFEST)
    collapse = pd.read_csv(results / "tables" / "study_collapse.csv")
    mismatch = pd.read_csv(results / "tables" / "study_mismatch.csv")
    ref = manifest["reference_arm"]
    sensitivity = miniature_sensitivity(results, manifest, dose_results)
    items = [collapse_claim(collapse, "all", "Aligning all three regions prevents the BF16 baseline's collapse", ref),
             collapse_claim(collapse, "rope", "RoPE alone suffices", ref),
             *([f"\\item {escape(sensitivity)}"] if sensitivity else []),
             mismatch_claim(mismatch, "all", ref), mismatch_claim(mismatch, "rope", ref)]
    found = findings(results, manifest, dose_results, search_results)
    real = real_model_finding(real_search_results)
    precision = precision_finding(precision_results)
    found["real model"] = [x for x in (real, precision) if x]
    heads = {"holds": "What holds at this scale", "does not": "What does not",
             "untested": "What could not be tested", "real model": "On a real pretrained model"}
    listed = "".join(f"\\item \\textbf{{{heads[key]}.}} " + " ".join(escape(x) for x in lines)
                     for key, lines in found.items() if lines)
    abstract = [*found["holds"], *found["does not"][:1], *found["untested"], *found["real model"]]
    dose = dose_parts(dose_results or results, out_dir)
    rule, used = study_rule(results, manifest)
    setup = (f"Models: {', '.join(manifest['models'])}; arms: {', '.join(manifest['arms'])}; seeds: "
             f"{', '.join(map(str, manifest['seeds']))}; {len(manifest['cells'])} runs."
             + ("" if "fp32" in manifest["arms"] else " No FP32 (negative-control) training arm ran in these results."))
    commits = provenance(results, dose_results, search_results, real_search_results, precision_results)
    text = [f"\\newcommand{{\\studylabel}}{{{escape(manifest['label'])}}}",
            f"\\newcommand{{\\resultsdir}}{{{escape(str(results))}}}",
            f"\\newcommand{{\\commit}}{{{escape(commit_of(results))}}}",
            f"\\newcommand{{\\commits}}{{{escape(commits)}}}",
            f"\\newcommand{{\\ruleversion}}{{{escape(RULE_VERSION)}}}",
            "\\newcommand{\\findings}{\\begin{itemize}" + listed + "\\end{itemize}}",
            f"\\newcommand{{\\abstractresults}}{{{' '.join(escape(x) for x in abstract)}}}",
            f"\\newcommand{{\\setupnote}}{{{escape(setup)}}}",
            f"\\newcommand{{\\collapserule}}{{{escape(rule)}}}",
            f"\\newcommand{{\\doserule}}{{{escape(dose_rule(dose_results or results, used))}}}",
            "\\newcommand{\\claims}{\\begin{itemize}" + "\n".join(items) + "\\end{itemize}}",
            f"\\newcommand{{\\dosenote}}{{{dose}}}"]
    path = out_dir / "claims.tex"
    write_text(path, "\n".join(text) + "\n")
    return path
