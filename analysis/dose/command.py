"""The positive control's dose-response: collapse, reward and accuracy vs the *measured*
trainer-sampler mismatch, per importance-sampling correction and old-logprob setting.

Reads ``RESULTS/dose/manifest.json`` (the ``dose:`` section's; ``--manifest``: another positive control's,
a ``grids:`` entry's of kind dose, ``RESULTS/grids/<entry>/manifest.json``) and the run of each cell it lists
(``dose/<arm>/<correction>-<old>/seed<N>``, :func:`analysis.runs.runs_table`). Verdicts are recomputed from ``metrics.jsonl`` with the thresholds of each
run's config (:func:`rpa.train.collapse.run_verdict`), so the tables follow the current
definition: ``stable``, ``unconfirmed`` (a drop the run ended too soon to judge; counted in its
own column, never as stable) or ``collapsed``; grad-norm spikes and recoveries are reported
beside them. Writes

* ``dose_runs.csv`` -- one row per run (:data:`analysis.dose.stats.RUN_COLUMNS`), with its verdict
  under each variation of :func:`rpa.train.collapse.sensitivity_settings`, the rule version that
  produced it (``rule_version``), whether the run's ``summary.json`` holds an earlier rule's different
  verdict (``summary_superseded``), and beside the smoothed final reward the raw terminal reward
  and the absorbing end state (:func:`rpa.train.collapse.terminal_state`);
* ``dose.csv`` -- one row per arm x correction x old logprobs (means over seeds);
* ``dose_sensitivity.csv`` -- per arm x correction x old logprobs, the collapsed (and
  unconfirmed) counts under each variation of the collapse thresholds;
* ``dose.md`` -- all of them, the collapse threshold per curve and where the BF16 arms sit;
* a figure: collapse fraction, final reward and phantom-clip rate vs measured mismatch.

The rows and statistics are in :mod:`analysis.dose.stats`, the text (``dose.md``, the threshold
statements) in :mod:`analysis.dose.text`, the figure in :mod:`analysis.dose.figures`.

**The dose** (x-axis) of a run is its mismatch over a fixed *early window*: the mean of
``mismatch/mean_abs_dlogp`` (and of every other ``mismatch/*`` column) over steps
1..K (``--mismatch-steps``, default :data:`analysis.dose.stats.MISMATCH_STEPS`), the same window
for every run and ending before any run of the committed grid collapsed. The mismatch of a collapsing run rises
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
from pathlib import Path

from analysis.dose.figures import figure
from analysis.dose.stats import (MISMATCH_STEPS, anchor_positions, collapse_rule, dose_rows, groups,
                                 sensitivity_table, sensitivity_thresholds, thresholds)
from analysis.dose.text import markdown, statement
from rpa.core.jsonfiles import atomic_path, write_text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--manifest", type=Path, default=None,
                        help="the grid's manifest (default: RESULTS/dose/manifest.json, the dose: section's)")
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--figure", required=True, type=Path)
    parser.add_argument("--mismatch-steps", type=int, default=MISMATCH_STEPS,
                        help=f"early window: the dose is the mean mismatch over steps 1..K (default {MISMATCH_STEPS})")
    args = parser.parse_args()
    runs = dose_rows(args.results, args.mismatch_steps, args.manifest)
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
                                                   collapse_rule(args.results, args.manifest)))
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    figure(per_group, anchors, args.figure, runs, th)
    print("\n".join(statement(th, anchors)))

