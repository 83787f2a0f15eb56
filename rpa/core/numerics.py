"""Aligned region numerics: FP32 intermediates, exactly one rounding per region.

These are the functions both sides call verbatim: the trainer patch
(:mod:`rpa.sides.trainer`) and the vLLM plugin (:mod:`rpa.sides.vllm_plugin`). Each is a small pure
function of plain ATen ops (so autograd works on the trainer side); the single rounding
back to the compute dtype is one visible line marked ``# the one rounding``.

Inputs are in the compute dtype (BF16 in the study); everything between the upcast and
the rounding is FP32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# ---------------------------------------------------------------------------- RoPE


def rope_inv_freq(base: float, rotary_dim: int, device: torch.device | str | None = None) -> Tensor:
    """FP32 inverse frequencies of default (unscaled) RoPE: ``base ** (-2i / rotary_dim)``."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim
    return 1.0 / (base**exponents)


def rope_cos_sin_table(inv_freq: Tensor, max_positions: int) -> Tensor:
    """FP32 table ``[max_positions, rotary_dim]`` holding ``cat(cos, sin)`` per position.

    Both sides build this table once with this function and only *index* it afterwards,
    so cos/sin never depend on how a batch is shaped (transcendentals may round
    differently on vectorised and scalar code paths; a gather cannot).
    """
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq.float())
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def rope_table(base: float, rotary_dim: int, max_positions: int) -> Tensor:
    """The shared FP32 cos/sin table, always built on the CPU.

    FP32 ``pow``/``cos``/``sin`` round differently on CPU and CUDA (measured on an H200:
    ``rope_inv_freq`` differs in 2 of 64 entries, the table in ~20%), and vLLM builds its
    layers under a CUDA default device. Building on the CPU, whatever the default device,
    and moving the finished table (an exact copy) gives both sides the same bits.
    """
    inv_freq = rope_inv_freq(base, rotary_dim, device="cpu")
    return rope_cos_sin_table(inv_freq, max_positions)


def rope_lookup(table: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """FP32 ``cos, sin`` of shape ``positions.shape + [rotary_dim // 2]`` (an exact gather)."""
    cos_sin = table[positions]
    return cos_sin.chunk(2, dim=-1)


def rope_rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the leading ``2 * cos.shape[-1]`` features of ``x`` (NeoX / Qwen layout).

    ``cos``/``sin`` are FP32 and broadcast against ``x[..., :rotary_dim // 2]``. Features
    past the rotary dimension pass through untouched.
    """
    half = cos.shape[-1]
    x32 = x.float()
    x1, x2 = x32[..., :half], x32[..., half : 2 * half]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    rotated = rotated.to(x.dtype)  # the one rounding: FP32 rotation -> compute dtype
    if x.shape[-1] == 2 * half:
        return rotated
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`rope_rotate` in the layout of the ``rpa::rope`` op (and of the Triton kernel's ``rope``):
    ``x`` ``[tokens, heads, head_dim]``, FP32 ``cos``/``sin`` ``[tokens, rotary_dim // 2]``, shared by
    every head."""
    return rope_rotate(x, cos[:, None], sin[:, None])


def rope_rotate_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Gradient of :func:`rope_rotate` w.r.t. ``x``: the rotation by the opposite angle."""
    return rope_rotate(grad, cos, -sin)


# -------------------------------------------------------------------------- SwiGLU


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` of the BF16 GEMM outputs, computed in FP32."""
    product = F.silu(gate.float()) * up.float()
    return product.to(gate.dtype)  # the one rounding: FP32 silu*up -> compute dtype


def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`swiglu` w.r.t. ``gate`` and ``up``, in FP32, each rounded once."""
    g32, u32, dy = gate.float(), up.float(), grad.float()
    sig = torch.sigmoid(g32)
    d_gate = dy * u32 * (sig * (1.0 + g32 * (1.0 - sig)))
    d_up = dy * (g32 * sig)
    return d_gate.to(gate.dtype), d_up.to(up.dtype)  # one rounding each


# --------------------------------------------------------- residual add + RMSNorm


def add_residual(x: Tensor, residual: Tensor) -> Tensor:
    """The residual stream stays in the compute dtype: the sum is rounded once."""
    total = x.float() + residual.float()
    return total.to(x.dtype)  # the one rounding: the new residual stream


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm of ``x`` (compute dtype) in FP32, times the weight in FP32.

    The weight is taken at the compute dtype first (a BF16 parameter, as in FSDP-style
    BF16 compute; for an FP32 master weight this is the parameter cast, not a rounding
    of an intermediate).
    """
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    w32 = weight.to(x.dtype).float()
    normed = x32 * torch.rsqrt(variance + eps) * w32
    return normed.to(x.dtype)  # the one rounding: FP32 norm*weight -> compute dtype


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Residual add then RMSNorm of the *rounded* sum. Returns ``(normed, new_residual)``."""
    new_residual = add_residual(x, residual)
    return rms_norm(new_residual, weight, eps), new_residual


def rms_norm_backward(grad: Tensor, x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Gradients of :func:`rms_norm` w.r.t. ``x`` and ``weight`` (taken at ``x``'s dtype),
    in FP32, each rounded once; the weight gradient is summed over all leading dims."""
    x32, dy = x.float(), grad.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    x_hat = x32 * rstd
    dy_w = dy * weight.to(x.dtype).float()
    d_x = rstd * (dy_w - x_hat * (dy_w * x_hat).mean(-1, keepdim=True))
    d_w = (dy * x_hat).reshape(-1, x.shape[-1]).sum(0)
    return d_x.to(x.dtype), d_w.to(weight.dtype)  # one rounding each


# ------------------------------------------------- a dose of mismatch (sampler only)


def round_mantissa(x: Tensor, bits: int) -> Tensor:
    """``x`` (BF16) rounded to ``bits`` explicit mantissa bits (BF16 has 7), to nearest even.

    Not part of the method: the positive control's *perturbation* of the sampler, a rounding
    error of the same kind as the mismatch under study, only larger. Integer arithmetic on
    the bit pattern, so it is exact and the same eager or compiled.
    """
    if x.dtype != torch.bfloat16 or not 1 <= bits < 7:
        raise ValueError(f"round_mantissa rounds BF16 to 1..6 explicit mantissa bits; got {x.dtype}, {bits}")
    drop = 7 - bits
    raw = x.contiguous().view(torch.int16).to(torch.int32)
    magnitude = raw & 0x7FFF
    keep_lsb = (magnitude >> drop) & 1
    rounded = (magnitude + (1 << (drop - 1)) - 1 + keep_lsb) & ~((1 << drop) - 1)
    finite = magnitude < 0x7F80  # inf/nan pass through
    magnitude = torch.where(finite, torch.clamp(rounded, max=0x7F80), magnitude)
    out = (raw & 0x8000) | magnitude
    return out.to(torch.int16).view(torch.bfloat16).view(x.shape)  # the perturbation's one rounding
