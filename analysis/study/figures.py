"""The study's figures (:mod:`analysis.study`): reward and held-out accuracy (``study_rewards``,
``study_accuracy``) and in-training mismatch (``study_mismatch_curves``) per arm family and model,
mean and sd band over seeds; the collapse heatmap (``study_heatmap``). One colour per arm everywhere
(:func:`arm_colors`), one legend per figure. Drawn from the rows of :func:`analysis.study.stats.study_rows`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from analysis.plots import plt, save_figure
from analysis.runs import flags


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
    save_figure(fig, path, dpi=150, bbox_inches="tight")


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
