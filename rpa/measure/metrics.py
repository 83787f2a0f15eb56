"""Trainer-vs-sampler mismatch metrics (names as in the DESIGN and the tables).

Inputs are per-token log-probabilities of the *sampled* tokens: ``logp_trainer`` (π,
recomputed by the trainer) and ``logp_sampler`` (μ, reported by vLLM), plus the
sequence each token belongs to. Δ_t = log π(y_t) − log μ(y_t).
"""

from __future__ import annotations

import numpy as np

RATIO_BAND = (0.8, 1.25)
"""Default band for ``frac_ratio_outside`` (share of tokens with e^Δ outside it)."""


def mismatch_metrics(logp_trainer, logp_sampler, seq_ids, ratio_band: tuple[float, float] = RATIO_BAND) -> dict:
    """All token- and sequence-level mismatch metrics as plain floats."""
    pi = np.asarray(logp_trainer, dtype=np.float64)
    mu = np.asarray(logp_sampler, dtype=np.float64)
    seq = np.asarray(seq_ids)
    if pi.shape != mu.shape or pi.shape != seq.shape or pi.ndim != 1:
        raise ValueError("logp_trainer, logp_sampler and seq_ids must be 1-D and of equal length")
    if pi.size == 0:
        raise ValueError("no tokens to compare")
    delta = pi - mu
    abs_delta = np.abs(delta)
    ratio = np.exp(delta)
    _, inverse = np.unique(seq, return_inverse=True)
    seq_log_ratio = np.bincount(inverse, weights=delta)
    lo, hi = ratio_band
    return {
        "tokens": int(pi.size),
        "sequences": int(seq_log_ratio.size),
        "mean_abs_dlogp": float(abs_delta.mean()),
        "p99_abs_dlogp": float(np.quantile(abs_delta, 0.99)),
        "max_abs_dlogp": float(abs_delta.max()),
        "frac_bitwise_equal": float(np.mean(np.asarray(logp_trainer) == np.asarray(logp_sampler))),
        "kl_k1": float(np.mean(-delta)),
        "kl_k3": float(np.mean(np.expm1(delta) - delta)),
        "seq_log_ratio_mean_abs": float(np.abs(seq_log_ratio).mean()),
        "seq_log_ratio_max_abs": float(np.abs(seq_log_ratio).max()),
        "frac_ratio_outside": float(np.mean((ratio < lo) | (ratio > hi))),
    }


def gap_split_metrics(logp_recompute, logp_sampler, part, outside, mode: str) -> dict:
    """The per-step split of ``rpa train`` (``split/*`` in ``metrics.jsonl``): over one step's completion
    tokens, the gap between the trainer's full recompute and the logprob the sampler reports in ``mode``,
    and its parts (:data:`rpa.core.sampling.REPORTED_PARTS`): ``part`` is each token's non-rounding part
    measured on the trainer's logits (:func:`rpa.core.sampling.transform_part`: the truncation's log kept
    mass, or the temperature's), ``rounding`` the rest. Each part's mean |.| and mean (nats/token);
    ``outside_kept``: tokens the sampler drew that vLLM's truncation rule leaves out on the trainer's
    logits (rounding moved the edge; renormalised with the kept set)."""
    from rpa.core.sampling import REPORTED_PARTS

    recompute = np.asarray(logp_recompute, dtype=np.float64)
    total = recompute - np.asarray(logp_sampler, dtype=np.float64)
    part = np.asarray(part, dtype=np.float64)
    if total.shape != part.shape or total.ndim != 1 or total.size == 0:
        raise ValueError("the split needs 1-D, equally long, non-empty token arrays")
    values = {"total": total, "rounding": total - part, "truncation": part, "temperature": part}
    out = {}
    for name in REPORTED_PARTS[mode]:
        out[f"{name}/mean_abs_dlogp"] = float(np.abs(values[name]).mean())
        out[f"{name}/mean_dlogp"] = float(values[name].mean())
    out["outside_kept"] = int(np.asarray(outside).sum())
    return out


def full_kl(logp_sampler, logp_trainer) -> np.ndarray:
    """KL(μ‖π) = Σ_v μ(v) (log μ(v) − log π(v)) per position, over the whole vocabulary.

    Inputs are log-distributions of shape [positions, vocab]; entries where μ is 0
    (log μ = −inf) contribute nothing.
    """
    mu = np.asarray(logp_sampler, dtype=np.float64)
    pi = np.asarray(logp_trainer, dtype=np.float64)
    if mu.shape != pi.shape or mu.ndim != 2:
        raise ValueError(f"need two [positions, vocab] arrays of equal shape, got {mu.shape} and {pi.shape}")
    p = np.exp(mu)
    terms = np.where(p > 0, p * (mu - np.where(p > 0, pi, 0.0)), 0.0)
    return terms.sum(-1)


def phantom_clipped(trainer_logps, sampler_logps, advantages, epsilon_low: float, epsilon_high: float):
    """Per token: does PPO's clip bind on the first update after a sync, before the policy has
    moved, when the old log-probabilities are the sampler's? The ratio is then pi/mu at equal
    weights -- the mismatch alone -- and the clipped branch is taken where the advantage
    pushes past the clip: ratio > 1 + eps_high with A > 0, or < 1 - eps_low with A < 0."""
    import torch

    ratio = torch.exp(trainer_logps - sampler_logps)
    adv = advantages if advantages.dim() == ratio.dim() else advantages.unsqueeze(-1)
    return ((ratio > 1 + epsilon_high) & (adv > 0)) | ((ratio < 1 - epsilon_low) & (adv < 0))
