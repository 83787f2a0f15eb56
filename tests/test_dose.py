"""The positive control's dose: a sampler-only perturbation, named as one, refused where it
means nothing; the probe measures it on the same tokens; the analysis regenerates from the
committed raw results, takes the dose over an early window, reports honest threshold intervals,
compares each curve with its own anchor and reports the verdicts' sensitivity."""

import csv
import json

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.dose import stats as dose  # the positive control's statistics
from analysis.dose.text import statement
from analysis.runs import SENSITIVITY_LABELS
from rpa.train.collapse import CollapseThresholds, sensitivity, sensitivity_settings

from rpa.core import numerics
from rpa.core.numerics_config import NumericsConfig, NumericsConfigError
from tests.conftest import REPO, assert_figure, run_py, tail


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


@pytest.mark.engine
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


def _committed(*parts: str):
    """A committed reference path: the committed results are part of the contract, so a missing
    one fails the test (never skips it)."""
    path = REFERENCE.joinpath(*parts)
    assert path.exists(), f"committed reference data missing: {path}"
    return path


def test_dose_analysis_regenerates_from_committed_raw_results(tmp_path):
    _committed("tables/dose_runs.csv")
    out = tmp_path / "tables"
    proc = run_py(["-m", "analysis.dose", "--results", str(REFERENCE), "--out-dir", str(out),
                   "--figure", str(tmp_path / "dose.png")])
    assert proc.returncode == 0, tail(proc)
    for name in ("dose.csv", "dose_runs.csv", "dose_sensitivity.csv", "dose.md"):
        assert (out / name).read_text() == (REFERENCE / "tables" / name).read_text(), name
    assert_figure(tmp_path / "dose.png")
    md = (out / "dose.md").read_text()
    assert "### Threshold" in md and "### Sensitivity of the verdicts" in md
    assert f"mean |dlogp| over steps 1-{dose.MISMATCH_STEPS}" in md and "profile-likelihood 95% interval" in md


def _committed_runs() -> pd.DataFrame:
    return pd.read_csv(REFERENCE / "tables/dose_runs.csv")


def _dose_manifest(root, *run_dirs: str):
    """The manifest of a positive control of the cells ``run_dirs`` (``<arm>/<is>-<old>/seed<N>``), as the
    workflow writes it (rpa/workflow/manifest.py)."""
    from rpa.workflow.manifest import manifest_text

    cells = []
    for rel in run_dirs:
        arm, setting, seed = rel.split("/")
        correction, old = setting.rsplit("-", 1)
        cells.append({"cell": rel, "labels": {"arm": arm, "is_correction": correction, "old_logprobs": old},
                      "seed": int(seed.removeprefix("seed")), "model": "tiny-qwen3"})
    (root / "dose").mkdir(parents=True, exist_ok=True)
    (root / "dose" / "manifest.json").write_text(manifest_text("dose", cells, {"doses": {}}))
    return root


def _link_runs(tmp_path, *run_dirs: str):
    """A results tree holding only the named committed runs (so a test loads 3 runs, not 126)."""
    for rel in run_dirs:
        dst = tmp_path / "dose" / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(REFERENCE / "dose" / rel)
    return _dose_manifest(tmp_path, *run_dirs)


SPIKY = "perturb-mantissa1/sequence_mask-sampler"


def test_grad_spike_only_runs_are_not_counted_as_collapses(tmp_path):
    _committed("dose", SPIKY)
    runs = dose.dose_rows(_link_runs(tmp_path, *(f"{SPIKY}/seed{s}" for s in range(3))))
    by_seed = runs.set_index("seed")
    for seed in (0, 2):  # grad-norm spikes, reward never held below half its best: events, not collapses
        assert by_seed.loc[seed, "grad_spikes"] >= 1 and by_seed.loc[seed, "verdict"] == "stable"
        assert not by_seed.loc[seed, "collapsed"]
    assert by_seed.loc[1, "verdict"] == "collapsed"
    group = dose.groups(runs).iloc[0]
    assert (group["collapsed"], group["unconfirmed"], group["grad_spike_runs"]) == (1, 0, 2)
    committed = dose.groups(_committed_runs()).set_index(["arm", "is_correction", "old_logprobs"])
    row = committed.loc[("perturb-mantissa1", "sequence_mask", "sampler")]
    assert (row["runs"], row["collapsed"], row["grad_spike_runs"]) == (3, 1, 2)


