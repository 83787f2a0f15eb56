"""The probe's split of the trainer-sampler gap by source (issue 58), on a real vLLM engine and a real
trainer-side model: tiny Qwen3, sampled at a temperature and a top-p."""

import csv
import json

import numpy as np
import pytest
import torch

from tests.conftest import run_py, tail

pytestmark = pytest.mark.engine


def probe(model, out, *extra):
    proc = run_py(["-m", "rpa.cli", "probe", "--model", str(model), "--out", str(out), "--prompts", "6",
                   "--samples", "2", "--max-tokens", "24", *extra])
    assert proc.returncode == 0, tail(proc)
    return json.loads((out / "summary.json").read_text())


def _rows(path):
    return list(csv.DictReader(open(path)))


def test_at_fp32_on_both_sides_only_truncation_remains_and_it_is_the_log_kept_mass(tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    model = tiny_dirs["qwen3"]
    s = probe(model, tmp_path / "fp32", "--regions", "none", "--precision", "fp32", "--temperature", "0.7", "--top-p", "0.9",
              "--split-sequences", "4")
    split = s["sampling_split"]
    assert split["label"] == "T0.7-p0.9" and split["sequences"] == 4 and split["outside_kept"] == 0
    assert set(split["parts"]) == {"total", "rounding", "truncation"}  # processed logprobs: no temperature part
    assert split["parts"]["rounding"]["max_abs_dlogp"] < 1e-5  # FP32 on both sides: the FP32 floor
    assert split["parts"]["truncation"]["mean_abs_dlogp"] > 1e-3  # top-p 0.9 leaves mass out
    rows = _rows(tmp_path / "fp32" / "split.csv")
    assert len(rows) == split["tokens"] > 20

    # the truncation part, token by token, is the log of the kept mass: computed here directly from the trainer
    # model's FP32 logits and vLLM's own truncation of them
    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    completions = [json.loads(line) for line in open(tmp_path / "fp32" / "completions.jsonl")][:4]
    direct = []
    for c in completions:
        with torch.no_grad():
            logits = hf(torch.tensor([c["prompt_ids"] + c["completion_ids"]])).logits[0, len(c["prompt_ids"]) - 1:-1]
        scaled = logits.float() / 0.7
        kept = torch.isfinite(apply_top_k_top_p(scaled.clone(), None, torch.full((len(scaled),), 0.9)))
        p = torch.softmax(scaled.double(), dim=-1)
        direct += torch.log((p * kept).sum(-1)).tolist()
    np.testing.assert_allclose([float(r["truncation"]) for r in rows], direct, rtol=0, atol=1e-5)

    # the processed logprob rebuilt from the sampler's whole raw distribution is the one vLLM reported when it
    # sampled (logprobs_mode processed_logprobs): the rebuild measures what vLLM's sampler did
    decode = [lp for c in completions for lp in c["logp_decode"]]
    np.testing.assert_allclose([float(r["logp_sampler_processed"]) for r in rows], decode, rtol=0, atol=1e-5)
    assert s["decode_vs_prompt_logprobs"]["max_abs_dlogp"] > 1e-3  # processed decode logprobs vs raw prompt ones


def test_in_bf16_the_split_adds_up_and_at_t1_it_is_the_probes_own_gap(tiny_dirs, tmp_path):
    model = tiny_dirs["qwen3"]
    plain = probe(model, tmp_path / "t1", "--regions", "none", "--logprobs", "raw", "--split-sequences", "3")
    rows, tokens = _rows(tmp_path / "t1" / "split.csv"), _rows(tmp_path / "t1" / "tokens.csv")
    assert plain["sampling_split"]["tokens"] == len(rows) and plain["sampling_split"]["outside_kept"] == 0
    for r, t in zip(rows, tokens):  # T = 1, no truncation, raw: the split's total is the probe's gap, bit for bit
        assert (r["seq"], r["token_id"]) == (t["seq"], t["token_id"])
        assert float(r["logp_recompute"]) == float(t["logp_trainer"])
        assert float(r["logp_sampler_raw"]) == float(t["logp_sampler"])
        assert float(r["temperature"]) == 0.0
    assert plain["sampling_split"]["parts"]["rounding"]["mean_abs_dlogp"] > 1e-4  # BF16: rounding is there

    warm = probe(model, tmp_path / "t07", "--regions", "none", "--logprobs", "raw", "--temperature", "0.7",
                 "--split-sequences", "3")
    parts = warm["sampling_split"]["parts"]
    assert set(parts) == {"total", "rounding", "temperature"}
    assert parts["temperature"]["mean_abs_dlogp"] > 10 * parts["rounding"]["mean_abs_dlogp"]  # raw logprobs at T 0.7
    for r in _rows(tmp_path / "t07" / "split.csv"):
        assert float(r["total"]) == pytest.approx(float(r["rounding"]) + float(r["temperature"]), abs=1e-12)
        assert float(r["truncation"]) == 0.0
