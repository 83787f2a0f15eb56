"""The study across sizes: collapse and mismatch tables, reward / accuracy / mismatch curves
and a collapse heatmap, from ``RESULTS/study/manifest.json`` (the ``study:`` section's; ``--manifest``: a
``grids:`` entry's of kind study, written with ``--out-dir`` / ``--figure-dir`` under ``RESULTS/tables/grids/<entry>``
and ``RESULTS/figures/grids/<entry>``) and the run directories it lists.

Every expected cell appears: a run without a summary is ``missing``, one that ended in an
error is ``failed``; neither is dropped. Verdicts are recomputed from each run's
``metrics.jsonl`` with the thresholds of its config (:func:`rpa.train.collapse.run_verdict`).
The rows and statistics are in :mod:`analysis.study.stats`, the figures in
:mod:`analysis.study.figures`; this module writes the tables (their readable and LaTeX forms and
captions).

Tables (CSV, Markdown, LaTeX/booktabs) under ``RESULTS/tables``:

* ``study_collapse``: per model x arm: runs, finished, collapsed (``k/n`` of the finished
  runs), unconfirmed (a drop that reached the end of the run before the persistence window:
  shown, never counted as stable), grad-norm spike events (summed over the runs), median
  collapse step, peak and final (smoothed) reward, the raw terminal reward (mean of each run's
  last :data:`rpa.train.collapse.TERMINAL_STEPS` logged rewards) and the runs that end in an
  absorbing state (:func:`rpa.train.collapse.terminal_state`, whatever the rule says), final
  eval accuracy (mean +- sd over seeds), and ``rule_version``, the collapse rule the verdicts
  were recomputed under. The LaTeX version leaves out failed/missing/peak reward to fit a page's
  width.
* ``study_sensitivity``: per model x arm, the collapsed count (and unconfirmed count) under
  each variation of :func:`rpa.train.collapse.sensitivity_settings` (drop fraction 0.4 / 0.5 / 0.6;
  half and twice the persistence window). The LaTeX version lists only the rows with a
  collapsed or unconfirmed run under some variation, and says how many rows are 0 everywhere.
* ``study_mismatch``: per model x arm: the offline probe's ``mean_abs_dlogp`` and ``kl_k3``
  on identical tokens (where a probe configuration has the arm's name) with the change vs
  the reference arm and its paired bootstrap 95% interval over sequences
  (:func:`analysis.paired.paired_change`); ``probe_note`` says why a row has no probe change:
  the reference itself, an arm without a probe configuration, or a configuration that differs
  from the reference only in ``trainer_positions`` ("n/a (unpadded probe)": the probe scores
  each sequence unpadded, so TRL's left-padding position shift never happens there). Then the
  same two metrics during training (mean over steps, mean +- sd over seeds), and the **paired
  in-training change** of ``mismatch/mean_abs_dlogp`` vs the reference arm: per seed, the
  geometric-mean ratio over the steps both runs logged (same seed, same step); then the mean of
  the per-seed log-ratios with a 95% t-interval over seeds (df = seeds - 1; t = 4.303 for three
  seeds), as ``exp(.) - 1`` (columns ``train_mean_abs_dlogp_change/_low/_high``, and
  ``train_paired_seeds``).

Figures under ``RESULTS/figures``: ``study_rewards`` (reward vs step per size, mean and sd
band over seeds clipped to [0, 1]; eval accuracy at its few eval steps, mean and sd error
bars), ``study_mismatch_curves`` (in-training mismatch, log scale), ``study_heatmap``
(collapsed share per size x arm; missing cells grey). One colour per arm everywhere
(:func:`analysis.study.figures.arm_colors`), one legend per figure.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from analysis.latex import booktabs
from analysis.paired import fmt_change
from analysis.runs import MANIFEST, read_manifest, section_of
from analysis.study.figures import heatmap, mismatch_figure, reward_figure
from analysis.study.stats import collapse_table, mismatch_table, sensitivity_table, study_rows
from rpa.core.jsonfiles import atomic_path, write_text
from rpa.train.collapse import RULE_VERSION, TERMINAL_STEPS


def latex_collapse(table: pd.DataFrame) -> pd.DataFrame:
    """The collapse table for the paper: few, short columns (runs that failed or are missing
    show as a finished count below the runs; peak reward is in the CSV and Markdown only)."""
    out = pd.DataFrame({"model": table["model"], "arm": table["arm"]})
    if (table["finished"] != table["runs"]).any():
        out["finished"] = [f"{f}/{r}" for f, r in zip(table["finished"], table["runs"])]
    out["collapsed"] = table["collapsed"]
    out["unconf."] = table["unconfirmed"].astype(object).where(table["unconfirmed"].notna(), None)
    out["spikes"] = table["grad_spikes"].astype(object).where(table["grad_spikes"].notna(), None)
    out["step"] = [None if pd.isna(v) else f"{v:g}" for v in table["median_collapse_step"]]
    out["final reward (smoothed)"] = table["final_reward"]
    if "terminal_reward" in table:
        out[f"raw reward, last {TERMINAL_STEPS} steps"] = table["terminal_reward"]
    if "absorbing" in table:
        out["absorbing"] = table["absorbing"].astype(object).where(table["absorbing"].notna(), None)
    out["eval accuracy"] = table["final_eval_accuracy"]
    return out


def readable_sensitivity(table: pd.DataFrame) -> pd.DataFrame:
    """``k/n`` collapsed per variation, ``k/n (u unconf.)`` where some drops were unconfirmed."""
    out = table[["model", "arm"]].copy()
    labels = [c.removesuffix(" collapsed") for c in table.columns if c.endswith(" collapsed")]
    for label in labels:
        out[label] = [f"{k}/{n}" + (f" ({u} unconf.)" if u else "") if n else "--"
                      for k, u, n in zip(table[f"{label} collapsed"], table[f"{label} unconfirmed"], table["judged"])]
    return out


def latex_sensitivity(table: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The sensitivity table for the paper, compacted: only the rows with a collapsed or
    unconfirmed run under the rule's own thresholds or some variation, and a sentence for the
    rest (every one of them 0 of its finished runs under every variation)."""
    readable = readable_sensitivity(table)
    counts = table[[c for c in table if c.endswith((" collapsed", " unconfirmed"))]]
    flagged = counts.sum(axis=1) > 0
    rest = table[~flagged]
    runs = sorted({int(n) for n in rest["judged"]}) if len(rest) else []
    note = (f"The other {len(rest)} of {len(table)} model x arm rows: 0/{'/'.join(map(str, runs)) or 0} collapsed and "
            f"none unconfirmed under every variation (all rows: study_sensitivity.csv)." if len(rest) else
            "Every row is listed.")
    if not flagged.any():
        return pd.DataFrame({"model": ["(none)"], "arm": ["--"]}), note
    return readable[flagged].reset_index(drop=True), note


