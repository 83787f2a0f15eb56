"""The registered dose-response at fixed trainer arithmetic (issue 68, item 2; analysis.dose.response): on runs made
to a known law, the per-seed slope, the gain predicted at zero mismatch, the deficit and the share of it the mismatch
explains come back within their exact intervals; nothing is read from an unfinished grid or across CPU types; the
decision names only arms the grid has."""

import numpy as np
import pandas as pd
import pytest

DOSES = {"none": 0.03, "perturb-m5": 0.05, "perturb-m4": 0.1, "perturb-m3": 0.2}


def _runs(cost: float, floor_gain: float, seeds: int = 8, noise: float = 0.004, collapse: str | None = None,
          seed: int = 0):
    """Runs whose learning gain is 0.20 - cost x mismatch (+ noise) on the dose arms, floor_gain on fp32."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(seeds):
        for arm, x in DOSES.items():
            dose = x * (1 + 0.05 * rng.standard_normal())
            gain = 0.20 - cost * dose + noise * rng.standard_normal()
            rows.append({"arm": arm, "seed": s, "state": "finished", "pre_collapse_mismatch": dose,
                         "reward_auc": 0.1 + gain, "step1_reward": 0.1, "collapsed": arm == collapse,
                         "cpu_type": "AuthenticAMD avx512_bf16"})
        rows.append({"arm": "fp32", "seed": s, "state": "finished", "pre_collapse_mismatch": 5e-6,
                     "reward_auc": 0.1 + floor_gain + noise * rng.standard_normal(), "step1_reward": 0.1,
                     "collapsed": False, "cpu_type": "AuthenticAMD avx512_bf16"})
    return pd.DataFrame(rows)


RULE = {"arm_axis": "arm", "control_arm": "fp32", "confidence": 0.95, "outcome": "learning_gain"}
SPEC = {"doses": list(DOSES)}


def test_a_mismatch_that_explains_the_whole_deficit_is_read_as_such():
    from analysis.dose.response import dose_response

    # gain 0.20 - 1.0 x mismatch: stock BF16 (0.03) loses 0.03; fp32 (no mismatch) gains 0.20 -> share 1
    d = dose_response(_runs(cost=1.0, floor_gain=0.20), SPEC, RULE)
    assert d["seeds"] == 8 and d["lowest_collapsing"] is None
    slope = d["slope"]["shift"]
    assert slope["low"] < -1.0 < slope["high"] and slope["high"] < 0 and d["slope"]["signed_rank_p"] < 0.05
    assert d["explained"]["shift"]["low"] < 0.03 < d["explained"]["shift"]["high"]
    share = d["share"]
    assert share["low"] <= 1.0 <= share["high"] and share["bounded"] and 0.5 < share["estimate"] < 1.5


def test_no_dependence_on_the_dose_explains_none_of_the_deficit():
    from analysis.dose.response import dose_response

    d = dose_response(_runs(cost=0.0, floor_gain=0.26, seed=1), SPEC, RULE)
    assert d["slope"]["shift"]["low"] < 0 < d["slope"]["shift"]["high"]
    assert d["share"]["low"] <= 0.0 <= d["share"]["high"] and d["share"]["high"] < 0.5
    assert d["deficit"]["shift"]["low"] > 0.05  # the deficit is there; the mismatch does not explain it


def test_the_lowest_collapsing_dose_unfinished_runs_and_mixed_cpus():
    from analysis.dose.response import dose_response

    d = dose_response(_runs(cost=1.0, floor_gain=0.2, collapse="perturb-m4"), SPEC, RULE)
    assert d["lowest_collapsing"]["arm"] == "perturb-m4" and d["arms"]["perturb-m4"]["collapsed"] == 8
    runs = _runs(cost=1.0, floor_gain=0.2)
    runs.loc[3, "state"] = "running"
    assert dose_response(runs, SPEC, RULE)["unfinished"] == 1 and "slope" not in dose_response(runs, SPEC, RULE)
    runs = _runs(cost=1.0, floor_gain=0.2)
    runs.loc[0, "cpu_type"] = "GenuineIntel amx_bf16"
    assert "2 CPU types" in dose_response(runs, SPEC, RULE)["refused"]


def test_the_statement_prints_every_estimand():
    from analysis.collapse_search import decided_text
    from analysis.dose.response import dose_response

    text = decided_text({"dose_response": dose_response(_runs(cost=1.0, floor_gain=0.2), SPEC, RULE)}, "grid")
    for part in ("**Dose-response** (8 seeds", "slope per unit mean |dlogp|", "gain predicted at zero mismatch",
                 "fp32 minus none", "share of the deficit the mismatch explains", "lowest dose with a collapse: none"):
        assert part in text, text


@pytest.mark.parametrize("dose, needle", [
    ({"doses": ["none", "perturb-m9", "perturb-m4"]}, "'perturb-m9' is not a label"),
    ({"doses": ["none", "fp32", "perturb-m4"]}, "is also a dose"),
    ({"doses": ["none", "none", "perturb-m4"]}, "listed twice"),
    ({"doses": ["none", "perturb-m5", "perturb-m4"], "floor_arm": "fp64"}, "floor_arm: 'fp64' is not a label")])
def test_a_dose_response_naming_what_the_grid_lacks_is_refused(dose, needle):
    from rpa.workflow.experiments import decision_problems
    from rpa.workflow.grid import Cell

    cells = [Cell(grid="dose", name=f"{a}/seed{s}", labels={"arm": a}, seed=s, model="m", config={})
             for a in [*DOSES, "fp32"]
             for s in range(2)]
    rule = {"arm_axis": "arm", "reference_arm": "none", "control_arm": "fp32", "dose_response": dose}
    problems = decision_problems(rule, cells, "grids.dose.decision")
    assert any(needle in p for p in problems), problems
    assert not decision_problems({**rule, "dose_response": SPEC}, cells, "grids.dose.decision")


PILOT = {"model": "smollm2", "reference": "none", "low": 1.5, "high": 5.0, "doses": 3,
         "candidates": ["perturb-m6", "perturb-m5", "perturb-m4", "perturb-m3", "perturb-m2"]}


def _probe(ratios):
    rows = [{"model": "smollm2", "config": "none", "mean_abs_dlogp": 0.04}]
    rows += [{"model": "smollm2", "config": c, "mean_abs_dlogp": 0.04 * r} for c, r in ratios.items()]
    return pd.DataFrame(rows)


def test_the_pilot_chooses_doses_spanning_its_written_range():
    from analysis.dose.response import choose_doses

    probe = _probe({"perturb-m6": 1.1, "perturb-m5": 1.6, "perturb-m4": 2.9, "perturb-m3": 6.0, "perturb-m2": 20.0})
    assert choose_doses(probe, PILOT) == ["perturb-m5", "perturb-m4", "perturb-m3"]  # 1.6x, 2.9x (geometric middle), 6x
    assert choose_doses(probe, {**PILOT, "doses": 2}) == ["perturb-m5", "perturb-m3"]
    with pytest.raises(ValueError, match="no candidate reaches 5.0x"):
        choose_doses(_probe({"perturb-m6": 1.1, "perturb-m5": 1.6, "perturb-m4": 2.9, "perturb-m3": 3.5,
                             "perturb-m2": 4.0}), PILOT)
    with pytest.raises(ValueError, match="1 candidates lie between"):
        choose_doses(_probe({"perturb-m6": 0.9, "perturb-m5": 1.0, "perturb-m4": 2.0, "perturb-m3": 8.0,
                             "perturb-m2": 20.0}), PILOT)
    with pytest.raises(ValueError, match="has no perturb-m2"):
        choose_doses(probe[probe["config"] != "perturb-m2"], PILOT)


def test_the_registered_pilot_probes_every_candidate_and_the_grid_is_its_choice(tmp_path):
    """experiments/dose-smollm2.yaml (written before any run): its dry run probes stock BF16, FP32 and every
    candidate dose of its dose_pilot rule on SmolLM2; the grid entry is written only after the pilot, and then its
    dose arms are the rule's choice on the committed pilot table."""
    import yaml

    from analysis.dose.response import choose_doses
    from tests.conftest import REPO
    from tests.test_pipeline import snakemake

    config = yaml.safe_load((REPO / "experiments/dose-smollm2.yaml").read_text())
    rule = config["dose_pilot"]
    proc = snakemake("-n", f"{tmp_path}/tables/probe.csv", "--configfile", "experiments/dose-smollm2.yaml",
                     "--config", f"results={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for name in [rule["reference"], *rule["candidates"], "fp32"]:
        assert f"numerics={name}" in proc.stdout, name
    pilot = REPO / "results/reference/dose-smollm2/tables/probe.csv"
    entry = (config.get("grids") or {}).get("dose-smollm2")
    if not pilot.exists():
        assert entry is None, "the grid is written after its pilot, from the rule's choice"
        return
    chosen = choose_doses(pd.read_csv(pilot), {"low": 1.5, "high": 5.0, "doses": 3, **rule})
    assert entry["decision"]["dose_response"]["doses"] == [rule["reference"], *chosen]
    assert set(entry["axes"]["arm"]) == {rule["reference"], "fp32", *chosen}


@pytest.mark.parametrize("change, needle", [
    ({"candidates": ["none", "perturb-m4"]}, "'none' has no sampler_perturbation"),
    ({"candidates": ["perturb-m9", "perturb-m4"]}, "'perturb-m9' is not a name in probe.configs"),
    ({"model": "qwen"}, "dose_pilot.model: 'qwen' is not a name in models"),
    ({"low": 6.0}, "low (6.0) must be below high (5.0)")])
def test_a_bad_dose_pilot_is_refused_before_anything_runs(tmp_path, change, needle):
    import yaml

    from tests.conftest import REPO
    from tests.test_pipeline import snakemake

    config = yaml.safe_load((REPO / "experiments/dose-smollm2.yaml").read_text())
    config["dose_pilot"].update(change)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = snakemake("-n", f"{tmp_path}/tables/probe.csv", "--configfile", str(path), "--config",
                     f"results={tmp_path}")
    assert proc.returncode != 0 and needle in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-2000:]


def test_the_pilot_command_prints_the_choice_or_refuses(tmp_path):
    from tests.conftest import REPO, run_py

    probe = tmp_path / "probe.csv"
    _probe({"perturb-m6": 1.1, "perturb-m5": 1.6, "perturb-m4": 2.9, "perturb-m3": 6.0, "perturb-m2": 20.0}).to_csv(
        probe, index=False)
    proc = run_py(["-m", "analysis.dose.response", "--probe", str(probe), "--configfile",
                   str(REPO / "experiments/dose-smollm2.yaml")])
    assert proc.returncode == 0, proc.stderr
    assert "dose_response: {doses: [none, perturb-m5, perturb-m4, perturb-m3], floor_arm: fp32}" in proc.stdout
    assert "perturb-m5: {numerics: {sampler_perturbation: {mantissa_bits: 5}}}" in proc.stdout
    proc = run_py(["-m", "analysis.dose.response", "--probe", str(tmp_path / "none.csv"), "--configfile",
                   str(REPO / "experiments/dose-smollm2.yaml")])
    assert proc.returncode == 2 and "run the pilot first" in proc.stderr
