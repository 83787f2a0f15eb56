"""Where the mismatch the regions leave lives: the sampler's own kernels swapped into the trainer.

The method aligns three regions and leaves GEMMs, attention and the LM head alone. What share
of the remaining gap each of those carries is measured here at the level the study cares
about, the log-probability of the sampled tokens: the trainer scores the same sequences again
and again, each time with some of its GEMMs computed **by vLLM's own layer objects** (the very
modules, prepacked weights and kernels the engine ran), and the gap to vLLM's logprobs is
measured for each such *rung* (:data:`RUNGS`). What no rung removes is what the trainer computes
differently from vLLM outside the swapped ops: with the regions aligned (``all``, checked
bitwise by ``rpa parity``), attention and whatever else the op-by-op replay below finds different.

This is a diagnosis, not a method arm: a trainer cannot train through vLLM's inference
kernels (no backward). It says which kernel would have to change to close the gap, and how much
each would close.

The engine runs in this process (vLLM's in-process engine core), eager, one request per
sequence, so its GEMMs see the sequence's own ``tokens x hidden`` input, as the trainer's batch-1
forward does (GEMM results can depend on the number of rows). The swap reaches into vLLM's model
(``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, ``logits_processor`` + ``lm_head`` of
its Qwen2/Qwen3/Llama modules), as :mod:`rpa.measure.diagnose`'s hooks do.

Op by op (:func:`local_divergence`): for the first ``local_sequences`` sequences every op of
vLLM's prefill -- each norm with its residual add, the q/k/v, o, gate/up and down GEMMs, RoPE,
attention, SwiGLU, the LM head -- is fed to the trainer's own op with vLLM's very inputs, and the
two outputs compared. An op that is bitwise equal there computes the same function on both sides;
the ones that differ are where the gap starts, whatever amplifies it downstream.

Output (``out_dir``): ``tokens.csv`` (one row per completion token: the sampler's logprob and
each rung's, ``logp_<rung>``), ``ops.csv`` (columns :data:`LOCAL_COLUMNS`) and ``summary.json``
(schema :data:`SCHEMA`: per rung the mismatch metrics of :func:`rpa.measure.metrics.mismatch_metrics`,
per op the replay's summary); the change of each rung vs ``trainer`` with its paired interval is
:mod:`analysis.attribution`'s table.
"""

from __future__ import annotations

import csv
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rpa.core.errors import InputError
from rpa.core.fieldtypes import seed_problem
from rpa.core.jsonfiles import atomic_path, write_json
from rpa.core.numerics_config import NumericsConfig
from rpa.core.runlog import log

SCHEMA = "rpa.attribution/1"
RUNGS: dict[str, tuple[str, ...]] = {
    "trainer": (),
    "vllm-qkv": ("qkv",),
    "vllm-o": ("o",),
    "vllm-gate_up": ("gate_up",),
    "vllm-down": ("down",),
    "vllm-gemms": ("qkv", "o", "gate_up", "down"),
    "vllm-gemms+lm_head": ("qkv", "o", "gate_up", "down", "lm_head"),
}
"""Rung name -> the ops swapped in; ``trainer`` (nothing swapped) is the reference every change is
measured against."""


