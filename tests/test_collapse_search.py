"""The natural-collapse search: grid expansion (each cell once), the pilot rule, the decision
rule and exact intervals, computed from run directories written here."""

import copy
import json

import pandas as pd
import pytest
import yaml

from analysis.collapse_search import clopper_pearson, decision, main, pilot, search_rows
from rpa.workflow.pipeline import PipelineConfigError, check_config
from rpa.workflow.experiments import grid_stage, kind_cells
from tests.conftest import REPO, tail
from tests.test_pipeline import snakemake

CONFIG = yaml.safe_load((REPO / "experiments/collapse-cpu.yaml").read_text())


def test_config_is_valid_and_every_cell_is_listed_once(tmp_path):
    check_config(CONFIG)
    points = kind_cells(CONFIG, "search")
    cells = [c.name for c in points]
    assert len(cells) == len(set(cells))
    for stage, spec in CONFIG["search"]["stages"].items():
        n = len(spec["seeds"])
        for values in spec["axes"].values():
            n *= len(values)
        assert sum(grid_stage(c) == stage for c in points) == n
        proc = snakemake("-n", "--cores", "2", f"collapse_{stage}", "--configfile", "experiments/collapse-cpu.yaml",
                         "--config", f"results={tmp_path / 'r'}")
        assert proc.returncode == 0, tail(proc)
        jobs = [line for line in proc.stdout.splitlines() if line.strip().startswith("grid_run ")]
        assert jobs and int(jobs[0].split()[1]) == n  # snakemake's job count: each cell once
    pilot_cells = [c for c in points if grid_stage(c) == "pilot"]
    assert all(c.config["steps"] == 10 and c.config["old_logprobs"] == "sampler" for c in pilot_cells)
    assert all(c.config["model"].endswith(f"/models/{c.model}") for c in pilot_cells)


def test_bad_search_entries_are_named():
    bad = copy.deepcopy(CONFIG)
    bad["search"]["stages"]["pilot"]["axes"]["model"]["nope"] = {"model": "no-such-model"}
    bad["search"]["stages"]["pilot"]["axes"]["temperature"]["T0"] = {"temperature": 0}
    with pytest.raises(PipelineConfigError) as err:
        check_config(bad)
    assert "model 'no-such-model' is not a name in models" in str(err.value)
    bad = copy.deepcopy(CONFIG)
    bad["search"]["stages"]["pilot"]["axes"]["temperature"]["T0"] = {"temperature": 0}
    with pytest.raises(PipelineConfigError, match=r"T0.*temperature must be in \[0.01, 2\], got 0"):
        check_config(bad)


def test_clopper_pearson_matches_known_values():
    assert clopper_pearson(0, 12)[1] == pytest.approx(1 - 0.025 ** (1 / 12), abs=1e-9)  # 0.2646
    lo, hi = clopper_pearson(3, 4)
    assert lo == pytest.approx(0.1941, abs=1e-4) and hi == pytest.approx(0.9937, abs=1e-4)
    assert clopper_pearson(4, 4) == (pytest.approx(0.025 ** (1 / 4), abs=1e-9), 1.0)


def _write_run(root, cell, rewards, mismatch, entropy=0.5, window=2, persist=3):
    run = root / "search" / cell
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"collapse": {"smoothing_window": window, "drop_fraction": 0.5,
                                                              "min_steps_after_drop": persist}}))
    lines = [{"step": i + 1, "reward": r, "loss": 0.1, "grad_norm": 1.0, "entropy": entropy,
              "mismatch/mean_abs_dlogp": m, "mismatch/phantom_clip_rate": m / 10}
             for i, (r, m) in enumerate(zip(rewards, mismatch))]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (run / "summary.json").write_text(json.dumps({"status": "ok", "wall_s": 1.0}))


def _manifest(root, stage, axes, cells, **extra):
    path = root / "search" / stage / "manifest.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stage": stage, "label": "test", "axes": axes, "cells": cells, **extra}))
    return json.loads(path.read_text())


RULE = {"arm_axis": "arm", "rung_axis": "lr", "reference_arm": "none", "control_arm": "fp32",
        "min_reference_collapsed": 3, "max_control_collapsed": 0, "confidence": 0.95}
STABLE, FALLS = [0.6] * 12, [0.6] * 5 + [0.1] * 7


def _grid(tmp_path, none_falls: int, fp32_falls: int, stage: str = "grid"):
    cells = []
    for lr in ("lr1", "lr2"):
        for arm, falls in (("none", none_falls if lr == "lr2" else 0), ("fp32", fp32_falls if lr == "lr2" else 0)):
            for seed in range(4):
                cell = f"{stage}/{lr}/{arm}/seed{seed}"
                rewards = FALLS if seed < falls else STABLE
                _write_run(tmp_path, cell, rewards, [0.01 * (i + 1) for i in range(12)])
                cells.append({"cell": cell, "labels": {"lr": lr, "arm": arm}, "seed": seed, "model": "m"})
    return _manifest(tmp_path, stage, {"lr": ["lr1", "lr2"], "arm": ["none", "fp32"]}, cells, decision=RULE)


