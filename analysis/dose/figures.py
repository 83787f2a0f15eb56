"""The positive control's figure (:mod:`analysis.dose`, Fig. 5): collapse fraction, final reward and
phantom-clip rate vs the early-window dose, per IS correction and old-logprob setting, with the
anchors, each point's 95% interval and each curve's logistic fit.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.collapse_stats import clopper_pearson
from analysis.dose.stats import _logistic_fit, counted, dose_arms, window_text
from analysis.paired import t975
from analysis.plots import plt, save_figure


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
    save_figure(fig, path, dpi=200)
