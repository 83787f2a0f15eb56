"""Collapse verdict of a training run, computed from its per-step metric log.

Definition (DESIGN.md): a run has collapsed at the first step where its smoothed reward
falls below ``drop_fraction`` of its running best (the best over full smoothing windows: a run
shorter than the window has no reward verdict) and never recovers above that level
again -- for at least ``min_steps_after_drop`` logged steps: a drop in the last steps of a
run is ``unconfirmed``, not a collapse -- or where its loss / grad norm is non-finite, or
where its grad norm spikes above ``spike_factor`` times its running median. All thresholds are data
(:class:`CollapseThresholds`, set in the run config), none live in the code.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import numpy as np


@dataclass(frozen=True)
class CollapseThresholds:
    smoothing_window: int = 5
    """Trailing moving-average window (steps) of the reward."""
    drop_fraction: float = 0.5
    """Collapse when the smoothed reward falls below this fraction of its running best..."""
    min_best_reward: float = 0.05
    """...once that best is at least this (a run that never learned cannot collapse by reward)."""
    spike_factor: float = 10.0
    """Collapse when the grad norm exceeds this multiple of its running median..."""
    spike_warmup_steps: int = 5
    """...measured over at least this many earlier steps."""
    min_steps_after_drop: int = 5
    """A reward drop is a collapse only if the run logged this many steps from the drop on
    (the drop step included); a later drop is reported as unconfirmed."""

    def __post_init__(self) -> None:
        if self.smoothing_window < 1 or self.spike_warmup_steps < 1 or self.min_steps_after_drop < 1:
            raise ValueError("smoothing_window, spike_warmup_steps and min_steps_after_drop must be >= 1")
        if not 0 < self.drop_fraction < 1:
            raise ValueError(f"drop_fraction must be in (0, 1), got {self.drop_fraction}")
        if self.spike_factor <= 1:
            raise ValueError(f"spike_factor must be > 1, got {self.spike_factor}")


def smooth(values: Iterable[float], window: int) -> np.ndarray:
    """Trailing moving average (the first steps average what exists so far)."""
    x = np.asarray(list(values), dtype=np.float64)
    csum = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def collapse_verdict(records: list[dict[str, Any]], thresholds: CollapseThresholds = CollapseThresholds(),
                     reward_key: str = "reward", loss_key: str = "loss",
                     grad_key: str = "grad_norm") -> dict[str, Any]:
    """The verdict over ``records`` (one dict per optimizer step, with a ``step`` key)."""
    if not records:
        raise ValueError("no steps logged")
    steps = [int(r["step"]) for r in records]
    if steps != sorted(set(steps)):
        raise ValueError("steps must be strictly increasing (duplicated or unordered log)")
    reward = np.array([float(r.get(reward_key, math.nan)) for r in records])
    candidates: list[tuple[int, str]] = []

    for i, r in enumerate(records):
        bad = [k for k in (loss_key, grad_key) if k in r and r[k] is not None and not math.isfinite(float(r[k]))]
        if bad or not math.isfinite(reward[i]):
            candidates.append((i, f"non-finite {', '.join(bad) or reward_key}"))
            break

    grads = [float(r[grad_key]) for r in records if r.get(grad_key) is not None]
    if len(grads) == len(records):
        for i in range(thresholds.spike_warmup_steps, len(grads)):
            median = float(np.median(grads[:i]))
            if math.isfinite(grads[i]) and median > 0 and grads[i] > thresholds.spike_factor * median:
                candidates.append((i, f"grad_norm spike {grads[i]:.3g} > {thresholds.spike_factor} x median {median:.3g}"))
                break

    finite = np.where(np.isfinite(reward), reward, np.nan)
    smoothed = smooth(np.nan_to_num(finite, nan=0.0), thresholds.smoothing_window)
    # only full windows set the running best: the first steps' partial averages are as noisy
    # as one batch's reward, and a lucky first batch must not become the level a run "fell" from
    full = np.where(np.arange(smoothed.size) >= thresholds.smoothing_window - 1, smoothed, -np.inf)
    best = np.maximum.accumulate(full)
    low = (best >= thresholds.min_best_reward) & (smoothed < thresholds.drop_fraction * best)
    # first step from which the smoothed reward stays below the drop level of the best so far
    unconfirmed = None
    for i in np.flatnonzero(low):
        if low[i:].all():
            if len(records) - i >= thresholds.min_steps_after_drop:
                candidates.append((int(i), f"smoothed reward {smoothed[i]:.3g} < {thresholds.drop_fraction} x "
                                           f"best {best[i]:.3g} and no recovery"))
            else:
                unconfirmed = steps[int(i)]
            break

    first = min(candidates, default=None)
    valid = reward[np.isfinite(reward)]
    auc = float(np.trapezoid(valid) / max(valid.size - 1, 1)) if valid.size > 1 else float(valid.sum())
    return {
        "collapsed": first is not None,
        "verdict": "collapsed" if first is not None else "unconfirmed" if unconfirmed is not None else "stable",
        "unconfirmed_drop_step": None if first is not None else unconfirmed,
        "collapse_step": None if first is None else steps[first[0]],
        "collapse_reason": None if first is None else first[1],
        "peak_reward": float(np.nanmax(finite)) if np.isfinite(finite).any() else None,
        "peak_smoothed_reward": float(best[-1]) if np.isfinite(best[-1]) else None,
        "final_reward": float(smoothed[-1]),
        "reward_auc": auc,
        "steps": len(records),
        "thresholds": asdict(thresholds),
    }


def run_verdict(records: list[dict[str, Any]], thresholds: CollapseThresholds,
                summary: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run's verdict under the current definition, as every analysis reports it.

    :func:`collapse_verdict` of its metric log with its own thresholds; where its summary says
    it was stopped by a blow-up (status ``collapsed``: non-finite weights, which the metric log
    cannot show) and the log shows no collapse, it is collapsed at the step the summary names.
    A run with neither a log nor a blow-up has only ``{"steps": 0}``.
    """
    verdict = collapse_verdict(records, thresholds) if records else {"steps": 0}
    summary = summary or {}
    if summary.get("status") == "collapsed" and not verdict.get("collapsed"):
        verdict.update(collapsed=True, verdict="collapsed", collapse_step=summary.get("collapse_step"),
                       collapse_reason=summary.get("collapse_reason"))
    return verdict
