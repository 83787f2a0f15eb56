"""Trainer side: align a Hugging Face Qwen2/Qwen3/Llama causal LM for a region set.

:func:`align_model` gives the model's own module instances (RMSNorm, MLP, rotary
embedding, and in BF16-compute mode every Linear and Embedding) a replacement forward
(:class:`PatchedForward`) that runs the aligned regions through the shared custom ops of
:mod:`rpa.core.ops` -- the very ops the vLLM plugin runs -- and returns a handle that removes
them again (also a context manager). The patch is meant to stay installed for a whole
training run: gradient checkpointing re-runs the forward inside ``backward()``.

The patch is a drop-in: it holds no closures over module instances (state lives on the
modules), so ``copy.deepcopy`` (TRL's reference model), pickling and ``torch.save`` of an
aligned model work and the copy is independent; the custom ops are opaque to
``torch.compile`` / ``torch.export``, so a compiled aligned model keeps the aligned bits;
the RoPE lookup needs no host sync. Before every forward the handle re-checks the model
(:meth:`TrainerAlignment.refresh`): embeddings or an LM head replaced after aligning
(``resize_token_embeddings``) get the same patch, and a parameter dtype the compute mode
cannot follow (``model.half()``) is refused.

What to align comes as one :class:`~rpa.core.numerics_config.NumericsConfig` (its trainer side).
Two compute modes:

* ``trainer_mode: compute`` (default), the study's BF16 baseline. Parameters at the trainer's
  compute dtype (BF16) are used as they are. FP32 master parameters (TRL's default) are cast to
  BF16 inside every Linear, Embedding and RMSNorm forward, as FSDP
  ``MixedPrecision(param_dtype=bf16)`` does, so the residual stream and every activation are BF16;
  gradients still reach the FP32 masters. With region set ``all``, such a model gives
  bit-identical logits to a BF16 copy of itself. Logits come back in the parameter dtype (the
  upcast is exact).
* ``trainer_mode: autocast``: parameters and autocast are left as the caller has them (TRL's
  FP32-master + autocast numerics); only the chosen regions are rewired.

Positions: with ``positions_from_mask`` (``trainer_positions: auto``: when RoPE is aligned), a forward
without ``position_ids`` takes them from the attention mask, so a left-padded sequence sees the
same RoPE positions as it does alone (TRL left-pads and passes none; vLLM counts from the
first real token).
"""

from __future__ import annotations

import contextlib

import importlib
import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rpa.core import numerics, ops
from rpa.core.errors import UserError
from rpa.core.numerics_config import NumericsConfig, require_numerics
from rpa.core.regions import format_regions

@dataclass(frozen=True)
class Architecture:
    """One Hugging Face model family the patch aligns: its modeling module and the prefix of its
    class names (``<prefix>RMSNorm``, ``<prefix>MLP``, ``<prefix>Model``). The three families
    share one decoder layout -- pre-norm residual blocks, ``q/k/v/o_proj``, a gated-SiLU MLP of
    ``gate/up/down_proj``, a ``rotary_emb`` on the decoder and a module-level
    ``apply_rotary_pos_emb`` -- so one patch covers them."""

    model_type: str
    module: str
    prefix: str

    def modeling(self) -> types.ModuleType:
        return importlib.import_module(self.module)

    def cls(self, name: str) -> type:
        """The family's ``<prefix><name>`` class (``RMSNorm``, ``MLP``, ``Model``)."""
        return getattr(self.modeling(), f"{self.prefix}{name}")


ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in (
    Architecture("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2"),  # Qwen2 and Qwen2.5
    Architecture("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3"),
    Architecture("llama", "transformers.models.llama.modeling_llama", "Llama"),  # Llama 2/3, SmolLM2
)}
"""``config.model_type`` -> :class:`Architecture`: every family the trainer patch and the vLLM
plugin align (anything else is refused from its ``config.json``, before weights load)."""