def _synthetic_run(root, arm="perturb-mantissa2", setting="off-sampler", seed=0, steps=30, jump=17):
    """A run whose reward falls from step 15 (collapse at step 17) and whose mismatch jumps 5x at step ``jump``."""
    run = root / "dose" / arm / setting / f"seed{seed}"
    run.mkdir(parents=True)
    correction, old = setting.rsplit("-", 1)
    (run / "config.json").write_text(json.dumps({"numerics": {"sampler_perturbation": {"mantissa_bits": 2}},
                                                 "is_correction": correction, "old_logprobs": old, "collapse": {}}))
    (run / "summary.json").write_text(json.dumps({"status": "ok"}))
    rows = []
    for step in range(1, steps + 1):
        mm = 0.01 if step < jump else 0.05
        rows.append({"step": step, "reward": 0.8 if step < 15 else 0.1, "loss": 0.0, "grad_norm": 1.0,
                     "clip_ratio/region_mean": 0.0, "mismatch/mean_abs_dlogp": mm, "mismatch/kl_k3": mm / 10,
                     "mismatch/seq_log_ratio_mean_abs": 30 * mm, "mismatch/phantom_clip_rate": mm / 2})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return _dose_manifest(root, f"{arm}/{setting}/seed{seed}")


def test_the_dose_is_the_early_window_not_the_post_collapse_mismatch(tmp_path):
    runs = dose.dose_rows(_synthetic_run(tmp_path))
    r = runs.iloc[0]
    assert r["verdict"] == "collapsed" and r["collapse_step"] == 17  # the mismatch jumps at the collapse
    assert r["mismatch_steps"] == dose.MISMATCH_STEPS
    assert r["mean_abs_dlogp"] == pytest.approx(0.01) and r["phantom_clip_rate"] == pytest.approx(0.005)
    assert r["pre_drop_mean_abs_dlogp"] == pytest.approx(0.01)
    assert r["all_steps_mean_abs_dlogp"] > 0.02  # what the all-steps mean reported
    late = dose.dose_rows(tmp_path, mismatch_steps=20).iloc[0]  # a window past the collapse sees the jump
    assert late["mean_abs_dlogp"] == pytest.approx((16 * 0.01 + 4 * 0.05) / 20) and late["mismatch_steps"] == 20
    assert dose.groups(runs)["mismatch_steps"].tolist() == [dose.MISMATCH_STEPS]
    assert dose.thresholds(runs)["mismatch_steps"].tolist() == [dose.MISMATCH_STEPS]


def test_the_default_window_ends_before_every_collapse_of_the_committed_grid():
    _committed("tables/dose_runs.csv")
    runs = _committed_runs()
    assert set(runs["mismatch_steps"]) == {dose.MISMATCH_STEPS}
    assert dose.earliest_collapse_step(runs) > dose.MISMATCH_STEPS


def _curve(x, y):
    return pd.DataFrame({"mean_abs_dlogp": x, "collapsed": y, "verdict": ["collapsed" if v else "stable" for v in y]})


def test_threshold_reports_a_profile_interval_and_the_degenerate_resamples():
    x = np.repeat(np.logspace(-3, -1, 6), 3)
    y = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 1, 1, 1, 1], dtype=bool)
    t = dose.threshold(_curve(x, y), boot=400)
    assert t["kind"] == "logistic" and t["interval"] == "profile-likelihood 95%"
    assert t["low"] < t["estimate"] < t["high"]
    assert 0 < t["bootstrap_degenerate"] < 400 and t["boot"] == 400
    # the ends are where the profile deviance crosses chi2(1, 0.95), not bootstrap percentiles
    lx, ly = np.log10(x), y.astype(float)
    ends = dose.profile_loglik(lx, ly, np.log10([t["low"], t["high"]]))
    best = dose.profile_loglik(lx, ly, np.log10([t["estimate"]]))[0]
    assert 2 * (best - ends) == pytest.approx([dose.CHI2_1_95] * 2, abs=0.05)
    # a curve collapsing only at its top dose: the interval is open above ("beyond the doses tried")
    top = dose.threshold(_curve(x, np.r_[np.zeros(15, bool), [True, False, False]]), boot=100)
    assert top["kind"] == "logistic" and top["high"] is None and top["low"] is not None
    # perfectly separated: a bracket, every resample degenerate
    sep = dose.threshold(_curve(x, x > 0.02), boot=100)
    assert sep["kind"] == "bracket" and sep["bootstrap_degenerate"] == 100
    assert sep["low"] < 0.02 < sep["high"]
    no_anchors = pd.DataFrame(columns=["arm", "is_correction", "old_logprobs", "mean_abs_dlogp"])
    th = pd.DataFrame([{"is_correction": "off", "old_logprobs": "sampler", **t, "mismatch_steps": 4}])
    line = statement(th, no_anchors)[0]
    assert "profile-likelihood 95% interval" in line and f"{t['bootstrap_degenerate']}/400 resamples degenerate" in line
    assert "steps 1-4" in line


def test_each_curve_is_compared_with_its_own_bf16_none_anchor():
    anchors = pd.DataFrame([("bf16-none", "off", "sampler", 0.001), ("bf16-none", "token_truncate", "sampler", 0.002),
                            ("bf16-none", "sequence_mask", "sampler", 0.004), ("bf16-all", "off", "sampler", 0.0005)],
                           columns=["arm", "is_correction", "old_logprobs", "mean_abs_dlogp"])
    base = {"old_logprobs": "sampler", "runs": 18, "collapsed": 4, "unconfirmed_left_out": 0, "mismatch_steps": 4,
            "bootstrap_degenerate": 10, "boot": 100}
    th = pd.DataFrame([{**base, "is_correction": "token_truncate", "kind": "logistic", "estimate": 0.04, "low": 0.02,
                        "high": None},
                       {**base, "is_correction": "sequence_mask", "kind": "none collapsed", "collapsed": 0,
                        "estimate": None, "low": 0.08, "high": None}])
    tis, mis = statement(th, anchors)
    assert "BF16 none of this curve (0.002) is 20x below the estimate and 10x below" in tis  # not 0.001 (IS off)
    assert "beyond the doses tried" in tis
    assert "BF16 none of this curve 0.004" in mis and "BF16 all 0.0005 (run with IS off only)" in mis


