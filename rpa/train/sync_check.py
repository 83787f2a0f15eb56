"""The check after every weight sync: vLLM and the trainer score a fixed probe sequence, and
:func:`check_sync_result` says whether the gap is rounding, the mismatch under study, stale
weights (:class:`WeightSyncError`) or a blow-up (:class:`EngineDivergence`)."""

from __future__ import annotations

import math


class WeightSyncError(RuntimeError):
    """vLLM does not serve the trainer's current weights after a sync."""


class EngineDivergence(RuntimeError):
    """vLLM took the new weights (its probe logprobs changed) yet disagrees with the trainer
    far beyond rounding: the run has blown up; recorded as a collapse."""


def check_sync_result(gap: float, tolerance: float, abort_gap: float, mu: list[float],
                      previous_mu: list[float] | None, step: int, dosed: bool = False, updated: bool = True) -> bool:
    """Classify a post-sync check; returns whether the gap is over ``tolerance``. ``updated``:
    the trainer's own logprobs of the probe changed since the previous check.

    * not finite, or over ``abort_gap``: the run has blown up (:class:`EngineDivergence`, a
      collapse; the run stops);
    * over ``tolerance`` with vLLM's own logprobs unchanged since the previous check although
      the trainer has ``updated`` its weights since: vLLM still serves old weights
      (:class:`WeightSyncError`; the run stops);
    * over ``tolerance`` at the start: the two engines did not load the same weights
      (:class:`WeightSyncError`), unless the sampler is dosed on purpose (``dosed``);
    * otherwise over ``tolerance``: the sampler and trainer disagree more than the tolerance --
      the mismatch under study, recorded (``sync/over_tolerance``), not an error.
    """
    where = (f"after the weight sync at step {step}, vLLM's logprobs of the probe sequence differ from the "
             f"trainer's by mean |dlogp| = {gap:.4g}")
    if not math.isfinite(gap) or gap > abort_gap:
        raise EngineDivergence(f"{where} > abort_gap {abort_gap}: the engines diverged (blow-up)")
    if gap <= tolerance:
        return False
    if previous_mu is not None and previous_mu == mu and updated:
        raise WeightSyncError(f"{where} > tolerance {tolerance}, and vLLM's own logprobs did not change: vLLM is "
                              f"not serving the trained weights")
    if previous_mu is None and not dosed:
        raise WeightSyncError(f"{where} > tolerance {tolerance} before any update: the engines did not start "
                              f"from the same weights")
    return True
