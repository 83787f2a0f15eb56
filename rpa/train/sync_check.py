"""The check after every weight sync: vLLM and the trainer score a fixed probe sequence, and
:func:`check_sync_result` says whether the gap is rounding, the mismatch under study, stale
weights (:class:`WeightSyncError`) or a blow-up (:class:`EngineDivergence`).

How large a gap rounding alone makes depends on the model: ~5e-3 mean |dlogp| on the tiny
random models, 0.045-0.055 on SmolLM2-135M with equal weights. So the check is relative to the
gap *measured with known-equal weights*: the start-up check, when both engines have loaded the
same checkpoint (:func:`sync_threshold`). A constant tuned on one model stops another model's
run on equal weights (SmolLM2's start gap of 0.0547 is over the old constant 0.05).
"""

from __future__ import annotations

import math


class WeightSyncError(RuntimeError):
    """vLLM does not serve the trainer's current weights after a sync."""


class EngineDivergence(RuntimeError):
    """vLLM took the new weights (its probe logprobs changed) yet disagrees with the trainer
    far beyond rounding: the run has blown up; recorded as a collapse."""


def sync_threshold(start_gap: float | None, relative_tolerance: float, tolerance: float | None) -> float:
    """The gap above which a check is *over tolerance*: ``relative_tolerance`` times the start gap
    (the rounding gap of this model with equal weights), never below the absolute floor
    ``tolerance`` where one is set; before the start gap is known, the floor (or 0)."""
    relative = 0.0 if start_gap is None or not math.isfinite(start_gap) else relative_tolerance * start_gap
    return max(relative, tolerance or 0.0)


def check_sync_result(gap: float, threshold: float, abort_gap: float, mu: list[float],
                      previous_mu: list[float] | None, step: int, dosed: bool = False, updated: bool = True,
                      start_tolerance: float = 1.0) -> bool:
    """Classify a post-sync check; returns whether the gap is over ``threshold``
    (:func:`sync_threshold`). ``previous_mu`` is None at the start-up check. ``updated``: the
    trainer's own logprobs of the probe changed since the previous check.

    * not finite, or over ``abort_gap``: the run has blown up (:class:`EngineDivergence`, a
      collapse; the run stops);
    * at the start, over ``start_tolerance``: the two engines did not load the same weights
      (:class:`WeightSyncError`) -- rounding gives hundredths of a nat, other weights whole nats
      -- unless the sampler is dosed on purpose (``dosed``); under it, this gap *is* the
      equal-weights reference the later checks are relative to;
    * later, over ``threshold`` with vLLM's own logprobs unchanged although the trainer has
      ``updated`` its weights since: vLLM still serves old weights (:class:`WeightSyncError`);
    * otherwise over ``threshold``: the sampler and trainer disagree more than rounding did at the
      start -- the mismatch under study, recorded (``sync/over_tolerance``), not an error.
    """
    where = (f"after the weight sync at step {step}, vLLM's logprobs of the probe sequence differ from the "
             f"trainer's by mean |dlogp| = {gap:.4g}")
    if not math.isfinite(gap) or gap > abort_gap:
        raise EngineDivergence(f"{where} > abort_gap {abort_gap}: the engines diverged (blow-up)")
    if previous_mu is None and not dosed and gap > start_tolerance:
        raise WeightSyncError(f"{where} > start_tolerance {start_tolerance} before any update: the engines did not "
                              f"start from the same weights")
    if gap <= threshold:
        return False
    if previous_mu is not None and previous_mu == mu and updated:
        raise WeightSyncError(f"{where} > {threshold:.4g} (the start-up gap times relative_tolerance), and vLLM's own "
                              f"logprobs did not change: vLLM is not serving the trained weights")
    return True
