"""The study across sizes: collapse and mismatch tables, reward / accuracy / mismatch curves
and a collapse heatmap, from ``RESULTS/study/manifest.json`` and the run directories it lists.

Every expected cell appears: a run without a summary is ``missing``, one that ended in an
error is ``failed``; neither is dropped. Verdicts are recomputed from each run's
``metrics.jsonl`` with the thresholds of its config (:func:`rpa.train.collapse.run_verdict`).

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
(:func:`arm_colors`), one legend per figure.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from analysis.latex import booktabs  # noqa: E402
from analysis.paired import fmt_change, paired_change, positions_only, seed_log_ratio, t_change  # noqa: E402
from analysis.runs import (MANIFEST, flags, probe_folder, probe_result, probe_tokens, read_manifest,  # noqa: E402
                           runs_table)
from rpa.core.jsonfiles import atomic_path, write_text  # noqa: E402
from rpa.train.collapse import RULE_VERSION, TERMINAL_STEPS, CollapseThresholds, sensitivity_settings  # noqa: E402


def study_rows(results: Path, manifest: dict) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(one row per expected cell, per-step metrics of finished runs, eval records): each cell's row of
    :func:`analysis.runs.runs_table` with the study's own columns: ``error``, ``sensitivity`` (the
    verdict under each variation, by label), ``persistence`` (the run's window), the run's ``numerics``
    and its in-training mismatch means."""
    rows, curves, evals = [], [], []
    for entry in runs_table(manifest, results, "study"):
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


# --------------------------------------------------------------------------- figures


# tab10's ten, then colours unlike any of them (tab20 paired the arms as light and dark shades
# of one hue); past these, evenly spaced hues
_EXTRA_COLOURS = ("#000000", "#ff00ff", "#000080", "#7f0000", "#00ff00")


def arm_colors(arms: list[str]) -> dict[str, tuple]:
    """One colour per arm, the same in every panel and figure, no two arms alike: tab10, then
    black, magenta, navy, maroon, lime (each of these at least 0.4 from every other colour in
    RGB, farther than tab10's own closest pair; a mustard was too near its orange and olive)."""
    from matplotlib.colors import hsv_to_rgb, to_rgba

    palette = [plt.get_cmap("tab10")(i) for i in range(10)] + [to_rgba(c) for c in _EXTRA_COLOURS]
    more = len(arms) - len(palette)
    palette += [to_rgba(hsv_to_rgb((k / max(more, 1), 0.9, 0.6))) for k in range(max(more, 0))]
    return {arm: palette[i] for i, arm in enumerate(arms)}


def arm_styles(arms: list[str]) -> dict[str, dict]:
    """Colour (:func:`arm_colors`), line style and marker per arm: arms past tab10's ten are
    dashed with square markers, so that they differ from the first ten in two ways."""
    return {arm: {"color": c, "ls": "-" if i < 10 else "--", "marker": "o" if i < 10 else "s"}
            for i, (arm, c) in enumerate(arm_colors(arms).items())}


def _band(ax, frame: pd.DataFrame, x: str, y: str, label: str, color, window: int = 1, log: bool = False,
          bounds: tuple[float, float] | None = None, ls: str = "-") -> None:
    """Mean over seeds and a band of one standard deviation; with ``log``, both in log10 space
    (geometric mean, band x/÷ 10^sd), so that the band of a log-scale axis never crosses zero;
    with ``bounds``, the band is clipped to them (a reward or an accuracy lies in [0, 1])."""
    frame = frame.sort_values(x)
    if window > 1:
        frame = frame.assign(**{y: frame.groupby("seed")[y].transform(lambda s: s.rolling(window, 1).mean())})
    if log:
        frame = frame[frame[y] > 0].assign(**{y: lambda f: np.log10(f[y])})
    stats = frame.groupby(x)[y].agg(["mean", "std"]).reset_index()
    low, high = stats["mean"] - stats["std"].fillna(0), stats["mean"] + stats["std"].fillna(0)
    mean = stats["mean"]
    if log:
        mean, low, high = 10 ** mean, 10 ** low, 10 ** high
    if bounds is not None:
        low, high = low.clip(*bounds), high.clip(*bounds)
    ax.plot(stats[x], mean, label=label, lw=1.2, color=color, ls=ls)
    ax.fill_between(stats[x], low, high, alpha=0.15, color=color, lw=0)


def _points(ax, frame: pd.DataFrame, x: str, y: str, style: dict, offset: float,
            bounds: tuple[float, float] | None = None) -> None:
    """Mean over seeds at each ``x`` (shifted by ``offset``) with an error bar of one standard
    deviation clipped to ``bounds``: for a metric measured at a few steps only (a band between
    two points would draw values nobody measured); joined by a thin line where there are more
    than two points."""
    stats = frame.groupby(x)[y].agg(["mean", "std"]).reset_index().sort_values(x)
    sd = stats["std"].fillna(0)
    low, high = stats["mean"] - sd, stats["mean"] + sd
    if bounds is not None:
        low, high = low.clip(*bounds), high.clip(*bounds)
    ax.errorbar(stats[x] + offset, stats["mean"], yerr=[stats["mean"] - low, high - stats["mean"]],
                color=style["color"], marker=style["marker"], ms=3.5, lw=0.8 if len(stats) > 2 else 0,
                ls=style["ls"], elinewidth=0.9, capsize=1.5)


