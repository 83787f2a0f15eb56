"""vLLM side: a ``vllm.general_plugins`` entry point that aligns the chosen regions.

vLLM calls :func:`register` in every process it starts (main, engine core, workers).
The region set comes from the environment variable :data:`ENV_VAR`, read by
:func:`rpa.core.regions.from_env` (unset, empty or ``none``: nothing is registered and vLLM runs
stock). For each aligned region the plugin registers a subclass of the stock layer with
``CustomOp.register_oot``; the subclass overrides ``forward`` itself (so neither vLLM's per-platform
dispatch nor its compiled / eager choice picks another path) and runs the shared ``torch.library``
custom ops of :mod:`rpa.core.ops` -- the same ops, hence the same kernels, as the trainer patch --
which Inductor treats as opaque: it cannot fuse across the rounding point, so eager and compiled
runs agree bit for bit. The RoPE table is :func:`rpa.core.numerics.rope_table`, built on the CPU as
the trainer builds it.

The region set is fixed per process: ``CustomOp.register_oot`` is global and vLLM caches
rotary-embedding instances across engines. :func:`plugin_status` reports, from inside a
worker, whether the plugin is active, which regions it aligned and how many layers of
the loaded model are aligned instances; :func:`rpa.sides.engine.verify_plugin` turns that into
a fail-closed check.

Capture (for ``rpa parity``): while :func:`start_capture` is on in a worker, every aligned
op records its inputs and outputs; it happens inside the custom op, so it also works in
compiled mode.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import torch
from torch import Tensor

from rpa.core import numerics, ops
from rpa.core.numerics_config import MANTISSA_BITS
from rpa.core.regions import ENV_VAR, format_regions, from_env

PERTURB_ENV = "RPA_SAMPLER_PERTURBATION"
"""The positive control's dose (sampler only): unset/``none``, or ``mantissa_bits=K`` to round
the outputs of the three regions' layers to K mantissa bits (:func:`rpa.core.numerics.round_mantissa`)."""

_STATE: dict[str, Any] = {"loaded": False, "regions": frozenset(), "perturbation": None, "registered": {},
                          "error": None}
_CALLS: Counter = Counter()
_CAPTURE: list[dict[str, Any]] | None = None
_OPS: dict[str, Any] = {}


# --------------------------------------------------------------------- custom ops


def _record(region: str, inputs: dict[str, Tensor], outputs: dict[str, Tensor]) -> None:
    _CALLS[region] += 1
    if _CAPTURE is not None:
        _CAPTURE.append(
            {
                "region": region,
                "inputs": {k: v.detach().cpu().clone() for k, v in inputs.items()},
                "outputs": {k: v.detach().cpu().clone() for k, v in outputs.items()},
            }
        )


def _define_ops() -> dict[str, Any]:
    """Define the plugin's ``rpa::vllm_*`` ops once per process (idempotent).

    Each is a thin adapter from vLLM's layer layout to the shared ops of :mod:`rpa.core.ops`
    (the ones the trainer runs) plus the parity capture; being a custom op itself, it keeps
    the capture working inside vLLM's compiled graphs.
    """
    if _OPS:
        return _OPS

    @torch.library.custom_op("rpa::vllm_rms_norm", mutates_args=())
    def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out = ops.rms_norm(x, weight.to(x.dtype), eps)
        _record("rmsnorm", {"x": x, "weight": weight}, {"out": out})
        return out

    @rms_norm_op.register_fake
    def _(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.custom_op("rpa::vllm_add_rms_norm", mutates_args=())
    def add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        out, new_residual = ops.add_rms_norm(x, residual, weight.to(x.dtype), eps)
        _record(
            "rmsnorm",
            {"x": x, "residual": residual, "weight": weight},
            {"out": out, "residual": new_residual},
        )
        return out, new_residual

    @add_rms_norm_op.register_fake
    def _(x, residual, weight, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape)

    @torch.library.custom_op("rpa::vllm_silu_and_mul", mutates_args=())
    def silu_and_mul_op(x: Tensor) -> Tensor:
        d = x.shape[-1] // 2
        out = ops.swiglu(x[..., :d], x[..., d:])
        _record("swiglu", {"x": x}, {"out": out})
        return out

    @silu_and_mul_op.register_fake
    def _(x):
        return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))

    @torch.library.custom_op("rpa::vllm_rope", mutates_args=())
    def rope_op(positions: Tensor, x: Tensor, table: Tensor, head_size: int) -> Tensor:
        cos, sin = numerics.rope_lookup(table, positions.flatten())
        out = ops.rope(x.reshape(positions.numel(), -1, head_size), cos, sin).reshape(x.shape)
        _record("rope", {"positions": positions, "x": x}, {"out": out})
        return out

    @rope_op.register_fake
    def _(positions, x, table, head_size):
        return x.new_empty(x.shape)

    _OPS.update(rms_norm=rms_norm_op, add_rms_norm=add_rms_norm_op, silu_and_mul=silu_and_mul_op, rope=rope_op)
    return _OPS


