"""Each region's trainer patch, seen on the model's own forward (issue 74): for every family and every region, what the
region's consumer receives -- ``down_proj``'s input (SwiGLU), ``q_proj``'s input (RMSNorm), the query and key the
attention function is called with (RoPE) -- is bitwise the aligned function of what the model itself computed before
it (captured by hooks), and the stock model, the control, is not. A patch that skipped a module (a renamed class, a
wrong ``arch.cls``) or a RoPE dispatch that fell back to stock fails here, where a replay of ``rpa.core.ops`` against
itself cannot."""

from __future__ import annotations

import pytest
import torch

from rpa.core import numerics
from rpa.core.numerics_config import NumericsConfig
from rpa.sides.trainer import align_model, rope_table

pytestmark = pytest.mark.unit

CAPTURE = "rpa_test_capture"
CAPTURED: list[tuple[torch.Tensor, torch.Tensor]] = []


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa, recording the query and key it is given (the rotated q / k: RoPE's consumer)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    CAPTURED.append((query.detach().clone(), key.detach().clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE, _capture_attention)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)


def _run(model_dir, regions: str):
    """The first layer's region inputs and consumers' inputs on one forward of the model aligned with ``regions``
    (BF16 compute on FP32 masters, as the trainer runs)."""
    from transformers import AutoModelForCausalLM

    _register()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.set_attn_implementation(CAPTURE)
    alignment = align_model(model, NumericsConfig.from_dict({"regions": regions, "precision": "bf16",
                                                             "trainer_positions": "mask"}))
    layer = model.model.layers[0]
    seen: dict[str, torch.Tensor] = {}

    def out(name):
        return lambda m, a, o: seen.__setitem__(name, o.detach().clone())

    def inp(name):
        return lambda m, a: seen.__setitem__(name, a[0].detach().clone())

    attn = layer.self_attn
    hooks = [layer.mlp.gate_proj.register_forward_hook(out("gate")), layer.mlp.up_proj.register_forward_hook(out("up")),
             layer.mlp.down_proj.register_forward_pre_hook(inp("down_in")),
             layer.input_layernorm.register_forward_pre_hook(inp("norm_in")),
             attn.q_proj.register_forward_pre_hook(inp("q_in")),
             (attn.q_norm if hasattr(attn, "q_norm") else attn.q_proj).register_forward_hook(out("q")),
             (attn.k_norm if hasattr(attn, "k_norm") else attn.k_proj).register_forward_hook(out("k"))]
    CAPTURED.clear()
    ids = torch.randint(3, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row: positions from the mask
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    for h in hooks:
        h.remove()
    seen["query"], seen["key"] = CAPTURED[0]
    seen["positions"] = (mask.cumsum(-1) - 1).clamp(min=0)
    eps, weight = layer.input_layernorm.variance_epsilon, layer.input_layernorm.weight
    alignment.remove()
    return model, seen, eps, weight


def _aligned_rope(model, seen, name):
    """The aligned rotation of the model's own q (or k) before RoPE, on HF's [batch, heads, seq, head_dim]."""
    x = seen[name]
    b, t = x.shape[0], x.shape[1]
    head_dim = seen["query"].shape[-1]
    x = x.view(b, t, -1, head_dim)  # [batch, seq, heads, head_dim]
    cos, sin = numerics.rope_lookup(rope_table(model.config), seen["positions"])
    rotated = numerics.rope(x.reshape(b * t, -1, head_dim), cos.reshape(b * t, -1), sin.reshape(b * t, -1))
    return rotated.view(b, t, -1, head_dim).transpose(1, 2)


CHECKS = {
    "swiglu": lambda model, s, eps, w: (s["down_in"], numerics.swiglu(s["gate"], s["up"])),
    "rmsnorm": lambda model, s, eps, w: (s["q_in"], numerics.rms_norm(s["norm_in"], w, eps)),
    "rope": lambda model, s, eps, w: (torch.cat([s["query"].flatten(), s["key"].flatten()]),
                                      torch.cat([_aligned_rope(model, s, "q").flatten(),
                                                 _aligned_rope(model, s, "k").flatten()])),
}


@pytest.mark.parametrize("region", list(CHECKS))
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_each_regions_consumer_receives_the_aligned_function_and_stock_does_not(tiny_dirs, family, region):
    model, seen, eps, weight = _run(tiny_dirs[family], region)
    got, want = CHECKS[region](model, seen, eps, weight)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want), f"{family} {region}: the patched forward differs"
    model, seen, eps, weight = _run(tiny_dirs[family], "none")  # the control: stock rounding positions
    got, want = CHECKS[region](model, seen, eps, weight)
    assert not torch.equal(got, want), f"{family} {region}: the stock model gives the aligned bits (a weak check)"
