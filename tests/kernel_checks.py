"""Checks of the region kernels, shared by the CPU tests (Triton interpreter), the CUDA
tests and ``benchmarks/kernel_report.py``. Each returns plain numbers; callers assert."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from rpa.core import numerics


def round_bf16_exact(x64: Tensor) -> Tensor:
    """Round float64 to the nearest BF16 (ties to even) in one step (a plain cast of a
    double goes through FP32: two roundings)."""
    _, exponent = torch.frexp(x64)
    ulp = torch.ldexp(torch.ones_like(x64), exponent - 8)
    return (torch.round(x64 / ulp) * ulp).to(torch.bfloat16)


FP32_REL_ERR = 2.0**-20
"""A generous bound on FP32 intermediates' relative error (tests/test_numerics.py's)."""


def decided(x64: Tensor) -> Tensor:
    """Mask of elements whose BF16 rounding no FP32-size error can flip: farther from the midpoint between two BF16
    values than 4 x :data:`FP32_REL_ERR` of their size. There a single rounding of the exact result is the only
    right answer (the CPU tests' check, tests/test_numerics.py)."""
    _, exponent = torch.frexp(x64)
    ulp = torch.ldexp(torch.ones_like(x64), exponent - 8)
    frac = (x64 / ulp) - torch.floor(x64 / ulp)
    return (frac - 0.5).abs() * ulp > x64.abs() * FP32_REL_ERR * 4


def ordered_bits(x: Tensor) -> Tensor:
    """BF16 bit patterns mapped to integers that count ULPs across zero."""
    v = x.contiguous().view(torch.int16).int()
    return torch.where(v < 0, -(v & 0x7FFF), v)


def vs_fp64(out: Tensor, ref64: Tensor, terms64: Tensor | None = None) -> dict[str, float]:
    """``out`` (BF16) against the exact result rounded once to BF16: the share equal, the largest distance in ulps,
    and ``decided_wrong``, the elements whose single rounding is :func:`decided` and that differ from it (a one-rounding
    claim allows none).

    ``terms64``: for a sum of products (RoPE: ``x1*cos - x2*sin``), the sum of the terms'
    magnitudes. Where the terms cancel, FP32 intermediates cannot deliver the result to 1
    BF16 ulp (the eager reference cannot either); ``beyond_fp32_bound`` counts elements off
    by more than 1 ulp plus the FP32 rounding of the terms (2**-22 of their size).
    """
    want = round_bf16_exact(ref64)
    ulps = (ordered_bits(out) - ordered_bits(want)).abs()
    mask = decided(ref64)
    stats = {"elements": out.numel(), "equal_frac": float((ulps == 0).double().mean()), "max_ulp": int(ulps.max()),
             "decided": int(mask.sum()), "decided_wrong": int(((ulps != 0) & mask).sum())}
    if terms64 is not None:
        _, exponent = torch.frexp(ref64)
        ulp = torch.ldexp(torch.ones_like(ref64), exponent - 8)
        excess = (out.double() - ref64).abs() - ulp - terms64 * 2.0**-22
        stats["beyond_fp32_bound"] = int((excess > 0).sum())
    return stats


def rope_terms64(t: dict[str, Tensor]) -> Tensor:
    """|x1*cos| + |x2*sin| (and the mirror) per RoPE output element, in FP64."""
    half = t["cos"].shape[-1]
    q1, q2 = t["q"].double()[..., :half].abs(), t["q"].double()[..., half:].abs()
    c, s = t["cos"].double()[:, None].abs(), t["sin"].double()[:, None].abs()
    return torch.cat((q1 * c + q2 * s, q2 * c + q1 * s), dim=-1)


def bitwise(a: Tensor, b: Tensor) -> dict[str, float]:
    same = a == b
    return {"equal": bool(torch.equal(a, b)), "differing": int((~same).sum()),
            "max_abs_diff": float((a.float() - b.float()).abs().max()) if a.numel() else 0.0}


def rel_err(a: Tensor, b: Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


# ------------------------------------------------------------------------ inputs


def inputs(device: str, rows: int, hidden: int, inter: int, heads: int, head_dim: int, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def bf(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)

    table = numerics.rope_table(1e6, head_dim, 4 * rows + 16).to(device)
    positions = torch.randint(0, 4 * rows + 16, (rows,), generator=g).to(device)
    cos, sin = numerics.rope_lookup(table, positions)
    return {"x": bf(rows, hidden), "r": bf(rows, hidden), "w": bf(hidden, scale=0.5) + 1.0,
            "g": bf(rows, inter, scale=2.0), "u": bf(rows, inter), "q": bf(rows, heads, head_dim),
            "cos": cos, "sin": sin, "dy": bf(rows, hidden), "dyi": bf(rows, inter), "dyq": bf(rows, heads, head_dim)}


def references64(t: dict[str, Tensor], eps: float = 1e-6) -> dict[str, Tensor]:
    x, r, w = t["x"].double(), t["r"].double(), t["w"].double()
    s = round_bf16_exact(x + r).double()

    def rms(v):
        return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * w

    half = t["cos"].shape[-1]
    q1, q2 = t["q"].double()[..., :half], t["q"].double()[..., half:]
    c, sn = t["cos"].double()[:, None], t["sin"].double()[:, None]
    return {"swiglu": torch.nn.functional.silu(t["g"].double()) * t["u"].double(), "rms_norm": rms(x),
            "add_rms_norm": rms(s), "residual": x + r,
            "rope": torch.cat((q1 * c - q2 * sn, q2 * c + q1 * sn), dim=-1)}


def forward_outputs(mod, t: dict[str, Tensor], eps: float = 1e-6) -> dict[str, Tensor]:
    """Outputs of a module with the kernels' signatures (:mod:`rpa.core.kernels.triton_regions`)
    or of the reference (:mod:`rpa.core.numerics`)."""
    if mod is numerics:
        rope = numerics.rope_rotate(t["q"], t["cos"][:, None], t["sin"][:, None])
    else:
        rope = mod.rope(t["q"], t["cos"], t["sin"])
    normed, residual = mod.add_rms_norm(t["x"], t["r"], t["w"], eps)
    return {"swiglu": mod.swiglu(t["g"], t["u"]), "rms_norm": mod.rms_norm(t["x"], t["w"], eps),
            "add_rms_norm": normed, "residual": residual, "rope": rope}


def batch_invariance(fn: Callable[[Tensor], Tensor], full: Tensor, sizes=(1, 3, 64)) -> bool:
    """Each leading slice of ``full`` gives the same bits alone as inside the whole batch."""
    whole = fn(full)
    return all(torch.equal(fn(full[:n].clone()), whole[:n]) for n in sizes if n <= full.shape[0])


def backward_errors(mod, t: dict[str, Tensor], eps: float = 1e-6) -> dict[str, float]:
    """Relative error of the backward kernels vs autograd through the FP32 reference."""
    def ref_grads(f, args, dy):
        leaves = [a.detach().float().requires_grad_(True) for a in args]
        f(*leaves).backward(dy.float())
        return [leaf.grad for leaf in leaves]

    silu = lambda g, u: torch.nn.functional.silu(g) * u  # noqa: E731
    rms = lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w  # noqa: E731
    out = {}
    dg, du = mod.swiglu_backward(t["dyi"], t["g"], t["u"])
    rg, ru = ref_grads(silu, (t["g"], t["u"]), t["dyi"])
    out["swiglu_d_gate"], out["swiglu_d_up"] = rel_err(dg, rg), rel_err(du, ru)
    dx, dw = mod.rms_norm_backward(t["dy"], t["x"], t["w"], eps)
    rx, rw = ref_grads(rms, (t["x"], t["w"]), t["dy"])
    out["rms_norm_d_x"], out["rms_norm_d_w"] = rel_err(dx, rx), rel_err(dw, rw)
    return out
