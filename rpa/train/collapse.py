"""Collapse verdict of a training run, computed from its per-step metric log.

The rule, in one sentence (:func:`rule_text` writes it with a run's own thresholds, for the
README and the paper): *a run collapses at the first step from which its smoothed reward stays
below ``drop_fraction`` of its running best for ``min_steps_after_drop`` consecutive logged
steps, or at the first step whose loss, grad norm or reward is non-finite* (a step that FP16
dynamic loss scaling skipped for an overflow, logged ``fp16/skipped_step``, is not one).

- The smoothed reward is a trailing mean over ``smoothing_window`` steps; the running best is
  taken over full windows only (a lucky first batch is not a level to fall from), and counts
  once it is at least ``min_best_reward`` (a run that never learned cannot collapse by reward).
- **Recovery does not undo a collapse**: a drop that held for the persistence window is a
  collapse even if the reward later climbs back above the level; the first such step is
  reported as ``recovered_step``. A dip shorter than the window is not a collapse.
- A drop that lasts to the end of the run but for fewer than ``min_steps_after_drop`` steps is
  ``unconfirmed`` (the run ended before the rule could judge it), reported as such, never as
  stable.
- Grad-norm spikes (above ``spike_factor`` x the running median of the earlier steps, after
  ``spike_warmup_steps``) are **events**, reported with their count, first step and largest
  factor; they are not a collapse by themselves.

All thresholds are data (:class:`CollapseThresholds`, set in each run's config); none live in
the code.

Beside the verdict, not part of it (:func:`terminal_state`): the **raw terminal reward** (mean
of the last :data:`TERMINAL_STEPS` logged rewards, unsmoothed) and whether the run ends in an
**absorbing state** -- raw reward about 0 in groups without reward variance, where GRPO's
advantages, and so its gradient, vanish -- whatever the persistence window says; and the
first **dip** (:func:`first_dip_step`): the first step whose raw reward is below the rule's
level, however briefly. Every verdict carries :data:`RULE_VERSION`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Iterable

import numpy as np


@dataclass(frozen=True)
class CollapseThresholds:
    smoothing_window: int = field(default=5, metadata={"help": "Trailing moving-average window (steps) of the reward."})
    drop_fraction: float = field(default=0.5, metadata={
        "help": "Collapse when the smoothed reward stays below this fraction of its running best..."})
    min_best_reward: float = field(default=0.05, metadata={
        "help": "...once that best is at least this (a run that never learned cannot collapse by reward)."})
    spike_factor: float = field(default=10.0, metadata={
        "help": "A grad-norm spike (an event, not a collapse) is a grad norm above this multiple of the running "
                "median of the earlier steps..."})
    spike_warmup_steps: int = field(default=5, metadata={"help": "...measured over at least this many earlier steps."})
    min_steps_after_drop: int = field(default=5, metadata={
        "help": "Persistence window: the smoothed reward must stay below the level for this many consecutive logged "
                "steps (the drop step included); a drop that reaches the end of the run sooner is ``unconfirmed``."})

    def __post_init__(self) -> None:
        if self.smoothing_window < 1 or self.spike_warmup_steps < 1 or self.min_steps_after_drop < 1:
            raise ValueError("smoothing_window, spike_warmup_steps and min_steps_after_drop must be >= 1")
        if not 0 < self.drop_fraction < 1:
            raise ValueError(f"drop_fraction must be in (0, 1), got {self.drop_fraction}")
        if self.spike_factor <= 1:
            raise ValueError(f"spike_factor must be > 1, got {self.spike_factor}")
        if not self.min_best_reward >= 0:  # NaN fails this too
            raise ValueError(f"min_best_reward must be >= 0, got {self.min_best_reward}")


RULE_VERSION = "v4"
"""The version of the collapse rule :func:`collapse_verdict` applies, in every verdict it
returns (and so in every ``summary.json`` written since, and in every table's ``rule_version``
column). Bump it with any change of what the rule decides (``tests/test_collapse.py`` pins
:func:`rule_text` to it). The versions, by the commit that introduced them:

- v1 (3203aaa): smoothed reward below a fraction of its running best at any step; a recovery
  undid it; a grad-norm spike was a collapse;