def _probe_cell(table: pd.DataFrame, key: str) -> list[str]:
    return [note if isinstance(note, str) and pd.isna(c) and note.startswith(("n/a", "reference")) else
            fmt_change(c, lo, hi)
            for note, c, lo, hi in zip(table["probe_note"], table[f"probe_{key}_change"], table[f"probe_{key}_low"],
                                       table[f"probe_{key}_high"])]


def _train_cell(table: pd.DataFrame, ref: str | None) -> list[str]:
    return ["reference" if arm == ref else fmt_change(c, lo, hi, resamples=0)  # a t-interval: no Monte Carlo error
            for arm, c, lo, hi in zip(table["arm"], table["train_mean_abs_dlogp_change"],
                                      table["train_mean_abs_dlogp_low"], table["train_mean_abs_dlogp_high"])]


def readable_mismatch(table: pd.DataFrame, ref: str | None = None) -> pd.DataFrame:
    """The mismatch table for people: each change as ``+x.x% [lo, hi]``."""
    out = table[["model", "arm"]].copy()
    for key in ("mean_abs_dlogp", "kl_k3"):
        out[f"probe {key}"] = table[f"probe_{key}"]
        out[f"{key} change (95% CI)"] = _probe_cell(table, key)
    out["probe entropy"] = table["probe_entropy"]
    out["train mean_abs_dlogp"] = table["train_mean_abs_dlogp"]
    out["train kl_k3"] = table["train_kl_k3"]
    out["train mean_abs_dlogp change (95% CI)"] = _train_cell(table, ref)
    return out


def latex_mismatch(table: pd.DataFrame, ref: str | None = None) -> pd.DataFrame:
    """The mismatch table for the paper: the probe's mean |dlogp| and its change, and the
    paired in-training change (kl_k3 and the per-arm in-training means are in the CSV and
    Markdown only)."""
    return pd.DataFrame({"model": table["model"], "arm": table["arm"],
                         "probe abs dlogp": table["probe_mean_abs_dlogp"], "probe entropy": table["probe_entropy"],
                         "probe change (95% CI)": _probe_cell(table, "mean_abs_dlogp"),
                         "training change (95% CI)": _train_cell(table, ref)})