SUPPORTED_ROPE_TYPES = ("default",)


class UnsupportedModelError(UserError):
    """A model the trainer patch does not handle (refused, never silently left stock)."""


class PatchedForward:
    """A module's replacement forward, ``fn(module, *args, **kwargs)``.

    It holds its module as plain state (no closure, no bound method): a deep copy of the
    model gets a copy that calls *its own* module, pickling works (``fn`` is a module-level
    function), and ``remove()`` only has to drop the instance attribute.
    """

    def __init__(self, module: nn.Module, fn: Callable) -> None:
        self.module = module
        self.fn = fn

    def __call__(self, *args, **kwargs):
        return self.fn(self.module, *args, **kwargs)

    def __repr__(self) -> str:
        return f"PatchedForward({self.fn.__name__})"


# ------------------------------------------------------------------ region wiring


def positions_from_mask(attention_mask: Tensor) -> Tensor:
    """RoPE positions counted from each row's first real token (left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _rope_heads(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``rpa::rope`` on HF's ``[batch, heads, seq, head_dim]`` layout (a view of the
    projections' ``[batch, seq, heads, head_dim]``, so the token-major form is free)."""
    b, h, t, d = x.shape
    tokens = x.transpose(1, 2).reshape(b * t, h, d)
    half = cos.shape[-1]
    cos, sin = cos.expand(b, t, half).reshape(b * t, half), sin.expand(b, t, half).reshape(b * t, half)
    return ops.rope(tokens, cos, sin).view(b, t, h, d).transpose(1, 2)


def aligned_apply_rotary_pos_emb(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1):
    """HF's ``apply_rotary_pos_emb`` signature over ``rpa::rope``.

    ``cos``/``sin`` are the FP32 half-width values ``[batch, seq, rotary_dim // 2]`` that the
    aligned rotary module gathers from the shared table.
    """
    if unsqueeze_dim != 1:
        raise NotImplementedError("aligned RoPE expects HF's [batch, heads, seq, head_dim] layout (unsqueeze_dim=1)")
    return _rope_heads(q, cos, sin), _rope_heads(k, cos, sin)


def _is_aligned_rope(q: Tensor, cos: Tensor) -> bool:
    """The aligned rotary module returns FP32 half-width cos/sin; HF's stock one returns the
    full rotary width (which for the supported models is the whole head)."""
    return cos.dtype == torch.float32 and 2 * cos.shape[-1] == q.shape[-1]


def _rope_dispatch(stock: Callable) -> Callable:
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if _is_aligned_rope(q, cos):
            return aligned_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
        return stock(q, k, cos, sin, unsqueeze_dim)

    apply_rotary_pos_emb.rpa_stock = stock
    return apply_rotary_pos_emb


def _install_rope_dispatch() -> None:
    """Route the supported modeling modules' ``apply_rotary_pos_emb`` through :func:`_rope_dispatch`.

    Installed on the first aligned model and left installed: it is transparent for stock
    models (their cos/sin are full-width), it holds no per-model state (deep copies and
    pickles of a model need nothing from it) and, decided by shapes alone, it traces under
    ``torch.compile(fullgraph=True)`` and ``torch.export``.
    """
    for arch in ARCHITECTURES.values():
        mod = arch.modeling()
        if not hasattr(mod.apply_rotary_pos_emb, "rpa_stock"):
            mod.apply_rotary_pos_emb = _rope_dispatch(mod.apply_rotary_pos_emb)


def _rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    return ops.rms_norm(hidden_states, self.weight.to(hidden_states.dtype), self.variance_epsilon)


def _rms_norm_forward_stock_cast(self, hidden_states: Tensor) -> Tensor:
    """HF's stock RMSNorm (5.19) with the weight taken at the compute dtype (not aligned)."""
    input_dtype = hidden_states.dtype
    x32 = hidden_states.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight.to(self._rpa_compute_dtype) * x32.to(input_dtype)