- v2 (cd54170): the running best over full smoothing windows only;
- v3 (84bf996): a drop must persist for ``min_steps_after_drop`` steps, a recovery does not
  undo it, grad-norm spikes are events, a drop cut short by the end of the run is unconfirmed;
- v4 (9183b06): a step that FP16 loss scaling skipped for an overflow is not a blow-up.

A ``summary.json`` without ``rule_version`` was written before versions were recorded, under
the rule of its commit; the tables recompute every verdict under this one
(:func:`summary_superseded` says where the two differ)."""

TERMINAL_STEPS = 4
"""The raw terminal reward is the mean of a run's last this many logged (unsmoothed) rewards."""
ABSORBING_MAX_REWARD = 0.02
"""An absorbing end state: a raw terminal reward at most this (rewards in [0, 1])..."""
ABSORBING_MAX_REWARD_STD = 0.02
"""...with the groups' reward spread (TRL's ``reward_std``: the mean within-group standard
deviation) at most this on average over the same steps: groups without reward variance give
GRPO zero advantages, so nothing moves the policy out of it."""


def _fraction(x: float) -> str:
    return {0.5: "half"}.get(x, f"{x:g} times")


def rule_text(t: CollapseThresholds) -> str:
    """The collapse rule as one plain-text paragraph, written from the thresholds ``t``."""
    return (f"A run collapses at the first step from which its reward, smoothed over "
            f"{t.smoothing_window} steps, stays below {_fraction(t.drop_fraction)} of its running best "
            f"(best over full windows, once at least {t.min_best_reward:g}) for {t.min_steps_after_drop} "
            f"consecutive logged steps, or at the first step whose loss, gradient norm or reward is "
            f"non-finite (a step that FP16 loss scaling skipped for an overflow is not one). A later return above that level does not undo a collapse (it is reported as "
            f"a recovery); a drop that reaches the end of the run in fewer than {t.min_steps_after_drop} "
            f"steps is unconfirmed. Gradient-norm spikes (above {t.spike_factor:g} times the running "
            f"median) are reported as events, not as collapses.")


def smooth(values: Iterable[float], window: int) -> np.ndarray:
    """Trailing moving average (the first steps average what exists so far)."""
    x = np.asarray(list(values), dtype=np.float64)
    csum = np.cumsum(np.insert(x, 0, 0.0))
    idx = np.arange(1, x.size + 1)
    lo = np.maximum(idx - window, 0)
    return (csum[idx] - csum[lo]) / (idx - lo)


def grad_spikes(grads: list[float], t: CollapseThresholds) -> list[tuple[int, float]]:
    """(index, factor over the running median) of every grad-norm spike."""
    out = []
    for i in range(t.spike_warmup_steps, len(grads)):
        median = float(np.median(grads[:i]))
        if math.isfinite(grads[i]) and median > 0 and grads[i] > t.spike_factor * median:
            out.append((i, grads[i] / median))
    return out


SKIPPED_STEP_KEY = "fp16/skipped_step"
"""Logged 1 for a step that FP16 dynamic loss scaling skipped (its scaled gradients overflowed,
so their norm is infinite by design): not a blow-up (:mod:`rpa.train.loss_scale`)."""


def _first_nonfinite(records: list[dict[str, Any]], reward: np.ndarray, loss_key: str,
                     grad_key: str) -> tuple[int, str] | None:
    for i, r in enumerate(records):
        keys = (loss_key,) if r.get(SKIPPED_STEP_KEY) else (loss_key, grad_key)
        bad = [k for k in keys if k in r and r[k] is not None and not math.isfinite(float(r[k]))]
        if bad or not math.isfinite(reward[i]):
            return i, f"non-finite {', '.join(bad) or 'reward'}"
    return None


def _first_persistent_run(low: np.ndarray, length: int) -> tuple[int | None, int | None]:
    """(start of the first run of ``length`` consecutive True, start of a shorter run of True
    that reaches the end) -- the collapse and the unconfirmed drop."""
    start = None
    for i, v in enumerate(low):
        if not v:
            start = None
            continue
        start = i if start is None else start
        if i - start + 1 >= length:
            return start, None
    return None, start


