"""Sampling settings and what they do to a logprob, as small pure functions.

The trainer–sampler gap a GRPO user sees is not only rounding. With a temperature ``T`` and a
truncation (``top_k``, ``top_p``), three logprobs of one sampled token ``y`` are in play:

* the **trainer's recompute** ``log softmax(l/T)[y]`` over the whole vocabulary (TRL's
  ``selective_log_softmax(logits / temperature)``: :func:`recompute_logprobs`);
* the sampler's **processed** logprob: the distribution it sampled from, temperature-scaled,
  truncated and renormalised over the kept tokens (vLLM's ``logprobs_mode: processed_logprobs``:
  :func:`processed_logprobs`);
* the sampler's **raw** logprob: ``log softmax(l)[y]``, before temperature and truncation (vLLM's
  default ``raw_logprobs``, and what its ``prompt_logprobs`` always report: :func:`raw_logprobs`).

On identical tokens the gap between the trainer's recompute and the logprob the sampler reports
splits exactly, token by token, into (:func:`gap_split`)::

    recompute_trn - reported_smp = rounding + truncation        (processed logprobs)
                                 = rounding + temperature       (raw logprobs)

    rounding    = log softmax(l_trn/T)[y] - log softmax(l_smp/T)[y]   same transforms, both sides
    truncation  = log softmax(l_smp/T)[y] - processed_smp[y]  = log of the sampler's kept mass (<= 0)
    temperature = log softmax(l_smp/T)[y] - log softmax(l_smp)[y]

Only ``rounding`` depends on where each stack rounds; at FP32 on both sides it is at the FP32
floor. The truncation rule is vLLM's (``apply_top_k_top_p``): on the temperature-scaled logits,
top-k keeps every token at least as large as the k-th largest (ties kept), then top-p masks the
smallest tokens whose ascending cumulative probability is at most ``1 - top_p``, always keeping
the largest. :func:`kept_mask` follows vLLM 0.32's CPU path bit for bit, tied BF16 logits at the
edge included (tested against ``apply_top_k_top_p_pytorch`` on 8,192-token vocabularies); vLLM's
GPU path (a Triton kernel) has its own order among ties, which this does not reproduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from rpa.core.errors import InputError

if TYPE_CHECKING:  # torch is imported where a function runs: the options are read before any model loads
    import torch

LogprobsMode = Literal["processed", "raw"]
LOGPROBS_MODES = ("processed", "raw")
"""What the sampler reports for a sampled token (vLLM's ``logprobs_mode``): ``processed`` -- after
temperature and truncation, the distribution it sampled from (``processed_logprobs``; TRL asks for
it for its IS correction); ``raw`` -- before either (``raw_logprobs``, vLLM's default)."""

VLLM_LOGPROBS_MODE = {"processed": "processed_logprobs", "raw": "raw_logprobs"}
"""The vLLM engine argument ``logprobs_mode`` of each :data:`LOGPROBS_MODES`."""

REPORTED_PARTS = {"processed": ("total", "rounding", "truncation"), "raw": ("total", "rounding", "temperature")}
"""The parts of the gap each :data:`LOGPROBS_MODES` carries (:func:`gap_split`; the other part is 0)."""

TrainerLogprobs = Literal["full", "renormalised"]
TRAINER_LOGPROBS = ("full", "renormalised")
"""The trainer's logprob of a sampled token: ``full`` -- TRL's recompute, ``log softmax(l/T)`` over the
whole vocabulary (:func:`recompute_logprobs`); ``renormalised`` -- over the sampler's kept support as
vLLM's rule finds it on the trainer's own logits (:func:`renormalised_logprobs`), so that with top-p/
top-k on, its ratio to the sampler's processed logprob carries rounding only, not the kept mass."""


VLLM_TEMPERATURE_RANGE = (1e-2, 2.0)
"""The temperatures vLLM samples at as given (vLLM 0.32 ``SamplingParams``): it raises one in (0, 0.01) to 0.01
(``_MAX_TEMP``, with a warning the train log never shows) while the trainer would divide by the value given, and
refuses one above 2 once the engine has started. Refused here, before anything loads."""


def temperature_problem(value, name: str = "temperature", greedy: bool = False) -> str | None:
    """Why ``value`` cannot be a sampling temperature both sides use as given, in one line (``greedy``: 0 allowed,
    vLLM's greedy decoding); None if it can."""
    low, high = VLLM_TEMPERATURE_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"{name} must be a finite number, got {value!r}"
    if greedy and value == 0:
        return None
    if not low <= value <= high:
        why = ("vLLM raises a smaller one to 0.01 while the trainer divides by the value given" if 0 < value < low
               else "vLLM refuses a larger one" if value > high else "")
        return f"{name} must be in [{low:g}, {high:g}]{' (or 0: greedy)' if greedy else ''}, got {value!r}" + (
            f": {why}" if why else "")
    return None


@dataclass(frozen=True)
class SamplingSettings:
    """How the sampler draws a token, and which logprob of it it reports: one definition for the
    probe and for training (the trainer's recompute scales by the same ``temperature``)."""

    temperature: float = field(default=1.0, metadata={
        "help": "sampling temperature, in [0.01, 2] (vLLM's range: VLLM_TEMPERATURE_RANGE)"})
    top_p: float = field(default=1.0, metadata={
        "help": "nucleus truncation: keep the smallest set of most likely tokens holding at least this probability "
                "(0 < top_p <= 1; 1: off)"})
    top_k: int = field(default=-1, metadata={
        "help": "keep the k most likely tokens (ties with the k-th kept); -1 or 0: off (vLLM's and TRL's spelling)"})
    logprobs: LogprobsMode = field(default="processed", metadata={
        "help": "the logprob the sampler reports for a sampled token: processed (after temperature and truncation: "
                "the distribution it sampled from) or raw (before either; vLLM's default)"})

    def __post_init__(self) -> None:
        problem = self.problem()
        if problem:
            raise InputError(problem)

    def problem(self) -> str | None:
        """Why these settings cannot be sampled with, in one line; None if they can."""
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
        if temperature_problem(self.temperature):
            return temperature_problem(self.temperature)
        if not number(self.top_p) or not 0 < self.top_p <= 1:
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            return f"top_k must be an integer >= -1 (-1 or 0: off), got {self.top_k!r}"
        if self.logprobs not in LOGPROBS_MODES:
            return f"logprobs must be one of {', '.join(LOGPROBS_MODES)}, got {self.logprobs!r}"
        return None

    @property
    def truncates(self) -> bool:
        """Whether the sampler leaves any token out (top-k or top-p on)."""
        return self.top_k > 0 or self.top_p < 1

    @property
    def reports_recompute(self) -> bool:
        """Whether the logprob the sampler reports is the trainer's recompute ``log softmax(l/T)`` but for
        rounding (:func:`gap_split`'s non-rounding part is 0): processed logprobs without truncation, raw
        logprobs at T = 1."""
        return not self.truncates if self.logprobs == "processed" else self.temperature == 1

    @property
    def label(self) -> str:
        """``T0.7-p0.9`` / ``T1-p1`` (top-k only where on, ``-raw`` for raw logprobs): a row's or a directory's
        name."""
        fmt = lambda v: f"{v:g}"  # noqa: E731
        return (f"T{fmt(self.temperature)}-p{fmt(self.top_p)}" + (f"-k{self.top_k}" if self.top_k > 0 else "")
                + ("-raw" if self.logprobs == "raw" else ""))


def sampling_field(name: str):
    """A dataclass field of another options class (the probe's) that is :class:`SamplingSettings`'
    field ``name``: the same default and help, defined once here."""
    import dataclasses

    f = next(f for f in dataclasses.fields(SamplingSettings) if f.name == name)
    return field(default=f.default, metadata=dict(f.metadata))


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "logprobs")
"""The fields of :class:`SamplingSettings`, as other options classes carry them."""


def settings_of(options) -> SamplingSettings:
    """The :class:`SamplingSettings` of an options object carrying :data:`SAMPLING_FIELDS`."""
    return SamplingSettings(**{name: getattr(options, name) for name in SAMPLING_FIELDS})


# ---------------------------------------------------------------------------- pure functions
# Every function takes logits of shape (..., vocab) and works in FP32: the rounding a stack does
# happens before (its logits), never here, so two stacks compared through these differ only by it.


def raw_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """``log softmax(l)``: before temperature and truncation (vLLM's ``raw_logprobs``)."""
    import torch

    return torch.log_softmax(logits.float(), dim=-1)


def recompute_logprobs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log softmax(l / T)`` over the whole vocabulary: the trainer's recompute (TRL divides the
    logits by the temperature and does not truncate)."""
    import torch

    return torch.log_softmax(logits.float() / temperature, dim=-1)


def kept_mask(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The tokens the sampler can draw (bool, same shape): vLLM's top-k then top-p rule on the
    temperature-scaled logits (module docstring), as vLLM 0.32's CPU path computes it
    (``apply_top_k_only`` for top-k alone, ``apply_top_k_top_p_pytorch`` with top-p) down to the
    tokens tied at the edge; every token where truncation is off."""
    import torch

    scaled = logits.float() / settings.temperature
    vocab = scaled.shape[-1]
    top_k = settings.top_k if 0 < settings.top_k < vocab else 0
    if settings.top_p >= 1:
        if not top_k:
            return torch.ones_like(scaled, dtype=torch.bool)
        kth = scaled.topk(top_k, dim=-1).values[..., -1:]
        return scaled >= kth  # ties with the k-th largest stay, as in vLLM's apply_top_k_only
    # vLLM sorts the logits themselves (not a masked copy: the order among ties is the sort's on these values),
    # masks top-k in that order, then drops the ascending tail whose cumulative probability is <= 1 - p
    ascending, order = scaled.sort(dim=-1, descending=False)
    if top_k:
        kth = ascending[..., vocab - top_k: vocab - top_k + 1]
        ascending = ascending.masked_fill(ascending < kth, -math.inf)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    tail = torch.tensor(1.0, dtype=torch.float32) - torch.tensor(settings.top_p, dtype=torch.float32)
    drop = cumulative <= tail  # 1 - p in float32, as vLLM's p tensor gives it (not Python's double)
    drop[..., -1] = False  # the most likely token always stays
    kept_sorted = ~drop & (ascending > -math.inf)
    return torch.zeros_like(kept_sorted).scatter(-1, order, kept_sorted)