def test_committed_anchors_exist_per_correction_and_the_statements_quote_them():
    _committed("tables/dose_runs.csv")
    runs = _committed_runs()
    anchors = dose.anchor_positions(runs)
    none = anchors[anchors["arm"] == "bf16-none"].set_index(["is_correction", "old_logprobs"])["mean_abs_dlogp"]
    assert len(none) == 6
    lines = dict(zip(dose.thresholds(runs, boot=50)[["is_correction", "old_logprobs"]].apply(tuple, axis=1),
                     statement(dose.thresholds(runs, boot=50), anchors)))
    for key, value in none.items():
        if dose.invalid_setting(*key):  # IS with sampler old logprobs: marked invalid, no threshold to compare
            assert "IS correction applied twice" in lines[key]
            continue
        assert any(f"BF16 none of this curve {v}" in lines[key] for v in (f"({value:.2g})", f"{value:.2g}"))


def test_the_sensitivity_table_counts_collapses_under_every_variation(tmp_path):
    _committed("dose", SPIKY)
    runs = dose.dose_rows(_link_runs(tmp_path, *(f"{SPIKY}/seed{s}" for s in range(3))))
    table = dose.sensitivity_table(runs)
    labels = [label for label, _ in sensitivity_settings(CollapseThresholds())]
    assert labels == list(SENSITIVITY_LABELS)
    assert {f"collapsed[{label}]" for label in labels} | {f"unconfirmed[{label}]" for label in labels} <= set(table)
    expected = {label: 0 for label in labels}
    for seed in range(3):
        run = REFERENCE / "dose" / SPIKY / f"seed{seed}"
        cfg = json.loads((run / "config.json").read_text())
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        for label, verdict in sensitivity(records, CollapseThresholds(**cfg["collapse"])).items():
            expected[label] += verdict == "collapsed"
    assert {label: int(table.iloc[0][f"collapsed[{label}]"]) for label in labels} == expected
    assert expected["drop 0.4"] != expected["drop 0.6"]  # the variations differ on these runs
    by_variation = dose.sensitivity_thresholds(runs)
    assert set(by_variation["variation"]) == set(labels)


def test_a_runs_setting_is_read_from_its_config_not_its_folder_name(tmp_path):
    _synthetic_run(tmp_path, setting="off-sampler")
    path = tmp_path / "dose/perturb-mantissa2/off-sampler/seed0/config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "is_correction": "token_truncate", "old_logprobs": "trainer"}))
    row = dose.dose_rows(tmp_path).iloc[0]
    assert (row["is_correction"], row["old_logprobs"]) == ("token_truncate", "trainer")


def test_the_sensitivity_listing_names_every_run_folder_with_a_collapse():
    """dose.md lists every arm x IS x old-logprob folder with a collapsed or unconfirmed run under
    the rule or a variation (perturb-mantissa1/off-sampler, 3 of 3 collapsed, among them) and
    says how many folders and runs it leaves out, each 0 under every variation."""
    sens = pd.read_csv(_committed("tables/dose_sensitivity.csv"))
    md = _committed("tables/dose.md").read_text()
    section = md.split("### Sensitivity of the verdicts")[1].split("### Anchors")[0]
    flagged = sens[dose.listed(sens)]
    for a, c, o in zip(flagged["arm"], flagged["is_correction"], flagged["old_logprobs"]):
        assert f"| {a}/{c}-{o} " in section, (a, c, o)
    assert "| perturb-mantissa1/off-sampler " in section
    rest = sens[~dose.listed(sens)]
    assert f"the other {len(rest)} ({int(rest['runs'].sum())} runs) have 0 collapsed and 0 unconfirmed" in section
    counts = rest[[c for c in rest if c.startswith(("collapsed", "unconfirmed"))]]
    assert (counts.to_numpy() == 0).all()


def test_committed_dose_runs_report_the_raw_terminal_reward_and_the_rule_version():
    from rpa.train.collapse import RULE_VERSION

    runs = _committed_runs()
    assert {"terminal_reward", "absorbing", "rule_version", "summary_superseded"} <= set(runs)
    assert set(runs["rule_version"]) == {RULE_VERSION} and not runs["absorbing"].astype(bool).any()
    assert int(runs["summary_superseded"].astype(bool).sum()) == 15  # summaries written under an earlier rule
    assert "summary_superseded" in _committed("tables/dose.md").read_text()
