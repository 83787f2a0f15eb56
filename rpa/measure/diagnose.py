"""Per-layer divergence: where the sampler (vLLM) and the trainer (HF) start to differ.

The same token sequences go through both engines under one
:class:`~rpa.core.numerics_config.NumericsConfig`; forward hooks record the hidden state at
every region boundary of every decoder layer (:data:`BOUNDARIES`) and the final norm.
Boundaries are defined on the residual-stream form of HF; vLLM's fused form (the residual
add happens inside the next RMSNorm) is mapped onto it:

============ ======================================= =======================================
boundary     HF                                      vLLM
============ ======================================= =======================================
attn_in      ``input_layernorm`` output              ``input_layernorm`` output[0]
attn_out     ``self_attn`` output (after o_proj)     ``self_attn`` output
mid_stream   ``post_attention_layernorm`` input      ``post_attention_layernorm`` output[1]
mlp_in       ``post_attention_layernorm`` output     ``post_attention_layernorm`` output[0]
swiglu_out   ``mlp.down_proj`` input                 ``mlp.down_proj`` input
mlp_out      ``mlp.down_proj`` output                ``mlp.down_proj`` output[0]
layer_out    decoder layer output                    sum of the layer's two outputs
final_norm   ``model.norm`` output                   ``model.norm`` output[0]
============ ======================================= =======================================

RoPE's output lives inside attention (no module boundary on the HF side); its effect shows
in ``attn_out``. vLLM runs eager here (hooks do not fire inside a compiled graph) and
in-process. Each sequence is one request (one prefill, no batching across sequences).
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rpa.core.errors import InputError
from rpa.core.fieldtypes import seed_problem
from rpa.core.jsonfiles import atomic_path, write_json
from rpa.core.numerics_config import NumericsConfig
from rpa.core.runlog import log

SCHEMA = "rpa.diagnose/1"


@dataclass(frozen=True)
class DiagnoseOptions:
    """``rpa diagnose``'s options (its flags are generated from these fields)."""

    sequences: int = field(default=4, metadata={
        "help": "token sequences compared (from --completions, else the probe's default prompts)"})
    seed: int = field(default=0, metadata={"help": "seed of the default prompts and of vLLM"})

    def __post_init__(self) -> None:
        if self.sequences < 1:
            raise InputError(f"--sequences must be >= 1, got {self.sequences}")
        if seed_problem(self.seed):
            raise InputError(f"--seed {seed_problem(self.seed)}")

BOUNDARIES: tuple[str, ...] = ("attn_in", "attn_out", "mid_stream", "mlp_in", "swiglu_out", "mlp_out", "layer_out")
FINAL = "final_norm"
LAYER_COLUMNS = ("layer", "boundary", "step", "elements", "max_abs_diff", "mean_abs_diff", "rel_mean_abs_diff",
                 "frac_bitwise_equal")
"""``layers.csv`` columns; ``step`` orders boundaries along the forward pass, ``layer`` is
the decoder layer index (the final norm gets ``num_layers``)."""

_CAPTURE: dict[str, Any] = {"store": None, "handles": []}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _hook_specs(model, side: str) -> list[tuple[Any, str, Callable, tuple[int, str]]]:
    """(module, 'pre'|'post', extract(args_or_out) -> Tensor, key) for every boundary."""
    specs = []
    inner = model.model
    for i, layer in enumerate(inner.layers):
        post_norm = layer.post_attention_layernorm
        specs += [
            (layer.input_layernorm, "post", _first, (i, "attn_in")),
            (layer.self_attn, "post", _first, (i, "attn_out")),
            (layer.mlp.down_proj, "pre", lambda a: a[0], (i, "swiglu_out")),
            (layer.mlp.down_proj, "post", _first, (i, "mlp_out")),
            (post_norm, "post", _first, (i, "mlp_in")),
        ]
        if side == "hf":
            specs += [(post_norm, "pre", lambda a: a[0], (i, "mid_stream")),
                      (layer, "post", _first, (i, "layer_out"))]
        else:
            specs += [(post_norm, "post", lambda o: o[1], (i, "mid_stream")),
                      (layer, "post", lambda o: o[0] + o[1], (i, "layer_out"))]
    specs.append((inner.norm, "post", _first, (len(inner.layers), FINAL)))
    return specs


