"""The aligned regions as ``torch.library`` custom ops, called by *both* sides.

``rpa::swiglu(gate, up)``, ``rpa::rms_norm(x, weight, eps)``,
``rpa::add_rms_norm(x, residual, weight, eps)`` and ``rpa::rope(x, cos, sin)`` (with their
backward ops) are what the trainer patch (:mod:`rpa.sides.trainer`) and the vLLM plugin
(:mod:`rpa.sides.vllm_plugin`) run. One implementation per device type:

* CPU: the pure-torch reference :mod:`rpa.core.numerics`;
* CUDA: the Triton kernels of :mod:`rpa.core.kernels.triton_regions`, or the reference where the
  backend is ``reference`` (see :func:`kernel_backend`).

Each op is a few module-level functions, one per backend with one signature (``<op>_native``,
``<op>_cuda``, ``<op>_fake``), listed in :data:`OPS` with its autograd.

Custom ops are opaque to Inductor, ``torch.compile`` and ``torch.export``: neither vLLM's
compiled graphs nor a user's compiled training model can fuse across a rounding point, so
compiled and eager runs give the same bits, and CUDA-graph capture keeps working. The
trainer side gets autograd through registered backward ops. ``weight`` arguments are
taken at ``x``'s dtype by the caller (an autograd-visible cast of an FP32 master).

The ops are defined on first use (no import-time registration).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor

from rpa.core import numerics
from rpa.core.errors import UserError

ENV_VAR = "RPA_KERNELS"
"""Kernel backend on CUDA: ``auto`` (Triton where it is available, else the reference),
``triton`` (required: fail if unavailable) or ``reference``. Read in every process (vLLM
workers inherit it); both sides of one machine therefore pick the same backend, and
:func:`rpa.sides.engine.verify_plugin` checks that they did."""
BACKEND_SETTINGS = ("auto", "triton", "reference")

_DEFINED: dict[str, Any] = {}


class KernelBackendError(UserError):
    """The requested kernel backend cannot run here."""


def backend_setting() -> str:
    setting = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if setting not in BACKEND_SETTINGS:
        raise KernelBackendError(f"{ENV_VAR}={setting!r}; valid: {', '.join(BACKEND_SETTINGS)}")
    return setting


@functools.cache
def _cuda_backend(setting: str) -> str:
    if setting == "reference":
        return "reference"
    from rpa.core.kernels import triton_available

    ok, why = triton_available()
    if not ok and setting == "triton":
        raise KernelBackendError(f"{ENV_VAR}=triton but the Triton kernels cannot run: {why}")
    return "triton" if ok else "reference"


def kernel_backend(device: torch.device | str) -> str:
    """``triton`` or ``reference``: what the ops run for tensors on ``device``."""
    if torch.device(device).type != "cuda":
        return "reference"
    return _cuda_backend(backend_setting())


def backend_report() -> dict[str, Any]:
    """The kernel choice of this process, for provenance and the plugin check."""
    report: dict[str, Any] = {"setting": backend_setting(), "cpu": "reference"}
    report["cuda"] = kernel_backend("cuda") if torch.cuda.is_available() else None
    return report


def _cuda_impl(t: Tensor):
    """The module a CUDA tensor's op runs: the Triton kernels, or the reference (:func:`kernel_backend`)."""
    if kernel_backend(t.device) == "triton":
        from rpa.core.kernels import triton_regions

        return triton_regions
    return numerics


def _check_weight(x: Tensor, weight: Tensor) -> None:
    if weight.dtype != x.dtype:
        raise TypeError(f"rpa RMSNorm ops take the weight at the input dtype ({x.dtype}); got {weight.dtype}")


