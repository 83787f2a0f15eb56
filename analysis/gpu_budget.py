"""The GPU study's budget, computed from its config: ``python -m analysis.gpu_budget
[--config experiments/study.yaml]`` prints a Markdown table (the README's) of tokens, GPU-hours
and wall hours per run, size and arm.

Tokens per run = ``steps`` x completions per step (``prompts_per_step`` x ``num_generations``) x
(``max_prompt_length`` + ``max_completion_length``): an upper bound (completions at their cap).
GPU-hours = tokens / the size's ``study.throughput_tokens_per_s`` (an *assumed* end-to-end GRPO
throughput per GPU, generation and training together, written in the config) / 3600; wall hours
= GPU-hours / the GPUs of one run (``study.resources``). Compare the wall hours with the size's
``runtime`` and your cluster's MaxTime: a run cut off by a time limit resumes on retry.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from rpa.workflow.pipeline import deep_merge, study_arms, study_resources


def budget(config: dict) -> list[dict]:
    study = config["study"]
    base = yaml.safe_load(open(study["base"]))
    rows = []
    for model in study["models"]:
        run = deep_merge(base, (study.get("sizes") or {}).get(model) or {})
        throughput = (study.get("throughput_tokens_per_s") or {}).get(model)
        if throughput is None:
            raise SystemExit(f"study.throughput_tokens_per_s: no assumed throughput for {model}")
        tokens = run["steps"] * run["prompts_per_step"] * run["num_generations"] * \
            (run["max_prompt_length"] + run["max_completion_length"])
        res = study_resources(config, model)
        gpu_h = tokens / throughput / 3600
        runs = len(study_arms(study, model)) * len(study["seeds"])
        rows.append({"model": model, "tokens_per_run": tokens, "gpus": res["gpu"], "gpu_h_per_run": gpu_h,
                     "wall_h_per_run": gpu_h / max(res["gpu"], 1), "runtime_h": res["runtime"] / 60,
                     "arms": len(study_arms(study, model)), "runs": runs, "gpu_h": gpu_h * runs})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | tokens / run (upper bound) | GPUs / run | GPU-h / run | wall h / run | job runtime h | "
             "arms x seeds | GPU-h, all runs |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens_per_run'] / 1e6:.0f}M | {r['gpus']} | {r['gpu_h_per_run']:.1f} | "
                     f"{r['wall_h_per_run']:.1f} | {r['runtime_h']:.0f} | {r['runs']} | {r['gpu_h']:.0f} |")
    lines.append(f"| **total** | | | | | | {sum(r['runs'] for r in rows)} | {sum(r['gpu_h'] for r in rows):.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("experiments/study.yaml"))
    args = parser.parse_args(argv)
    print(markdown(budget(yaml.safe_load(args.config.read_text()))), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
