"""Each aligned region is a *single* rounding of the exact (float64) computation.

A float64 reference is rounded once to BF16 (exactly, not via FP32). Where that single
rounding is decided -- the reference is not within the FP32 intermediates' error of a
BF16 rounding boundary -- the aligned output must equal it bit for bit. Where the region
is exact in FP32 (the residual add), every element must. As a control that the check
can fail, the stock implementations (several roundings) must violate it.
"""

import torch
import torch.nn.functional as F

from rpa.core import numerics

BF16_MANTISSA = 8  # bits incl. the implicit one
FP32_REL_ERR = 2.0**-20  # generous bound on the FP32 intermediates' relative error


def round_bf16_exact(x64: torch.Tensor) -> torch.Tensor:
    """Round float64 to the nearest BF16 (ties to even) in one step."""
    _, exponent = torch.frexp(x64)
    ulp = torch.ldexp(torch.ones_like(x64), exponent - BF16_MANTISSA)
    rounded = torch.round(x64 / ulp) * ulp  # torch.round is half-to-even; /ulp is exact
    out = rounded.to(torch.bfloat16)
    assert torch.equal(out.double(), rounded)  # representable, so the cast is exact
    return out


def decided(x64: torch.Tensor) -> torch.Tensor:
    """Mask of elements whose BF16 rounding no FP32-size error can flip."""
    _, exponent = torch.frexp(x64)
    ulp = torch.ldexp(torch.ones_like(x64), exponent - BF16_MANTISSA)
    frac = (x64 / ulp) - torch.floor(x64 / ulp)
    dist = (frac - 0.5).abs() * ulp  # distance to the midpoint between two BF16 values
    return dist > x64.abs() * FP32_REL_ERR * 4


def check_single_rounding(out: torch.Tensor, ref64: torch.Tensor) -> tuple[int, int, int]:
    """(decided elements, of which equal, undecided elements)."""
    want = round_bf16_exact(ref64)
    mask = decided(ref64)
    equal = (out == want) & mask
    return int(mask.sum()), int(equal.sum()), int((~mask).sum())


def bf16(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(torch.bfloat16)


def assert_single_rounding(out, ref64):
    n, eq, undecided = check_single_rounding(out, ref64)
    assert n > 0.95 * ref64.numel()
    assert eq == n, f"{n - eq} of {n} decided elements are not a single rounding"
    return undecided


# ---------------------------------------------------------------------------------- add


def test_residual_add_is_exactly_one_rounding():
    x, r = bf16(64, 256, seed=1), bf16(64, 256, seed=2)
    out = numerics.add_residual(x, r)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, round_bf16_exact(x.double() + r.double()))


def test_add_rms_norm_normalises_the_rounded_sum():
    x, r, w = bf16(64, 256, seed=1), bf16(64, 256, seed=2), bf16(256, seed=3)
    out, new_r = numerics.add_rms_norm(x, r, w, 1e-6)
    assert torch.equal(new_r, numerics.add_residual(x, r))
    s64 = new_r.double()
    ref = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert_single_rounding(out, ref)
    # control: normalising the unrounded FP32 sum (vLLM CPU native) is not this contract
    s32 = x.float() + r.float()
    unrounded = (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(torch.bfloat16)
    n, eq, _ = check_single_rounding(unrounded, ref)
    assert eq < n


# ------------------------------------------------------------------------------ RMSNorm


def hf_stock_rms_norm(x, w, eps):
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return w * x32.to(x.dtype)


def test_rms_norm_single_rounding_and_stock_is_not():
    x, w = bf16(128, 512, seed=4), bf16(512, seed=5, scale=0.5)
    ref = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    assert_single_rounding(numerics.rms_norm(x, w, 1e-6), ref)
    n, eq, _ = check_single_rounding(hf_stock_rms_norm(x, w, 1e-6), ref)
    assert eq < 0.9 * n  # two roundings: a large share differs


def test_rms_norm_fp32_master_weight_is_cast_like_fsdp():
    x = bf16(8, 64, seed=6)
    w32 = torch.randn(64, dtype=torch.float32)
    assert torch.equal(numerics.rms_norm(x, w32, 1e-6), numerics.rms_norm(x, w32.to(torch.bfloat16), 1e-6))


# ------------------------------------------------------------------------------- SwiGLU


def test_swiglu_single_rounding_and_stock_is_not():
    g, u = bf16(128, 384, seed=7, scale=2.0), bf16(128, 384, seed=8)
    ref = F.silu(g.double()) * u.double()
    assert_single_rounding(numerics.swiglu(g, u), ref)
    n, eq, _ = check_single_rounding(F.silu(g) * u, ref)
    assert eq < n


# --------------------------------------------------------------------------------- RoPE


def test_rope_table_is_a_gather_of_one_fp32_table():
    inv = numerics.rope_inv_freq(10000.0, 32)
    assert inv.dtype == torch.float32
    table = numerics.rope_cos_sin_table(inv, 256)
    pos = torch.tensor([[0, 5, 255], [3, 3, 7]])
    cos, sin = numerics.rope_lookup(table, pos)
    assert cos.shape == (2, 3, 16) and cos.dtype == torch.float32
    assert torch.equal(cos[1, 0], table[3, :16]) and torch.equal(sin[0, 2], table[255, 16:])


def test_rope_single_rounding_and_stock_is_not():
    table = numerics.rope_cos_sin_table(numerics.rope_inv_freq(10000.0, 64), 512)
    pos = torch.randint(0, 512, (96,), generator=torch.Generator().manual_seed(0))
    cos, sin = numerics.rope_lookup(table, pos)
    x = bf16(96, 4, 64, seed=9)  # tokens, heads, head_dim
    out = numerics.rope_rotate(x, cos[:, None], sin[:, None])
    x1, x2 = x.double()[..., :32], x.double()[..., 32:]
    c, s = cos[:, None].double(), sin[:, None].double()
    ref = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    assert_single_rounding(out, ref)
    # control: HF stock (BF16 cos/sin, q*cos and rot(q)*sin each rounded, then the sum)
    cb, sb = torch.cat((cos, cos), -1)[:, None].to(torch.bfloat16), torch.cat((sin, sin), -1)[:, None].to(torch.bfloat16)
    stock = x * cb + torch.cat((-x[..., 32:], x[..., :32]), -1) * sb
    n, eq, _ = check_single_rounding(stock, ref)
    assert eq < 0.9 * n


def test_rope_partial_rotary_passes_the_rest_through():
    table = numerics.rope_cos_sin_table(numerics.rope_inv_freq(10000.0, 16), 8)
    cos, sin = numerics.rope_lookup(table, torch.arange(4))
    x = bf16(4, 2, 32, seed=10)
    out = numerics.rope_rotate(x, cos[:, None], sin[:, None])
    assert torch.equal(out[..., 16:], x[..., 16:])
    assert not torch.equal(out[1:, :, :16], x[1:, :, :16])


def test_rope_position_zero_is_identity():
    table = numerics.rope_cos_sin_table(numerics.rope_inv_freq(10000.0, 32), 4)
    cos, sin = numerics.rope_lookup(table, torch.zeros(3, dtype=torch.long))
    x = bf16(3, 2, 32, seed=11)
    assert torch.equal(numerics.rope_rotate(x, cos[:, None], sin[:, None]), x)