def test_decision_rule_collapses_naturally_only_with_the_control_stable(tmp_path):
    manifest = _grid(tmp_path, none_falls=3, fp32_falls=0)
    runs, _ = search_rows(tmp_path, manifest)
    d = decision(runs, RULE)
    assert d["outcome"] == "collapses naturally" and d["collapsing_rungs"] == ["lr2"]
    assert d["pooled"] == {"pairs": 8, "reference_collapsed": 3, "control_collapsed": 0}
    # the same collapses with FP32 collapsing too: the step size's, not BF16's
    other = tmp_path / "other"
    runs2, _ = search_rows(other, _grid(other, none_falls=4, fp32_falls=1))
    d2 = decision(runs2, RULE)
    assert d2["outcome"] == "does not collapse naturally" and "4/8 runs collapsed" in d2["statement"]
    # pre-collapse mismatch: steps before the collapse only (smoothed over 2: collapse at step 7, steps 1-6 before)
    falls = runs[(runs.arm == "none") & (runs.lr == "lr2") & (runs.seed == 0)].iloc[0]
    assert falls["collapse_step"] == 7 and falls["max_pre_collapse_mismatch"] == pytest.approx(0.06)


def test_no_collapse_reports_the_envelope_and_an_upper_bound(tmp_path):
    manifest = _grid(tmp_path, none_falls=0, fp32_falls=0)
    assert main(["--results", str(tmp_path), "--stage", "grid", "--figure", str(tmp_path / "f.png")]) == 0
    d = json.loads((tmp_path / "tables/search_grid.json").read_text())["decision"]
    assert d["outcome"] == "does not collapse naturally" and d["reference_runs"] == 8
    assert d["reference_collapse_rate_interval"][1] == pytest.approx(1 - 0.025 ** (1 / 8), abs=1e-6)
    assert d["max_mismatch"] == pytest.approx(0.12) and "up to a pre-collapse mismatch of 0.12" in d["statement"]
    assert (tmp_path / "f.png").stat().st_size > 0 and manifest["cells"]


def test_the_lever_stage_is_judged_by_the_grids_rule_and_shares_its_warm_starts(tmp_path):
    _grid(tmp_path, none_falls=3, fp32_falls=0, stage="lever")
    assert main(["--results", str(tmp_path), "--stage", "lever", "--figure", str(tmp_path / "f.png")]) == 0
    assert json.loads((tmp_path / "tables/search_lever.json").read_text())["decision"]["outcome"] == "collapses naturally"
    assert "before the lever ran" in (tmp_path / "tables/search_lever.md").read_text()
    lever, grid = kind_cells(CONFIG, "search", "lever"), kind_cells(CONFIG, "search", "grid")
    assert {c.init.name for c in lever} == {c.init.name for c in grid}
    assert all(c.config["updates_per_generation"] == 4 for c in lever)


def test_pilot_picks_the_largest_mismatch_among_eligible_cells(tmp_path):
    cells = []
    for name, entropy, reward, mismatch in (("a", 0.2, 0.5, 0.05), ("b", 0.5, 0.5, 0.01), ("c", 0.6, 0.45, 0.02),
                                            ("d", 0.9, 0.9, 0.09)):
        _write_run(tmp_path, f"pilot/{name}/seed0", [reward] * 4, [mismatch] * 4, entropy=entropy)
        cells.append({"cell": f"pilot/{name}/seed0", "labels": {"setting": name}, "seed": 0, "model": "m"})
    manifest = _manifest(tmp_path, "pilot", {"setting": ["a", "b", "c", "d"]}, cells)
    runs, _ = search_rows(tmp_path, manifest)
    table, choice = pilot(runs, {"min_entropy": 0.3, "reward_low": 0.3, "reward_high": 0.7})
    assert choice["chosen"] == "pilot/c/seed0" and choice["eligible"] == 2  # a: entropy, d: reward out of range
    assert table["chosen"].sum() == 1


