"""Cost of the aligned region functions vs the stock ones, and (on a GPU) of a whole
training step of a real-size Qwen shape with each region set. Prints numbers; asserts
nothing.

    python benchmarks/bench_regions.py [--tokens 2048] [--shape qwen2.5-0.5b] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.utils import benchmark

from rpa import numerics

SHAPES = {  # Qwen2.5 dense configs (hidden, intermediate, layers, heads, kv heads, vocab); "tiny" for a smoke run
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936),
}


def stock_rms_norm(x, w, eps):  # transformers 5.19 Qwen2RMSNorm
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def stock_rope(q, cos_full, sin_full):  # transformers 5.19 apply_rotary_pos_emb, BF16 cos/sin
    half = q.shape[-1] // 2
    return q * cos_full + torch.cat((-q[..., half:], q[..., :half]), -1) * sin_full


def time_us(fn, *args) -> float:
    t = benchmark.Timer(stmt="fn(*args)", globals={"fn": fn, "args": args})
    return t.blocked_autorange(min_run_time=0.5).median * 1e6


def bench_functions(tokens: int, shape: dict, device: str) -> list[dict]:
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    heads, head_dim = shape["num_attention_heads"], shape["hidden_size"] // shape["num_attention_heads"]
    bf = dict(dtype=torch.bfloat16, device=device)
    x, r, w = torch.randn(tokens, hidden, **bf), torch.randn(tokens, hidden, **bf), torch.rand(hidden, **bf) + 0.5
    g, u = torch.randn(tokens, inter, **bf), torch.randn(tokens, inter, **bf)
    q = torch.randn(1, heads, tokens, head_dim, **bf)
    table = numerics.rope_cos_sin_table(numerics.rope_inv_freq(1e6, head_dim, device=device), 32768)
    pos = torch.arange(tokens, device=device)[None]
    cos, sin = numerics.rope_lookup(table, pos)
    cos_full, sin_full = torch.cat((cos, cos), -1)[:, None].to(torch.bfloat16), torch.cat((sin, sin), -1)[:, None].to(torch.bfloat16)

    def aligned_rope(q, pos):
        c, s = numerics.rope_lookup(table, pos)
        return numerics.rope_rotate(q, c[:, None], s[:, None])

    rows = [
        ("rope", time_us(stock_rope, q, cos_full, sin_full), time_us(aligned_rope, q, pos)),
        ("swiglu", time_us(lambda g, u: F.silu(g) * u, g, u), time_us(numerics.swiglu, g, u)),
        ("rmsnorm", time_us(stock_rms_norm, x, w, 1e-6), time_us(numerics.rms_norm, x, w, 1e-6)),
        ("add+rmsnorm", time_us(lambda x, r, w: stock_rms_norm(x + r, w, 1e-6), x, r, w),
         time_us(numerics.add_rms_norm, x, r, w, 1e-6)),
    ]
    return [{"region": n, "stock_us": s, "aligned_us": a, "ratio": a / s} for n, s, a in rows]


def bench_step(shape: dict, tokens: int, device: str, region_sets: list[str], steps: int = 5) -> list[dict]:
    """Forward+backward of a random-weight Qwen2 model (FP32 master, BF16 compute)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rpa.trainer import align_model

    config = Qwen2Config(**shape, max_position_embeddings=32768, tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).to(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, shape["vocab_size"], (1, tokens), device=device)
    out = []
    for regions in region_sets:
        with align_model(model, regions):
            times = []
            for _ in range(steps + 1):
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                logits = model(ids).logits
                loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
                loss.backward()
                model.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        out.append({"regions": regions, "step_ms": 1e3 * sorted(times[1:])[len(times[1:]) // 2], "peak_gib": peak})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--step", action="store_true", help="also time fwd+bwd steps (default on CUDA only)")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    print(f"device={args.device} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"shape={args.shape} tokens={args.tokens}")
    funcs = bench_functions(args.tokens, shape, args.device)
    print(f"{'region':12s} {'stock us':>10s} {'aligned us':>11s} {'ratio':>6s}")
    for row in funcs:
        print(f"{row['region']:12s} {row['stock_us']:10.1f} {row['aligned_us']:11.1f} {row['ratio']:6.2f}")
    steps = []
    if args.step or args.device == "cuda":
        steps = bench_step(shape, args.tokens, args.device, ["none", "rope", "swiglu", "rmsnorm", "all"])
        base = steps[0]["step_ms"]
        print(f"{'regions':10s} {'fwd+bwd ms':>11s} {'vs none':>8s} {'peak GiB':>9s}")
        for row in steps:
            peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
            print(f"{row['regions']:10s} {row['step_ms']:11.1f} {row['step_ms'] / base:8.3f} {peak:>9s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"functions": funcs, "steps": steps, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
