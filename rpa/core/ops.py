"""The aligned regions as ``torch.library`` custom ops, called by *both* sides.

``rpa::swiglu(gate, up)``, ``rpa::rms_norm(x, weight, eps)``,
``rpa::add_rms_norm(x, residual, weight, eps)`` and ``rpa::rope(x, cos, sin)`` (with their
backward ops) are what the trainer patch (:mod:`rpa.sides.trainer`) and the vLLM plugin
(:mod:`rpa.sides.vllm_plugin`) run. One implementation per device type:

* CPU: the pure-torch reference :mod:`rpa.core.numerics`;
* CUDA: the Triton kernels of :mod:`rpa.core.kernels.triton_regions`, or the reference where the
  backend is ``reference`` (see :func:`kernel_backend`).

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
from typing import Any

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


def _impl(t: Tensor):
    if t.is_cuda and kernel_backend(t.device) == "triton":
        from rpa.core.kernels import triton_regions

        return triton_regions
    return numerics


def _check_weight(x: Tensor, weight: Tensor) -> None:
    if weight.dtype != x.dtype:
        raise TypeError(f"rpa RMSNorm ops take the weight at the input dtype ({x.dtype}); got {weight.dtype}")


# ------------------------------------------------------------------------- definitions


def _define() -> None:
    """Define the ``rpa::*`` ops once per process (idempotent)."""
    if _DEFINED:
        return
    lib = "rpa"

    # ------------------------------------------------------------------ SwiGLU
    @torch.library.custom_op(f"{lib}::swiglu", mutates_args=())
    def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
        return _impl(gate).swiglu(gate, up).contiguous()

    @swiglu_op.register_fake
    def _(gate, up):
        return gate.new_empty(gate.shape)

    @torch.library.custom_op(f"{lib}::swiglu_backward", mutates_args=())
    def swiglu_backward_op(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
        d_gate, d_up = _impl(gate).swiglu_backward(grad, gate, up)
        return d_gate.contiguous(), d_up.contiguous()

    @swiglu_backward_op.register_fake
    def _(grad, gate, up):
        return gate.new_empty(gate.shape), up.new_empty(up.shape)

    def swiglu_setup(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def swiglu_grad(ctx, grad):
        gate, up = ctx.saved_tensors
        return swiglu_backward_op(grad, gate, up)

    swiglu_op.register_autograd(swiglu_grad, setup_context=swiglu_setup)

    # ----------------------------------------------------------------- RMSNorm
    @torch.library.custom_op(f"{lib}::rms_norm", mutates_args=())
    def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> Tensor:
        _check_weight(x, weight)
        return _impl(x).rms_norm(x, weight, eps).contiguous()

    @rms_norm_op.register_fake
    def _(x, weight, eps):
        return x.new_empty(x.shape)

    @torch.library.custom_op(f"{lib}::rms_norm_backward", mutates_args=())
    def rms_norm_backward_op(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        d_x, d_w = _impl(x).rms_norm_backward(grad, x, weight, eps)
        return d_x.contiguous(), d_w

    @rms_norm_backward_op.register_fake
    def _(grad, x, weight, eps):
        return x.new_empty(x.shape), weight.new_empty(weight.shape)

    def rms_norm_setup(ctx, inputs, output):
        x, weight, eps = inputs
        ctx.save_for_backward(x, weight)
        ctx.eps = eps

    def rms_norm_grad(ctx, grad):
        x, weight = ctx.saved_tensors
        d_x, d_w = rms_norm_backward_op(grad, x, weight, ctx.eps)
        return d_x, d_w, None

    rms_norm_op.register_autograd(rms_norm_grad, setup_context=rms_norm_setup)

    @torch.library.custom_op(f"{lib}::add_rms_norm", mutates_args=())
    def add_rms_norm_op(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        _check_weight(x, weight)
        out, new_residual = _impl(x).add_rms_norm(x, residual, weight, eps)
        return out.contiguous(), new_residual.contiguous()

    @add_rms_norm_op.register_fake
    def _(x, residual, weight, eps):
        return x.new_empty(x.shape), x.new_empty(x.shape)

    def add_rms_norm_setup(ctx, inputs, output):
        x, residual, weight, eps = inputs
        ctx.save_for_backward(output[1], weight)
        ctx.eps = eps
        ctx.dtypes = (x.dtype, residual.dtype)

    def add_rms_norm_grad(ctx, grad_out, grad_residual):
        new_residual, weight = ctx.saved_tensors
        total = torch.zeros_like(new_residual, dtype=torch.float32)
        d_w = None
        if grad_out is not None:
            d_norm, d_w = rms_norm_backward_op(grad_out, new_residual, weight, ctx.eps)
            total = total + d_norm.float()
        if grad_residual is not None:
            total = total + grad_residual.float()
        return total.to(ctx.dtypes[0]), total.to(ctx.dtypes[1]), d_w, None

    add_rms_norm_op.register_autograd(add_rms_norm_grad, setup_context=add_rms_norm_setup)

    # -------------------------------------------------------------------- RoPE
    @torch.library.custom_op(f"{lib}::rope", mutates_args=())
    def rope_op(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if x.dim() != 3 or cos.shape != (x.shape[0], cos.shape[-1]) or sin.shape != cos.shape:
            raise ValueError(f"rpa::rope takes x [tokens, heads, head_dim] and cos/sin [tokens, rotary_dim // 2]; "
                             f"got {tuple(x.shape)}, {tuple(cos.shape)}, {tuple(sin.shape)}")
        impl = _impl(x)
        if impl is numerics:
            return numerics.rope_rotate(x, cos[:, None], sin[:, None]).contiguous()
        return impl.rope(x, cos, sin)

    @rope_op.register_fake
    def _(x, cos, sin):
        return x.new_empty(x.shape)

    def rope_setup(ctx, inputs, output):
        _, cos, sin = inputs
        ctx.save_for_backward(cos, sin)

    def rope_grad(ctx, grad):
        cos, sin = ctx.saved_tensors
        return rope_op(grad, cos, -sin), None, None  # the rotation by the opposite angle

    rope_op.register_autograd(rope_grad, setup_context=rope_setup)

    _DEFINED.update(swiglu=swiglu_op, rms_norm=rms_norm_op, add_rms_norm=add_rms_norm_op, rope=rope_op,
                    swiglu_backward=swiglu_backward_op, rms_norm_backward=rms_norm_backward_op)


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
