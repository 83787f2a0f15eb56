"""Trainer-side checks that need a GPU (torch + transformers + Triton; no vLLM), one JSON
file with a section per check, rewritten as each section ends. Prints, asserts nothing:
the CUDA tests (``pytest tests/test_kernels.py``) hold the pass/fail versions.

    python benchmarks/gpu_checks.py --out gpu_checks.json [--small]

Sections:
``kernels``      each Triton kernel, IEEE and plain-operator variants, vs the FP64 single
                 rounding and vs eager :mod:`rpa.core.numerics` on the same device, with timings;
``rope_table``   the RoPE table built on CPU vs on CUDA (the difference the shared table
                 avoids) and the trainer's table on a CUDA model vs the plugin's build;
``bf16_copy``    FP32-master (BF16 compute) vs BF16 copy logits on CUDA, left padding;
``compile``      ``torch.compile(fullgraph=True)`` of an aligned model vs eager, stock as control;
``scoring``      peak memory of :func:`rpa.measure.scoring.token_logps_and_entropy` (micro-batches +
                 chunked log-softmax) at a 7B shape vs the full-logits tensor.
``--small`` shrinks every shape (a CPU dry run of the script itself).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_regions import SHAPES, build_model  # noqa: E402
from rpa.core import numerics, ops  # noqa: E402
from tests import kernel_checks as kc  # noqa: E402


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _time_ms(fn) -> float:
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=50, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def check_kernels(small: bool) -> dict:
    from rpa.core.kernels import triton_regions as k

    dev = _device()
    shape = dict(rows=64, hidden=128, inter=256, heads=4, head_dim=32) if small else \
        dict(rows=4096, hidden=3584, inter=18944, heads=28, head_dim=128)
    t = kc.inputs(dev, **shape)
    ref64, eager = kc.references64(t), kc.forward_outputs(numerics, t)
    out = {"shape": shape, "ieee_default": k.IEEE}
    for ieee in ((True, False) if k.IEEE else (False,)):
        mod = type("Variant", (), {
            "swiglu": staticmethod(lambda g, u: k.swiglu(g, u, ieee=ieee)),
            "rms_norm": staticmethod(lambda x, w, e: k.rms_norm(x, w, e, ieee=ieee)),
            "add_rms_norm": staticmethod(lambda x, r, w, e: k.add_rms_norm(x, r, w, e, ieee=ieee)),
            "rope": staticmethod(lambda q, c, s: k.rope(q, c, s, ieee=ieee))})
        got = kc.forward_outputs(mod, t)
        out["ieee" if ieee else "plain"] = {
            n: {"vs_fp64": kc.vs_fp64(got[n], ref64[n]), "vs_eager_reference": kc.bitwise(got[n], eager[n])}
            for n in ref64}
    out["timings_ms"] = {
        "swiglu": {"kernel": _time_ms(lambda: k.swiglu(t["g"], t["u"])),
                   "reference": _time_ms(lambda: numerics.swiglu(t["g"], t["u"])),
                   "stock": _time_ms(lambda: torch.nn.functional.silu(t["g"]) * t["u"])},
        "add_rms_norm": {"kernel": _time_ms(lambda: k.add_rms_norm(t["x"], t["r"], t["w"], 1e-6)),
                         "reference": _time_ms(lambda: numerics.add_rms_norm(t["x"], t["r"], t["w"], 1e-6))},
        "rope": {"kernel": _time_ms(lambda: k.rope(t["q"], t["cos"], t["sin"])),
                 "reference": _time_ms(lambda: numerics.rope_rotate(t["q"], t["cos"][:, None], t["sin"][:, None]))},
    }
    out["backward_rel_err"] = kc.backward_errors(k, t)
    return out


def check_rope_table(small: bool) -> dict:
    from rpa.core.numerics_config import NumericsConfig
    from rpa.sides.trainer import align_model, rope_table

    dev = _device()
    inv_cpu = numerics.rope_inv_freq(1e6, 128, device="cpu")
    inv_dev = numerics.rope_inv_freq(1e6, 128, device=dev)
    tab_cpu = numerics.rope_cos_sin_table(inv_cpu, 40960)
    tab_dev = numerics.rope_cos_sin_table(inv_dev, 40960)
    out = {"built_on_device_vs_cpu": {
        "inv_freq_differing": int((inv_cpu != inv_dev.cpu()).sum()), "inv_freq_entries": inv_cpu.numel(),
        "table_differing_frac": float((tab_cpu != tab_dev.cpu()).float().mean()),
        "table_max_abs_diff": float((tab_cpu - tab_dev.cpu()).abs().max())}}
    model = build_model(SHAPES["tiny"] if small else dict(SHAPES["qwen3-4b"], num_hidden_layers=2), dev)
    handle = align_model(model, NumericsConfig.from_dict({"regions": "all"}))
    trainer_table = model.model.rotary_emb.rpa_cos_sin_bits.view(torch.float32)
    with torch.device(dev):  # what the vLLM plugin does inside vLLM's default-device context
        plugin_table = numerics.rope_table(model.config.rope_parameters["rope_theta"], model.config.head_dim,
                                           model.config.max_position_embeddings).to(dev)
    out["trainer_table_device"] = str(trainer_table.device)
    out["trainer_vs_plugin_table_equal"] = bool(torch.equal(trainer_table, plugin_table))
    out["trainer_vs_cpu_built_equal"] = bool(torch.equal(trainer_table.cpu(), rope_table(model.config)))
    handle.remove()
    return out


def _pair(arch: str, small: bool):
    from transformers import AutoModelForCausalLM

    base = SHAPES["tiny"] if small else dict(SHAPES["qwen3-0.6b" if arch == "qwen3" else "qwen2.5-1.5b"],
                                              num_hidden_layers=4)
    shape = dict(base, arch=arch)
    m32 = build_model(shape, _device()).eval()
    m32.gradient_checkpointing_disable()
    with torch.no_grad():
        for p in m32.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # master values that are not BF16 values
    m16 = AutoModelForCausalLM.from_config(m32.config, dtype=torch.bfloat16).to(_device()).eval()
    m16.load_state_dict({k: v.to(torch.bfloat16) for k, v in m32.state_dict().items()})
    return m32, m16


def _batch(vocab: int, small: bool):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (4, 48 if small else 512), generator=g).to(_device())
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    mask[3, :100 if not small else 20] = 0
    return ids, mask


def check_bf16_copy(small: bool) -> dict:
    from rpa.core.numerics_config import NumericsConfig
    from rpa.sides.trainer import align_model

    out = {}
    for arch in ("qwen2", "qwen3"):
        m32, m16 = _pair(arch, small)
        ids, mask = _batch(m32.config.vocab_size, small)
        for regions in ("all", "none"):
            aligned = NumericsConfig.from_dict({"regions": regions})
            with align_model(m32, aligned), align_model(m16, aligned), torch.no_grad():
                a, b = m32(ids, attention_mask=mask).logits, m16(ids, attention_mask=mask).logits
            out[f"{arch}/{regions}"] = {"logits_dtype": str(a.dtype), **kc.bitwise(a, b.float())}
        del m32, m16
    return out


def check_compile(small: bool) -> dict:
    from rpa.core.numerics_config import NumericsConfig
    from rpa.sides.trainer import align_model

    out = {}
    for arch in ("qwen3",):  # Qwen3-0.6B widths, 4 layers (the shape issue 10 measured)
        _, m16 = _pair(arch, small)
        ids, mask = _batch(m16.config.vocab_size, small)
        for regions in ("all", None):
            torch._dynamo.reset()
            handle = align_model(m16, NumericsConfig.from_dict({"regions": regions})) if regions else None
            with torch.no_grad():
                eager = m16(ids, attention_mask=mask).logits
                t0 = time.perf_counter()
                compiled = torch.compile(m16, fullgraph=True)(ids, attention_mask=mask).logits
            stats = kc.bitwise(compiled, eager)
            stats["differing_frac"] = stats["differing"] / eager.numel()
            stats["compile_s"] = round(time.perf_counter() - t0, 1)
            out[f"{arch}/{regions or 'stock'}"] = stats
            if handle:
                handle.remove()
        del m16
    return out


def check_scoring(small: bool) -> dict:
    from rpa.core.numerics_config import NumericsConfig
    from rpa.measure.scoring import token_logps_and_entropy
    from rpa.sides.trainer import align_model

    dev = _device()
    shape = dict(SHAPES["tiny"], vocab_size=151936, hidden_size=64, intermediate_size=128) if small else \
        SHAPES["qwen2.5-7b"]
    model = build_model(shape, dev)
    model.eval()
    handle = align_model(model, NumericsConfig.from_dict({"regions": "all"}))
    seqs, length, keep = (16, 64, 48) if small else (64, 1024, 768)
    ids = torch.randint(3, shape["vocab_size"], (seqs, length), device=dev)
    mask = torch.ones_like(ids)
    full_gb = seqs * keep * shape["vocab_size"] * 4 / 1e9
    out = {"shape": "tiny-vocab151936" if small else "qwen2.5-7b", "sequences": seqs, "length": length,
           "completion_tokens": keep, "full_logprob_tensor_gb": full_gb}

    def peak(fn):
        if dev == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        result = fn()
        if dev == "cuda":
            torch.cuda.synchronize()
            return result, (torch.cuda.max_memory_allocated() - base) / 1e9, time.perf_counter() - t0
        return result, None, time.perf_counter() - t0

    with torch.no_grad():
        (chunked, _), out["chunked_no_grad_peak_gb"], out["chunked_no_grad_s"] = peak(
            lambda: token_logps_and_entropy(model, ids, mask, keep, batch_size=8, chunk_tokens=1024))
        (whole, _), out["one_chunk_per_microbatch_peak_gb"], _ = peak(
            lambda: token_logps_and_entropy(model, ids[:8], mask[:8], keep, batch_size=8, chunk_tokens=8 * keep))
    out["chunked_equals_unchunked_first_microbatch"] = kc.bitwise(chunked[:8], whole)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def train_step():
        logps, _ = token_logps_and_entropy(model, ids[:8], mask[:8], keep, batch_size=8, chunk_tokens=1024)
        logps.float().mean().backward()
        model.zero_grad(set_to_none=True)

    _, out["train_microbatch8_peak_gb_incl_grads"], out["train_microbatch8_s"] = peak(train_step)
    handle.remove()
    return out


CHECKS = {"kernels": check_kernels, "rope_table": check_rope_table, "bf16_copy": check_bf16_copy,
          "compile": check_compile, "scoring": check_scoring}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--only", default=",".join(CHECKS))
    args = parser.parse_args()
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
              else "cpu", "kernels": ops.backend_report(), "small": args.small}
    import transformers

    report["transformers"] = transformers.__version__
    for name in args.only.split(","):
        t0 = time.perf_counter()
        try:
            report[name] = CHECKS[name](args.small)
        except Exception:  # noqa: BLE001 - one failing check must not lose the others
            report[name] = {"error": traceback.format_exc()[-3000:]}
        report[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        print(f"[gpu_checks] {name}: {json.dumps(report[name])[:2000]}", flush=True)
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
