"""The shared ``rpa::*`` custom ops: same bits as :mod:`rpa.core.numerics` on CPU, registered
fake and autograd implementations, opaque to ``torch.compile``, one backend choice."""

import pytest
import torch

from rpa.core import numerics, ops
from tests import kernel_checks as kc


@pytest.fixture(scope="module")
def t():
    return kc.inputs("cpu", rows=33, hidden=64, inter=96, heads=3, head_dim=32)


def test_ops_equal_the_reference_bitwise_on_cpu(t):
    ref = kc.forward_outputs(numerics, t)
    assert torch.equal(ops.swiglu(t["g"], t["u"]), ref["swiglu"])
    assert torch.equal(ops.rms_norm(t["x"], t["w"], 1e-6), ref["rms_norm"])
    normed, residual = ops.add_rms_norm(t["x"], t["r"], t["w"], 1e-6)
    assert torch.equal(normed, ref["add_rms_norm"]) and torch.equal(residual, ref["residual"])
    assert torch.equal(ops.rope(t["q"], t["cos"], t["sin"]), ref["rope"])


def test_weight_must_be_at_the_input_dtype(t):
    with pytest.raises(TypeError, match="weight at the input dtype"):
        ops.rms_norm(t["x"], t["w"].float(), 1e-6)


@pytest.mark.parametrize("name", ["swiglu", "rms_norm", "add_rms_norm", "rope"])
def test_opcheck(t, name):
    """torch's own consistency check of schema, fake (meta) and autograd registrations."""
    ops._define()
    args = {"swiglu": (t["g"], t["u"]), "rms_norm": (t["x"], t["w"], 1e-6),
            "add_rms_norm": (t["x"], t["r"], t["w"], 1e-6), "rope": (t["q"], t["cos"], t["sin"])}[name]
    # BF16 activations and weights get gradients; the FP32 cos/sin table values do not
    args = tuple(a.clone().requires_grad_(a.dtype == torch.bfloat16) if isinstance(a, torch.Tensor) else a
                 for a in args)
    torch.library.opcheck(getattr(torch.ops.rpa, name).default, args)


def test_gradients_match_autograd_through_the_reference(t):
    def grads(fn, *args):
        leaves = [a.detach().clone().requires_grad_(True) for a in args]
        out = fn(*leaves)
        out = out[0] * 1.5 + out[1] if isinstance(out, tuple) else out
        out.float().pow(2).sum().backward()
        return [leaf.grad for leaf in leaves]

    cases = [("swiglu", ops.swiglu, numerics.swiglu, (t["g"], t["u"])),
             ("rms_norm", lambda x, w: ops.rms_norm(x, w, 1e-6), lambda x, w: numerics.rms_norm(x, w, 1e-6),
              (t["x"], t["w"])),
             ("add_rms_norm", lambda x, r, w: ops.add_rms_norm(x, r, w, 1e-6),
              lambda x, r, w: numerics.add_rms_norm(x, r, w, 1e-6), (t["x"], t["r"], t["w"]))]
    for name, op, ref, args in cases:
        for got, want in zip(grads(op, *args), grads(ref, *args)):
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert kc.rel_err(got, want) < 2e-2, name
    q = t["q"].detach().clone().requires_grad_(True)
    dy = torch.randn_like(t["q"])
    ops.rope(q, t["cos"], t["sin"]).backward(dy)
    assert torch.equal(q.grad, numerics.rope_rotate_backward(dy, t["cos"][:, None], t["sin"][:, None]))


@pytest.mark.engine  # Inductor compiles C++ through gcc
def test_compiled_callers_keep_the_ops_bits(t):
    def block(x, r, w, g, u):
        normed, residual = ops.add_rms_norm(x, r, w, 1e-6)
        return ops.swiglu(g, u) * 2, normed + residual

    eager = block(t["x"], t["r"], t["w"], t["g"], t["u"])
    compiled = torch.compile(block, fullgraph=True)(t["x"], t["r"], t["w"], t["g"], t["u"])
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))


def test_backend_choice(monkeypatch):
    assert ops.kernel_backend("cpu") == "reference"
    monkeypatch.setenv(ops.ENV_VAR, "fast")
    with pytest.raises(ops.KernelBackendError, match="valid: auto, triton, reference"):
        ops.backend_setting()
    monkeypatch.setenv(ops.ENV_VAR, "reference")
    assert ops.backend_report()["setting"] == "reference"
    if not torch.cuda.is_available():
        with pytest.raises(ops.KernelBackendError, match="no CUDA device"):
            ops._cuda_backend("triton")
        assert ops._cuda_backend("auto") == "reference"
