"""Trainer side: align a Hugging Face Qwen2/Qwen3 causal LM for a region set.

:func:`align_model` swaps the forwards of the model's own module instances (RMSNorm, MLP,
rotary embedding, attention, the inner model) for wiring around :mod:`rpa.numerics`, and
returns a handle that removes them again (also a context manager). The patch is meant to
stay installed for a whole training run: gradient checkpointing re-runs the forward
inside ``backward()``.

Two compute modes:

* ``compute_dtype=torch.bfloat16`` (default), the study's BF16 baseline. BF16 parameters
  are used as they are. FP32 master parameters (TRL's default) are cast to BF16 inside
  every Linear, Embedding and RMSNorm forward, as FSDP ``MixedPrecision(param_dtype=bf16)``
  does, so the residual stream and every activation are BF16; gradients still reach the
  FP32 masters. With region set ``all``, such a model gives bit-identical logits to a
  BF16 copy of itself.
* ``compute_dtype=None``: parameters and autocast are left as the caller has them (TRL's
  FP32-master + autocast numerics); only the chosen regions are rewired.

RoPE aligned also means: when no ``position_ids`` are passed, positions come from the
attention mask, so a left-padded sequence sees the same RoPE positions as it does alone
(TRL left-pads and passes none; vLLM counts from the first real token).
"""

from __future__ import annotations

import contextvars
import importlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rpa import numerics
from rpa.regions import format_regions, parse_regions

SUPPORTED_ARCHS: dict[str, str] = {
    "qwen2": "transformers.models.qwen2.modeling_qwen2",
    "qwen3": "transformers.models.qwen3.modeling_qwen3",
}
"""``config.model_type`` -> modeling module. Qwen2.5 checkpoints use ``qwen2``."""

SUPPORTED_ROPE_TYPES = ("default",)


class UnsupportedModelError(ValueError):
    """A model the trainer patch does not handle (refused, never silently left stock)."""


# ------------------------------------------------------------------ region wiring


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """RoPE positions counted from each row's first real token (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


_ROPE_ALIGNED: contextvars.ContextVar[bool] = contextvars.ContextVar("rpa_rope_aligned", default=False)


def aligned_apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
    """HF's ``apply_rotary_pos_emb`` signature over :func:`rpa.numerics.rope_rotate`.

    ``cos``/``sin`` are the FP32 half-width values of the aligned rotary module.
    """
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return numerics.rope_rotate(q, cos, sin), numerics.rope_rotate(k, cos, sin)


def _rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    return numerics.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def _rms_norm_forward_stock_cast(self, hidden_states: Tensor) -> Tensor:
    """HF's stock RMSNorm (5.19) with the weight taken at the compute dtype (not aligned)."""
    input_dtype = hidden_states.dtype
    x32 = hidden_states.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight.to(self._rpa_compute_dtype) * x32.to(input_dtype)


def _mlp_forward(self, x: Tensor) -> Tensor:
    return self.down_proj(numerics.swiglu(self.gate_proj(x), self.up_proj(x)))


def _rotary_forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    table = self._rpa_cos_sin
    if table.device != position_ids.device:
        table = self._rpa_cos_sin = table.to(position_ids.device)
    if position_ids.numel() and int(position_ids.max()) >= table.shape[0]:
        raise ValueError(f"position {int(position_ids.max())} is past max_position_embeddings={table.shape[0]}")
    return numerics.rope_lookup(table, position_ids)


def _linear_forward_cast(self, x: Tensor) -> Tensor:
    dtype = self._rpa_compute_dtype
    bias = None if self.bias is None else self.bias.to(dtype)
    return F.linear(x.to(dtype), self.weight.to(dtype), bias)


def _lm_head_forward_fp32(self, x: Tensor) -> Tensor:
    """LM head in FP32 (ScaleRL; vLLM ``head_dtype=float32`` on CPU does the same casts).

    With FP32 masters in compute mode the weight is first taken at the compute dtype (what an
    FSDP-style trainer gathers); in autocast mode the FP32 master is used as it is (TRL).
    """
    weight, bias = self.weight, self.bias
    dtype = self.__dict__.get("_rpa_compute_dtype")
    if dtype is not None:
        weight = weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device_type=x.device.type, enabled=False):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