# ------------------------------------------------------------------ layer classes


def _make_layers() -> dict[str, type]:
    """Aligned subclasses of vLLM's stock layers, keyed by region."""
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    ops = _define_ops()

    class RpaRMSNorm(RMSNorm):
        """RMSNorm (and the fused residual add) with one rounding each."""

        rpa_region = "rmsnorm"

        def __init__(self, hidden_size: int, eps: float = 1e-6, var_hidden_size: int | None = None,
                     has_weight: bool = True, dtype: torch.dtype | None = None) -> None:
            super().__init__(hidden_size, eps, var_hidden_size, has_weight, dtype)
            if self.variance_size_override is not None or not has_weight:
                raise NotImplementedError(
                    "rpa aligns RMSNorm with a weight over the full hidden size only "
                    "(Qwen2/Qwen3/Llama); this model uses var_hidden_size or has_weight=False"
                )

        def forward(self, x: Tensor, residual: Tensor | None = None):
            if residual is None:
                return ops["rms_norm"](x, self.weight, self.variance_epsilon)
            return ops["add_rms_norm"](x, residual, self.weight, self.variance_epsilon)

    class RpaSiluAndMul(SiluAndMul):
        """SwiGLU: ``silu(gate) * up`` in FP32, one rounding."""

        rpa_region = "swiglu"

        def forward(self, x: Tensor) -> Tensor:
            return ops["silu_and_mul"](x)

    class RpaRotaryEmbedding(RotaryEmbedding):
        """Default NeoX RoPE with the shared FP32 cos/sin table and one rounding."""

        rpa_region = "rope"

        def __init__(self, head_size: int, rotary_dim: int, max_position_embeddings: int, base: float,
                     is_neox_style: bool, dtype: torch.dtype, init_cache: bool = True) -> None:
            super().__init__(head_size, rotary_dim, max_position_embeddings, base, is_neox_style, dtype, init_cache)
            if not is_neox_style:
                raise NotImplementedError("rpa aligns NeoX-style (HF Qwen/Llama layout) rotary embeddings only")
            # the shared table: built on the CPU whatever vLLM's default device, then moved
            table = numerics.rope_table(base, rotary_dim, max_position_embeddings)
            self.register_buffer("rpa_cos_sin", table.to(torch.empty(0).device), persistent=False)

        def forward(self, positions: Tensor, query: Tensor, key: Tensor | None = None):
            table = self.rpa_cos_sin
            if table.device != query.device:  # once, if vLLM built the layer elsewhere
                table = self.rpa_cos_sin = table.to(query.device)
            query = ops["rope"](positions, query, table, self.head_size)
            if key is not None:
                key = ops["rope"](positions, key, table, self.head_size)
            return query, key

    return {"rmsnorm": (RMSNorm, RpaRMSNorm), "swiglu": (SiluAndMul, RpaSiluAndMul),
            "rope": (RotaryEmbedding, RpaRotaryEmbedding)}