def _mlp_forward(self, x: Tensor) -> Tensor:
    return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


ROPE_TABLE_BUFFER = "rpa_cos_sin_bits"
"""Non-persistent buffer of the rotary module: the shared FP32 table stored as int32 bits,
so it moves with ``model.to(device)`` while ``model.to(dtype)`` (which casts floating
buffers) cannot round it."""


def _rotary_forward(self, x: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor]:
    table = getattr(self, ROPE_TABLE_BUFFER).view(torch.float32)
    if position_ids.numel():
        # device-side check: no host sync, traceable by torch.compile / torch.export
        torch._assert_async(position_ids.max() < table.shape[0],
                            f"a RoPE position is past max_position_embeddings={table.shape[0]}")
    return numerics.rope_lookup(table, position_ids)


def _linear_forward_cast(self, x: Tensor) -> Tensor:
    dtype = self._rpa_compute_dtype
    bias = None if self.bias is None else self.bias.to(dtype)
    return F.linear(x.to(dtype), self.weight.to(dtype), bias)


def _lm_head_forward_cast(self, x: Tensor) -> Tensor:
    """The LM head at the compute dtype; logits returned in the parameter dtype (upcasting a
    BF16 value to FP32 is exact), as a stock model of that dtype returns them."""
    return _linear_forward_cast(self, x).to(self.weight.dtype)


def _lm_head_forward_fp32(self, x: Tensor) -> Tensor:
    """LM head in FP32 (ScaleRL; vLLM ``head_dtype=float32`` on CPU does the same casts; on CUDA vLLM
    runs ``torch.mm(bf16, bf16, out_dtype=float32)`` instead: the same exact products of the same
    BF16 values, summed by another kernel in another order, so the logits differ by FP32 rounding).

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


FP32_ATTENTION = "rpa_fp32_sdpa"
"""The name :func:`fp32_attention` is registered under in transformers' ``AttentionInterface``."""


def fp32_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                   **kwargs):
    """HF's sdpa attention on the compute-dtype q, k, v upcast to FP32, its output rounded once --
    the numerics of vLLM's CPU attention kernel (``trainer_attention: fp32``); outside autocast, which
    would cast sdpa's inputs back down."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()  # an additive mask at the compute dtype's minimum
    with torch.autocast(device_type=query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(query.dtype), weights  # the one rounding: FP32 attention -> compute dtype


def _register_fp32_attention() -> None:
    """Make :func:`fp32_attention` known to transformers (once, on first use: no import-time
    registration), with sdpa's mask builder: an implementation without one gets *no* mask at all
    (``masking_utils`` exits early), and a left-padded batch would attend to its padding."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(FP32_ATTENTION, fp32_attention)
    AttentionMaskInterface.register(FP32_ATTENTION, sdpa_mask)


def _positions_pre_hook(module: nn.Module, args: tuple, kwargs: dict):
    """Inner-model pre-hook: without ``position_ids``, take them from a 2-D attention mask."""
    if args:  # positional call: bind to the stock signature
        bound = inspect.signature(type(module).forward).bind(module, *args, **kwargs)
        args, kwargs = (), {k: v for k, v in bound.arguments.items() if k not in ("self", "kwargs")}
        kwargs.update(bound.arguments.get("kwargs", {}))
    mask = kwargs.get("attention_mask")
    if kwargs.get("position_ids") is not None or not isinstance(mask, Tensor) or mask.dim() != 2:
        return args, kwargs
    ids = kwargs.get("input_ids")
    seq_len = (ids if ids is not None else kwargs["inputs_embeds"]).shape[1]
    kwargs["position_ids"] = positions_from_mask(mask)[:, -seq_len:]
    return args, kwargs