def terminal_state(records: list[dict[str, Any]], steps: int = TERMINAL_STEPS, reward_key: str = "reward",
                   std_key: str = "reward_std", grad_key: str = "grad_norm") -> dict[str, Any]:
    """The raw end of a run, beside its smoothed final reward: ``terminal_reward`` (mean of the
    last ``steps`` logged rewards, finite ones only; None without any), ``terminal_reward_std``
    (mean of their ``reward_std``; None where it is not logged), ``terminal_zero_grad_steps``
    (how many of them have a gradient norm of exactly 0: every group's rewards equal) and
    ``absorbing`` (raw reward about 0 in groups without reward variance:
    :data:`ABSORBING_MAX_REWARD`, :data:`ABSORBING_MAX_REWARD_STD`; False where the spread is
    not logged). Not part of the verdict: reported whatever the persistence window says."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    last = records[-steps:]

    def mean(key: str) -> float | None:
        values = [float(r[key]) for r in last if r.get(key) is not None and math.isfinite(float(r[key]))]
        return float(np.mean(values)) if values else None

    reward, spread = mean(reward_key), mean(std_key)
    zero_grad = sum(1 for r in last if r.get(grad_key) is not None and float(r[grad_key]) == 0.0)
    absorbing = (reward is not None and spread is not None and reward <= ABSORBING_MAX_REWARD
                 and spread <= ABSORBING_MAX_REWARD_STD)
    return {"terminal_reward": reward, "terminal_reward_std": spread, "terminal_zero_grad_steps": zero_grad,
            "terminal_steps": len(last), "absorbing": bool(absorbing)}


def _levels(reward: np.ndarray, t: CollapseThresholds) -> tuple[np.ndarray, np.ndarray]:
    """(smoothed reward, running best over full windows) of a reward log (non-finite as 0)."""
    finite = np.where(np.isfinite(reward), reward, np.nan)
    smoothed = smooth(np.nan_to_num(finite, nan=0.0), t.smoothing_window)
    # only full windows set the running best: the first steps' partial averages are as noisy
    # as one batch's reward, and a lucky first batch must not become the level a run "fell" from
    full = np.where(np.arange(smoothed.size) >= t.smoothing_window - 1, smoothed, -np.inf)
    return smoothed, np.maximum.accumulate(full)


def first_dip_step(records: list[dict[str, Any]], thresholds: CollapseThresholds = CollapseThresholds(),
                   reward_key: str = "reward") -> int | None:
    """The first step whose *raw* reward is below the rule's level (``drop_fraction`` x the
    running best of the smoothed reward, once that best counts), however briefly: the start of
    any drop, persistent or not (None if the reward never dips). "Before any drop" means before
    the earlier of this step and the collapse step."""
    if not records:
        return None
    t = thresholds
    reward = np.array([float(r.get(reward_key, math.nan)) for r in records])
    _, best = _levels(reward, t)
    dips = np.flatnonzero((best >= t.min_best_reward) & ~(reward >= t.drop_fraction * best))
    return int(records[int(dips[0])]["step"]) if dips.size else None


def summary_superseded(summary: dict[str, Any] | None, verdict: dict[str, Any]) -> bool:
    """Whether the verdict a run's ``summary.json`` holds (written by the trainer under the rule
    of its commit: ``rule_version``, or none before versions were recorded) differs from
    ``verdict``, the one recomputed under the current rule -- in its ``verdict`` (or, for a
    summary without one, its ``collapsed`` flag) or its collapse step. Such a summary's verdict
    is superseded by the tables'."""
    if not summary or "collapsed" not in summary and "verdict" not in summary:
        return False
    old = summary.get("verdict") or ("collapsed" if summary.get("collapsed") else "stable")
    return (old != verdict.get("verdict") or bool(summary.get("collapsed")) != bool(verdict.get("collapsed"))
            or summary.get("collapse_step") != verdict.get("collapse_step"))


