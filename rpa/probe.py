"""Offline mismatch probe (first cut): sample with vLLM, rescore with the trainer.

Completions are sampled at temperature 1 by vLLM with the plugin aligning ``regions``;
the trainer-side HF model, aligned in the same regions, recomputes the log-probability
of every sampled token (one sequence at a time, so its positions equal vLLM's). Writes
``summary.json`` (the :mod:`rpa.metrics` names as top-level keys, plus config and
provenance) and ``tokens.csv`` (one row per sampled token).
"""

from __future__ import annotations

import csv
import json
import random
from pathlib import Path
from typing import Any

import torch

from rpa.metrics import mismatch_metrics
from rpa.regions import format_regions, parse_regions

SCHEMA = "rpa.probe/0"


def default_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        out.append(rng.choice([f"What is {a} + {b}? Answer:", f"sort {a % 10} {b % 10} {(a + b) % 10} ->",
                               "the number of words in this list is", "count up: 1 2 3"]))
    return out


def trainer_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    """Trainer log-probability of each completion token given everything before it."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + completion_ids], device=device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits.float()[0, len(prompt_ids) - 1 : -1], dim=-1)
    return logp.gather(-1, ids[0, len(prompt_ids):, None])[:, 0].tolist()


def run_probe(model_dir: str, regions: str | frozenset[str], out_dir: str | Path, *, prompts: int = 16,
              samples: int = 2, max_tokens: int = 64, seed: int = 0, compiled: bool = False,
              trainer_dtype: str = "bfloat16") -> dict[str, Any]:
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from rpa.engine import make_llm
    from rpa.provenance import provenance
    from rpa.trainer import align_model

    if isinstance(regions, str):
        regions = parse_regions(regions)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    llm = make_llm(model_dir, regions, enforce_eager=not compiled, seed=seed)
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, logprobs=0)
    results = llm.generate(default_prompts(prompts, seed), params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, trainer_dtype))
    rows = []
    completions = [(r.prompt_token_ids, c) for r in results for c in r.outputs]
    with align_model(hf, regions):
        for seq, (prompt_ids, c) in enumerate(completions):
            comp = list(c.token_ids)
            mu = [lp[t].logprob for lp, t in zip(c.logprobs, comp)]
            pi = trainer_logprobs(hf, list(prompt_ids), comp)
            for pos, (t, a, b) in enumerate(zip(comp, pi, mu)):
                rows.append({"seq": seq, "position": pos, "token_id": t, "logp_trainer": a, "logp_sampler": b})
    metrics = mismatch_metrics([x["logp_trainer"] for x in rows], [x["logp_sampler"] for x in rows],
                               [x["seq"] for x in rows])
    summary = {"schema": SCHEMA, **metrics,
               "config": {"model": str(model_dir), "regions": format_regions(regions), "prompts": prompts,
                          "samples": samples, "max_tokens": max_tokens, "seed": seed,
                          "mode": "compiled" if compiled else "eager", "trainer_dtype": trainer_dtype},
               "provenance": provenance()}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(out / "tokens.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return summary