def _model_pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Top-level pre-hook: refuse a dtype change and align modules added after aligning."""
    module._rpa_alignment.refresh()


@dataclass
class TrainerAlignment:
    """Installed patch on one model; :meth:`remove` (or leaving the ``with``) undoes it.

    It lives on the model (``model._rpa_alignment``) and holds only the model, its modules
    and settings: a deep copy or a pickle of the model carries its own, working alignment.
    """

    model: nn.Module
    regions: frozenset[str]
    compute_dtype: torch.dtype | None
    lm_head_fp32: bool = False
    positions_from_mask: bool = False
    stock_attention: str | None = None
    """The model's attention implementation before ``attention_fp32`` replaced it (None: not replaced)."""
    patched: list[nn.Module] = field(default_factory=list)
    hooks: list[Any] = field(default_factory=list)
    active: bool = True

    def describe(self) -> dict[str, Any]:
        param_dtype = next(self.model.parameters()).dtype
        return {
            "regions": format_regions(self.regions),
            "compute_dtype": None if self.compute_dtype is None else str(self.compute_dtype).removeprefix("torch."),
            "param_dtype": str(param_dtype).removeprefix("torch."),
            "cast_fp32_master_params": self.compute_dtype is not None and param_dtype != self.compute_dtype,
            "lm_head_fp32": self.lm_head_fp32,
            "positions": "mask" if self.positions_from_mask else "stock",
            "attention": "fp32" if self.stock_attention is not None else "stock",
            "kernels": ops.kernel_backend(next(self.model.parameters()).device),
            "patched_modules": len(self.patched),
            "active": self.active,
        }

    # ------------------------------------------------------------------ patching

    def patch(self, module: nn.Module, fn: Callable, **attrs: Any) -> None:
        module.__dict__.update(attrs, _rpa_patched=True)
        module.forward = PatchedForward(module, fn)
        self.patched.append(module)

    def _head_forward(self) -> Callable | None:
        if self.lm_head_fp32:
            return _lm_head_forward_fp32
        return _lm_head_forward_cast if self.compute_dtype is not None else None

    def refresh(self) -> None:
        """Called before every forward: modules that replaced the embeddings or the LM head
        after aligning (``resize_token_embeddings``, a new head) get the same patch, and a
        change of the parameter dtype that the compute mode cannot follow is refused."""
        embeddings, head = self.model.get_input_embeddings(), self.model.get_output_embeddings()
        if self.compute_dtype is not None:
            dtype = embeddings.weight.dtype
            if dtype not in (torch.float32, self.compute_dtype):
                raise UnsupportedModelError(
                    f"the model's parameters are now {dtype}, but it was aligned for {self.compute_dtype} compute "
                    f"(from {self.compute_dtype} or FP32 master parameters); remove() the alignment before changing "
                    f"the dtype and align again")
            if not getattr(embeddings, "_rpa_patched", False):
                self.patch(embeddings, _embedding_forward_cast, _rpa_compute_dtype=self.compute_dtype)
        forward = self._head_forward()
        if head is not None and forward is not None and not getattr(head, "_rpa_patched", False):
            self.patch(head, forward, _rpa_compute_dtype=self.compute_dtype)

    def remove(self) -> None:
        if not self.active:
            return
        for module in self.patched:
            for attr in ("forward", "_rpa_compute_dtype", "_rpa_patched"):
                module.__dict__.pop(attr, None)
            module._buffers.pop(ROPE_TABLE_BUFFER, None)
            module._non_persistent_buffers_set.discard(ROPE_TABLE_BUFFER)
        for hook in self.hooks:
            hook.remove()
        if self.stock_attention is not None:
            self.model.set_attn_implementation(self.stock_attention)
            self.stock_attention = None
        self.patched.clear()
        self.hooks.clear()
        self.model.__dict__.pop("_rpa_alignment", None)
        self.active = False

    def __enter__(self) -> "TrainerAlignment":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def supported_families() -> str:
    """``qwen2 (Qwen2ForCausalLM), ...``: the families :func:`check_config` accepts, for messages."""
    return ", ".join(f"{t} ({a.prefix}ForCausalLM)" for t, a in ARCHITECTURES.items())