def test_shared_warm_start_is_one_per_model_settings_and_seed(tmp_path):
    config = copy.deepcopy(CONFIG)
    config["search"]["stages"]["grid"] = {
        "seeds": [0, 1, 2], "shared_warm_start": True,
        "overrides": {"model": "deep8", "warm_start": {"steps": 40}},
        "axes": {"lr": {"lr1": {"learning_rate": 1e-4}, "lr2": {"learning_rate": 2e-4}},
                 "arm": {"fp32": {"numerics": {"precision": "fp32"}}, "none": {}, "all": {"numerics": {"regions": "all"}}}}}
    check_config(config)
    grid = kind_cells(config, "search", "grid")
    inits = {c.init.name for c in grid}
    assert len(grid) == 18 and len(inits) == 3  # one per seed, shared by every lr and arm
    for c in grid:
        assert c.config["model"] == c.init.dir and c.config["warm_start"]["steps"] == 0
        assert c.init.config["warm_start"]["steps"] == 40 and c.init.config["seed"] == c.seed
    # the pilot keeps its own per-run warm start
    assert all(c.init is None for c in kind_cells(config, "search", "pilot"))
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    proc = snakemake("-n", "--cores", "2", "collapse_grid", "--configfile", str(path), "--config",
                     f"results={tmp_path / 'r'}")
    assert proc.returncode == 0, tail(proc)
    counts = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.splitlines()
              if len(line.split()) == 2 and line.split()[1].isdigit()}
    assert counts["grid_warm_start"] == 3 and counts["grid_run"] == 18


def test_an_incomplete_grid_gets_no_verdict(tmp_path):
    manifest = _grid(tmp_path, none_falls=3, fp32_falls=0)
    missing = tmp_path / "search" / manifest["cells"][0]["cell"] / "summary.json"
    missing.unlink()
    runs, _ = search_rows(tmp_path, manifest)
    d = decision(runs, RULE)
    assert d["outcome"] == "incomplete" and "15 of 16 runs finished" in d["statement"]
    # the unfinished run's partial log (still on disk) gives its row no numbers: the exported
    # reference, which holds finished runs only, must regenerate the same table
    row = runs.set_index("cell").loc[manifest["cells"][0]["cell"]]
    assert row["state"] == "missing" and pd.isna(row["step1_mismatch"]) and pd.isna(row["step1_entropy"])


@pytest.mark.parametrize("stage", ["pilot", "grid", "lever"])
def test_committed_search_tables_regenerate_from_the_raw_runs(tmp_path, stage):
    """The committed pilot choice and grid decision are what analysis.collapse_search computes
    from the committed raw runs (and an unfinished grid has no verdict)."""
    import shutil

    committed = REPO / "results/reference/collapse-cpu"
    # the committed results are part of the contract: a missing stage fails, never skips
    assert (committed / "search" / stage / "manifest.json").exists(), f"no committed {stage} results"
    shutil.copytree(committed / "search", tmp_path / "search")
    assert main(["--results", str(tmp_path), "--stage", stage, "--figure", str(tmp_path / "f.png")]) == 0
    for ext in ("csv", "md", "json"):  # byte for byte
        assert (tmp_path / f"tables/search_{stage}.{ext}").read_bytes() == \
            (committed / f"tables/search_{stage}.{ext}").read_bytes(), ext
    got = json.loads((tmp_path / f"tables/search_{stage}.json").read_text())
    want = json.loads((committed / f"tables/search_{stage}.json").read_text())
    if stage == "pilot":
        assert got["chosen"] == want["chosen"] and got["eligible"] == want["eligible"]
    else:
        assert got["decision"] == want["decision"]
        manifest = json.loads((committed / f"search/{stage}/manifest.json").read_text())
        finished = sum((committed / "search" / c["cell"] / "summary.json").exists() for c in manifest["cells"])
        assert (got["decision"]["outcome"] == "incomplete") == (finished < len(manifest["cells"]))


def test_the_grid_goes_on_from_committed_runs(tmp_path):
    """Committed finished runs put into place by ``analysis.restore_reference`` are not run again,
    whatever times the clone gave them (git writes a record ``seed0.json`` before its
    ``seed0/run.yaml``), and although their shared warm starts are missing (a finished run needs
    none); copied as the clone wrote them, they would be (the control)."""
    import os
    import shutil

    from analysis.restore_reference import is_record, restore

    committed = REPO / "results/reference/collapse-cpu"
    finished = list(committed.glob("search/grid/*/*/seed*/summary.json"))
    assert finished, "no committed grid runs (part of the contract)"
    clone = tmp_path / "clone"
    shutil.copytree(committed / "search", clone / "search", copy_function=shutil.copyfile)
    for f in sorted(p for p in clone.rglob("*") if p.is_file()):  # a clone's times: path order
        t = 1e9 + (0 if is_record(f) else 10)  # the records (before their run folders) the oldest
        os.utime(f, (t, t))
    grid = kind_cells(CONFIG, "search", "grid")

    def runs_to_do(res):
        proc = snakemake("-n", "--cores", "2", "collapse_grid", "--configfile", "experiments/collapse-cpu.yaml",
                         "--config", f"results={res}")
        assert proc.returncode == 0, tail(proc)
        counts = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.splitlines()
                  if len(line.split()) == 2 and line.split()[1].isdigit()}
        return counts

    assert runs_to_do(clone).get("grid_run", 0) == len(grid)  # the control: the clone's times rerun every job
    res = tmp_path / "r"
    assert restore(clone, res)["search"] == sum(1 for p in clone.rglob("*") if p.is_file())
    counts = runs_to_do(res)
    assert counts.get("grid_run", 0) == len(grid) - len(finished)  # none once the whole grid is committed
    if len(finished) == len(grid):
        assert "grid_warm_start" not in counts  # a complete committed grid rebuilds no warm start
    assert restore(clone, res) == {"search": 0}  # twice: nothing copied again