def _bounds(frame: pd.DataFrame, key: str) -> tuple[float, float] | None:
    """(0, 1) where every value of ``key`` lies in it (a reward or an accuracy), else none."""
    return (0.0, 1.0) if not frame.empty and key in frame and frame[key].dropna().between(0, 1).all() else None


def _of(frame: pd.DataFrame, model: str, arm: str) -> pd.DataFrame:
    return frame if frame.empty else frame[(frame.model == model) & (frame.arm == arm)]


def _legend(fig, styles: dict[str, dict], shown: set[str], markers: bool = False) -> None:
    """One legend for the whole figure, below its panels (every arm drawn somewhere in it)."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=s["color"], ls=s["ls"], lw=1.4, marker=s["marker"] if markers else None,
                      ms=4, label=arm) for arm, s in styles.items() if arm in shown]
    if handles:
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 6),
                   fontsize=8, frameon=False, title="arm", title_fontsize=8)


def _save(fig, path: Path) -> None:
    """Write ``fig`` cropped to what it draws (a legend below the panels included) and free it."""
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=150, bbox_inches="tight")
    plt.close(fig)


ARM_FAMILIES = (("stock BF16 and controls", ("none", "positions-stock", "fp32")),
                ("one region aligned", ("rope", "swiglu", "rmsnorm")),
                ("all three regions aligned", ("all", "all-trainer-only", "all-sampler-only")),
                ("other fixes", ("fp16", "lm-head-fp32", "tis", "mis")))
"""The figures' rows: arms that answer one question each, so that a panel holds a few arms."""


def arm_families(arms: list[str]) -> list[tuple[str, list[str]]]:
    """``arms`` by :data:`ARM_FAMILIES` (in the arms' order within a family), then the sampler
    perturbations ("positive control") and any other arm ("other arms"); empty families left out."""
    out, placed = [], set()
    for name, members in ARM_FAMILIES:
        mine = [a for a in arms if a in members]
        placed.update(mine)
        out.append((name, mine))
    out.append(("positive control", [a for a in arms if a.startswith("perturb-") and a not in placed]))
    placed.update(out[-1][1])
    out.append(("other arms", [a for a in arms if a not in placed]))
    return [(name, members) for name, members in out if members]


def _family_axes(models: list[str], families: list[tuple[str, list[str]]], height: float = 1.9, log: bool = False):
    """One row per arm family, one column per model, every panel on the same y-axis."""
    fig, axes = plt.subplots(len(families), len(models), figsize=(2.7 * len(models), height * len(families) + 0.8),
                             squeeze=False, sharex=True, sharey=True)
    for i, (family, _) in enumerate(families):
        for j, model in enumerate(models):
            ax = axes[i, j]
            ax.tick_params(labelsize=7)
            if log:
                ax.set_yscale("log")
            if i == 0:
                ax.set_title(model, fontsize=9)
            if i == len(families) - 1:
                ax.set_xlabel("step", fontsize=8)
        axes[i, -1].annotate(family, xy=(1.03, 0.5), xycoords="axes fraction", rotation=270, va="center",
                             ha="left", fontsize=8)
    return fig, axes


def _reference_style(style: dict) -> dict:
    """The reference arm as drawn in the other families' panels: light grey, dotted, crosses (tab10's
    own grey, an arm's colour, is darker)."""
    return {**style, "color": (0.72, 0.72, 0.72, 1.0), "ls": ":", "marker": "x"}


def _panel_curves(data: pd.DataFrame, models: list[str], families: list, ref: str, styles: dict):
    """``(row, column, k, drawn, arm, rows, style)`` for every curve of the family figures: row = arm
    family, column = model; each panel draws its family's arms and the reference arm (greyed, when it
    is not a member), ``k`` the arm's place among the ``drawn`` of its panel; empty curves skipped."""
    for i, (_, members) in enumerate(families):
        drawn = members if ref in members else [ref, *members]
        for j, model in enumerate(models):
            for k, arm in enumerate(drawn):
                part = _of(data, model, arm)
                if not part.empty:
                    style = styles[arm] if arm in members else _reference_style(styles[arm])
                    yield i, j, k, len(drawn), arm, part, style


