"""The paper's ``claims.tex`` (:func:`write_claims`; :mod:`analysis.paper` says what it holds): the study's label,
the collapse rule and the commits the results came from (:mod:`analysis.paper.provenance`), the miniature's
mismatch claims and sensitivity in one passage (:func:`miniature_note`), the positive control's table
(``dose_table.tex``) and threshold statements; and, through :mod:`analysis.paper.front`, the abstract and the
claims table (``front.tex``). Each finding is said once: the front gives its key number, a section its detail.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.dose.stats import anchor_positions, groups, thresholds
from analysis.dose.text import statement
from analysis.latex import booktabs, escape, readable
from analysis.paper.provenance import commit_of, dose_rule, provenance, study_rule, study_old_logprobs
from analysis.paper.front import below_zero, gather, write_front
from analysis.runs import MANIFEST, read_manifest
from rpa.workflow.paper import by_kind, first
from rpa.core.jsonfiles import write_text
from rpa.train.collapse import RULE_VERSION, TERMINAL_STEPS


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


def miniature_note(results: Path, manifest: dict, dose_results: Path | None = None) -> str:
    """The miniature's two mismatch claims in one passage (the per-size detail is its mismatch table) and, where the
    positive control ran, whether its runs could have seen a collapse at all."""
    mismatch = pd.read_csv(results / "tables" / "study_mismatch.csv")
    said = []
    for arm, what in (("all", "Aligning all three regions"), ("rope", "Aligning RoPE alone")):
        rows = mismatch[mismatch["arm"] == arm]
        if len(rows):
            probe, train = below_zero(rows, "probe_mean_abs_dlogp"), below_zero(rows, "train_mean_abs_dlogp")
            said.append(f"{what} lowers the mismatch with a 95% interval below zero on {probe[0]} of {probe[1]} sizes "
                        f"offline and on {train[0]} of {train[1]} during training")
    text = "; ".join(said) + " (the mismatch table)." if said else ""
    sensitivity = miniature_sensitivity(results, manifest, dose_results)
    return f"{text} {sensitivity}".strip()


def write_claims(results: Path, out_dir: Path, sections: dict[str, list[Path]] | None = None) -> Path:
    """``claims.tex`` (the study's label, rule, commits, setup and miniature notes) and, beside it, ``front.tex``
    (:mod:`analysis.paper.front`: the abstract and the claims table), from the study's ``results`` and the
    paper's further ``sections`` (kind -> directories, :func:`rpa.workflow.paper.by_kind`)."""
    sections = by_kind([]) | (sections or {})
    manifest = read_manifest(results / "study" / MANIFEST)
    dose_results = first(sections, "dose")
    write_front(out_dir, gather(results, manifest, sections))
    dose = dose_parts(dose_results or results, out_dir)
    rule, used = study_rule(results, manifest)
    setup = (f"Models: {', '.join(manifest['models'])}; arms: {', '.join(manifest['arms'])}; seeds: "
             f"{', '.join(map(str, manifest['seeds']))}; {len(manifest['cells'])} runs."
             + ("" if "fp32" in manifest["arms"] else " No FP32 (negative-control) training arm ran in these results."))
    commits = provenance(results, sections)
    text = [f"\\newcommand{{\\studylabel}}{{{escape(manifest['label'])}}}",
            f"\\newcommand{{\\resultsdir}}{{{escape(str(results))}}}",
            f"\\newcommand{{\\commit}}{{{escape(commit_of(results))}}}",
            f"\\newcommand{{\\commits}}{{{escape(commits)}}}",
            f"\\newcommand{{\\ruleversion}}{{{escape(RULE_VERSION)}}}",
            f"\\newcommand{{\\miniaturenote}}{{{escape(miniature_note(results, manifest, dose_results))}}}",
            f"\\newcommand{{\\setupnote}}{{{escape(setup)}}}",
            f"\\newcommand{{\\collapserule}}{{{escape(rule)}}}",
            f"\\newcommand{{\\doserule}}{{{escape(dose_rule(dose_results or results, used))}}}",
            f"\\newcommand{{\\dosenote}}{{{dose}}}"]
    path = out_dir / "claims.tex"
    write_text(path, "\n".join(text) + "\n")
    return path