@dataclass(frozen=True)
class AttributionOptions:
    """``rpa attribute``'s options (its flags are generated from these fields)."""

    sequences: int = field(default=16, metadata={"help": "sequences of --completions scored (the first N)"})
    local_sequences: int = field(default=4, metadata={
        "help": "of those, the first N whose every op is replayed through the trainer on vLLM's inputs (ops.csv)"})
    seed: int = field(default=0, metadata={"help": "vLLM's seed (scoring is deterministic; recorded)"})

    def __post_init__(self) -> None:
        for name in ("sequences", "local_sequences"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if seed_problem(self.seed):
            raise InputError(f"--seed {seed_problem(self.seed)}")


def _log(msg: str) -> None:
    log("attribute", msg)


# ----------------------------------------------------------------------------- the swap


def _worker_model(worker):
    return worker.model_runner.get_model()


def vllm_model(llm):
    """The engine's model object; only an in-process engine (``multiprocess=False``) shares it."""
    model = llm.collective_rpc(_worker_model)[0]
    import torch

    if not isinstance(model, torch.nn.Module):
        raise RuntimeError("the vLLM engine runs in another process; the attribution needs the in-process engine")
    return model


def _flat(fn: Callable, x):
    """Call a vLLM layer (2-D ``tokens x features``) on HF's ``[batch, tokens, features]``."""
    out = fn(x.reshape(-1, x.shape[-1]))
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(*x.shape[:-1], out.shape[-1])


def _slice_forward(fn: Callable, lo: int, hi: int) -> Callable:
    """A forward returning columns ``lo:hi`` of the merged vLLM GEMM ``fn`` (q/k/v of qkv, gate/up)."""
    def forward(x):
        return _flat(fn, x)[..., lo:hi]

    return forward


def swap_forwards(hf_model, vllm, swaps: tuple[str, ...]) -> dict[Any, Callable]:
    """Instance forwards for the HF modules whose op ``swaps`` names, each computed by the vLLM
    layer that runs that op: ``{hf_module: forward}`` (not installed: :func:`installed`)."""
    new: dict[Any, Callable] = {}
    for hf_layer, v_layer in zip(hf_model.model.layers, vllm.model.layers):
        attn, v_attn, mlp, v_mlp = hf_layer.self_attn, v_layer.self_attn, hf_layer.mlp, v_layer.mlp
        if "qkv" in swaps:
            q, kv = v_attn.q_size, v_attn.kv_size
            for module, lo, hi in ((attn.q_proj, 0, q), (attn.k_proj, q, q + kv), (attn.v_proj, q + kv, q + 2 * kv)):
                new[module] = _slice_forward(v_attn.qkv_proj, lo, hi)
        if "o" in swaps:
            new[attn.o_proj] = lambda x, f=v_attn.o_proj: _flat(f, x)
        if "gate_up" in swaps:
            width = mlp.gate_proj.out_features
            new[mlp.gate_proj] = _slice_forward(v_mlp.gate_up_proj, 0, width)
            new[mlp.up_proj] = _slice_forward(v_mlp.gate_up_proj, width, 2 * width)
        if "down" in swaps:
            new[mlp.down_proj] = lambda x, f=v_mlp.down_proj: _flat(f, x)
    if "lm_head" in swaps:
        head = hf_model.get_output_embeddings()
        new[head] = lambda x: _flat(lambda h: vllm.logits_processor(vllm.lm_head, h), x).to(head.weight.dtype)
    return new


class installed:
    """Context: the forwards of :func:`swap_forwards` installed on their modules, the modules'
    own (an alignment's patched forward, or none) put back on exit."""

    def __init__(self, forwards: dict[Any, Callable]) -> None:
        self.forwards, self.saved = forwards, {}

    def __enter__(self) -> "installed":
        for module, forward in self.forwards.items():
            self.saved[module] = module.__dict__.get("forward")
            module.forward = forward
        return self

    def __exit__(self, *exc) -> None:
        for module, own in self.saved.items():
            if own is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = own


# --------------------------------------------------------------- op by op, on the sampler's inputs

LOCAL_OPS = ("input_add", "input_norm", "qkv", "rope", "attention", "o", "post_add", "post_norm", "gate_up", "swiglu",
             "down", "final_add", "final_norm", "lm_head")
"""The ops :func:`local_divergence` compares, in forward order: each is fed the very inputs vLLM's
op received and its output compared with vLLM's (the norms' rows also cover the residual add)."""
LOCAL_COLUMNS = ("layer", "op", "elements", "frac_bitwise_equal", "max_abs_diff", "mean_abs_diff", "rel_mean_abs_diff")


def _capture_specs(vllm) -> list[tuple[Any, tuple[int, str]]]:
    """(vLLM module, (layer, op)) for every op of :data:`LOCAL_OPS`; the final norm and the LM
    head get layer ``num_layers``."""
    specs = []
    for i, layer in enumerate(vllm.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        specs += [(layer.input_layernorm, (i, "input_norm")), (attn.qkv_proj, (i, "qkv")),
                  (attn.rotary_emb, (i, "rope")), (attn.attn, (i, "attention")), (attn.o_proj, (i, "o")),
                  (layer.post_attention_layernorm, (i, "post_norm")), (mlp.gate_up_proj, (i, "gate_up")),
                  (mlp.act_fn, (i, "swiglu")), (mlp.down_proj, (i, "down"))]
    last = len(vllm.model.layers)
    return specs + [(vllm.model.norm, (last, "final_norm")), (vllm.logits_processor, (last, "lm_head"))]


def _cpu(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_cpu(v) for v in value)
    return value


def capture_vllm_ops(llm, vllm, ids: list[int]) -> dict[tuple[int, str], tuple[tuple, Any]]:
    """Every op's (inputs, output) of vLLM's prefill of ``ids`` (one request; the decode step that
    follows is left out by its row count)."""
    from vllm import SamplingParams

    store: dict[tuple[int, str], tuple[tuple, Any]] = {}
    pending: dict[tuple[int, str], tuple] = {}
    rows = len(ids)

    def rows_of(args) -> int | None:
        first = next((a for a in args if hasattr(a, "shape") and a.dim() >= 1), None)
        return None if first is None else first.shape[0]

    def before(key):
        def take(module, args):  # inputs copied before the call: vLLM's stock CPU kernels work in place
            pending[key] = _cpu(args)
        return take

    def after(key):
        def record(module, args, output):
            n = rows_of(pending[key])
            # the prefill's call: every row; the LM head's prompt-logprob call may leave the last out
            wanted = (rows - 1, rows) if key[1] == "lm_head" else (rows,)
            if n in wanted and (key not in store or n > rows_of(store[key][0])):
                store[key] = (pending[key], _cpu(output))
        return record

    handles = []
    for module, key in _capture_specs(vllm):
        handles += [module.register_forward_pre_hook(before(key)), module.register_forward_hook(after(key))]
    try:
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0),
                     use_tqdm=False)
    finally:
        for handle in handles:
            handle.remove()
    return store


