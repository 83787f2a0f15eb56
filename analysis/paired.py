"""Paired changes with intervals, shared by :mod:`analysis.study` and :mod:`analysis.aggregate`.

Two pairings, two intervals:

* **Offline probe, identical tokens** (:func:`paired_change`): two numerics configurations score
  the same sampled tokens (``tokens.csv`` of each: ``seq``, ``logp_trainer``, ``logp_sampler``);
  the change of the token-mean |dlogp| (and of kl_k3) is ``sum_arm / sum_ref - 1``, with a 95%
  percentile interval from a paired bootstrap over sequences (the same resampled sequences for
  both; :data:`BOOTSTRAP` resamples, fixed seed, so tables are reproducible byte for byte). A
  percentile of B resamples has a Monte Carlo error of about ``0.68 x width / sqrt(B)`` (normal
  approximation: ``sqrt(p(1-p)) / phi(z_p)`` per standard deviation of the bootstrap
  distribution, whose 95% width is ``2 z`` of them): with a million resamples and the probes'
  16-64 sequences that is 0.005-0.08 percentage points, so :func:`fmt_change` shows each bound to
  the finest of 0.1, 1 or 10 points that is at least four of those errors (:func:`bound_step`):
  a bound shown is the same for any bootstrap seed but where it sits at a rounding edge.
* **During training, same seed** (:func:`seed_log_ratio`, :func:`t_change`): a run and the
  reference arm's run of the same seed share data order and initial weights, so the pair is the
  seed. Per seed, the geometric-mean ratio of the metric over the steps both runs logged (mean
  of ``log(arm) - log(ref)`` over those steps); then the mean of the per-seed log-ratios with a
  95% t-interval over seeds (``df = seeds - 1``), reported as a percent change
  ``exp(mean) - 1`` with bounds ``exp(mean -+ t * sd / sqrt(seeds)) - 1``. One seed gives a
  point and no interval.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np
import pandas as pd

BOOTSTRAP = 1_000_000
"""Paired bootstrap resamples of :func:`paired_change` (2000 until a reported bound of a
16-sequence probe moved by 3 percentage points between bootstrap seeds)."""
BOOTSTRAP_CHUNK = 50_000
"""Resamples drawn at a time (memory: chunk x sequences indices)."""
MC_ERROR_PER_WIDTH = 0.6815
"""Monte Carlo standard error of a 2.5% / 97.5% bootstrap percentile per unit of the 95%
interval's width, times sqrt(resamples): ``sqrt(0.025 x 0.975) / phi(1.96) / (2 x 1.96)``."""

# two-sided 95% quantiles of Student's t, df = 1..30 (t_{0.975, df})
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with ``df`` degrees of freedom (table to 30, then the
    Cornish-Fisher expansion around the normal quantile, within 1e-4 there)."""
    if df < 1:
        raise ValueError(f"t quantile needs df >= 1, got {df}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def per_sequence(tokens: pd.DataFrame) -> pd.DataFrame:
    """Per sequence: sum of |dlogp|, sum of kl_k3 and token count (dlogp = trainer - sampler)."""
    d = tokens["logp_trainer"] - tokens["logp_sampler"]
    frame = pd.DataFrame({"seq": tokens["seq"], "abs": d.abs(), "k3": np.exp(d) - 1 - d})
    return frame.groupby("seq").agg(abs_sum=("abs", "sum"), k3_sum=("k3", "sum"), n=("abs", "size"))


def _resamples(n: int, seed: int):
    """:data:`BOOTSTRAP` resamples of ``n`` sequences (indices, with replacement), :data:`BOOTSTRAP_CHUNK`
    at a time, from a generator seeded with ``seed``: the draws every bootstrap here makes."""
    rng = np.random.default_rng(seed)
    for start in range(0, BOOTSTRAP, BOOTSTRAP_CHUNK):
        yield rng.integers(0, n, (min(BOOTSTRAP_CHUNK, BOOTSTRAP - start), n))


def paired_change(arm_tokens: pd.DataFrame, ref_tokens: pd.DataFrame, seed: int = 0) -> dict:
    """Relative change of the token-mean |dlogp| and kl_k3 vs the reference on the same
    tokens, with a paired bootstrap over sequences (95% percentile interval).

    ``{"mean_abs_dlogp": {"value", "change", "low", "high"}, "kl_k3": {...}}``; ``value`` is the
    arm's token mean over the sequences both scored."""
    a, r = per_sequence(arm_tokens), per_sequence(ref_tokens)
    common = a.index.intersection(r.index)
    a, r = a.loc[common], r.loc[common]
    keys = (("mean_abs_dlogp", "abs_sum"), ("kl_k3", "k3_sum"))
    boots: dict[str, list[np.ndarray]] = {key: [] for key, _ in keys}
    for idx in _resamples(len(common), seed):  # the same resampled sequences for every metric
        for key, col in keys:
            boots[key].append(a[col].to_numpy()[idx].sum(1) / r[col].to_numpy()[idx].sum(1) - 1)
    out = {}
    for key, col in keys:
        num_a, num_r, n = a[col].to_numpy(), r[col].to_numpy(), a["n"].to_numpy()
        point = num_a.sum() / num_r.sum() - 1
        lo, hi = np.percentile(np.concatenate(boots[key]), [2.5, 97.5])
        out[key] = {"value": float(num_a.sum() / n.sum()), "change": float(point), "low": float(lo),
                    "high": float(hi)}
    return out