def reward_figure(curves: pd.DataFrame, evals: pd.DataFrame, manifest: dict, path: Path, label: str,
                  accuracy_path: Path | None = None) -> None:
    """Reward (smoothed over 5 steps; mean and sd band over seeds, clipped to [0, 1]): one row per
    arm family (:func:`arm_families`), one column per model, common y-axes; the reference arm
    (grey, dotted) in every family's panels. Held-out accuracy (measured at a few steps: mean and
    sd error bars, the arms dodged along the step axis) the same way in ``accuracy_path``."""
    models, arms = manifest["models"], manifest["arms"]
    ref = manifest.get("reference_arm", arms[0])
    styles = arm_styles(arms)
    families = arm_families(arms)
    fig, axes = _family_axes(models, families)
    shown: set[str] = set()
    for i, j, _, _, arm, part, style in _panel_curves(curves, models, families, ref, styles):
        _band(axes[i, j], part, "step", "reward", arm, style["color"], window=5, bounds=_bounds(curves, "reward"),
              ls=style["ls"])
        shown.add(arm)
    for i in range(len(families)):
        axes[i, 0].set_ylabel("reward (smoothed, 5 steps)", fontsize=7)
    fig.suptitle(f"{label}: reward per arm family (band: sd over seeds; light grey, dotted: {ref})", fontsize=9)
    fig.tight_layout()
    _legend(fig, styles, shown, markers=False)
    _save(fig, path)
    if accuracy_path is None:
        return
    fig, axes = _family_axes(models, families)
    steps = evals["step"] if not evals.empty else pd.Series([0.0, 1.0])
    dodge = 0.02 * max(float(steps.max() - steps.min()), 1.0)
    shown = set()
    for i, j, k, drawn, arm, part, style in _panel_curves(evals, models, families, ref, styles):
        _points(axes[i, j], part, "step", "eval/accuracy", style, (k - (drawn - 1) / 2) * dodge,
                bounds=_bounds(evals, "eval/accuracy"))
        shown.add(arm)
    for i in range(len(families)):
        axes[i, 0].set_ylabel("held-out accuracy", fontsize=7)
    fig.suptitle(f"{label}: held-out accuracy per arm family (bars: sd over seeds; light grey, dotted: {ref})", fontsize=9)
    fig.tight_layout()
    _legend(fig, styles, shown, markers=True)
    _save(fig, accuracy_path)


def mismatch_figure(curves: pd.DataFrame, manifest: dict, path: Path, label: str) -> None:
    """In-training mismatch (geometric mean over seeds, band x/÷ one sd of log10): one row per arm
    family, one column per model, common log y-axes; the reference arm in every panel."""
    models, arms = manifest["models"], manifest["arms"]
    ref = manifest.get("reference_arm", arms[0])
    styles = arm_styles(arms)
    families = arm_families(arms)
    fig, axes = _family_axes(models, families, log=True)
    shown: set[str] = set()
    for i, j, _, _, arm, part, style in _panel_curves(curves, models, families, ref, styles):
        _band(axes[i, j], part, "step", "mismatch/mean_abs_dlogp", arm, style["color"], window=3, log=True,
              ls=style["ls"])
        shown.add(arm)
    for i in range(len(families)):
        axes[i, 0].set_ylabel("mean |dlogp|", fontsize=7)
    fig.suptitle(f"{label}: in-training mismatch per arm family (geometric mean over seeds, band x/÷ one sd of "
                 f"log10; light grey, dotted: {ref})", fontsize=9)
    fig.tight_layout()
    _legend(fig, styles, shown)
    _save(fig, path)


def heatmap(runs: pd.DataFrame, manifest: dict, path: Path, label: str) -> None:
    models, arms = manifest["models"], manifest["arms"]
    share = np.full((len(models), len(arms)), np.nan)
    text = [["n/a"] * len(arms) for _ in models]
    for i, model in enumerate(models):
        for j, arm in enumerate(arms):
            done = runs[(runs.model == model) & (runs.arm == arm) & (runs.state == "finished")]
            if len(done):
                k = int(flags(done["collapsed"]).sum())
                share[i, j], text[i][j] = k / len(done), f"{k}/{len(done)}"
    fig, ax = plt.subplots(figsize=(0.6 * len(arms) + 1.4, 0.42 * len(models) + 1.6))
    cmap = plt.get_cmap("Reds").copy()
    cmap.set_bad("lightgrey")
    ax.imshow(np.ma.masked_invalid(share), cmap=cmap, vmin=0, vmax=1, aspect="auto")
    for i in range(len(models)):
        for j in range(len(arms)):
            ax.text(j, i, text[i][j], ha="center", va="center", fontsize=9)
    ax.set_xticks(range(len(arms)), arms, rotation=45, ha="right", rotation_mode="anchor", fontsize=9)
    ax.set_yticks(range(len(models)), models, fontsize=9)
    ax.set_title(f"{label}:\ncollapsed runs / finished runs (grey: none finished)", fontsize=9)
    _save(fig, path)


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
    args = parser.parse_args()
    manifest = read_manifest(args.results / "study" / MANIFEST)
    tables, fig_dir = args.results / "tables", args.results / "figures"
    tables.mkdir(parents=True, exist_ok=True)
    fig_dir.mkdir(parents=True, exist_ok=True)
    runs, curves, evals = study_rows(args.results, manifest)
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


if __name__ == "__main__":
    main()
