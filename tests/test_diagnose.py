"""``rpa diagnose``'s trainer side without vLLM: the token ids go to the model's device. A model on
``meta`` stands in for one on CUDA, checked as CUDA would check it: an input tensor on another device
than the model's parameters raises (meta's own kernels accept a CPU index, CUDA's do not)."""

import pytest
import torch

from rpa.core.numerics_config import NumericsConfig
from rpa.measure import diagnose


def _model(tiny_dirs, device):
    """The tiny Qwen3 (random weights) on ``device``, refusing inputs on any other device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_dirs["qwen3"])
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    own = next(model.parameters()).device

    def check(module, args, kwargs):
        for value in [*args, *kwargs.values()]:
            if torch.is_tensor(value) and value.device != own:
                raise RuntimeError(f"input on {value.device}, model on {own}")

    model.register_forward_pre_hook(check, with_kwargs=True)
    return model.eval()


def _layers(model) -> int:
    return model.config.num_hidden_layers


def test_the_trainer_side_feeds_its_inputs_on_the_models_device(tiny_dirs, monkeypatch):
    model = _model(tiny_dirs, "meta")
    seen = []

    def record_devices(hf, side, store):  # the real hooks copy to the CPU, which a meta tensor cannot
        handles = []
        for module, kind, extract, key in diagnose._hook_specs(hf, side):
            def record(value, key=key):
                seen.append(value.device.type)
                store.setdefault(key, []).append(value.reshape(-1, value.shape[-1]))

            if kind == "pre":
                handles.append(module.register_forward_pre_hook(lambda m, a, ex=extract, r=record: r(ex(a))))
            else:
                handles.append(module.register_forward_hook(lambda m, a, o, ex=extract, r=record: r(ex(o))))
        return handles

    monkeypatch.setattr(diagnose, "install_hooks", record_devices)
    runs = diagnose.trainer_runs(model, NumericsConfig(), [[1, 2, 3, 4], [5, 6, 7]])
    assert len(runs) == 2 and set(seen) == {"meta"}
    assert len(runs[0]) == len(diagnose.BOUNDARIES) * _layers(model) + 1  # every boundary and the final norm
    assert runs[1][(0, "attn_in")].shape == (3, model.config.hidden_size)
    # the boundary hooks are removed (the model's own pre-hook is the device check)
    assert not any(m._forward_hooks or (m is not model and m._forward_pre_hooks) for m in model.modules())


def test_a_cpu_input_to_a_model_elsewhere_raises(tiny_dirs):
    """The control: the input diagnose fed before (a CPU tensor) fails against the same model."""
    model = _model(tiny_dirs, "meta")
    with pytest.raises(RuntimeError, match="input on cpu, model on meta"):
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]]))


def test_the_trainer_side_captures_every_boundary_on_the_cpu(tiny_dirs):
    model = _model(tiny_dirs, "cpu")
    runs = diagnose.trainer_runs(model, NumericsConfig(), [[1, 2, 3, 4]])
    captured = runs[0]
    assert len(captured) == len(diagnose.BOUNDARIES) * _layers(model) + 1
    assert all(t.device.type == "cpu" and t.shape[0] == 4 for t in captured.values())
    assert all(torch.isfinite(t.float()).all() for t in captured.values())