def _embedding_forward_cast(self, input_ids: Tensor) -> Tensor:
    weight = self.weight.to(self._rpa_compute_dtype)
    return F.embedding(input_ids, weight, self.padding_idx, self.max_norm, self.norm_type,
                       self.scale_grad_by_freq, self.sparse)


def _wrap_attention(module: nn.Module) -> Callable:
    stock = module.forward

    def forward(*args, **kwargs):
        token = _ROPE_ALIGNED.set(True)
        try:
            return stock(*args, **kwargs)
        finally:
            _ROPE_ALIGNED.reset(token)

    return forward


def _wrap_inner_model(module: nn.Module) -> Callable:
    stock = module.forward

    def forward(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, **kwargs):
        if position_ids is None and isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
            seq_len = (input_ids if input_ids is not None else inputs_embeds).shape[1]
            position_ids = positions_from_mask(attention_mask)[:, -seq_len:]
        return stock(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     past_key_values=past_key_values, inputs_embeds=inputs_embeds, **kwargs)

    return forward


# ------------------------------------------- the module-level rope function switch


class _RopeDispatch:
    """Replaces ``apply_rotary_pos_emb`` in the Qwen modeling modules while any aligned
    model exists; it takes the aligned path only inside an aligned attention forward."""

    def __init__(self) -> None:
        self.users = 0
        self.stock: dict[str, Callable] = {}

    def acquire(self) -> None:
        if self.users == 0:
            for path in SUPPORTED_ARCHS.values():
                mod = importlib.import_module(path)
                stock = mod.apply_rotary_pos_emb
                self.stock[path] = stock
                mod.apply_rotary_pos_emb = self._make(stock)
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            for path, stock in self.stock.items():
                importlib.import_module(path).apply_rotary_pos_emb = stock
            self.stock.clear()

    @staticmethod
    def _make(stock: Callable) -> Callable:
        def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
            if _ROPE_ALIGNED.get():
                return aligned_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
            return stock(q, k, cos, sin, unsqueeze_dim)

        apply_rotary_pos_emb.rpa_stock = stock
        return apply_rotary_pos_emb


_ROPE_DISPATCH = _RopeDispatch()


# ----------------------------------------------------------------------- the handle