def test_restoring_from_a_folder_without_runs_is_refused(tmp_path, capsys):
    from analysis.refusal import run
    from analysis.restore_reference import main

    code = run(lambda: main(["--reference", str(tmp_path / "nothing"), "--results", str(tmp_path / "r")]))
    assert code == 2 and "has no search, dose, study folder of runs" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


@pytest.mark.cli  # the checker runs each analysis in a process of its own
def test_check_reference_finds_a_table_that_its_raw_runs_do_not_give(tmp_path, capsys):
    """``analysis.check_reference`` passes on the committed search results and names a table that was
    changed by hand (the control: a check that cannot fail would pass it too)."""
    import shutil

    from analysis import check_reference

    ref = tmp_path / "reference"
    shutil.copytree(REPO / "results/reference/collapse-cpu", ref / "collapse-cpu")
    assert check_reference.main(["--only", "collapse-cpu", "--reference", str(ref)]) == 0
    assert "0 differ" in capsys.readouterr().out
    table = ref / "collapse-cpu/tables/search_pilot.csv"
    table.write_text(table.read_text().replace("deep16", "deep61", 1))
    assert check_reference.main(["--only", "collapse-cpu", "--reference", str(ref)]) == 1
    assert "differs: collapse-cpu/tables/search_pilot.csv" in capsys.readouterr().out
    # the command lines are the workflow's: a committed table no rule declares cannot be checked
    (ref / "collapse-cpu/tables/extra.csv").write_text("x\n")
    with pytest.raises(SystemExit, match="no rule of the workflow writes extra.csv"):
        check_reference.main(["--only", "collapse-cpu", "--reference", str(ref)])


def test_fisher_exact_matches_known_values():
    from analysis.collapse_search import fisher_exact

    assert fisher_exact(4, 4, 0, 4) == pytest.approx(2 / 70)  # the two most extreme tables of C(8,4) = 70
    assert fisher_exact(3, 4, 0, 4) == pytest.approx(10 / 70)
    assert fisher_exact(1, 4, 0, 4) == pytest.approx(1.0)
    assert fisher_exact(1, 12, 0, 12) == pytest.approx(1.0)
    assert fisher_exact(0, 12, 6, 12) == pytest.approx(0.0137, abs=1e-4)


def test_a_stage_without_collapse_reports_its_envelope_and_the_arms_comparison(tmp_path):
    manifest = _grid(tmp_path, none_falls=0, fp32_falls=0)
    assert main(["--results", str(tmp_path), "--stage", "grid", "--figure", str(tmp_path / "f.png")]) == 0
    summary = json.loads((tmp_path / "tables/search_grid.json").read_text())
    env = summary["envelope"]
    assert env["arm"] == "none" and env["runs"] == 8 and env["models"] == ["m"]
    assert env["max_pre_collapse_mismatch"] == pytest.approx(0.12) and env["final_entropy"] == [0.5, 0.5]
    assert env["learning_rate"] == []  # the synthetic runs' config.json names no learning rate
    c = summary["comparison"]
    assert (c["reference"], c["treatment"], c["fisher_p"]) == ([0, 8], [0, 0], None)  # this grid has no `all` arm
    assert len(manifest["cells"]) == 16


@pytest.mark.cli  # the export is a script run in its own process
def test_exporting_one_search_stage_keeps_the_other_stages_committed_runs(tmp_path):
    """The grid and the lever ran from different worktrees; exporting the lever's results folder
    replaces the committed lever stage and leaves the committed grid as it was."""
    from tests.conftest import run_py

    out = tmp_path / "reference"
    _grid(out, none_falls=0, fp32_falls=0, stage="grid")
    (out / "search" / "lever" / "lr1" / "none" / "seed9").mkdir(parents=True)  # a stale run of an earlier export
    src = tmp_path / "lever-results"
    _grid(src, none_falls=0, fp32_falls=0, stage="lever")
    grid_before = sorted(p.relative_to(out) for p in (out / "search" / "grid").rglob("*"))
    proc = run_py(["-m", "analysis.export_reference", "--results", str(src), "--out", str(out), "--what", "search"])
    assert proc.returncode == 0, tail(proc)
    assert sorted(p.relative_to(out) for p in (out / "search" / "grid").rglob("*")) == grid_before
    assert (out / "search/lever/manifest.json").exists() and (out / "search/lever/lr2/none/seed0/summary.json").exists()
    assert not (out / "search/lever/lr1/none/seed9").exists()


