"""analysis.master_eval (issue 68): a checkpoint's greedy held-out evaluation by the BF16 engine, the FP32 master on
the trainer and its BF16 rounding on the trainer. The weight-grid lag it measures, checked bitwise: a master moved by
less than half a BF16 ulp from a BF16-exact model is, to the engine and the BF16 trainer, that model."""

from __future__ import annotations

import json
import shutil

import pytest

pytestmark = pytest.mark.engine


def _bf16_exact(src, dst):
    """``src``'s weights rounded to BF16 and saved in FP32 (a checkpoint on the BF16 grid)."""
    import torch
    from transformers import AutoModelForCausalLM

    shutil.copytree(src, dst)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.save_pretrained(dst)
    return model


def test_a_sub_ulp_master_is_its_rounding_to_the_engine_and_the_bf16_trainer(tiny_dirs, tmp_path):
    import torch

    from rpa.train.config import TrainConfig
    from tests.conftest import run_py, tail

    run = tmp_path / "run"
    base = _bf16_exact(tiny_dirs["llama"], run / "checkpoint-0")
    moved = run / "checkpoint-2"  # every weight moved by a quarter ulp: the FP32 master changed, its rounding did not
    with torch.no_grad():
        for p in base.parameters():
            ulp = (p.abs().to(torch.bfloat16).float() * 2.0 ** -7).clamp_min(2.0 ** -133)
            p.add_(0.25 * ulp * torch.sign(torch.randn_like(p)))
            assert torch.equal(p.to(torch.bfloat16), p.to(torch.bfloat16).float().to(torch.bfloat16))
    shutil.copytree(run / "checkpoint-0", moved)
    base.save_pretrained(moved)
    cfg = TrainConfig.from_dict({"model": str(run / "checkpoint-0"), "numerics": {"trainer_precision": "fp32"},
                                 "task": {"name": "synthetic-add", "num_prompts": 16, "eval_prompts": 6},
                                 "max_completion_length": 6, "vllm_enforce_eager": True})
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    results = {}
    for ckpt in ("checkpoint-0", "checkpoint-2"):
        out = tmp_path / f"{ckpt}.json"
        proc = run_py(["-m", "analysis.master_eval", "--run", str(run), "--checkpoint", ckpt, "--out", str(out)])
        assert proc.returncode == 0, tail(proc)
        results[ckpt] = json.loads(out.read_text())
    a, b = results["checkpoint-0"]["sides"], results["checkpoint-2"]["sides"]
    assert a["engine"]["completion_ids"] == b["engine"]["completion_ids"]  # the engine holds the rounding
    assert a["trainer_bf16"]["completion_ids"] == b["trainer_bf16"]["completion_ids"]
    assert all(len(a[s]["completion_ids"]) == 6 for s in a)
    assert results["checkpoint-2"]["engine_numerics"]["trainer_precision"] == "fp32"
    proc = run_py(["-m", "analysis.master_eval", "--run", str(run), "--checkpoint", "checkpoint-9", "--out",
                   str(tmp_path / "x.json")])
    assert proc.returncode == 2 and "is not a checkpoint" in proc.stderr and not (tmp_path / "x.json").exists()