class _Tally:
    """Running difference statistics of one (layer, op) over sequences."""

    def __init__(self) -> None:
        self.elements = self.equal = 0
        self.abs_sum = self.ref_sum = self.max = 0.0

    def add(self, got, want) -> None:
        if got.shape != want.shape:
            raise ValueError(f"shape mismatch {tuple(got.shape)} vs {tuple(want.shape)}")
        diff = (got.double() - want.double()).abs()
        self.elements += got.numel()
        self.equal += int((got == want).sum()) if got.dtype == want.dtype else int((diff == 0).sum())
        self.abs_sum += float(diff.sum())
        self.ref_sum += float(want.double().abs().sum())
        self.max = max(self.max, float(diff.max())) if got.numel() else self.max

    def row(self) -> dict[str, Any]:
        return {"elements": self.elements, "frac_bitwise_equal": self.equal / self.elements if self.elements else None,
                "max_abs_diff": self.max, "mean_abs_diff": self.abs_sum / self.elements if self.elements else None,
                "rel_mean_abs_diff": self.abs_sum / self.ref_sum if self.ref_sum else None}


def replay_op(hf_model, arch, op: str, layer: int, args: tuple, output, numerics: NumericsConfig):
    """The trainer's result of ``op`` on vLLM's inputs ``args``, and vLLM's own (as comparable tensors);
    ``numerics``: the configuration the trainer was aligned to (its trainer-side regions)."""
    import torch

    decoder = hf_model.model
    if op in ("input_norm", "post_norm", "final_norm"):
        norm = decoder.norm if op == "final_norm" else getattr(
            decoder.layers[layer], "input_layernorm" if op == "input_norm" else "post_attention_layernorm")
        x = args[0]
        if len(args) > 1 and args[1] is not None:  # the fused residual add: HF adds in the compute dtype
            total = args[1] + x
            return (norm(total), total), (output[0], output[1])
        return norm(x), output[0] if isinstance(output, tuple) else output
    attn, mlp = decoder.layers[min(layer, len(decoder.layers) - 1)].self_attn, \
        decoder.layers[min(layer, len(decoder.layers) - 1)].mlp
    if op == "qkv":
        x = args[0]
        return torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1), output[0]
    if op in ("o", "down"):
        return (attn.o_proj if op == "o" else mlp.down_proj)(args[0]), output[0]
    if op == "gate_up":
        return torch.cat([mlp.gate_proj(args[0]), mlp.up_proj(args[0])], -1), output[0]
    if op == "swiglu":
        gate, up = args[0].chunk(2, dim=-1)
        if "swiglu" in numerics.trainer_regions:
            from rpa.core import ops

            return ops.swiglu(gate.contiguous(), up.contiguous()), output
        return mlp.act_fn(gate) * up, output
    head_dim = attn.head_dim
    if op == "rope":
        positions, q, k = args[0], args[1], args[2]
        heads = lambda t: t.reshape(t.shape[0], -1, head_dim).transpose(0, 1).unsqueeze(0)  # noqa: E731
        cos, sin = decoder.rotary_emb(heads(q), positions.reshape(1, -1))
        q2, k2 = arch.modeling().apply_rotary_pos_emb(heads(q), heads(k), cos, sin)
        flat = lambda t: t[0].transpose(0, 1).reshape(t.shape[2], -1)  # noqa: E731
        return (flat(q2), flat(k2)), (output[0], output[1])
    if op == "attention":  # the trainer's attention function (stock sdpa, or fp32_attention), causal, no padding
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        q, k, v = args[0], args[1], args[2]
        heads = lambda t: t.reshape(t.shape[0], -1, head_dim).transpose(0, 1).unsqueeze(0)  # noqa: E731
        impl = hf_model.config._attn_implementation
        if impl not in ALL_ATTENTION_FUNCTIONS:  # HF's eager attention needs a mask built for it
            raise ValueError(f"attention replay runs the trainer's {impl!r} attention only through transformers' "
                             f"attention interface (sdpa, or rpa's FP32 sdpa)")
        fn = ALL_ATTENTION_FUNCTIONS[impl]
        out, _ = fn(attn, heads(q), heads(k), heads(v), None, scaling=attn.scaling, dropout=0.0)
        return out.reshape(q.shape[0], -1), output
    if op == "lm_head":
        head = hf_model.get_output_embeddings()
        return head(args[1]).to(output.dtype), output
    raise ValueError(f"unknown op {op!r}")


