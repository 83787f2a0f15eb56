"""The Triton region kernels (``rpa.core.kernels.triton_regions``).

On CPU they run under Triton's interpreter in a subprocess (structure and tolerances: the
interpreter's BF16 conversion is not round-to-nearest). On a CUDA machine the bitwise
claims are checked: one rounding of the exact result (FP64 reference) on every element whose rounding
FP32-size errors cannot flip (the CPU tests' decided-element check) and never more than 1 BF16 ulp off, batch invariance, the same bits from the
trainer's and the vLLM plugin's layouts, and compiled == eager for an aligned model.
"""

import json
import os

import pytest
import torch

from rpa.core import numerics
from tests import kernel_checks as kc
from tests.conftest import run_py, tail

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the bitwise CUDA tests below instead "
                    "(and Triton 3.6's interpreter cannot loop over a runtime bound)")
def test_kernels_under_the_triton_interpreter():
    proc = run_py(["tests/scripts/kernels_interpret.py"], env={"TRITON_INTERPRET": "1"}, timeout=600)
    assert proc.returncode == 0, tail(proc)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["shapes_dtypes"] and report["strided_swiglu_equal"]
    assert all(report["batch_invariant"].values()), report["batch_invariant"]
    for name, stats in report["vs_fp64"].items():
        # interpreter BF16 casts truncate: within 1 ulp of the single rounding (2 where a
        # truncated residual feeds the norm), yet a real share exact
        assert stats["max_ulp"] <= (2 if name == "add_rms_norm" else 1), (name, stats)
        assert stats["equal_frac"] > 0.3, (name, stats)
    for name, err in report["backward_rel_err"].items():
        assert err < 2e-2, (name, err)
    assert report["rope_inverse_rel_err"] < 2e-2


# ---------------------------------------------------------------------------- CUDA


@pytest.fixture(scope="module")
def kernels():
    from rpa.core.kernels import triton_regions

    assert triton_regions.IEEE
    return triton_regions


SHAPES = [dict(rows=4096, hidden=3584, inter=18944, heads=28, head_dim=128),   # Qwen2.5-7B widths
          dict(rows=1000, hidden=1024, inter=3072, heads=16, head_dim=128),    # Qwen3-0.6B widths
          dict(rows=257, hidden=128, inter=384, heads=4, head_dim=32)]


@cuda
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"h{s['hidden']}")
def test_cuda_kernels_round_once(kernels, shape):
    t = kc.inputs("cuda", **shape)
    got, ref64 = kc.forward_outputs(kernels, t), kc.references64(t)
    for name in ref64:
        if name == "rope":  # cancellation: bounded by the FP32 rounding of the two products
            stats = kc.vs_fp64(got[name], ref64[name], kc.rope_terms64(t))
            assert stats["beyond_fp32_bound"] == 0 and stats["equal_frac"] >= 0.999, (name, stats)
        else:
            stats = kc.vs_fp64(got[name], ref64[name])
            # one rounding: every element whose rounding FP32-size errors cannot flip is the single rounding
            assert stats["max_ulp"] <= 1 and stats["decided_wrong"] == 0, (name, stats)
            # (the residual sum of two BF16 values often lies on a midpoint: it is checked bit for bit below)
            assert name == "residual" or stats["decided"] > 0.95 * stats["elements"], (name, stats)
    # SwiGLU and RoPE use IEEE FP32 operations in torch's order: equal to eager torch on CUDA
    eager = kc.forward_outputs(numerics, t)
    assert torch.equal(got["swiglu"], eager["swiglu"]) and torch.equal(got["rope"], eager["rope"])
    assert torch.equal(got["residual"], kc.round_bf16_exact(ref64["residual"]))


@cuda
@pytest.mark.parametrize("hidden", [128, 1024, 3584, 4096])
def test_cuda_kernels_are_batch_invariant(kernels, hidden):
    t = kc.inputs("cuda", rows=8192, hidden=hidden, inter=2 * hidden, heads=max(hidden // 128, 1), head_dim=128)
    sizes = (1, 7, 128, 1000, 8192)
    assert kc.batch_invariance(lambda x: kernels.rms_norm(x, t["w"], 1e-6), t["x"], sizes)
    assert kc.batch_invariance(lambda x: kernels.add_rms_norm(x, t["r"][: x.shape[0]], t["w"], 1e-6)[0], t["x"], sizes)
    assert kc.batch_invariance(lambda g: kernels.swiglu(g, t["u"][: g.shape[0]]), t["g"], sizes)
    assert kc.batch_invariance(lambda q: kernels.rope(q, t["cos"][: q.shape[0]], t["sin"][: q.shape[0]]), t["q"], sizes)


@cuda
def test_cuda_backward_kernels_match_autograd(kernels):
    t = kc.inputs("cuda", rows=1024, hidden=1024, inter=3072, heads=8, head_dim=128)
    for name, err in kc.backward_errors(kernels, t).items():
        assert err < 1e-2, (name, err)


@cuda
def test_cuda_trainer_and_plugin_layouts_give_the_same_bits():
    """The trainer passes contiguous [tokens, ...] tensors; vLLM passes views (gate/up halves
    of one GEMM output, q/k slices of the fused qkv). The same op gives the same bits."""
    from rpa.core import ops

    t = kc.inputs("cuda", rows=512, hidden=1024, inter=2048, heads=8, head_dim=128)
    merged = torch.cat((t["g"], t["u"]), dim=-1)
    assert torch.equal(ops.swiglu(merged[:, :2048], merged[:, 2048:]), ops.swiglu(t["g"].clone(), t["u"].clone()))
    qkv = torch.cat((t["q"].reshape(512, -1), t["q"].reshape(512, -1)), dim=-1)
    q_view = qkv[:, :1024].view(512, 8, 128)
    assert torch.equal(ops.rope(q_view, t["cos"], t["sin"]), ops.rope(t["q"], t["cos"], t["sin"]))
    assert torch.equal(ops.rms_norm(q_view, t["w"][:128], 1e-6), ops.rms_norm(t["q"], t["w"][:128], 1e-6))


@cuda
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_cuda_compiled_aligned_model_equals_eager(tiny_dirs, arch):
    from transformers import AutoModelForCausalLM

    from rpa.core.numerics_config import NumericsConfig
    from rpa.sides.trainer import align_model

    model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32).cuda()
    align_model(model, NumericsConfig.from_dict({"regions": "all"}))
    ids = torch.randint(3, 500, (3, 40), generator=torch.Generator().manual_seed(0)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    with torch.no_grad():
        eager = model(ids, attention_mask=mask).logits
        compiled = torch.compile(model, fullgraph=True)(ids, attention_mask=mask).logits
    assert torch.equal(compiled, eager)


@cuda
def test_cuda_backend_is_triton_and_recorded():
    from rpa.core import ops

    if os.environ.get(ops.ENV_VAR, "auto") == "reference":
        pytest.skip("RPA_KERNELS=reference")
    assert ops.backend_report()["cuda"] == "triton"
