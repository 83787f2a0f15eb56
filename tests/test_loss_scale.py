"""FP16 compute needs loss scaling: gradients of a DAPO-normalised loss through FP16 activations
underflow without it (zero entries, lower cosine to FP32); with it they match FP32."""

import math

import pytest
import torch

from rpa.train.loss_scale import DynamicLossScale


def test_unscale_detects_overflow_and_the_scale_backs_off_and_grows():
    s = DynamicLossScale(scale=8.0, growth_interval=2)
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([8.0, 16.0, 24.0])
    assert not s.unscale_([p]) and torch.equal(p.grad, torch.tensor([1.0, 2.0, 3.0]))
    p.grad = torch.tensor([1.0, math.inf, 0.0])
    assert s.unscale_([p])
    s.update(True)
    assert s.scale == 4.0 and s.skipped_steps == 1
    s.update(False)
    s.update(False)
    assert s.scale == 8.0 and s.good_steps == 0


def test_unscale_syncs_the_host_once_per_step_not_once_per_parameter(monkeypatch):
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(12)]
    for i, p in enumerate(params):
        p.grad = torch.full((4,), 2.0 * (i + 1))
    conversions = []
    stock = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: conversions.append(1) or stock(t))  # tensor -> host
    scaler = DynamicLossScale(scale=2.0)
    assert not scaler.unscale_(params) and len(conversions) == 1
    assert all(torch.equal(p.grad, torch.full((4,), float(i + 1))) for i, p in enumerate(params))
    params[7].grad[2] = math.nan  # one non-finite entry of one parameter of twelve
    conversions.clear()
    assert scaler.unscale_(params) and len(conversions) == 1
    assert not scaler.unscale_([torch.nn.Parameter(torch.zeros(2))])  # no gradients: nothing to check


def _grads(model_dir, ids, numerics, scale=1.0):
    """``numerics``: the configuration's options beside ``regions: none``."""
    from transformers import AutoModelForCausalLM

    from rpa.core.numerics_config import NumericsConfig
    from rpa.sides.trainer import align_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # FP32 masters
    handle = align_model(model, NumericsConfig.from_dict({"regions": "none", **numerics}))
    logp = torch.log_softmax(model(ids).logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    advantages = torch.randn(ids.size(0), 1, generator=torch.Generator().manual_seed(1))
    loss = -(logp * advantages).sum() / 6e4  # DAPO: normalised by the step's tokens
    (loss * scale).backward()
    handle.remove()
    scaler = DynamicLossScale(scale=scale)
    assert not scaler.unscale_(model.parameters())
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_fp16_gradients_underflow_without_loss_scaling(tiny_dirs):
    ids = torch.randint(3, 500, (8, 64), generator=torch.Generator().manual_seed(0))
    ref = _grads(tiny_dirs["qwen3"], ids, {"trainer_mode": "autocast"})  # FP32 masters, no cast, no autocast: FP32
    plain = _grads(tiny_dirs["qwen3"], ids, {"precision": "fp16"})
    scaled = _grads(tiny_dirs["qwen3"], ids, {"precision": "fp16"}, scale=2.0 ** 16)
    cos = lambda g: torch.nn.functional.cosine_similarity(g, ref, dim=0).item()  # noqa: E731
    zero = lambda g: ((g == 0) & (ref != 0)).float().mean().item()  # noqa: E731
    print(f"fp16 no scaling: cos {cos(plain):.4f}, zeroed {zero(plain):.2e}; scaled: cos {cos(scaled):.6f}, "
          f"zeroed {zero(scaled):.2e}")
    assert zero(plain) > 100 * max(zero(scaled), 1e-7) and cos(plain) < 0.99
    assert cos(scaled) == pytest.approx(1.0, abs=1e-4)
