"""Triton kernels of the aligned regions (CUDA), one per :mod:`rpa.core.numerics` function.

Each kernel loads the compute-dtype inputs, works in FP32 and rounds each output once
(the ``.to(...element_ty)`` on the store). Row-wise kernels (RMSNorm) give one program a
whole row, with a block size and warp count that depend only on the row length: the
reduction order is the same whether the row comes alone or in a batch of any size.
Elementwise kernels (SwiGLU, RoPE) have no cross-element arithmetic at all.

With :data:`IEEE` (the default on a GPU) every FP32 operation of a forward kernel is an
IEEE round-to-nearest one (``libdevice`` ``mul_rn``/``add_rn``/``div_rn``, full-precision
``exp``): no fused multiply-add and no approximate division, so SwiGLU and RoPE round as
torch's own eager kernels do. Triton's CPU interpreter (``TRITON_INTERPRET=1``, used by the
CPU tests) has no ``libdevice``; there the plain operators run, and its BF16 conversion is
not round-to-nearest, so the interpreter checks structure and tolerances, not bits.

The launchers take tensors whose last dimension is the feature dimension; other leading
dimensions are flattened into rows (a copy only where the layout does not allow a view).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

try:  # libdevice is absent from the interpreter's patched language
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the Triton build
    libdevice = None

IEEE: bool = os.environ.get("TRITON_INTERPRET") != "1" and libdevice is not None
"""Exact IEEE FP32 arithmetic in the forward kernels (see the module doc)."""

ELEMENTWISE_BLOCK = 1024


# ------------------------------------------------------------------ FP32 primitives


@triton.jit
def _mul(a, b, IEEE: tl.constexpr):
    if IEEE:
        return libdevice.mul_rn(a, b)
    else:
        return a * b


@triton.jit
def _add(a, b, IEEE: tl.constexpr):
    if IEEE:
        return libdevice.add_rn(a, b)
    else:
        return a + b


@triton.jit
def _sub(a, b, IEEE: tl.constexpr):
    if IEEE:
        return libdevice.sub_rn(a, b)
    else:
        return a - b


@triton.jit
def _div(a, b, IEEE: tl.constexpr):
    if IEEE:
        return libdevice.div_rn(a, b)
    else:
        return a / b


@triton.jit
def _exp(a, IEEE: tl.constexpr):
    if IEEE:
        return libdevice.exp(a)
    else:
        return tl.exp(a)


# --------------------------------------------------------------------------- SwiGLU


@triton.jit
def _swiglu_fwd(g_ptr, u_ptr, o_ptr, n_cols, g_row, u_row, o_row, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * g_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _div(g, _add(1.0, _exp(-g, IEEE), IEEE), IEEE)  # torch's silu: x / (1 + exp(-x))
    y = _mul(silu, u, IEEE)
    tl.store(o_ptr + row * o_row + cols, y.to(o_ptr.dtype.element_ty), mask=mask)  # the one rounding


@triton.jit
def _swiglu_bwd(dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n_cols, dy_row, g_row, u_row, dg_row, du_row,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dy = tl.load(dy_ptr + row * dy_row + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row + cols, mask=mask, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-g))
    dg = dy * u * (sig * (1.0 + g * (1.0 - sig)))
    du = dy * (g * sig)
    tl.store(dg_ptr + row * dg_row + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * du_row + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


# -------------------------------------------------------------- residual add + RMSNorm


@triton.jit
def _rms_norm_fwd(x_ptr, r_ptr, w_ptr, o_ptr, ro_ptr, n_cols, x_row, r_row, o_row, ro_row, eps,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, IEEE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * r_row + cols, mask=mask, other=0.0)
        x = _add(x.to(tl.float32), r.to(tl.float32), IEEE).to(ro_ptr.dtype.element_ty)  # the one rounding: new stream
        tl.store(ro_ptr + row * ro_row + cols, x, mask=mask)
    x32 = x.to(tl.float32)  # the norm reads the rounded sum
    variance = _div(tl.sum(_mul(x32, x32, IEEE), axis=0), tl.cast(n_cols, tl.float32), IEEE)
    rstd = tl.rsqrt(variance + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _mul(_mul(x32, rstd, IEEE), w, IEEE)
    tl.store(o_ptr + row * o_row + cols, y.to(o_ptr.dtype.element_ty), mask=mask)  # the one rounding


@triton.jit
def _rms_norm_bwd(dy_ptr, x_ptr, w_ptr, dx_ptr, dw_ptr, n_rows, n_cols, dy_row, x_row, dx_row, eps,
                  rows_per_program, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program
    for i in range(0, rows_per_program):
        row = start + i
        row_mask = mask & ((row + tl.zeros([BLOCK], dtype=tl.int64)) < n_rows)
        x = tl.load(x_ptr + row * x_row + cols, mask=row_mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row + cols, mask=row_mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        x_hat = x * rstd
        dy_w = dy * w
        c = tl.sum(x_hat * dy_w, axis=0) / n_cols
        dx = (dy_w - x_hat * c) * rstd
        tl.store(dx_ptr + row * dx_row + cols, dx.to(dx_ptr.dtype.element_ty), mask=row_mask)
        dw += dy * x_hat
    tl.store(dw_ptr + pid.to(tl.int64) * n_cols + cols, dw, mask=mask)


# ----------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_fwd(x_ptr, c_ptr, s_ptr, o_ptr, n_heads, x_tok, x_head, c_tok, s_tok, o_tok, o_head,
              HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, IEEE: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    j_mask = j < HALF
    mask = (heads < n_heads)[:, None] & j_mask[None, :]
    c = tl.load(c_ptr + tok * c_tok + j, mask=j_mask, other=0.0)[None, :]
    s = tl.load(s_ptr + tok * s_tok + j, mask=j_mask, other=0.0)[None, :]
    src = x_ptr + tok * x_tok + heads.to(tl.int64)[:, None] * x_head + j[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = _sub(_mul(x1, c, IEEE), _mul(x2, s, IEEE), IEEE)
    o2 = _add(_mul(x2, c, IEEE), _mul(x1, s, IEEE), IEEE)
    dst = o_ptr + tok * o_tok + heads.to(tl.int64)[:, None] * o_head + j[None, :]
    tl.store(dst, o1.to(o_ptr.dtype.element_ty), mask=mask)  # the one rounding
    tl.store(dst + HALF, o2.to(o_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------ launchers


def _rows(t: Tensor) -> Tensor:
    """``t`` as 2-D rows over its last dimension, unit stride along the row."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_warps(block: int) -> int:
    """Warps of a row program: a function of the row length only (batch invariance)."""
    return min(max(block // 256, 1), 16)


def _grid_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def swiglu(gate: Tensor, up: Tensor, ieee: bool = IEEE) -> Tensor:
    """:func:`rpa.core.numerics.swiglu` as one kernel."""
    n = gate.shape[-1]
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    g, u, o = _rows(gate), _rows(up), out.view(-1, n)
    if o.numel():
        grid = (o.shape[0], triton.cdiv(n, ELEMENTWISE_BLOCK))
        _swiglu_fwd[grid](g, u, o, n, g.stride(0), u.stride(0), o.stride(0), BLOCK=ELEMENTWISE_BLOCK, IEEE=ieee)
    return out


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`rpa.core.numerics.swiglu_backward` as one kernel."""
    n = gate.shape[-1]
    d_gate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    d_up = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    dy, g, u = _rows(grad), _rows(gate), _rows(up)
    dg, du = d_gate.view(-1, n), d_up.view(-1, n)
    if dg.numel():
        grid = (dg.shape[0], triton.cdiv(n, ELEMENTWISE_BLOCK))
        _swiglu_bwd[grid](dy, g, u, dg, du, n, dy.stride(0), g.stride(0), u.stride(0), dg.stride(0), du.stride(0),
                          BLOCK=ELEMENTWISE_BLOCK)
    return d_gate, d_up


def _rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, ieee: bool):
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"RMSNorm weight of shape {tuple(weight.shape)} for rows of {n}")
    block = triton.next_power_of_2(n)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    new_residual = torch.empty(x.shape, dtype=x.dtype, device=x.device) if residual is not None else None
    xr, o = _rows(x), out.view(-1, n)
    rr = _rows(residual) if residual is not None else xr
    ro = new_residual.view(-1, n) if new_residual is not None else o
    if o.numel():
        _rms_norm_fwd[(o.shape[0],)](xr, rr, weight.contiguous(), o, ro, n, xr.stride(0), rr.stride(0), o.stride(0),
                                     ro.stride(0), eps, HAS_RESIDUAL=residual is not None, BLOCK=block, IEEE=ieee,
                                     num_warps=_row_warps(block))
    return out, new_residual


def rms_norm(x: Tensor, weight: Tensor, eps: float, ieee: bool = IEEE) -> Tensor:
    """:func:`rpa.core.numerics.rms_norm` as one kernel, one program per row."""
    return _rms_norm(x, None, weight, eps, ieee)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float, ieee: bool = IEEE) -> tuple[Tensor, Tensor]:
    """:func:`rpa.core.numerics.add_rms_norm` as one kernel, one program per row."""
    return _rms_norm(x, residual, weight, eps, ieee)


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """:func:`rpa.core.numerics.rms_norm_backward`: a row kernel plus an FP32 sum of per-program
    weight-gradient partials."""
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    dy, xr = _rows(grad), _rows(x)
    d_x = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx = d_x.view(-1, n)
    rows = dx.shape[0]
    if rows == 0:
        return d_x, torch.zeros_like(weight)
    programs = min(rows, _grid_programs(x.device))
    per_program = triton.cdiv(rows, programs)
    programs = triton.cdiv(rows, per_program)
    partial = torch.empty((programs, n), dtype=torch.float32, device=x.device)
    _rms_norm_bwd[(programs,)](dy, xr, weight.contiguous(), dx, partial, rows, n, dy.stride(0), xr.stride(0),
                               dx.stride(0), eps, per_program, BLOCK=block, num_warps=_row_warps(block))
    return d_x, partial.sum(0).to(weight.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor, ieee: bool = IEEE) -> Tensor:
    """:func:`rpa.core.numerics.rope_rotate` for ``x`` ``[tokens, heads, head_dim]`` and FP32
    ``cos``/``sin`` ``[tokens, head_dim // 2]`` (full rotary dimension)."""
    tokens, heads, dim = x.shape
    half = cos.shape[-1]
    if 2 * half != dim:
        raise NotImplementedError(f"the RoPE kernel rotates the whole head (head_dim {dim}, rotary_dim {2 * half})")
    if cos.shape != (tokens, half) or sin.shape != (tokens, half):
        raise ValueError(f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} for x {tuple(x.shape)}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if out.numel():
        block_h = min(triton.next_power_of_2(heads), 64)
        grid = (tokens, triton.cdiv(heads, block_h))
        _rope_fwd[grid](x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
                        out.stride(0), out.stride(1), HALF=half, BLOCK_H=block_h,
                        BLOCK_HALF=triton.next_power_of_2(half), IEEE=ieee)
    return out