def architecture(config) -> Architecture:
    """The :class:`Architecture` of a HF config, or :class:`UnsupportedModelError`."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise UnsupportedModelError(f"rpa aligns {'/'.join(a.prefix for a in ARCHITECTURES.values())} causal LMs "
                                    f"only; got model_type={model_type!r}. Supported: {supported_families()}")
    return ARCHITECTURES[model_type]


def check_config(config) -> None:
    """Refuse (:class:`UnsupportedModelError`) a HF config the aligned regions do not cover:
    checked from ``config.json`` alone, before any weights load."""
    arch = architecture(config)
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported by the aligned RoPE; "
                                    f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(f"partial_rotary_factor {rope['partial_rotary_factor']} is not supported: "
                                    f"the aligned RoPE rotates the whole head, as Qwen2/Qwen3/Llama do")
    if config.hidden_act != "silu":
        raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not SwiGLU (silu)")
    if arch.model_type == "llama" and getattr(config, "pretraining_tp", 1) != 1:
        raise UnsupportedModelError(f"pretraining_tp {config.pretraining_tp}: HF's Llama then splits every "
                                    f"projection into slices (another GEMM than vLLM's); only 1 is supported")


def check_supported(model: nn.Module) -> Architecture:
    """Return the model's :class:`Architecture`, or raise :class:`UnsupportedModelError`."""
    arch = architecture(getattr(model, "config", None))
    check_config(model.config)
    decoder_of(model, arch)  # raises for a model without exactly one decoder
    return arch


def decoder_of(model: nn.Module, arch: Architecture) -> nn.Module:
    """The model's decoder (``Qwen2Model``, ``LlamaModel``, ...): the model itself (the base class)
    or its one decoder child (``.model`` of the causal LM and classification heads,
    ``.transformer`` of QA)."""
    base = arch.cls("Model")
    if isinstance(model, base):
        return model
    found = [m for m in model.children() if isinstance(m, base)]
    if len(found) != 1:
        raise UnsupportedModelError(f"expected a {base.__name__} or a model with one {base.__name__} inside; "
                                    f"got {type(model).__name__}")
    return found[0]