def test_sign_test_and_the_paired_reward_auc_leave_ties_out(tmp_path):
    from analysis.collapse_search import comparison, sign_test

    assert sign_test(4, 4) == pytest.approx(0.125) and sign_test(0, 4) == pytest.approx(0.125)
    assert sign_test(9, 12) == pytest.approx(0.1460, abs=1e-4) and sign_test(2, 4) == 1.0
    assert sign_test(0, 0) is None
    manifest = _grid(tmp_path, none_falls=0, fp32_falls=0)  # none and fp32 learn identically: every pair tied
    slow = tmp_path / "search" / "grid/lr2/none/seed1"  # one none run learns later: its reward AUC is lower
    (slow / "metrics.jsonl").unlink()
    _write_run(tmp_path / "slow", "x", [0.3] * 4 + [0.6] * 8, [0.01] * 12)
    (tmp_path / "slow/search/x/metrics.jsonl").rename(slow / "metrics.jsonl")
    runs, _ = search_rows(tmp_path, manifest)
    paired = comparison(runs, RULE)["reward_auc_paired"]["fp32"]
    assert paired == {"pairs": 8, "ties": 7, "reference_lower": 1, "sign_test_p": 1.0}


# ----------------------------------------------- per-rung intervals, power, terminal reward

def test_the_rules_power_is_a_binomial_tail_over_the_rungs():
    """">= 3 of 4 seeds at one of 3 rungs" finds a true per-run collapse rate of 30% 23% of the
    time and one of 50% 68% of the time; one rung alone: 8% and 31%."""
    from analysis.collapse_search import binomial_tail, rule_power

    assert binomial_tail(3, 4, 0.5) == pytest.approx(5 / 16) and binomial_tail(0, 4, 0.3) == pytest.approx(1.0)
    assert binomial_tail(3, 4, 0.3) == pytest.approx(4 * 0.3 ** 3 * 0.7 + 0.3 ** 4)
    assert rule_power(0.3) == pytest.approx(0.2307, abs=1e-4) and rule_power(0.5) == pytest.approx(0.6750, abs=1e-4)
    assert round(100 * rule_power(0.3)) == 23 and round(100 * rule_power(0.5)) == 68
    assert rule_power(0.3, rungs=1) == pytest.approx(0.0837) and rule_power(0.5, rungs=1) == pytest.approx(0.3125)
    assert rule_power(0.0) == 0.0 and rule_power(1.0) == 1.0


def test_each_rung_has_its_own_exact_interval_and_the_statement_says_what_the_rule_can_detect(tmp_path):
    manifest = _grid(tmp_path, none_falls=0, fp32_falls=0)
    runs, _ = search_rows(tmp_path, manifest)
    d = decision(runs, RULE)
    for rung in d["rungs"]:
        assert rung["reference"] == "0/4" and rung["reference_interval"] == [0.0, pytest.approx(0.6024, abs=1e-4)]
    assert "lr1: none 0/4 (exact 95% interval 0.00-0.60)" in d["statement"]
    assert "0.00-0.37 if the collapse probability were one and the same at every rung" in d["statement"]
    assert d["power"]["rungs"] == 2 and d["power"]["seeds_per_rung"] == 4
    assert "30% with probability 16%, 50% with probability 53%" in d["statement"]


def _committed_stage(stage: str) -> dict:
    path = REPO / f"results/reference/collapse-cpu/tables/search_{stage}.json"
    assert path.exists(), f"committed reference data missing: {path}"
    return json.loads(path.read_text())


def test_committed_grid_reports_the_raw_terminal_reward_and_the_absorbing_end():
    """The lr 8e-4 `all` seed 0 run: smoothed final reward 0.429, raw terminal reward 0.002, an
    absorbing end -- in the run table, the group table and the stage's text."""
    runs = pd.read_csv(REPO / "results/reference/collapse-cpu/tables/search_grid.csv").set_index("cell")
    row = runs.loc["grid/lr8e-4/all/seed0"]
    assert row["final_reward"] == pytest.approx(0.4288, abs=1e-4) and row["terminal_reward"] < 0.003
    assert bool(row["absorbing"]) and row["verdict"] == "collapsed"
    assert runs["absorbing"].astype(bool).sum() == 1
    grid = _committed_stage("grid")
    assert [a["cell"] for a in grid["absorbing"]] == ["grid/lr8e-4/all/seed0"]
    group = next(g for g in grid["groups"] if g["lr"] == "lr8e-4" and g["arm"] == "all")
    assert group["absorbing"] == 1 and group["terminal_reward"] < group["final_reward"]
    md = (REPO / "results/reference/collapse-cpu/tables/search_grid.md").read_text()
    assert "**Absorbing end states**" in md and "grid/lr8e-4/all/seed0 (verdict collapsed, raw terminal reward 0.00228" in md


