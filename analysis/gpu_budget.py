"""The GPU study's budget, computed from its config: ``python -m analysis.gpu_budget
[--config experiments/study.yaml]`` prints a Markdown table (docs/study.md's) of tokens, GPU-hours
and wall hours per run, size and arm.

Tokens per run = ``steps`` x completions per step (``prompts_per_step`` x ``num_generations``) x
(``max_prompt_length`` + ``max_completion_length``): an upper bound (completions at their cap).
GPU-hours = tokens / the size's ``study.throughput_tokens_per_s`` (an *assumed* end-to-end GRPO
throughput per GPU, generation and training together, written in the config) / 3600; wall hours
= GPU-hours / the GPUs of one run (``study.resources``). Compare the wall hours with the size's
``runtime`` and your cluster's MaxTime: a run cut off by a time limit resumes on retry.

Disk per run = the model's parameters (``study.parameters``, an assumption read off the model's
config) x (:data:`CHECKPOINT_BYTES` per checkpoint kept -- the last ``save_total_limit`` of the
``ceil(steps / checkpoint_every)`` written -- + :data:`INIT_BYTES` for the run's BF16
``init_model/``); a run writing a checkpoint holds one more until transformers deletes the oldest.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from analysis.refusal import Refused, run
from rpa.workflow.grid import deep_merge
from rpa.workflow.resources import study_resources
from rpa.workflow.presets import study_arms

CHECKPOINT_BYTES = 12
"""Bytes a parameter per checkpoint: the FP32 master weight (4) and Adam's two FP32 moments (8)."""
INIT_BYTES = 2
"""Bytes a parameter of a run's starting checkpoint ``init_model/`` (BF16)."""


def disk(run: dict, parameters: float | None) -> tuple[float | None, float | None]:
    """(bytes of one run's directory with its checkpoints bounded, bytes with every checkpoint kept),
    or Nones without a parameter count. ``run`` is a run config (its defaults from TrainConfig)."""
    import math

    from rpa.train.config import TrainConfig

    if parameters is None:
        return None, None
    cfg = TrainConfig.from_dict(run)
    written = math.ceil(cfg.steps / cfg.checkpoint_every)  # transformers also saves at the last step
    kept = written if cfg.save_total_limit is None else min(written, cfg.save_total_limit)
    return (parameters * (CHECKPOINT_BYTES * kept + INIT_BYTES),
            parameters * (CHECKPOINT_BYTES * written + INIT_BYTES))


def budget(config: dict) -> list[dict]:
    study = config["study"]
    base = yaml.safe_load(open(study["base"]))
    rows = []
    for model in study["models"]:
        run = deep_merge(base, (study.get("sizes") or {}).get(model) or {})
        throughput = (study.get("throughput_tokens_per_s") or {}).get(model)
        if throughput is None:
            raise Refused(f"study.throughput_tokens_per_s: no assumed throughput for {model}")
        tokens = run["steps"] * run["prompts_per_step"] * run["num_generations"] * \
            (run["max_prompt_length"] + run["max_completion_length"])
        res = study_resources(config, model)
        gpu_h = tokens / throughput / 3600
        runs = len(study_arms(study, model)) * len(study["seeds"])
        # every arm's run directory (an arm may override the checkpoint settings)
        sizes = [disk(deep_merge(run, overrides or {}), (study.get("parameters") or {}).get(model))
                 for overrides in study_arms(study, model).values()]
        known = all(d is not None for d, _ in sizes)
        bounded = sum(d for d, _ in sizes) * len(study["seeds"]) if known else None
        unbounded = sum(u for _, u in sizes) * len(study["seeds"]) if known else None
        rows.append({"model": model, "tokens_per_run": tokens, "gpus": res["gpu"], "gpu_h_per_run": gpu_h,
                     "wall_h_per_run": gpu_h / max(res["gpu"], 1), "runtime_h": res["runtime"] / 60,
                     "arms": len(study_arms(study, model)), "runs": runs, "gpu_h": gpu_h * runs,
                     "disk_gb_per_run": None if bounded is None else bounded / runs / 1e9,
                     "disk_tb": None if bounded is None else bounded / 1e12,
                     "disk_tb_every_checkpoint": None if unbounded is None else unbounded / 1e12})
    return rows


def _figure(value: float | None, digits: int) -> str:
    return "?" if value is None else f"{value:.{digits}f}"


def markdown(rows: list[dict]) -> str:
    lines = ["| model | tokens / run (upper bound) | GPUs / run | GPU-h / run | wall h / run | job runtime h | "
             "arms x seeds | GPU-h, all runs | disk / run, GB | disk, all runs, TB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['tokens_per_run'] / 1e6:.0f}M | {r['gpus']} | {r['gpu_h_per_run']:.1f} | "
                     f"{r['wall_h_per_run']:.1f} | {r['runtime_h']:.0f} | {r['runs']} | {r['gpu_h']:.0f} | "
                     f"{_figure(r['disk_gb_per_run'], 0)} | {_figure(r['disk_tb'], 1)} |")
    known = all(r["disk_tb"] is not None for r in rows)
    disk_total = _figure(sum(r["disk_tb"] for r in rows) if known else None, 1)
    lines.append(f"| **total** | | | | | | {sum(r['runs'] for r in rows)} | {sum(r['gpu_h'] for r in rows):.0f} | | "
                 f"{disk_total} |")
    every = _figure(sum(r["disk_tb_every_checkpoint"] for r in rows) if known else None, 0)
    lines += ["", f"Assumed: the throughput (`study.throughput_tokens_per_s`, tokens/s per GPU) and the parameters "
                  f"(`study.parameters`). Disk: {CHECKPOINT_BYTES} B a parameter per checkpoint kept (FP32 weights + "
                  f"Adam's two moments; the last `save_total_limit`) + {INIT_BYTES} B for `init_model/` (BF16); a "
                  f"run writing a checkpoint holds one more for a while; with every checkpoint kept "
                  f"(`save_total_limit: null`) {every} TB."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=Path("experiments/study.yaml"))
    args = parser.parse_args(argv)
    print(markdown(budget(yaml.safe_load(args.config.read_text()))), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