@dataclass
class TrainerAlignment:
    """Installed patch on one model; :meth:`remove` (or leaving the ``with``) undoes it."""

    model: nn.Module
    regions: frozenset[str]
    compute_dtype: torch.dtype | None
    cast_params: bool
    lm_head_fp32: bool = False
    patched: list[nn.Module] = field(default_factory=list)
    uses_rope_dispatch: bool = False
    active: bool = True

    def describe(self) -> dict[str, Any]:
        return {
            "regions": format_regions(self.regions),
            "compute_dtype": None if self.compute_dtype is None else str(self.compute_dtype).removeprefix("torch."),
            "cast_fp32_master_params": self.cast_params,
            "lm_head_fp32": self.lm_head_fp32,
            "patched_modules": len(self.patched),
            "active": self.active,
        }

    def remove(self) -> None:
        if not self.active:
            return
        for module in self.patched:
            module.__dict__.pop("forward", None)
            for attr in ("_rpa_cos_sin", "_rpa_compute_dtype"):
                module.__dict__.pop(attr, None)
        self.patched.clear()
        if self.uses_rope_dispatch:
            _ROPE_DISPATCH.release()
        self.model.__dict__.pop("_rpa_alignment", None)
        self.active = False

    def __enter__(self) -> "TrainerAlignment":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def check_supported(model: nn.Module) -> types.ModuleType:
    """Return the model's modeling module, or raise :class:`UnsupportedModelError`."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    supported = ", ".join(f"{t} ({SUPPORTED_ARCHS[t].rsplit('.', 1)[-1]})" for t in SUPPORTED_ARCHS)
    if model_type not in SUPPORTED_ARCHS:
        raise UnsupportedModelError(f"rpa aligns Qwen2/Qwen3 causal LMs only; got model_type={model_type!r}. "
                                    f"Supported: {supported}")
    modeling = importlib.import_module(SUPPORTED_ARCHS[model_type])
    prefix = "Qwen2" if model_type == "qwen2" else "Qwen3"
    if not isinstance(getattr(model, "model", None), getattr(modeling, f"{prefix}Model")):
        raise UnsupportedModelError(f"expected a {prefix}ForCausalLM-style model with .model a {prefix}Model; "
                                    f"got {type(model).__name__}")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported by the aligned RoPE; "
                                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if config.hidden_act != "silu":
        raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not SwiGLU (silu)")
    return modeling


def _rope_table(model: nn.Module) -> Tensor:
    config = model.config
    rope = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotary_dim = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    device = model.model.rotary_emb.inv_freq.device
    inv_freq = numerics.rope_inv_freq(rope["rope_theta"], rotary_dim, device=device)
    return numerics.rope_cos_sin_table(inv_freq, config.max_position_embeddings)


def align_model(model: nn.Module, regions: frozenset[str] | str = "all",
                compute_dtype: torch.dtype | None = torch.bfloat16, lm_head_fp32: bool = False) -> TrainerAlignment:
    """Align ``model`` (a HF Qwen2/Qwen3 causal LM) in ``regions``; see the module doc.

    ``lm_head_fp32`` runs the LM head in FP32 on FP32 copies of its (compute-dtype)
    weights, outside autocast: the FP32-LM-head comparison point, not part of the regions.
    """
    if isinstance(regions, str):
        regions = parse_regions(regions)
    modeling = check_supported(model)
    if getattr(model, "_rpa_alignment", None) is not None:
        raise RuntimeError("model is already aligned; remove() the existing alignment first")
    param_dtypes = {p.dtype for p in model.parameters()}
    cast_params = compute_dtype is not None and param_dtypes != {compute_dtype}
    if cast_params and not param_dtypes <= {torch.float32, compute_dtype}:
        raise UnsupportedModelError(f"parameters are {sorted(map(str, param_dtypes))}; BF16 compute needs "
                                    f"{compute_dtype} or FP32 master parameters")
    handle = TrainerAlignment(model, regions, compute_dtype, cast_params, lm_head_fp32)
    prefix = "Qwen2" if model.config.model_type == "qwen2" else "Qwen3"
    norm_cls, mlp_cls = getattr(modeling, f"{prefix}RMSNorm"), getattr(modeling, f"{prefix}MLP")
    attn_cls = getattr(modeling, f"{prefix}Attention")

    def patch(module: nn.Module, forward: Callable, bind: bool = True, **attrs: Any) -> None:
        module.__dict__.update(attrs)
        module.forward = types.MethodType(forward, module) if bind else forward
        handle.patched.append(module)

    try:
        if lm_head_fp32:
            patch(model.lm_head, _lm_head_forward_fp32, _rpa_compute_dtype=compute_dtype if cast_params else None)
        for module in model.modules():
            if lm_head_fp32 and module is model.lm_head:
                continue
            if isinstance(module, norm_cls):
                if "rmsnorm" in regions:
                    patch(module, _rms_norm_forward)
                elif cast_params:
                    patch(module, _rms_norm_forward_stock_cast, _rpa_compute_dtype=compute_dtype)
            elif isinstance(module, mlp_cls) and "swiglu" in regions:
                patch(module, _mlp_forward)
            elif isinstance(module, attn_cls) and "rope" in regions:
                patch(module, _wrap_attention(module), bind=False)
            elif cast_params and type(module) is nn.Linear:
                patch(module, _linear_forward_cast, _rpa_compute_dtype=compute_dtype)
            elif cast_params and type(module) is nn.Embedding:
                patch(module, _embedding_forward_cast, _rpa_compute_dtype=compute_dtype)
        if "rope" in regions:
            patch(model.model.rotary_emb, _rotary_forward, _rpa_cos_sin=_rope_table(model))
            patch(model.model, _wrap_inner_model(model.model), bind=False)
            _ROPE_DISPATCH.acquire()
            handle.uses_rope_dispatch = True
    except BaseException:
        handle.remove()
        raise
    model.__dict__["_rpa_alignment"] = handle
    return handle
