"""``rpa.workflow.gpucheck``'s reporting, without engines (the end-to-end run is in test_vllm.py)."""

import json
import subprocess

from rpa.workflow import gpucheck


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