def install_hooks(model, side: str, store: dict) -> list:
    """Record each boundary's tensor (flattened to [tokens, hidden], on CPU) into ``store[key]``."""
    handles = []
    for module, kind, extract, key in _hook_specs(model, side):
        def record(value, key=key):
            store.setdefault(key, []).append(value.detach().reshape(-1, value.shape[-1]).cpu().clone())

        if kind == "pre":
            handles.append(module.register_forward_pre_hook(lambda m, a, ex=extract, r=record: r(ex(a))))
        else:
            handles.append(module.register_forward_hook(lambda m, a, o, ex=extract, r=record: r(ex(o))))
    return handles


def _worker_install(worker) -> int:
    _CAPTURE["store"] = {}
    _CAPTURE["handles"] = install_hooks(worker.model_runner.get_model(), "vllm", _CAPTURE["store"])
    return len(_CAPTURE["handles"])


def _worker_take(worker) -> dict:
    taken = dict(_CAPTURE["store"])
    _CAPTURE["store"].clear()  # the hooks hold this dict: empty it in place
    return taken


def _worker_remove(worker) -> None:
    for h in _CAPTURE["handles"]:
        h.remove()
    _CAPTURE["handles"] = []


def compare(a, b) -> dict[str, float]:
    """Difference statistics of two same-shape tensors (bitwise share in their own dtypes)."""
    import torch

    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {tuple(a.shape)} vs {tuple(b.shape)}")
    equal = (a == b) if a.dtype == b.dtype else (a.double() == b.double())
    diff = (a.double() - b.double()).abs()
    scale = b.double().abs().mean().item()
    return {"elements": a.numel(), "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
            "rel_mean_abs_diff": diff.mean().item() / scale if scale else float("nan"),
            "frac_bitwise_equal": equal.double().mean().item() if torch.is_tensor(equal) else float(equal)}


def recorded_options(model: str, numerics: NumericsConfig, sequences: list[list[int]], seed: int) -> dict[str, Any]:
    """What a diagnose output directory records (``options.json``): a rerun with others is refused."""
    import hashlib

    digest = hashlib.sha1(json.dumps(sequences).encode()).hexdigest()[:12]
    return {"model": str(model), "numerics": numerics.to_dict(), "seed": seed, "sequences": len(sequences),
            "sequences_sha1": digest}


def trainer_runs(hf, numerics: NumericsConfig, sequences: list[list[int]]) -> list[dict]:
    """The trainer's boundary tensors (:func:`install_hooks`) of each sequence, one forward each,
    the token ids on the model's device (cuda on a GPU machine)."""
    import torch

    from rpa.sides.trainer import trainer_context

    device = next(hf.parameters()).device
    runs = []
    with trainer_context(numerics), torch.no_grad():
        for ids in sequences:
            store: dict = {}
            handles = install_hooks(hf, "hf", store)
            try:
                hf(torch.tensor([ids], device=device))
            finally:
                for h in handles:
                    h.remove()
            runs.append({k: v[0] for k, v in store.items()})
    return runs