def test_committed_search_says_what_is_before_any_drop_and_compares_mismatch_at_matched_entropy():
    grid, lever = _committed_stage("grid"), _committed_stage("lever")
    env = grid["envelope"]
    # no `none` run collapsed: the envelope is the largest in-training mismatch any `none` run logged, from the raw logs
    logged = [json.loads(line)["mismatch/mean_abs_dlogp"]
              for log in sorted((REPO / "results/reference/collapse-cpu/search/grid").glob("*/none/seed*/metrics.jsonl"))
              for line in log.read_text().splitlines() if line.strip()]
    assert len(logged) >= 12 * 100 and env["max_pre_collapse_mismatch"] == pytest.approx(max(logged), abs=1e-12)
    assert env["max_pre_collapse_mismatch"] == pytest.approx(9.24e-3, abs=1e-5)  # step 108 of lr8e-4 none seed 3
    assert env["max_pre_drop_mismatch"] == pytest.approx(8.75e-3, abs=1e-5)  # before its raw reward fell (step 93)
    assert "0.00875 before any drop" in grid["decision"]["statement"]
    for stage in (grid, lever):
        for rung, r in stage["comparison"]["mismatch_ratio"].items():
            assert 0.72 <= min(r["step1"].values()) and max(r["step1"].values()) <= 0.80, rung  # all < none at step 1
    assert lever["comparison"]["mismatch_ratio"]["lr4e-4"]["entropy_matched"] == pytest.approx(0.82, abs=0.005)
    assert grid["comparison"]["mismatch_ratio"]["lr8e-4"]["mean_over_steps"] > 1  # all's policy stayed stochastic


@pytest.mark.parametrize("stage", ["grid", "lever"])
def test_committed_search_stages_have_the_sensitivity_companion(stage):
    from analysis.collapse_search import SENSITIVITY_LABELS

    summary = _committed_stage(stage)
    sens = pd.DataFrame(summary["sensitivity"])
    assert len(sens) == len(summary["groups"])
    assert {f"collapsed[{label}]" for label in SENSITIVITY_LABELS} <= set(sens)
    md = (REPO / f"results/reference/collapse-cpu/tables/search_{stage}.md").read_text()
    assert "### Sensitivity of the verdicts" in md
    runs = pd.read_csv(REPO / f"results/reference/collapse-cpu/tables/search_{stage}.csv")
    assert {"verdict_drop_0.4", "verdict_persist_x2", "rule_version", "summary_superseded"} <= set(runs)


def test_search_resources_take_the_stage_and_the_largest_label(tmp_path):
    """A run's memory is its stage's: ``label_mem_mb`` of its labels (largest), else ``mem_mb``,
    else the config's ``job_mem_mb``; Snakemake's dry run shows what each job reserves, and the
    schema refuses a memory of 0."""
    import re

    config = copy.deepcopy(CONFIG)
    config["results"] = str(tmp_path / "r")
    config["search"]["stages"]["lever"]["resources"] = {"mem_mb": 5000, "runtime": 77, "label_mem_mb": {"fp32": 9000}}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    dry = snakemake("-n", "--cores", "2", "collapse_lever", "--configfile", str(cfg))
    assert dry.returncode == 0, tail(dry)
    jobs = re.findall(r"rule grid_run:.*?wildcards: record=search/(\S+).*?resources: ([^\n]*)", dry.stdout, re.S)
    assert len(jobs) == 12
    for cell, resources in jobs:
        assert f"mem_mb={9000 if '/fp32/' in cell else 5000}" in resources and "runtime=77" in resources
    config["search"]["stages"]["lever"]["resources"] = {"mem_mb": 0}
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    bad = snakemake("-n", "--cores", "2", "collapse_lever", "--configfile", str(cfg))
    assert bad.returncode != 0 and "mem_mb" in bad.stdout + bad.stderr


def test_the_questions_name_arms_of_the_grid():
    config = copy.deepcopy(CONFIG)
    config["search"]["decision"]["questions"] = {"Q1": {"question": "?", "a": "none", "b": "fp32"}}
    check_config(config)
    config["search"]["decision"]["questions"]["Q2"] = {"a": "none", "b": "self-sampled"}
    with pytest.raises(PipelineConfigError, match="questions.Q2.b: 'self-sampled' is not a label"):
        check_config(config)