def write_table(df: pd.DataFrame, tables: Path, name: str, caption: str, readable: pd.DataFrame | None = None,
                latex: pd.DataFrame | None = None, latex_caption: str | None = None) -> None:
    """CSV (numbers), Markdown (``readable``, or the same table) and LaTeX (``latex``, a
    narrower frame that fits a page's width, or the Markdown's; placed where the paper inputs
    it, so that it never splits a sentence; ``latex_caption``, or the caption)."""
    with atomic_path(tables / f"{name}.csv") as tmp:
        df.to_csv(tmp, index=False)
    shown = df if readable is None else readable
    write_text(tables / f"{name}.md", f"### {caption}\n\n" + shown.to_markdown(index=False, floatfmt=".3g") + "\n")
    write_text(tables / f"{name}.tex", booktabs(shown if latex is None else latex, latex_caption or caption,
                                                f"tab:{name}", placement="H"))


def _compact_sensitivity(sens: pd.DataFrame, label: str, runs: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """The paper's sensitivity table (:func:`latex_sensitivity`) and its caption."""
    table, note = latex_sensitivity(sens)
    return table, (f"{label}: collapsed / finished runs under variations of the collapse rule (drop fraction 0.4, "
                   f"0.5, 0.6 at each run's persistence window{_persistence_text(runs)}; persist /2, x2: half and "
                   f"twice that window; unconf.: drops that reached the end before the window), the rows with a "
                   f"collapsed or unconfirmed run. {note}")


def _persistence_text(runs: pd.DataFrame) -> str:
    windows = sorted({int(w) for w in runs.get("persistence", pd.Series(dtype=float)).dropna()})
    return f" ({'/'.join(map(str, windows))} steps here)" if windows else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--format", default="png")
    parser.add_argument("--manifest", type=Path, default=None,
                        help="the study's manifest (default: RESULTS/study/manifest.json, the study: section's)")
    parser.add_argument("--out-dir", type=Path, default=None, help="where the tables go (default: RESULTS/tables)")
    parser.add_argument("--figure-dir", type=Path, default=None, help="where the figures go (default: RESULTS/figures)")
    args = parser.parse_args()
    path = args.manifest or args.results / "study" / MANIFEST
    manifest = read_manifest(path)
    tables, fig_dir = args.out_dir or args.results / "tables", args.figure_dir or args.results / "figures"
    tables.mkdir(parents=True, exist_ok=True)
    fig_dir.mkdir(parents=True, exist_ok=True)
    runs, curves, evals = study_rows(args.results, manifest, section_of(path, args.results))
    label = manifest["label"]
    ref = manifest["reference_arm"]
    collapse = collapse_table(runs, manifest)
    write_table(collapse, tables, "study_collapse",
                f"{label}: collapse per model and arm (verdicts recomputed from the metric logs): collapsed / "
                f"finished runs; unconfirmed: runs whose reward drop reached the end of the run before the "
                f"persistence window{_persistence_text(runs)}, not counted as stable; spikes: grad-norm spike "
                f"events over the runs (events, not collapses); step: median collapse step; reward and "
                f"accuracy at the end, mean ± sd over seeds: the final reward smoothed over the rule's window, the "
                f"raw reward the mean of the last {TERMINAL_STEPS} logged steps; absorbing: runs that end with a raw "
                f"reward about 0 in groups without reward variance, whatever the rule says; verdicts under collapse "
                f"rule {RULE_VERSION}",
                latex=latex_collapse(collapse))
    sens = sensitivity_table(runs, manifest)
    write_table(sens, tables, "study_sensitivity",
                f"{label}: collapsed / finished runs under variations of the collapse rule: drop fraction 0.4, "
                f"0.5, 0.6 at each run's persistence window{_persistence_text(runs)}; persist /2, x2: each "
                f"run's drop fraction at half and twice that window (unconf.: drops that reached the end "
                f"before the window)", readable_sensitivity(sens), *_compact_sensitivity(sens, label, runs))
    mismatch = mismatch_table(args.results, runs, manifest, curves)
    write_table(mismatch, tables, "study_mismatch",
                f"{label}: mismatch per arm vs {ref}. Probe: mean abs dlogp on identical tokens, change with a "
                f"paired bootstrap 95% interval over sequences; n/a (unpadded probe): the arm differs from {ref} "
                f"only in the trainer's positions, and the probe scores unpadded sequences, so the shift never "
                f"happens there. Training: change of the in-training mean abs dlogp, per seed the geometric-mean "
                f"ratio over the steps both runs logged, then the mean log-ratio over seeds with a 95% "
                f"t-interval (df = seeds - 1)",
                readable_mismatch(mismatch, ref), latex_mismatch(mismatch, ref))
    reward_figure(curves, evals, manifest, fig_dir / f"study_rewards.{args.format}", label,
                  fig_dir / f"study_accuracy.{args.format}")
    mismatch_figure(curves, manifest, fig_dir / f"study_mismatch_curves.{args.format}", label)
    heatmap(runs, manifest, fig_dir / f"study_heatmap.{args.format}", label)
    states = runs.state.value_counts().to_dict()
    print(f"study: {len(runs)} cells: {states}")