def _check_rope(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    if x.dim() != 3 or cos.shape != (x.shape[0], cos.shape[-1]) or sin.shape != cos.shape:
        raise ValueError(f"rpa::rope takes x [tokens, heads, head_dim] and cos/sin [tokens, rotary_dim // 2]; "
                         f"got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")


# ------------------------------------------------------------------------- the ops, one function per backend
# ``<op>_native``: every device but CUDA, the reference :mod:`rpa.core.numerics`; ``<op>_cuda``: CUDA, the
# kernel backend's module with the same signature; ``<op>_fake``: the output's shape for tracing. Outputs
# are made contiguous: a custom op's output may not alias or view its inputs.

def swiglu_native(gate: Tensor, up: Tensor) -> Tensor:
    return numerics.swiglu(gate, up).contiguous()


def swiglu_cuda(gate: Tensor, up: Tensor) -> Tensor:
    return _cuda_impl(gate).swiglu(gate, up).contiguous()


def swiglu_fake(gate: Tensor, up: Tensor) -> Tensor:
    return gate.new_empty(gate.shape)


def swiglu_backward_native(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    d_gate, d_up = numerics.swiglu_backward(grad, gate, up)
    return d_gate.contiguous(), d_up.contiguous()


def swiglu_backward_cuda(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    d_gate, d_up = _cuda_impl(gate).swiglu_backward(grad, gate, up)
    return d_gate.contiguous(), d_up.contiguous()


def swiglu_backward_fake(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def rms_norm_native(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check_weight(x, weight)
    return numerics.rms_norm(x, weight, eps).contiguous()


def rms_norm_cuda(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    _check_weight(x, weight)
    return _cuda_impl(x).rms_norm(x, weight, eps).contiguous()


def rms_norm_fake(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x.new_empty(x.shape)


def rms_norm_backward_native(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    d_x, d_w = numerics.rms_norm_backward(grad, x, weight, eps)
    return d_x.contiguous(), d_w


def rms_norm_backward_cuda(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    d_x, d_w = _cuda_impl(x).rms_norm_backward(grad, x, weight, eps)
    return d_x.contiguous(), d_w


def rms_norm_backward_fake(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def add_rms_norm_native(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check_weight(x, weight)
    out, new_residual = numerics.add_rms_norm(x, residual, weight, eps)
    return out.contiguous(), new_residual.contiguous()


def add_rms_norm_cuda(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    _check_weight(x, weight)
    out, new_residual = _cuda_impl(x).add_rms_norm(x, residual, weight, eps)
    return out.contiguous(), new_residual.contiguous()


def add_rms_norm_fake(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)


def rope_native(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    _check_rope(x, cos, sin)
    return numerics.rope(x, cos, sin).contiguous()


def rope_cuda(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    _check_rope(x, cos, sin)
    return _cuda_impl(x).rope(x, cos, sin).contiguous()


def rope_fake(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x.new_empty(x.shape)


# ------------------------------------------------------------------------- autograd (trainer side)

def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx, grad):
    gate, up = ctx.saved_tensors
    return torch.ops.rpa.swiglu_backward(grad, gate, up)


def _rms_norm_setup(ctx, inputs, output) -> None:
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_norm_grad(ctx, grad):
    x, weight = ctx.saved_tensors
    d_x, d_w = torch.ops.rpa.rms_norm_backward(grad, x, weight, ctx.eps)
    return d_x, d_w, None


def _add_rms_norm_setup(ctx, inputs, output) -> None:
    x, residual, weight, eps = inputs
    ctx.save_for_backward(output[1], weight)
    ctx.eps = eps
    ctx.dtypes = (x.dtype, residual.dtype)


def _add_rms_norm_grad(ctx, grad_out, grad_residual):
    new_residual, weight = ctx.saved_tensors
    total = torch.zeros_like(new_residual, dtype=torch.float32)  # both outputs' gradients summed in FP32
    d_w = None
    if grad_out is not None:
        d_norm, d_w = torch.ops.rpa.rms_norm_backward(grad_out, new_residual, weight, ctx.eps)
        total = total + d_norm.float()
    if grad_residual is not None:
        total = total + grad_residual.float()
    return total.to(ctx.dtypes[0]), total.to(ctx.dtypes[1]), d_w, None


def _rope_setup(ctx, inputs, output) -> None:
    _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _rope_grad(ctx, grad):
    cos, sin = ctx.saved_tensors
    return torch.ops.rpa.rope(grad, cos, -sin), None, None  # the rotation by the opposite angle


@dataclass(frozen=True)
class OpSpec:
    """One ``rpa::<name>`` op: its implementation per backend, its fake, and (forward ops) its autograd."""

    name: str
    native: Callable
    cuda: Callable
    fake: Callable
    setup_context: Callable | None = None
    backward: Callable | None = None


OPS = (
    OpSpec("swiglu", swiglu_native, swiglu_cuda, swiglu_fake, _swiglu_setup, _swiglu_grad),
    OpSpec("swiglu_backward", swiglu_backward_native, swiglu_backward_cuda, swiglu_backward_fake),
    OpSpec("rms_norm", rms_norm_native, rms_norm_cuda, rms_norm_fake, _rms_norm_setup, _rms_norm_grad),
    OpSpec("rms_norm_backward", rms_norm_backward_native, rms_norm_backward_cuda, rms_norm_backward_fake),
    OpSpec("add_rms_norm", add_rms_norm_native, add_rms_norm_cuda, add_rms_norm_fake, _add_rms_norm_setup,
           _add_rms_norm_grad),
    OpSpec("rope", rope_native, rope_cuda, rope_fake, _rope_setup, _rope_grad),
)
"""Every ``rpa::*`` op; the schema of each comes from its ``native`` function's signature."""


def _define() -> None:
    """Register :data:`OPS` with ``torch.library`` once per process (idempotent): the native
    function for every device, the CUDA one for CUDA, the fake for tracing, then autograd."""
    if _DEFINED:
        return
    for spec in OPS:
        op = torch.library.custom_op(f"rpa::{spec.name}", spec.native, mutates_args=())
        op.register_kernel("cuda", spec.cuda)
        op.register_fake(spec.fake)
        if spec.backward is not None:
            op.register_autograd(spec.backward, setup_context=spec.setup_context)
        _DEFINED[spec.name] = op


# ------------------------------------------------------------------- public callables


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``rpa::swiglu``: :func:`rpa.core.numerics.swiglu`."""
    _define()
    return torch.ops.rpa.swiglu(gate, up)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rpa::rms_norm``: :func:`rpa.core.numerics.rms_norm` (``weight`` at ``x``'s dtype)."""
    _define()
    return torch.ops.rpa.rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``rpa::add_rms_norm``: :func:`rpa.core.numerics.add_rms_norm` -> ``(normed, new_residual)``."""
    _define()
    return torch.ops.rpa.add_rms_norm(x, residual, weight, eps)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``rpa::rope``: :func:`rpa.core.numerics.rope_rotate` of ``x`` ``[tokens, heads, head_dim]``
    with FP32 ``cos``/``sin`` ``[tokens, rotary_dim // 2]`` gathered from the shared table."""
    _define()
    return torch.ops.rpa.rope(x, cos, sin)