def mean_interval(sums: np.ndarray, counts: np.ndarray, seed: int = 0) -> dict:
    """A token mean over sequences (``sum(sums) / sum(counts)``, one entry per sequence) with its 95%
    percentile interval from a bootstrap over sequences (:data:`BOOTSTRAP` resamples, fixed seed, as
    :func:`paired_change`): ``{"value", "low", "high"}``."""
    sums, counts = np.asarray(sums, dtype=float), np.asarray(counts, dtype=float)
    boots = [sums[idx].sum(1) / counts[idx].sum(1) for idx in _resamples(len(sums), seed)]
    lo, hi = np.percentile(np.concatenate(boots), [2.5, 97.5])
    return {"value": float(sums.sum() / counts.sum()), "low": float(lo), "high": float(hi)}


def seed_log_ratio(arm: pd.DataFrame, ref: pd.DataFrame, key: str) -> tuple[float, int]:
    """(mean of ``log(arm[key]) - log(ref[key])`` over the steps both logged with a positive,
    finite value, number of those steps); ``(nan, 0)`` where there are none. ``arm`` and ``ref``
    are one run's per-step metrics each, with a ``step`` column."""
    if key not in arm or key not in ref:
        return math.nan, 0
    both = pd.merge(arm[["step", key]], ref[["step", key]], on="step", suffixes=("_arm", "_ref"))
    a, r = both[f"{key}_arm"].astype(float).to_numpy(), both[f"{key}_ref"].astype(float).to_numpy()
    ok = np.isfinite(a) & np.isfinite(r) & (a > 0) & (r > 0)
    if not ok.any():
        return math.nan, 0
    return float(np.mean(np.log(a[ok]) - np.log(r[ok]))), int(ok.sum())


def t_change(log_ratios: Iterable[float]) -> dict:
    """Percent change (as a fraction) from per-pair log-ratios: ``exp(mean) - 1`` and the 95%
    t-interval over pairs (df = pairs - 1), exponentiated. ``low``/``high`` are NaN with fewer
    than two pairs; everything is NaN with none."""
    x = np.array([v for v in log_ratios if math.isfinite(v)], dtype=float)
    out = {"change": math.nan, "low": math.nan, "high": math.nan, "pairs": int(x.size)}
    if x.size == 0:
        return out
    mean = float(x.mean())
    out["change"] = math.expm1(mean)
    if x.size >= 2:
        half = t975(x.size - 1) * float(x.std(ddof=1)) / math.sqrt(x.size)
        out["low"], out["high"] = math.expm1(mean - half), math.expm1(mean + half)
    return out


def positions_only(numerics: dict | None, ref_numerics: dict | None) -> bool:
    """Whether two numerics configurations differ only in ``trainer_positions`` (the RoPE
    position shift of TRL's left padding, which the probe's unpadded per-sequence scoring never
    has: such a configuration's probe change is not a measurement)."""
    if not numerics or not ref_numerics:
        return False
    rest = lambda d: {k: v for k, v in d.items() if k not in ("trainer_positions", "device")}  # noqa: E731
    return (numerics.get("trainer_positions") != ref_numerics.get("trainer_positions")
            and rest(numerics) == rest(ref_numerics))


def bound_step(low: float, high: float, resamples: int = BOOTSTRAP) -> float:
    """The precision (percentage points) a bootstrap interval's bounds are shown to: the finest
    of 0.1, 1 and 10 that is at least four Monte Carlo standard errors of a bound
    (:data:`MC_ERROR_PER_WIDTH` x width / sqrt(resamples); 100 beyond)."""
    error = MC_ERROR_PER_WIDTH * 100 * abs(high - low) / math.sqrt(resamples)
    return next((step for step in (0.1, 1.0, 10.0) if step >= 4 * error), 100.0)


def _bound(value: float, step: float) -> str:
    if step < 1:
        return f"{100 * value:+.1f}"
    return f"{step * round(100 * value / step):+.0f}"


def fmt_change(change: float, low: float, high: float, resamples: int = BOOTSTRAP) -> str:
    """``+x.x% [lo, hi]`` (percent; the bounds to :func:`bound_step`'s precision: what the
    bootstrap's ``resamples`` support), ``+x.x%`` without an interval, ``--`` without a value.
    A t-interval (no Monte Carlo error) is shown with ``resamples=0``: bounds to 0.1."""
    if change is None or not math.isfinite(change):
        return "--"
    if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)):
        return f"{100 * change:+.1f}%"
    step = bound_step(low, high, resamples) if resamples else 0.1
    return f"{100 * change:+.1f}% [{_bound(low, step)}, {_bound(high, step)}]"