@pytest.mark.engine
def test_a_finished_search_is_not_run_again(tmp_path):
    """A search stage Snakemake ran to the end has nothing to do the next time: the run's input
    (its starting checkpoint) is the same set before and after the run, so the input trigger
    does not fire, and a run asks for the memory its stage's resources give it."""
    config = copy.deepcopy(CONFIG)
    config["results"] = str(tmp_path / "r")
    config["models"] = {"deep8": {"tiny": {"arch": "qwen3", "seed": 0}}}
    config["search"]["stages"] = {"pilot": {
        "seeds": [0], "overrides": {"steps": 2, "eval_every": 0, "checkpoint_every": 2, "warm_start": {"steps": 0},
                                    "max_completion_length": 16, "task": {"length": 6},
                                    "vllm_enforce_eager": True},  # eager: ~6 s to start, not a ~30-s compile
        "axes": {"model": {"deep8": {"model": "deep8"}}}, "resources": {"mem_mb": 3500, "runtime": 9}}}
    config["search"].pop("decision")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    dry = snakemake("-n", "--cores", "2", "collapse_pilot", "--configfile", str(cfg))
    assert dry.returncode == 0, tail(dry)
    assert "mem_mb=3500" in dry.stdout and "runtime=9" in dry.stdout
    proc = snakemake("--cores", "2", "collapse_pilot", "--configfile", str(cfg))
    assert proc.returncode == 0, tail(proc, 6000)
    again = snakemake("--cores", "2", "collapse_pilot", "--configfile", str(cfg))
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, tail(again)


def test_an_incomplete_grid_with_arm_only_metrics_loads_without_pandas_deprecations(tmp_path):
    """A missing run (no verdict: flags missing) beside finished ones, and a metric only one arm logs:
    read under warnings-as-errors, so a pandas dtype rule that is changing cannot decide a table."""
    import warnings

    from analysis.runs import flags

    manifest = _grid(tmp_path, none_falls=0, fp32_falls=0)
    extra = tmp_path / "search" / manifest["cells"][0]["cell"] / "metrics.jsonl"
    lines = [{**json.loads(x), "mismatch/self_residual": None} for x in extra.read_text().splitlines()]
    extra.write_text("".join(json.dumps(x) + "\n" for x in lines))  # logged, but all missing
    (tmp_path / "search" / manifest["cells"][1]["cell"] / "summary.json").unlink()  # a run not finished
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runs, curves = search_rows(tmp_path, manifest)
        collapsed = flags(runs["collapsed"])
    assert collapsed.dtype == bool and not collapsed.any()
    assert (runs["state"] == "missing").sum() == 1 and "mismatch/self_residual" not in curves
    assert flags(pd.Series([True, None, False, float("nan")], dtype=object)).tolist() == [True, False, False, False]


def test_runs_per_arm_counts_runs_not_steps():
    """The grid figure's legend: each arm's runs (labels and seed), however many steps each logged."""
    from analysis.collapse_search import runs_per_arm

    curves = pd.DataFrame([{"lr": lr, "arm": arm, "seed": seed, "step": step}
                           for lr, arm, seeds in (("a", "none", (0, 1, 2)), ("b", "none", (0,)), ("a", "fp32", (0,)))
                           for seed in seeds for step in (1, 5, 9)])
    counts = runs_per_arm(curves, ["lr", "arm"], "arm")
    assert counts.to_dict() == {"none": 4, "fp32": 1}


def test_final_entropy_is_over_the_runs_own_window_and_refused_when_the_window_is_longer(tmp_path):
    """``final_entropy`` averages the run's smoothing window (the window of its smoothed final reward), says
    which (``final_entropy_steps``), and is left empty -- not the whole-run mean -- when the run logged fewer
    steps than that window (issue 55: a 10-step window over 9 logged steps was the whole run)."""
    cells = []
    for seed, (window, steps) in enumerate(((3, 9), (10, 9))):
        cell = f"grid/lr1/none/seed{seed}"
        _write_run(tmp_path, cell, [0.5] * steps, [0.01] * steps, window=window)
        metrics = tmp_path / "search" / cell / "metrics.jsonl"
        lines = [json.loads(x) for x in metrics.read_text().splitlines()]
        for i, line in enumerate(lines):
            line["entropy"] = float(i + 1)  # 1 .. 9
        metrics.write_text("".join(json.dumps(x) + "\n" for x in lines))
        cells.append({"cell": cell, "labels": {"lr": "lr1", "arm": "none"}, "seed": seed, "model": "m"})
    runs, _ = search_rows(tmp_path, _manifest(tmp_path, "grid", {"lr": ["lr1"], "arm": ["none"]}, cells))
    fits, longer = runs.iloc[0], runs.iloc[1]
    assert fits["final_entropy"] == pytest.approx(8.0) and fits["final_entropy_steps"] == 3
    assert fits["last_entropy"] == 9.0 and fits["entropy"] == pytest.approx(5.0)
    assert pd.isna(longer["final_entropy"]) and longer["final_entropy_steps"] == 10 and longer["last_entropy"] == 9.0