def collapse_verdict(records: list[dict[str, Any]], thresholds: CollapseThresholds = CollapseThresholds(),
                     reward_key: str = "reward", loss_key: str = "loss",
                     grad_key: str = "grad_norm") -> dict[str, Any]:
    """The verdict over ``records`` (one dict per optimizer step, with a ``step`` key)."""
    if not records:
        raise ValueError("no steps logged")
    t = thresholds
    steps = [int(r["step"]) for r in records]
    if steps != sorted(set(steps)):
        raise ValueError("steps must be strictly increasing (duplicated or unordered log)")
    reward = np.array([float(r.get(reward_key, math.nan)) for r in records])

    finite = np.where(np.isfinite(reward), reward, np.nan)
    smoothed, best = _levels(reward, t)
    low = (best >= t.min_best_reward) & (smoothed < t.drop_fraction * best)
    drop, unconfirmed = _first_persistent_run(low, t.min_steps_after_drop)

    candidates: list[tuple[int, str]] = []
    if drop is not None:
        candidates.append((drop, f"smoothed reward {smoothed[drop]:.3g} < {t.drop_fraction} x best {best[drop]:.3g} "
                                 f"for {t.min_steps_after_drop} steps"))
    nonfinite = _first_nonfinite(records, reward, loss_key, grad_key)
    if nonfinite is not None:
        candidates.append(nonfinite)
    first = min(candidates, default=None)
    recovered = None
    if drop is not None and first is not None and first[0] == drop:
        after = np.flatnonzero(~low[drop:])
        recovered = steps[drop + int(after[0])] if after.size else None

    grads = [float(r[grad_key]) for r in records if r.get(grad_key) is not None]
    spikes = grad_spikes(grads, t) if len(grads) == len(records) else []

    valid = reward[np.isfinite(reward)]
    auc = float(np.trapezoid(valid) / max(valid.size - 1, 1)) if valid.size > 1 else float(valid.sum())
    collapsed = first is not None
    return {
        "collapsed": collapsed,
        "verdict": "collapsed" if collapsed else "unconfirmed" if unconfirmed is not None else "stable",
        "unconfirmed_drop_step": None if collapsed or unconfirmed is None else steps[unconfirmed],
        "collapse_step": None if first is None else steps[first[0]],
        "collapse_reason": None if first is None else first[1],
        "recovered_step": recovered,
        "grad_spikes": len(spikes),
        "first_grad_spike_step": steps[spikes[0][0]] if spikes else None,
        "max_grad_spike_factor": max(f for _, f in spikes) if spikes else None,
        "peak_reward": float(np.nanmax(finite)) if np.isfinite(finite).any() else None,
        "peak_smoothed_reward": float(best[-1]) if np.isfinite(best[-1]) else None,
        "final_reward": float(smoothed[-1]),
        "reward_auc": auc,
        "steps": len(records),
        **terminal_state(records, reward_key=reward_key, grad_key=grad_key),
        "first_dip_step": first_dip_step(records, t, reward_key),
        "thresholds": asdict(t),
        "rule_version": RULE_VERSION,
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
                       collapse_reason=summary.get("collapse_reason"), unconfirmed_drop_step=None,
                       rule_version=RULE_VERSION)
    return verdict


SENSITIVITY_DROP_FRACTIONS = (0.4, 0.5, 0.6)


def sensitivity_settings(t: CollapseThresholds) -> list[tuple[str, CollapseThresholds]]:
    """The variations every collapse table reports beside its verdicts: drop fraction 0.4 / 0.5 /
    0.6 at the run's persistence window, and the run's drop fraction at half and twice that window."""
    out = [(f"drop {f:g}", replace(t, drop_fraction=f)) for f in SENSITIVITY_DROP_FRACTIONS]
    out.append(("persist /2", replace(t, min_steps_after_drop=max(1, t.min_steps_after_drop // 2))))
    out.append(("persist x2", replace(t, min_steps_after_drop=2 * t.min_steps_after_drop)))
    return out


def sensitivity(records: list[dict[str, Any]], t: CollapseThresholds,
                summary: dict[str, Any] | None = None) -> dict[str, str]:
    """The run's verdict (``stable``/``unconfirmed``/``collapsed``) under each variation of
    :func:`sensitivity_settings`, keyed by its label ("persist /2" and "persist x2": half and
    twice the run's own persistence window, rounded down, at least 1)."""
    return {label: run_verdict(records, v, summary).get("verdict", "missing")
            for label, v in sensitivity_settings(t)}