def rope_table(config) -> Tensor:
    """The shared FP32 cos/sin table of a supported HF config (built on the CPU, see
    :func:`rpa.core.numerics.rope_table`); the vLLM plugin builds the same from its layer args."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return numerics.rope_table(config.rope_parameters["rope_theta"], head_dim, config.max_position_embeddings)


def align_model(model: nn.Module, numerics: NumericsConfig) -> TrainerAlignment:
    """Align ``model`` (a HF Qwen2/Qwen3/Llama model, :data:`ARCHITECTURES`) as the trainer side of
    ``numerics`` (a :class:`~rpa.core.numerics_config.NumericsConfig`, BF16 or FP32 masters); see the
    module doc. From the configuration: its trainer-side regions; the compute dtype (the trainer's,
    ``trainer_torch_dtype``: FP32 with ``trainer_precision: fp32``; none in autocast mode);
    ``lm_head_fp32`` (the LM head in FP32 on FP32 copies of its compute-dtype weights, outside
    autocast: the FP32-LM-head comparison point, not part of the regions); RoPE positions
    (``trainer_positions``: from the attention mask when none are passed, so left padding does not
    shift them; ``auto``: when ``rope`` is aligned); ``trainer_attention: fp32`` (attention through
    :func:`fp32_attention`: FP32 intermediates, one rounding).
    """
    numerics = require_numerics(numerics, "align_model")
    autocast = numerics.trainer_mode == "autocast"
    return _align(model, numerics.trainer_regions, None if autocast else numerics.trainer_torch_dtype(),
                  numerics.lm_head_fp32, numerics.positions_from_mask, numerics.trainer_attention == "fp32")


def _align(model: nn.Module, regions: frozenset[str], compute_dtype: torch.dtype | None, lm_head_fp32: bool,
           positions_from_mask: bool, attention_fp32: bool) -> TrainerAlignment:
    """:func:`align_model` on the settings its configuration resolved to."""
    arch = check_supported(model)
    if getattr(model, "_rpa_alignment", None) is not None:
        raise RuntimeError("model is already aligned; remove() the existing alignment first")
    param_dtypes = {p.dtype for p in model.parameters()}
    if compute_dtype is not None and not param_dtypes <= {torch.float32, compute_dtype}:
        raise UnsupportedModelError(f"parameters are {sorted(map(str, param_dtypes))}; {compute_dtype} compute needs "
                                    f"{compute_dtype} or FP32 master parameters")
    handle = TrainerAlignment(model, regions, compute_dtype, lm_head_fp32, positions_from_mask)
    norm_cls, mlp_cls = arch.cls("RMSNorm"), arch.cls("MLP")
    cast = compute_dtype is not None  # a no-op for parameters already at the compute dtype
    head = model.get_output_embeddings()  # None for the base model and the classification / QA heads
    if lm_head_fp32 and head is None:
        raise UnsupportedModelError(f"lm_head_fp32: {type(model).__name__} has no LM head")
    decoder = decoder_of(model, arch)

    try:
        for module in model.modules():
            if module is head:
                continue  # refresh() patches the head (and follows a replaced one)
            if isinstance(module, norm_cls):
                if "rmsnorm" in regions:
                    handle.patch(module, _rms_norm_forward)
                elif cast:
                    handle.patch(module, _rms_norm_forward_stock_cast, _rpa_compute_dtype=compute_dtype)
            elif isinstance(module, mlp_cls) and "swiglu" in regions:
                handle.patch(module, _mlp_forward)
            elif cast and type(module) is nn.Linear:
                handle.patch(module, _linear_forward_cast, _rpa_compute_dtype=compute_dtype)
            elif cast and type(module) is nn.Embedding:
                handle.patch(module, _embedding_forward_cast, _rpa_compute_dtype=compute_dtype)
        if "rope" in regions:
            rotary = decoder.rotary_emb
            table = rope_table(model.config).to(rotary.inv_freq.device)
            rotary.register_buffer(ROPE_TABLE_BUFFER, table.view(torch.int32), persistent=False)
            handle.patch(rotary, _rotary_forward)
            _install_rope_dispatch()
        if positions_from_mask:
            handle.hooks.append(decoder.register_forward_pre_hook(_positions_pre_hook, with_kwargs=True))
        if attention_fp32:
            _register_fp32_attention()
            stock = model.config._attn_implementation or "sdpa"
            model.set_attn_implementation(FP32_ATTENTION)
            handle.stock_attention = stock
        model.__dict__["_rpa_alignment"] = handle
        handle.refresh()
        handle.hooks.append(model.register_forward_pre_hook(_model_pre_hook, with_kwargs=True))
    except BaseException:
        handle.remove()
        raise
    return handle


def load_trainer_model(config, model: str, **kwargs) -> tuple[nn.Module, TrainerAlignment]:
    """The HF model for ``config`` on its trainer device, at the trainer's dtype (FP32 masters in
    autocast mode), aligned (:func:`align_model`), in eval mode. Returns ``(model, alignment)``; run
    forwards inside :func:`trainer_context`."""
    from transformers import AutoModelForCausalLM

    autocast = config.trainer_mode == "autocast"
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32 if autocast else config.trainer_torch_dtype(),
                                              **kwargs).to(config.trainer_device())
    hf.eval()
    return hf, align_model(hf, config)


def trainer_context(config):
    """``torch.autocast`` at the trainer's precision in autocast mode, else a null context."""
    if config.trainer_mode != "autocast":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(config.trainer_device()).type, dtype=config.trainer_torch_dtype())