def parse_perturbation(spec: str | None) -> int | None:
    """``mantissa_bits=K`` -> K; unset, empty or ``none`` -> None."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return None
    key, _, value = spec.partition("=")
    lo, hi = MANTISSA_BITS
    if key.strip() != "mantissa_bits" or not value.strip().isdigit() or not lo <= int(value) <= hi:
        raise ValueError(f"{PERTURB_ENV}={spec!r}: expected 'mantissa_bits=K' with K in {lo}..{hi}, or 'none'")
    return int(value)


def _round_region_outputs(region: str, out, bits: int):
    """The dose: the layer's region output(s) rounded to ``bits`` mantissa bits (RMSNorm's
    normed output, not the residual it passes on; SwiGLU's product; RoPE's q and k)."""
    if region == "rmsnorm":
        return (numerics.round_mantissa(out[0], bits), out[1]) if isinstance(out, tuple) else \
            numerics.round_mantissa(out, bits)
    if region == "rope":
        query, key = out
        return numerics.round_mantissa(query, bits), None if key is None else numerics.round_mantissa(key, bits)
    return numerics.round_mantissa(out, bits)


def _perturbed(base: type, region: str, bits: int) -> type:
    """``base`` (vLLM's stock layer or rpa's aligned one) with its outputs rounded to ``bits``."""

    def forward(self, *args, **kwargs):
        return _round_region_outputs(region, base.forward(self, *args, **kwargs), bits)

    return type(f"Perturbed{base.__name__}", (base,), {"forward": forward, "rpa_perturbation": bits,
                                                       "__doc__": f"{base.__name__} + sampler dose ({bits} bits)"})


# ----------------------------------------------------------------- entry point


def register() -> None:
    """The ``vllm.general_plugins`` entry point. Idempotent within a process."""
    if _STATE["loaded"]:
        return
    _STATE["loaded"] = True
    _STATE["pid"] = os.getpid()
    try:
        regions = from_env(os.environ)  # unset or empty: stock vLLM
    except ValueError as err:
        _STATE["error"] = str(err)
        raise
    try:
        bits = parse_perturbation(os.environ.get(PERTURB_ENV))
    except ValueError as err:
        _STATE["error"] = str(err)
        raise
    _STATE["regions"], _STATE["perturbation"] = regions, bits
    if not regions and bits is None:
        return
    from vllm.model_executor.custom_op import op_registry_oot

    for region, (stock, aligned) in _make_layers().items():
        layer = aligned if region in regions else stock
        if bits is not None:
            layer = _perturbed(layer, region, bits)
        elif region not in regions:
            continue
        if stock.__name__ in op_registry_oot:
            raise RuntimeError(
                f"another plugin already replaced vLLM's {stock.__name__} "
                f"({op_registry_oot[stock.__name__]!r}); rpa cannot take region {region!r}"
            )
        stock.register_oot(layer)
        if region not in regions:  # a dosed stock layer: keep the stock op's name, so vLLM's custom_ops
            layer.name = stock.name  # switches (+rms_norm, ...) pick the same implementation as undosed
        _STATE["registered"][region] = layer.__name__


def plugin_status(model: torch.nn.Module | None = None) -> dict[str, Any]:
    """What the plugin did in *this* process; with ``model``, count its aligned layers."""
    status: dict[str, Any] = {
        "pid": os.getpid(),
        "env": os.environ.get(ENV_VAR),
        "loaded": _STATE["loaded"],
        "regions": format_regions(_STATE["regions"]),
        "perturbation": _STATE["perturbation"],
        "registered": dict(_STATE["registered"]),
        "error": _STATE["error"],
        "calls": dict(_CALLS),
        "kernels": ops.backend_report(),
    }
    if model is not None:
        aligned: Counter = Counter()
        stock: Counter = Counter()
        perturbed: Counter = Counter()
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.layernorm import RMSNorm
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase

        kinds = {"rmsnorm": RMSNorm, "swiglu": SiluAndMul, "rope": RotaryEmbeddingBase}
        for module in model.modules():
            for kind, cls in kinds.items():
                if not isinstance(module, cls):
                    continue
                (aligned if getattr(module, "rpa_region", None) == kind else stock)[kind] += 1
                if getattr(module, "rpa_perturbation", None) is not None:
                    perturbed[kind] += 1
        status["aligned_layers"] = dict(aligned)
        status["stock_layers"] = dict(stock)
        status["perturbed_layers"] = dict(perturbed)
    return status


def start_capture() -> None:
    """Record inputs/outputs of every aligned op from now on (this process)."""
    global _CAPTURE
    _CAPTURE = []


def stop_capture() -> list[dict[str, Any]]:
    """Stop recording and return what was recorded."""
    global _CAPTURE
    captured, _CAPTURE = _CAPTURE or [], None
    return captured