def run_diagnose(model: str, numerics: NumericsConfig, out_dir: str | Path, sequences: list[list[int]],
                 seed: int = 0, replace: bool = False) -> dict[str, Any]:
    """Per-layer divergence over ``sequences`` (token ids); writes ``options.json``, ``layers.csv`` + ``summary.json``
    (``replace``: :func:`rpa.core.outdir.claim`)."""
    import torch
    from vllm import SamplingParams

    from rpa.sides.engine import close_llm, make_llm, release_memory
    from rpa.core.outdir import claim
    from rpa.core.provenance import provenance

    out, done = claim(out_dir, "diagnose", recorded_options(model, numerics, sequences, seed), replace=replace)
    if done is not None:
        log("diagnose", f"{out}: finished with these options already; nothing to do (delete it to run again)")
        return done
    t0 = time.time()
    started = provenance(model)  # the code that ran is the code at the start
    log("diagnose", f"{model}: {numerics.to_dict()}, {len(sequences)} sequences")
    from transformers import AutoConfig

    from rpa.sides.engine import engine_context

    llm = make_llm(model, numerics, enforce_eager=True, seed=seed, enable_prefix_caching=False,
                   max_model_len=engine_context(AutoConfig.from_pretrained(model)))
    llm.collective_rpc(_worker_install)
    vllm_runs = []
    for ids in sequences:
        llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=1.0), use_tqdm=False)
        store = llm.collective_rpc(_worker_take)[0]
        # the prefill of this sequence is the call that saw all of its tokens
        vllm_runs.append({k: next((t for t in v if t.shape[0] == len(ids)), None) for k, v in store.items()})
    llm.collective_rpc(_worker_remove)
    close_llm(llm)  # the captures are CPU copies: give the engine's memory back before the trainer model loads
    del llm
    release_memory()

    from rpa.sides.trainer import load_trainer_model

    hf, alignment = load_trainer_model(numerics, model)
    hf_runs = trainer_runs(hf, numerics, sequences)
    trainer_record = alignment.describe()  # the trainer that ran, before the patch comes off
    alignment.remove()

    keys = sorted(hf_runs[0], key=lambda k: (k[0], BOUNDARIES.index(k[1]) if k[1] in BOUNDARIES else len(BOUNDARIES)))
    rows = []
    for step, key in enumerate(keys):
        missing = [i for i, run in enumerate(vllm_runs) if run.get(key) is None]
        if missing:
            raise RuntimeError(f"vLLM did not produce boundary {key} for sequences {missing} "
                               f"(chunked prefill split them? use shorter sequences)")
        a = torch.cat([run[key] for run in vllm_runs])
        b = torch.cat([run[key] for run in hf_runs])
        rows.append({"layer": key[0], "boundary": key[1], "step": step, **compare(a, b)})
    first = next((r for r in rows if r["frac_bitwise_equal"] < 1.0), None)
    summary = {
        "schema": SCHEMA,
        "first_divergence": None if first is None else {"layer": first["layer"], "boundary": first["boundary"]},
        "final_norm": next(r for r in rows if r["boundary"] == FINAL),
        "config": {"model": str(model), "numerics": numerics.to_dict(), "sequences": len(sequences),
                   "tokens": sum(map(len, sequences)), "trainer": trainer_record, "mode": "eager"},
        "provenance": started,
        "wall_s": round(time.time() - t0, 2),
    }
    with atomic_path(out / "layers.csv") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(LAYER_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    write_json(out / "summary.json", summary)  # atomic, and last: a diagnose with a summary is whole
    return summary


def sequences_from(completions_path: str | Path | None, model: str, count: int, seed: int) -> list[list[int]]:
    """``count`` token sequences: prompt + completion from a probe's ``completions.jsonl``,
    or the probe's default prompts tokenized; refused (:class:`InputError`) where there are fewer."""
    if completions_path is not None:
        from rpa.measure.scoring import load_completions

        records = load_completions(completions_path)
        if count > len(records):
            raise InputError(f"--sequences {count}: {completions_path} holds {len(records)} sequences")
        return [c["prompt_ids"] + c["completion_ids"] for c in records[:count]]
    from rpa.measure.prompts import DEFAULT_PROMPTS_DISTINCT, default_prompts

    if count > DEFAULT_PROMPTS_DISTINCT:
        raise InputError(f"--sequences {count}: the built-in prompts are {DEFAULT_PROMPTS_DISTINCT} distinct ones "
                         f"(more sequences: --completions)")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return [tokenizer.encode(p) for p in default_prompts(count, seed)]


def check_sequences(sequences: list[list[int]], config, source: str | Path | None) -> None:
    """Every sequence fits the context diagnose's engine runs with on a model of HF ``config``
    (:func:`rpa.sides.engine.engine_context`); ``source``: the completions file, or None (the
    built-in prompts)."""
    from rpa.measure.inputs import check_lengths
    from rpa.sides.engine import engine_context

    where = f"completions {source}" if source else "the built-in prompts"
    context = engine_context(config)
    limited = context < engine_context(None)  # the model's max_position_embeddings, not the default, bounds it
    check_lengths([(f"sequence {i}", len(ids)) for i, ids in enumerate(sequences)], context, where,
                  " (the model's max_position_embeddings)" if limited else "")


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'layer':>5} {'boundary':<11} {'max|d|':>10} {'mean|d|':>10} {'bitwise':>8}"]
    for r in rows:
        lines.append(f"{r['layer']:>5} {r['boundary']:<11} {r['max_abs_diff']:>10.3g} {r['mean_abs_diff']:>10.3g} "
                     f"{r['frac_bitwise_equal']:>8.3f}")
    return "\n".join(lines)


def read_layers(path: str | Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [{k: (int(v) if k in ("layer", "step", "elements") else v if k == "boundary" else float(v))
                 for k, v in row.items()} for row in csv.DictReader(f)]