def local_divergence(llm, vllm, hf_model, arch, sequences: list[list[int]], numerics: NumericsConfig) -> list[dict]:
    """:data:`LOCAL_COLUMNS` rows: per layer and op, the trainer's op fed vLLM's inputs vs vLLM's
    output, over ``sequences`` (each captured from its own vLLM prefill)."""
    import torch

    tallies: dict[tuple[int, str], _Tally] = {}
    with torch.no_grad():
        for ids in sequences:
            for (layer, op), (args, output) in capture_vllm_ops(llm, vllm, ids).items():
                got, want = replay_op(hf_model, arch, op, layer, args, output, numerics)
                pairs = list(zip(got, want)) if isinstance(got, tuple) else [(got, want)]
                for part, (g, w) in enumerate(pairs):
                    name = op if part == 0 else op.replace("_norm", "_add")  # a norm's second output: the residual
                    tallies.setdefault((layer, name), _Tally()).add(g, w)
    order = {op: i for i, op in enumerate(LOCAL_OPS)}
    keys = sorted(tallies, key=lambda k: (k[0], order[k[1]]))
    return [{"layer": layer, "op": op, **tallies[(layer, op)].row()} for layer, op in keys]


def summarise_ops(rows: list[dict]) -> dict[str, dict[str, Any]]:
    """Per op over every layer: bitwise share, relative mean |diff|, and the layers where it differs."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        s = out.setdefault(r["op"], {"elements": 0, "equal": 0.0, "abs": 0.0, "ref": 0.0, "layers_differing": 0,
                                     "layers": 0, "max_abs_diff": 0.0})
        s["elements"] += r["elements"]
        s["equal"] += r["frac_bitwise_equal"] * r["elements"]
        s["abs"] += r["mean_abs_diff"] * r["elements"]
        s["ref"] += (r["mean_abs_diff"] * r["elements"] / r["rel_mean_abs_diff"]) if r["rel_mean_abs_diff"] else 0.0
        s["layers"] += 1
        s["layers_differing"] += int(r["frac_bitwise_equal"] < 1.0)
        s["max_abs_diff"] = max(s["max_abs_diff"], r["max_abs_diff"])
    return {op: {"elements": s["elements"], "frac_bitwise_equal": s["equal"] / s["elements"],
                 "rel_mean_abs_diff": s["abs"] / s["ref"] if s["ref"] else 0.0, "max_abs_diff": s["max_abs_diff"],
                 "layers_differing": s["layers_differing"], "layers": s["layers"]} for op, s in out.items()}


# ----------------------------------------------------------------------------- the driver


def recorded_options(model: str, numerics: NumericsConfig, completions: str, options: AttributionOptions) -> dict:
    """What an attribution directory records (``options.json``): a rerun with others is refused."""
    from dataclasses import asdict

    return {"model": str(model), "numerics": numerics.to_dict(), "completions": str(completions), **asdict(options)}


def run_attribution(model: str, numerics: NumericsConfig, out_dir: str | Path, completions_path: str | Path,
                    options: AttributionOptions = AttributionOptions(), replace: bool = False) -> dict[str, Any]:
    """Score the first ``options.sequences`` completions with vLLM (one request each) and with the
    trainer at every rung of :data:`RUNGS`; write ``tokens.csv`` and ``summary.json`` (``replace``:
    :func:`rpa.core.outdir.claim`)."""
    import numpy as np
    import torch

    from rpa.core.outdir import claim
    from rpa.core.provenance import provenance
    from rpa.measure.metrics import mismatch_metrics
    from rpa.measure.scoring import load_completions, sampler_logprobs, trainer_logprobs
    from transformers import AutoConfig

    from rpa.sides.engine import close_llm, engine_context, make_llm, release_memory
    from rpa.sides.trainer import load_trainer_model, trainer_context

    out, done = claim(out_dir, "attribute", recorded_options(model, numerics, completions_path, options),
                      replace=replace)
    if done is not None:
        _log(f"{out}: finished with these options already; nothing to do (delete it to run again)")
        return done
    t0 = time.time()
    started = provenance(model)
    completions = load_completions(completions_path)[: options.sequences]
    _log(f"{model}: {numerics.to_dict()}, {len(completions)} sequences, rungs {', '.join(RUNGS)}")
    llm = make_llm(model, numerics, enforce_eager=True, multiprocess=False, seed=options.seed,
                   enable_prefix_caching=False, max_model_len=engine_context(AutoConfig.from_pretrained(model)))
    mu = [sampler_logprobs(llm, [c], None)[0][0] for c in completions]  # one request per sequence
    vllm = vllm_model(llm)
    hf, alignment = load_trainer_model(numerics, model)
    rungs: dict[str, list[list[float]]] = {}
    with trainer_context(numerics), torch.no_grad():
        for rung, swaps in RUNGS.items():
            with installed(swap_forwards(hf, vllm, swaps)):
                rungs[rung] = [trainer_logprobs(hf, c["prompt_ids"], c["completion_ids"]) for c in completions]
            _log(f"rung {rung}: mean |dlogp| "
                 f"{np.mean(np.abs(np.concatenate(rungs[rung]) - np.concatenate(mu))):.4g}")
        from rpa.sides.trainer import check_supported

        local = local_divergence(llm, vllm, hf, check_supported(hf), [c["prompt_ids"] + c["completion_ids"]
                                                                      for c in completions[: options.local_sequences]],
                                 numerics)
    trainer_record = alignment.describe()
    alignment.remove()
    close_llm(llm)
    del llm, vllm
    release_memory()

    rows, seqs = [], []
    for i, c in enumerate(completions):
        for j, tok in enumerate(c["completion_ids"]):
            rows.append({"seq": c["seq"], "position": j, "token_id": tok, "logp_sampler": mu[i][j],
                         **{f"logp_{rung}": rungs[rung][i][j] for rung in RUNGS}})
            seqs.append(c["seq"])
    flat_mu = [r["logp_sampler"] for r in rows]
    summary: dict[str, Any] = {"schema": SCHEMA, "tokens": len(rows), "sequences": len(completions), "rungs": {}}
    for rung, swaps in RUNGS.items():
        metrics = mismatch_metrics([r[f"logp_{rung}"] for r in rows], flat_mu, seqs)
        summary["rungs"][rung] = {"swapped": list(swaps), **{k: metrics[k] for k in (
            "mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp", "frac_bitwise_equal", "kl_k3")}}
    summary["local_ops"] = summarise_ops(local)
    summary["local_sequences"] = min(options.local_sequences, len(completions))
    summary["config"] = {"model": str(model), "numerics": numerics.to_dict(), "completions": str(completions_path),
                         "options": recorded_options(model, numerics, completions_path, options),
                         "trainer": trainer_record, "mode": "eager"}
    summary["provenance"] = started
    summary["wall_s"] = round(time.time() - t0, 2)
    with atomic_path(out / "tokens.csv") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["seq", "position", "token_id", "logp_sampler",
                                               *(f"logp_{rung}" for rung in RUNGS)])
        writer.writeheader()
        writer.writerows(rows)
    with atomic_path(out / "ops.csv") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(LOCAL_COLUMNS))
        writer.writeheader()
        writer.writerows(local)
    write_json(out / "summary.json", summary)  # last: an attribution with a summary is whole
    _log(f"done in {summary['wall_s']} s -> {out}")
    return summary
