"""The positive control's dose: a sampler-only perturbation, named as one, refused where it
means nothing; the probe measures it on the same tokens; the analysis regenerates from the
committed raw results."""

import csv
import json

import pytest
import torch

from rpa import numerics
from rpa.numerics_config import NumericsConfig, NumericsConfigError
from tests.conftest import REPO, run_py, tail


@pytest.mark.parametrize("bits", [1, 3, 6])
def test_round_mantissa_is_one_exact_rounding(bits):
    x = (torch.randn(20000, dtype=torch.float64) * 3).to(torch.bfloat16)
    got = numerics.round_mantissa(x, bits).double()
    v = x.double()
    _, e = torch.frexp(v)
    ulp = torch.ldexp(torch.ones_like(v), e - (bits + 1))
    assert torch.equal(got, torch.round(v / ulp) * ulp)  # ties to even, one step


def test_the_dose_is_off_by_default_named_and_refused_where_meaningless():
    assert NumericsConfig().sampler_perturbation is None and NumericsConfig().perturbation_label == ""
    n = NumericsConfig.from_dict({"regions": "all", "sampler_perturbation": {"mantissa_bits": 4}})
    assert n.perturbation_label == "perturb-mantissa4" and n.to_dict()["sampler_perturbation"] == {"mantissa_bits": 4}
    for bad, needle in [({"precision": "fp32"}, "needs precision bf16"),
                        ({"precision": "fp16"}, "needs precision bf16"),
                        ({"mantissa": 4}, "expected {mantissa_bits"), ({"bits": 7}, "expected {mantissa_bits")]:
        spec = {"sampler_perturbation": {"mantissa_bits": 4}, **{k: v for k, v in bad.items() if k == "precision"}}
        if "precision" not in bad:
            spec["sampler_perturbation"] = bad
        with pytest.raises(NumericsConfigError, match=needle.replace("{", "\\{")):
            NumericsConfig.from_dict(spec)
    with pytest.raises(NumericsConfigError, match="1..6"):
        NumericsConfig.from_dict({"sampler_perturbation": {"mantissa_bits": 7}})


@pytest.mark.slow
def test_dose_perturbs_the_sampler_only_and_the_probe_measures_it(tiny_dirs, tmp_path):
    model = tiny_dirs["qwen3"]

    def probe(out, *extra):
        proc = run_py(["-m", "rpa.cli", "probe", "--model", str(model), "--regions", "all", "--out", str(out),
                       "--prompts", "4", "--max-tokens", "24", *extra])
        assert proc.returncode == 0, tail(proc)
        rows = list(csv.DictReader(open(out / "tokens.csv")))
        return json.loads((out / "summary.json").read_text()), rows

    clean, clean_rows = probe(tmp_path / "clean")
    dosed, dosed_rows = probe(tmp_path / "dosed", "--sampler-mantissa-bits", "3",
                              "--completions", str(tmp_path / "clean" / "completions.jsonl"))
    assert [r["token_id"] for r in clean_rows] == [r["token_id"] for r in dosed_rows]  # identical tokens
    assert [r["logp_trainer"] for r in clean_rows] == [r["logp_trainer"] for r in dosed_rows]  # trainer untouched
    assert sum(r["logp_sampler"] != s["logp_sampler"] for r, s in zip(clean_rows, dosed_rows)) > 0.9 * len(clean_rows)
    assert dosed["mean_abs_dlogp"] > 3 * clean["mean_abs_dlogp"]
    assert dosed["config"]["numerics"]["sampler_perturbation"] == {"mantissa_bits": 3}
    assert {"kl_k3", "seq_log_ratio_mean_abs"} <= set(dosed)


REFERENCE = REPO / "results/reference/cpu"


@pytest.mark.skipif(not (REFERENCE / "tables/dose_runs.csv").exists(), reason="no committed dose results")
def test_dose_analysis_regenerates_from_committed_raw_results(tmp_path):
    out = tmp_path / "tables"
    proc = run_py(["-m", "analysis.dose", "--results", str(REFERENCE), "--out-dir", str(out),
                   "--figure", str(tmp_path / "dose.png")])
    assert proc.returncode == 0, tail(proc)
    for name in ("dose.csv", "dose_runs.csv"):
        assert (out / name).read_text() == (REFERENCE / "tables" / name).read_text(), name
    assert (tmp_path / "dose.png").stat().st_size > 10_000
    assert "### Threshold" in (out / "dose.md").read_text()
