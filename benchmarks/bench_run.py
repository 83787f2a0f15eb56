"""Where one GRPO run's wall time goes: ``python benchmarks/bench_run.py CONFIG.yaml [...]
[--out DIR] [--set key=value ...]`` runs ``rpa train`` on each config (in its own process, as a
grid would) and prints, from the run's ``summary.json`` ``timings``: process start + the CLI's
imports, the run's set-up (the training stack's imports, task, tokenizers, the trainer model),
the warm start / init checkpoint, trainer + vLLM engine start (incl. compilation), and within
training: generation, the trainer's no-grad scoring (old logprobs, mismatch metrics), the
forward + backward of the loss, weight sync into vLLM + its check, evaluation, and the rest
(optimizer, logging, checkpointing, TRL's bookkeeping). The "model floor" is generation +
scoring + forward/backward: the share of the run the model's own compute takes.

Run on a config with ``--set steps=N`` to time a short version. ``--one-process`` runs the
configs in one ``rpa train`` process, each run taking over the previous one's vLLM engine where
it can (as a study job of ``study.runs_per_process`` seeds does): the same configs with and
without it give the saving side by side. Every process's wall time from start to exit (process
exit included) is measured from outside. Summaries of finished runs can be printed without
running: ``--summaries RUN_DIR/summary.json ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

LABEL_WIDTH = 72
"""Width of the phase column of :func:`table` (the seconds follow in the next 10 characters)."""


def table(summary: dict) -> str:
    """TRL nests the phases: ``train`` > ``training_step`` (per micro-batch) > ``generate_and_score``
    (on a micro-batch that starts a generation) > ``generate``, the weight sync + check and the
    no-grad scoring. Printed as a partition of the run's wall time."""
    t = {k: v["seconds"] for k, v in (summary.get("timings") or {}).items()}
    calls = {k: v["calls"] for k, v in (summary.get("timings") or {}).items()}
    g = lambda k: t.get(k, 0.0)  # noqa: E731
    total = (summary.get("wall_s") or 0.0) + g("process_start_to_run")
    steps = summary.get("steps") or 0
    score = g("generate_and_score") - g("generate") - g("sync_weights_and_check")
    rows = [("process start + CLI imports (or since the process's previous run)", g("process_start_to_run"),
             calls.get("process_start_to_run", 0)),
            ("run set-up: provenance, training-stack imports, task, trainer model load", g("run_setup"),
             calls.get("run_setup", 0)),
            ("warm start + init checkpoint", g("init_model"), calls.get("init_model", 0)),
            ("trainer + vLLM engine start (compile), first sync check", g("trainer_and_engine_start"), 1),
            ("generation (vLLM)", g("generate"), calls.get("generate", 0)),
            ("weight sync into vLLM + sync check", g("sync_weights_and_check"), calls.get("sync_weights_and_check", 0)),
            ("scoring: rewards, old logprobs, mismatch metrics, evaluation", score,
             calls.get("generate_and_score", 0)),
            ("  of which trainer forward, no grad", g("trainer_logprobs_no_grad"),
             calls.get("trainer_logprobs_no_grad", 0)),
            ("  of which held-out evaluation", g("evaluate"), calls.get("evaluate", 0)),
            ("loss forward + backward", g("training_step") - g("generate_and_score"), calls.get("training_step", 0)),
            ("optimizer, logging, checkpoints", g("train") - g("training_step"), 0)]
    rest = total - sum(v for label, v, _ in rows if not label.startswith("  "))
    rows.append(("summary, process exit, unaccounted", rest, 0))
    lines = [f"{'phase':{LABEL_WIDTH}s} {'seconds':>9s} {'share':>7s} {'calls':>6s}"]
    lines += [f"{label:{LABEL_WIDTH}s} {v:9.1f} {100 * v / total:6.1f}% {n:6d}" for label, v, n in rows]
    floor = g("generate") + g("trainer_logprobs_no_grad") + g("training_step") - g("generate_and_score")
    lines.append(f"{'total (process start to summary)':{LABEL_WIDTH}s} {total:9.1f}")
    lines.append(f"model floor (generation + trainer scoring + loss fwd/bwd): {floor:.1f} s = "
                 f"{100 * floor / total:.1f}% of the run, overhead {100 - 100 * floor / total:.1f}%; {steps} steps, "
                 f"{g('train') / max(steps, 1):.2f} s/step in the loop")
    return "\n".join(lines)


def run(configs: list[Path], outs: list[Path], overrides: list[str]) -> tuple[list[dict], float]:
    """``rpa train`` on ``configs`` in one process (the runs in turn, as ``rpa train`` with
    several ``--config/--out`` runs them): their summaries, and the process's wall time from
    its start to its exit, measured from outside."""
    paths = []
    for config, out in zip(configs, outs):
        cfg = yaml.safe_load(config.read_text())
        for item in overrides:
            key, _, value = item.partition("=")
            cfg[key] = yaml.safe_load(value)
        out.parent.mkdir(parents=True, exist_ok=True)
        path = out.with_suffix(".yaml")
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        paths += ["--config", str(path), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rpa.cli", "train", *paths], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"rpa train failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads((out / "summary.json").read_text()) for out in outs], wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="run-config override")
    parser.add_argument("--one-process", action="store_true",
                        help="run the configs in one rpa train process (as a study job of several seeds does) "
                             "instead of one process each")
    parser.add_argument("--summaries", nargs="*", type=Path, default=[], help="print finished runs' timings")
    args = parser.parse_args(argv)
    for path in args.summaries:
        print(f"== {path}\n{table(json.loads(path.read_text()))}\n")
    if not args.configs:
        return 0
    root = args.out or Path(tempfile.mkdtemp(prefix="bench-run-"))
    outs = [root / f"{i}-{config.stem}" for i, config in enumerate(args.configs)]
    groups = [(args.configs, outs)] if args.one_process else [([c], [o]) for c, o in zip(args.configs, outs)]
    total = 0.0
    for configs, group_outs in groups:
        summaries, wall = run(configs, group_outs, args.set)
        total += wall
        for config, summary in zip(configs, summaries):
            taken = " (took over the previous run's vLLM engine)" if summary.get("engine_taken_over") else ""
            print(f"== {config} {' '.join(args.set)}{taken}\n{table(summary)}\n")
        inside = sum((sm.get("wall_s") or 0.0) + sm["timings"].get("process_start_to_run", {}).get("seconds", 0.0)
                     for sm in summaries)
        print(f"process of {len(configs)} run(s): {wall:.1f} s from start to exit, {inside:.1f} s of it in the "
              f"runs' tables, {wall - inside:.1f} s after the last summary (engine shutdown, process exit)\n")
    print(f"{len(args.configs)} run(s) in {len(groups)} process(es): {total:.1f} s of process wall time "
          f"({total / len(args.configs):.1f} s per run)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