def processed_logprobs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """The distribution the sampler draws from: temperature, truncation, renormalised over the kept
    tokens; ``-inf`` outside them (vLLM's ``processed_logprobs``)."""
    import torch

    scaled = (logits.float() / settings.temperature).masked_fill(~kept_mask(logits, settings), -math.inf)
    return torch.log_softmax(scaled, dim=-1)


def log_kept_mass(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """``log S``: the log of the temperature-scaled probability the truncation keeps (0 where it
    keeps everything), one per position."""
    import torch

    logp = recompute_logprobs(logits, settings.temperature).masked_fill(~kept_mask(logits, settings), -math.inf)
    return torch.logsumexp(logp, dim=-1)


@dataclass(frozen=True)
class SamplerToken:
    """What the sampler's own logits say of one sampled token: its raw, temperature-scaled and
    processed logprob (:func:`sampler_token`)."""

    raw: float
    scaled: float
    processed: float

    def reported(self, mode: LogprobsMode) -> float:
        """The logprob the sampler reports in ``mode``."""
        return self.processed if mode == "processed" else self.raw


def sampler_token(logits: torch.Tensor, token: int, settings: SamplingSettings) -> SamplerToken:
    """The sampler's three logprobs of ``token`` from its logits at that position (shape (vocab,))."""
    return SamplerToken(raw=float(raw_logprobs(logits)[token]),
                        scaled=float(recompute_logprobs(logits, settings.temperature)[token]),
                        processed=float(processed_logprobs(logits, settings)[token]))


def gap_split(recompute_trn: float, smp: SamplerToken, mode: LogprobsMode) -> dict[str, float]:
    """One token's gap between the trainer's recompute and what the sampler reports, split by source
    (module docstring): ``total`` = ``rounding`` + ``truncation`` (processed) or + ``temperature``
    (raw); the part ``mode`` does not report is 0. Exact up to the FP64 sum of the parts."""
    rounding = recompute_trn - smp.scaled
    truncation = smp.scaled - smp.processed if "truncation" in REPORTED_PARTS[mode] else 0.0
    temperature = smp.scaled - smp.raw if "temperature" in REPORTED_PARTS[mode] else 0.0
    return {"total": recompute_trn - smp.reported(mode), "rounding": rounding, "truncation": truncation,
            "temperature": temperature}


# ------------------------------------------------------------ the trainer's side, in training
# During training the sampler reports one logprob per token and nothing else, so the part of the
# gap that is not rounding is measured on the trainer's logits (the probe measures it on the
# sampler's: the two differ by rounding only). ``logits`` (n, vocab), ``targets`` (n,) the sampled tokens.


def kept_support(logits: torch.Tensor, targets: torch.Tensor, settings: SamplingSettings):
    """vLLM's kept set on these logits (:func:`kept_mask`) with each sampled token put in it, and
    whether it was outside (rounding can move the truncation's edge past a token the other stack kept
    and drew: it is then renormalised over the kept set and itself, never given ``-inf``)."""
    keep = kept_mask(logits, settings)
    outside = ~keep.gather(-1, targets[:, None])[:, 0]
    return keep.scatter(-1, targets[:, None], True), outside


def renormalised_logprobs(logits: torch.Tensor, targets: torch.Tensor, settings: SamplingSettings,
                          keep: torch.Tensor) -> torch.Tensor:
    """The sampled tokens' ``log softmax(l/T)`` over ``keep`` (:func:`kept_support`): the trainer's
    logprob with ``trainer_logprobs: renormalised``; bit for bit :func:`processed_logprobs` where the
    token is inside vLLM's kept set (the same mask, the same log-softmax)."""
    import torch

    scaled = (logits.float() / settings.temperature).masked_fill(~keep, -math.inf)
    return torch.log_softmax(scaled, dim=-1).gather(-1, targets[:, None])[:, 0]


def transform_part(logits: torch.Tensor, targets: torch.Tensor, settings: SamplingSettings,
                   keep: torch.Tensor | None, recompute: torch.Tensor | None = None) -> torch.Tensor:
    """The part of each token's gap (:func:`gap_split`) that is not rounding, from these logits:
    the recompute ``log softmax(l/T)[y]`` minus what they report in the sampler's mode -- ``processed``:
    the log of the mass the truncation keeps (``keep``, :func:`kept_support`; 0 without truncation);
    ``raw``: ``log softmax(l/T)[y] - log softmax(l)[y]`` (0 at T = 1). ``recompute``: these logits'
    :func:`recompute_logprobs` where the caller has them already."""
    import torch

    if recompute is None:
        recompute = recompute_logprobs(logits, settings.temperature)
    if settings.logprobs == "raw":
        return (recompute - raw_logprobs(logits)).gather(-1, targets[:, None])[:, 0]
    if keep is None:  # nothing truncated: the processed logprob is the recompute
        return torch.zeros(targets.shape, dtype=recompute.dtype, device=recompute.device)
    return torch.logsumexp(recompute.masked_fill(~keep, -math.inf), dim=-1)  # log S <= 0
