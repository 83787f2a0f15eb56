"""vLLM throughput with the plugin: ``none`` vs ``all`` (or any region sets), prefill and
decode tokens per second. Prints numbers (and writes JSON); asserts nothing.

    python benchmarks/bench_vllm.py --model DIR_OR_HUB_ID [--regions none,all]
        [--prompts 64 --prompt-len 512 --decode-tokens 256] [--eager] [--json F]

Each region set runs in its own process (the plugin's region set is fixed per process),
compiled with CUDA graphs where the platform has them (``--eager`` for eager mode). Prompts
are random token ids; decoding ignores EOS so every request decodes ``--decode-tokens``.
Prefill rate = prompt tokens / time of a 1-token generation; decode rate = generated
tokens / (time of the full generation - that prefill time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def measure(model: str, regions: str, prompts: int, prompt_len: int, decode_tokens: int, eager: bool,
            repeat: int) -> dict:
    import random

    from vllm import SamplingParams

    from rpa.core.numerics_config import NumericsConfig
    from rpa.sides.engine import make_llm

    llm = make_llm(model, NumericsConfig.from_dict({"regions": regions}), enforce_eager=eager, seed=0, max_model_len=prompt_len + decode_tokens + 8,
                   enable_prefix_caching=False)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    rng = random.Random(0)
    batch = [{"prompt_token_ids": [rng.randrange(10, vocab) for _ in range(prompt_len)]} for _ in range(prompts)]
    prefill = SamplingParams(max_tokens=1, temperature=0.0)
    full = SamplingParams(max_tokens=decode_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(batch[:2], full, use_tqdm=False)  # warm-up (compilation, graph capture)
    t_prefill, t_full = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        llm.generate(batch, prefill, use_tqdm=False)
        t_prefill.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        llm.generate(batch, full, use_tqdm=False)
        t_full.append(time.perf_counter() - t0)
    p, f = min(t_prefill), min(t_full)
    return {"regions": regions, "prefill_tok_s": prompts * prompt_len / p,
            "decode_tok_s": prompts * decode_tokens / max(f - p, 1e-9), "prefill_s": p, "full_s": f}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--regions", default="none,all", help="region sets separated by ';' or ',' between sets "
                                                                "('none,all' = two sets)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one region set, print JSON
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.model, args.one, args.prompts, args.prompt_len, args.decode_tokens, args.eager,
                                 args.repeat)))
        return
    sets = args.regions.split(";") if ";" in args.regions else args.regions.split(",")
    rows = []
    for regions in sets:
        cmd = [sys.executable, __file__, "--model", args.model, "--one", regions, "--prompts", str(args.prompts),
               "--prompt-len", str(args.prompt_len), "--decode-tokens", str(args.decode_tokens),
               "--repeat", str(args.repeat)] + (["--eager"] if args.eager else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(f"bench_vllm: {regions}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    base = rows[0]
    print(f"{'regions':16s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'prefill vs first':>17s} "
          f"{'decode vs first':>16s}")
    for r in rows:
        print(f"{r['regions']:16s} {r['prefill_tok_s']:14.0f} {r['decode_tok_s']:13.0f} "
              f"{r['prefill_tok_s'] / base['prefill_tok_s']:17.3f} {r['decode_tok_s'] / base['decode_tok_s']:16.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