def test_post_hoc_comparisons_pool_arms_per_seed_and_describe_each_arm():
    """A post-hoc comparison (config ``post_hoc``) pairs by seed the per-seed mean of its ``a`` arms with
    ``b``; ``learning_gain`` takes each run's own step-1 reward out; the per-arm rows say whether the first
    held-out evaluation is one measurement (identical over seeds) and how many prompts it solved."""
    from analysis.collapse_search import post_hoc

    rows = []
    for seed in range(8):
        for arm, auc, step1, acc in (("fp32", 0.5, 0.1, 22 / 64), ("none", 0.4, 0.1, 19 / 64),
                                     ("all", 0.3 + seed / 100, 0.0, 20 / 64)):
            rows.append({"arm": arm, "seed": seed, "state": "finished", "reward_auc": auc, "step1_reward": step1,
                         "terminal_reward": auc + 0.1, "step1_entropy": 1.5, "last_entropy": 1.4 if arm == "none"
                         else 1.6, "first_eval_accuracy": acc, "first_eval_prompts": 64})
    spec = {"comparisons": {"auc": {"a": ["none", "all"], "b": "fp32", "outcome": "reward_auc"},
                            "gain": {"a": "all", "b": "fp32", "outcome": "learning_gain"}}}
    out = post_hoc(pd.DataFrame(rows), pd.DataFrame(), spec, {"arm_axis": "arm"})
    auc, gain = out["comparisons"]["auc"], out["comparisons"]["gain"]
    # (0.4 + 0.3 + s/100) / 2 - 0.5 per seed: -0.15 .. -0.115, all lower
    assert auc["mean_difference"] == pytest.approx(-0.15 + 0.0175) and auc["a_lower"] == 8
    assert auc["signed_rank_p"] == pytest.approx(2 / 256) and auc["shift"]["high"] < 0
    # all's gain (0.3 + s/100 - 0) vs fp32's (0.5 - 0.1): -0.1 + s/100 per seed
    assert gain["mean_difference"] == pytest.approx(-0.1 + 0.035) and gain["pairs"] == 8
    none = out["arms"]["none"]
    assert none["first_eval_one_measurement"] and none["first_eval_solved"] == [19] and none["eval_prompts"] == 64
    assert none["entropy_fell"] == 8 and out["arms"]["fp32"]["entropy_fell"] == 0
    assert out["arms"]["fp32"]["reward_gain"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="outcome"):
        post_hoc(pd.DataFrame(rows), pd.DataFrame(), {"comparisons": {"x": {"a": "all", "b": "fp32",
                                                                               "outcome": "auc"}}}, {})


def test_a_factorial_grids_figure_adds_the_outcome_per_run(tmp_path):
    """With pre-registered effects the grid figure has a third row: each finished run's learning gain per
    cell (issue 56's figure); without them it keeps its two rows."""
    from PIL import Image

    from analysis.collapse_search import _figure_grid
    from tests.conftest import assert_figure

    cells = []
    for arm in ("fp32", "none"):
        for seed in range(2):
            cell = f"grid/lr1/{arm}/seed{seed}"
            _write_run(tmp_path, cell, [0.2, 0.3, 0.4, 0.5], [0.01] * 4)
            cells.append({"cell": cell, "labels": {"lr": "lr1", "arm": arm}, "seed": seed, "model": "m"})
    manifest = _manifest(tmp_path, "grid", {"lr": ["lr1"], "arm": ["fp32", "none"]}, cells)
    runs, curves = search_rows(tmp_path, manifest)
    rule = {"arm_axis": "arm", "rung_axis": "lr", "effects": {"e": {"contrast": {"none": 1, "fp32": -1}}}}
    sizes = {}
    for name, r in (("with", rule), ("without", {k: v for k, v in rule.items() if k != "effects"})):
        path = tmp_path / f"{name}.png"
        _figure_grid(curves, {**manifest, "label": "t"}, path, r, runs.assign(state="finished", reward_auc=0.3,
                                                                                step1_reward=0.1))
        assert_figure(path)
        sizes[name] = Image.open(path).size
    assert sizes["with"][1] > sizes["without"][1]  # the third row
