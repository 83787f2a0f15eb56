"""Cost of the aligned regions: region functions vs the stock ones, and whole training
steps of real-size Qwen shapes per region set. Prints numbers (and writes JSON); asserts
nothing.

    python benchmarks/bench_regions.py --functions            # region functions only
    python benchmarks/bench_regions.py --steps --shapes qwen2.5-1.5b,qwen3-4b,qwen2.5-7b \\
        --batch 8 --seq 1024 --device cuda --json bench.json

Region functions, per region: ``stock`` (transformers' BF16 code), ``reference`` (eager
:mod:`rpa.core.numerics`), ``op`` (the shared :mod:`rpa.core.ops` custom op: Triton kernels on CUDA,
the reference on CPU), forward and forward+backward.

Steps: forward + backward of a random-weight model of the shape (FP32 master weights,
BF16 compute through :func:`rpa.sides.trainer.align_model`, gradient checkpointing), median of
``--repeat`` steps after a warm-up, with ``none``, each region, ``all``, and ``autocast``
(no regions, FP32 parameters under ``torch.autocast``: TRL's default). On CPU use
``--shapes tiny`` (a smoke run that shows the path works).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from rpa.core import numerics, ops

SHAPES = {  # dense configs: arch, hidden, intermediate, layers, heads, kv heads, head_dim, vocab
    "tiny": dict(arch="qwen3", hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512),
    "qwen3-0.6b": dict(arch="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936),
    "qwen2.5-1.5b": dict(arch="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, head_dim=128, vocab_size=151936),
    "qwen3-4b": dict(arch="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen2.5-7b": dict(arch="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, head_dim=128, vocab_size=152064),
}
STEP_SETTINGS = ("none", "rope", "swiglu", "rmsnorm", "all", "autocast")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_us(fn, device: str) -> float:
    """Median time of ``fn()`` in microseconds."""
    if device == "cuda":
        from triton.testing import do_bench

        return 1e3 * do_bench(fn, warmup=25, rep=100, return_mode="median")
    from torch.utils import benchmark

    return benchmark.Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=0.3).median * 1e6


# ------------------------------------------------------------------------ functions


def stock_rms_norm(x, w, eps):  # transformers 5.19 Qwen2RMSNorm, BF16 weight
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def stock_rope(q, cos_full, sin_full):  # transformers 5.19 apply_rotary_pos_emb, BF16 cos/sin
    half = q.shape[-1] // 2
    return q * cos_full + torch.cat((-q[..., half:], q[..., :half]), -1) * sin_full


def bench_functions(tokens: int, shape: dict, device: str) -> list[dict]:
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, head_dim = shape["num_attention_heads"], shape["head_dim"]
    bf = dict(dtype=torch.bfloat16, device=device)
    x, r = torch.randn(tokens, hidden, **bf), torch.randn(tokens, hidden, **bf)
    w = torch.rand(hidden, **bf) + 0.5
    g, u = torch.randn(tokens, inter, **bf), torch.randn(tokens, inter, **bf)
    q = torch.randn(tokens, heads, head_dim, **bf)
    table = numerics.rope_table(1e6, head_dim, max(tokens, 4096)).to(device)
    cos, sin = numerics.rope_lookup(table, torch.arange(tokens, device=device))
    cos_full = torch.cat((cos, cos), -1)[:, None].to(torch.bfloat16)
    sin_full = torch.cat((sin, sin), -1)[:, None].to(torch.bfloat16)
    eps = 1e-6
    regions = {
        "rope": (lambda q: stock_rope(q, cos_full, sin_full),
                 lambda q: numerics.rope_rotate(q, cos[:, None], sin[:, None]),
                 lambda q: ops.rope(q, cos, sin), (q,)),
        "swiglu": (lambda g, u: F.silu(g) * u, numerics.swiglu, ops.swiglu, (g, u)),
        "rmsnorm": (lambda x, w: stock_rms_norm(x, w, eps), lambda x, w: numerics.rms_norm(x, w, eps),
                    lambda x, w: ops.rms_norm(x, w, eps), (x, w)),
        "add+rmsnorm": (lambda x, r, w: stock_rms_norm(x + r, w, eps),
                        lambda x, r, w: numerics.add_rms_norm(x, r, w, eps),
                        lambda x, r, w: ops.add_rms_norm(x, r, w, eps), (x, r, w)),
    }
    rows = []
    for name, (stock, reference, op, args) in regions.items():
        row = {"region": name, "tokens": tokens}
        for impl, fn in (("stock", stock), ("reference", reference), ("op", op)):
            row[f"{impl}_fwd_us"] = time_us(lambda: fn(*args), device)
            leaves = [a.detach().requires_grad_(True) for a in args]

            def fwd_bwd():
                out = fn(*leaves)
                (out[0] if isinstance(out, tuple) else out).backward(grad)

            first = fn(*args)
            grad = torch.ones_like(first[0] if isinstance(first, tuple) else first)
            row[f"{impl}_fwd_bwd_us"] = time_us(fwd_bwd, device)
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- steps


def build_model(shape: dict, device: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    kind = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}[shape["arch"]]
    config = kind[0](**{k: v for k, v in shape.items() if k != "arch"}, max_position_embeddings=32768,
                     tie_word_embeddings=False)
    with torch.device(device):  # initialise on the device (a 7B FP32 init on the CPU takes minutes)
        model = kind[1](config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def bench_steps(shape: dict, batch: int, seq: int, device: str, settings: list[str], repeat: int) -> list[dict]:
    from rpa.core.numerics_config import NumericsConfig
    from rpa.sides.trainer import align_model

    model = build_model(shape, device)
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=device)
    out = []
    for setting in settings:
        autocast = setting == "autocast"
        handle = align_model(model, NumericsConfig.from_dict({"regions": "none", "trainer_mode": "autocast"} if autocast
                                                             else {"regions": setting}))
        ctx = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=autocast)
        times = []
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()

        def step():
            with ctx:
                logits = model(ids).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            loss.backward()
            model.zero_grad(set_to_none=True)

        for _ in range(repeat + 1):
            _sync(device)
            t0 = time.perf_counter()
            step()
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        row = {"setting": setting, "batch": batch, "seq": seq, "step_ms": 1e3 * statistics.median(times[1:]),
               "peak_gib": peak}
        handle.remove()
        out.append(row)
        print(f"  {setting:9s} {row['step_ms']:9.1f} ms", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--functions", action="store_true", help="time the region functions")
    parser.add_argument("--steps", action="store_true", help="time training steps")
    parser.add_argument("--tokens", type=int, default=8192, help="rows for the region functions")
    parser.add_argument("--function-shape", choices=sorted(SHAPES), default="qwen2.5-7b")
    parser.add_argument("--shapes", default="qwen2.5-1.5b,qwen3-4b,qwen2.5-7b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--settings", default=",".join(STEP_SETTINGS))
    parser.add_argument("--repeat", type=int, default=4)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    if not (args.functions or args.steps):
        args.functions = args.steps = True
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    report = {"args": vars(args), "torch": torch.__version__, "kernels": ops.backend_report(),
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "functions": [], "steps": {}}
    print(f"device={report['device_name']} torch={torch.__version__} kernels={report['kernels']}")
    if args.functions:
        report["functions"] = bench_functions(args.tokens, SHAPES[args.function_shape], args.device)
        print(f"region functions, {args.function_shape} widths, {args.tokens} tokens (us; fwd | fwd+bwd)")
        for row in report["functions"]:
            print(f"  {row['region']:12s} " + "  ".join(
                f"{impl} {row[f'{impl}_fwd_us']:8.1f} | {row[f'{impl}_fwd_bwd_us']:8.1f}"
                for impl in ("stock", "reference", "op")))
    if args.steps:
        for name in shapes:
            print(f"steps: {name}, batch {args.batch} x {args.seq}", flush=True)
            rows = bench_steps(SHAPES[name], args.batch, args.seq, args.device, args.settings.split(","), args.repeat)
            if args.device == "cuda":
                torch.cuda.empty_cache()  # the shape's model is gone with bench_steps
            base = next((r["step_ms"] for r in rows if r["setting"] == "none"), None)
            for r in rows:
                r["vs_none"] = r["step_ms"] / base if base else None
            report["steps"][name] = rows
            if args.json:  # each part as it ends
                with open(args.json, "w") as f:
                    json.dump(report, f, indent=2)
        print(f"{'shape':14s} " + " ".join(f"{s:>9s}" for s in args.settings.split(",")))
        for name, rows in report["steps"].items():
            ratios = " ".join(f"{r['vs_none']:9.3f}" for r in rows)
            print(f"{name:14s} {ratios}   (none {rows[0]['step_ms']:.0f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
