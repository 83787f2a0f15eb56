"""The config's ``grids:`` section: an experiment written as a grid entry in the one shape every
experiment has (rpa.workflow.experiments.grid_of), checked before anything loads, run by the one grid
rule file and tabled by analysis.grid_summary."""

import copy
import json
import re
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from rpa.workflow.grid import expand
from rpa.workflow.pipeline import PipelineConfigError, check_config
from rpa.workflow.experiments import grid_of, kind_cells, kind_grids
from rpa.workflow.presets import train_spec
from tests.conftest import REPO, tail
from tests.test_grid import _config
from tests.test_pipeline import snakemake

TOYS = yaml.safe_load((REPO / "experiments/toys.yaml").read_text())
RUN = {"steps": 2, "eval_every": 0, "checkpoint_every": 2, "warm_start": {"steps": 0}, "max_completion_length": 16,
       "task": {"length": 6}, "vllm_enforce_eager": True}  # eager: ~6 s to start, not a ~30-s compile


def _with_grids(tmp_path, grids, models=None):
    """The toys config (no grid of its own) with a ``grids:`` section, validated as the Snakefile does."""
    from snakemake.utils import validate

    config = {**copy.deepcopy(TOYS), "results": str(tmp_path / "r"), "grids": copy.deepcopy(grids)}
    if models:
        config["models"] = {**config["models"], **models}
    validate(config, str(REPO / "experiments/schema/config.schema.yaml"))
    return config


def _same_runs(a, b):
    return [(c.labels, c.seed, c.config, c.init and c.init.config) for c in a] == \
        [(c.labels, c.seed, c.config, c.init and c.init.config) for c in b]


def _moved(c):
    """A cell's run as a search stage would have it: a shared warm start under ``search/init/``."""
    config = dict(c.config)
    if c.init is not None:
        config["model"] = config["model"].replace("/grids/init/", "/search/init/")
    return dict(c.labels), c.seed, config, c.init and dict(c.init.config)


def test_a_train_section_and_every_search_stage_are_grids_entries_as_written(tmp_path):
    """The sections are shorthand for the one shape: the GRPO grid's entry (train_spec) and each search
    stage, written into ``grids:``, pass its schema and expand to the same run configs, labels, seeds and
    warm starts (under ``grids/`` instead of their own section)."""
    default = _config("config.yaml")
    config = _with_grids(tmp_path, {"grpo": train_spec(default)}, default["models"])
    config["results"] = default["results"]
    assert _same_runs(expand(grid_of(config, "grids", config["grids"]["grpo"], "grpo")), kind_cells(default, "train"))
    assert check_config(config).cells["grids"][0].name == "grpo/" + kind_cells(default, "train")[0].name

    search = _config("collapse-cpu.yaml")
    stages = {name: {"base": search["search"]["base"], **stage} for name, stage in search["search"]["stages"].items()}
    config = _with_grids(tmp_path, stages, search["models"])
    config["results"] = search["results"]
    cells = check_config(config).cells["grids"]
    for stage_grid in kind_grids(search, "search"):
        stage = stage_grid.name.removeprefix("search/")
        mine = [c for c in cells if c.grid == f"grids/{stage}"]
        # the same runs, each shared warm start in the section's own folder (grids/init/... for search/init/...)
        assert [_moved(c) for c in mine] == [_moved(c) for c in expand(stage_grid)]
        assert all(c.init is None or c.init.dir.startswith(f"{search['results']}/grids/init/") for c in mine)
    assert any(c.init for c in cells)  # a stage with shared warm starts is among them


def test_a_grids_entry_is_refused_before_anything_loads(tmp_path):
    good = {"base": "experiments/train/collapse-walk.yaml", "seeds": [0], "overrides": {"model": "tiny-qwen3"},
            "axes": {"arm": {"none": {}}}}
    check_config(_with_grids(tmp_path, {"g": good}))  # the control: the entry the bad ones change is valid
    config = _with_grids(tmp_path, {"g": good})
    for name, bad, needle in [
        ("model", {**good, "overrides": {"model": "nope"}}, "grids cell g/none/seed0: model 'nope' is not a name in models"),
        ("run", {**good, "axes": {"arm": {"none": {"learning_rate": -1}}}}, "grids cell g/none/seed0: learning_rate"),
        ("exclude", {**good, "exclude": [{"lr": ["x"]}]}, "grids: grid grids/g: exclude names no axis: lr"),
        ("twice", {**good, "axes": {"a": {"x": {}}, "b": {"x": {}, "y": {}}}, "path": "{a}"}, "two cells share a directory"),
    ]:
        config["grids"] = {"g": bad}
        with pytest.raises(PipelineConfigError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            check_config(config)
    from snakemake.utils import validate

    with pytest.raises(Exception, match="sedes"):
        validate({**config, "grids": {"g": {**good, "sedes": [0]}}}, str(REPO / "experiments/schema/config.schema.yaml"))


def test_a_grids_arm_may_set_the_trainers_precision_and_is_held_to_its_refusals(tmp_path):
    """An axis value is a numerics override like any other: ``trainer_precision: fp32`` reaches the cell's run
    config (merged key by key into the base's numerics) and its refusals name the cell."""
    entry = {"base": "experiments/train/collapse-walk.yaml", "seeds": [0], "overrides": {"model": "tiny-qwen3"},
             "axes": {"arm": {"none": {}, "trainer-fp32": {"numerics": {"trainer_precision": "fp32"}}}}}
    cells = check_config(_with_grids(tmp_path, {"g": entry})).cells["grids"]
    runs = {c.labels["arm"]: c.run.numerics for c in cells}
    assert runs["trainer-fp32"].trainer_precision == "fp32" and runs["none"].trainer_precision == "same"
    assert runs["trainer-fp32"].trainer_positions == "mask"  # the base's, kept
    bad = {**entry, "axes": {"arm": {"bad": {"numerics": {"regions": "all", "trainer_precision": "fp32"}}}}}
    with pytest.raises(PipelineConfigError, match="grids cell g/bad/seed0: .*trainer_precision fp32 leaves no BF16"):
        check_config(_with_grids(tmp_path, {"g": bad}))


def test_the_documented_grids_entry_is_a_valid_config(tmp_path):
    """docs/pipeline.md's example entry, as written, passes the schema and the config check: 2 x 2 labels
    less the one combination it excludes, times 3 seeds."""
    text = (REPO / "docs/pipeline.md").read_text()
    block = text[text.index("```yaml\ngrids:") + len("```yaml\n"):]
    entry = yaml.safe_load(block[:block.index("```")])["grids"]
    cells = check_config(_with_grids(tmp_path, entry)).cells["grids"]
    assert len(cells) == 9 and cells[0].name == "lr-sweep/none/hi/seed0"
    assert not [c for c in cells if c.labels == {"regions": "all", "lr": "lo"}]


def test_the_documented_preset_entry_is_a_valid_config(tmp_path):
    """docs/pipeline.md's ``kind: dose`` entry, as written, passes the schema and the config check: 3 doses x 2
    corrections with the trainer's old logprobs x 3 seeds, from one warm start in the entry's folder."""
    text = (REPO / "docs/pipeline.md").read_text()
    block = text[text.index("```yaml\ngrids:\n  control-b:") + len("```yaml\n"):]
    entry = yaml.safe_load(block[:block.index("```")])["grids"]
    cells = check_config(_with_grids(tmp_path, entry)).cells["grids"]
    assert len(cells) == 18 and cells[0].name == "control-b/bf16-none/off-trainer/seed0"
    assert {c.init.dir for c in cells} == {f"{tmp_path}/r/grids/control-b/init"}


@pytest.mark.engine
def test_an_arm_added_in_yaml_only_reaches_the_table(tmp_path):
    """The README's recipe "add an arm", on a grid written only in YAML: the cheapest grids: entry (one arm, tiny
    model, 2 steps) is run and tabled; then one more label is written on its axis in the YAML and nothing else.
    The two arms of the seed share one sampler side, so with ``arms_per_process: 2`` they are now one job of
    one process (its resources doubled); the next `snakemake grids` runs the new cell only (the first run is
    not run again), the entry's table has a row per run from the one run loader, and the third has nothing to do."""
    entry = {"base": "experiments/train/collapse-walk.yaml", "seeds": [0], "overrides": {**RUN, "model": "tiny-qwen3"},
             "arms_per_process": 2, "resources": {"mem_mb": 3500, "runtime": 9},
             "axes": {"lr": {"hi": {"learning_rate": 1e-3}}}}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(_with_grids(tmp_path, {"arms": entry}), sort_keys=False))
    proc = snakemake("--cores", "2", "grids", "--configfile", str(cfg))
    assert proc.returncode == 0, tail(proc, 6000)
    r = tmp_path / "r"
    assert list(pd.read_csv(r / "tables/grids/arms.csv")["lr"]) == ["hi"]
    first = (r / "grids/arms/hi/seed0/summary.json").stat().st_mtime_ns
    config = yaml.safe_load(cfg.read_text())  # the copy of the config with one more arm, nothing else changed
    config["grids"]["arms"]["axes"]["lr"]["lo"] = {"learning_rate": 1e-5}
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    dry = snakemake("-n", "--cores", "2", "grids", "--configfile", str(cfg))
    assert dry.returncode == 0, tail(dry)
    assert "mem_mb=3500" in dry.stdout and "runtime=18" in dry.stdout  # one process of two runs
    proc = snakemake("--cores", "2", "grids", "--configfile", str(cfg))
    assert proc.returncode == 0, tail(proc, 6000)
    assert (r / "grids/arms/hi+lo/seed0.json").is_file()
    table = pd.read_csv(r / "tables/grids/arms.csv")
    assert list(table["lr"]) == ["hi", "lo"] and set(table["state"]) == {"finished"}
    assert (table["steps"] == 2).all() and table["reward_auc"].notna().all()
    assert "### grid arms" in (r / "tables/grids/arms.md").read_text()
    assert (r / "grids/arms/hi/seed0/summary.json").stat().st_mtime_ns == first  # the first arm not run again
    manifest = json.loads((r / "grids/arms/manifest.json").read_text())
    assert manifest["axes"] == {"lr": ["hi", "lo"]}
    assert [c["cell"] for c in manifest["cells"]] == ["arms/hi/seed0", "arms/lo/seed0"]
    again = snakemake("--cores", "2", "grids", "--configfile", str(cfg))
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, tail(again)


# ---------------------------------------------------------------- grids: entries of a preset kind (dose, study)

PRESET_CONFIGS = {"dose": "config.yaml", "study": "study-cpu.yaml"}
"""A committed config with the preset's section, and the committed raw runs the section made."""


def _as_entry(kind, name="e", results=None, **changes):
    """(the committed config with its ``kind`` section, the same config with that section moved into ``grids:``
    as the entry ``name`` of that kind), both validated as the Snakefile does (the schema's defaults)."""
    from snakemake.utils import validate

    section = yaml.safe_load((REPO / "experiments" / PRESET_CONFIGS[kind]).read_text())
    section.pop("train", None)
    section[kind].update(changes)
    if results:
        section["results"] = str(results)
    entry = copy.deepcopy(section)
    entry["grids"] = {name: {"kind": kind, **entry.pop(kind)}}
    for config in (section, entry):
        validate(config, str(REPO / "experiments/schema/config.schema.yaml"))
    return section, entry


def _one_size(model="mini-xs", arms=None):
    """The committed study's section changes that keep one model size only (its per-size keys with it), and of
    its arms only ``arms`` (None: all)."""
    study = yaml.safe_load((REPO / "experiments" / PRESET_CONFIGS["study"]).read_text())["study"]
    per_size = ("sizes", "size_arms", "resources", "parameters", "throughput_tokens_per_s")
    kept = {k: {m: v for m, v in study[k].items() if m == model} for k in per_size if k in study}
    return {"models": [model], **kept, **({"arms": {a: study["arms"][a] for a in arms}} if arms else {})}


def _relative(text, config, folder):
    """A run's text with its entry's folder under the results (where its shared warm start is) left out."""
    return text.replace(f"{config['results']}/{folder}/", "<entry>/")


@pytest.mark.parametrize("kind", ["dose", "study"])
def test_a_dose_or_study_section_is_shorthand_for_a_grids_entry_of_its_kind(kind):
    """The ``dose:`` / ``study:`` section written as a ``grids:`` entry of ``kind: dose`` / ``kind: study``
    passes the one schema with the same defaults and expands to the same cells: the same directories under the
    entry, labels, seeds and models, the same run.yaml text and shared warm starts (each under the entry's own
    folder), the same process groups with the same resources, and the same manifest (its cells under the
    entry, and the entry's name)."""
    from rpa.workflow.experiments import ancient_start, entry_of, manifest
    from rpa.workflow.resources import group_resources

    section, entry = _as_entry(kind)
    assert entry["grids"]["e"] == {"kind": kind, **section[kind]}  # the defaults filled in alike
    mine, theirs = check_config(entry), check_config(section)
    cells, expected = mine.cells["grids"], theirs.cells[kind]
    assert len(cells) == len(expected) > 1
    assert [c.name for c in cells] == [f"e/{c.name}" for c in expected]
    assert [(c.labels, c.seed, c.model) for c in cells] == [(c.labels, c.seed, c.model) for c in expected]
    assert [_relative(yaml.safe_dump(c.run.to_dict()), entry, "grids/e") for c in cells] == \
        [_relative(yaml.safe_dump(c.run.to_dict()), section, kind) for c in expected]
    assert {c.init.dir for c in cells} == {c.init.dir.replace(f"/{kind}/", "/grids/e/", 1) for c in expected}
    assert [dict(c.init.config) for c in cells] == [dict(c.init.config) for c in expected]
    assert [c.name for c in cells if ancient_start(entry, "grids", c)] == []  # a fixed warm-start folder
    groups, expected_groups = mine.groups["grids"], theirs.groups[kind]
    assert [g.name for g in groups] == [f"e/{g.name}" for g in expected_groups]
    assert [group_resources(entry, "grids", entry_of(entry, "grids", g.cells[0]), g.cells) for g in groups] == \
        [group_resources(section, kind, section[kind], g.cells) for g in expected_groups]
    written, own = manifest(entry, "grids", "e", cells), manifest(section, kind, None, expected)
    assert written.pop("grid") == "e"
    assert [c.pop("cell") for c in written["cells"]] == [f"e/{c.pop('cell')}" for c in own["cells"]]
    assert json.dumps(written) == json.dumps(own)  # the kind's keys, in its order


@pytest.mark.parametrize("kind,changes,needle", [
    ("dose", {"doses": None}, "grids.e: 'doses' is a required property"),
    ("dose", {"dosez": [1]}, "grids.e: unknown key(s) 'dosez' (did you mean 'doses'?)"),
    ("dose", {"axes": {"arm": {"x": {}}}}, "grids.e: unknown key(s) 'axes'"),  # a plain grid's key
    ("dose", {"doses": [9]}, "grids.e.doses.0: 9 is greater than the maximum of 6"),
    ("study", {"armz": {}}, "grids.e: unknown key(s) 'armz' (did you mean 'arms'?)"),
    ("doze", {}, "grids.e.kind: 'doze' is not one of ['grid', 'dose', 'study']"),
], ids=["missing", "misspelt", "plain-key", "bad-value", "study-misspelt", "kind"])
def test_a_bad_preset_entry_is_refused_by_the_schema_naming_it(kind, changes, needle):
    """The schema checks a ``grids:`` entry by its kind: one of a preset kind has exactly the keys of that
    kind's section; the refusal is one line naming the entry (the Snakefile's message)."""
    import jsonschema

    from rpa.workflow.pipeline import schema_problem

    section = yaml.safe_load((REPO / "experiments" / PRESET_CONFIGS.get(kind, "config.yaml")).read_text())
    written = {**section.pop(kind if kind in PRESET_CONFIGS else "dose"), **changes, "kind": kind}
    config = {**section, "grids": {"e": {k: v for k, v in written.items() if v is not None}}}
    schema = str(REPO / "experiments/schema/config.schema.yaml")
    assert schema_problem(config, schema).startswith(needle)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(yaml.safe_load(open(schema))).validate(config)


@pytest.mark.parametrize("kind,changes,needle", [
    ("dose", {"model": "nope"}, "grids.e.model: 'nope' is not a name in models"),
    ("dose", {"doses": ["none", "none"]}, "grids.e: two cells share a directory"),
    ("study", {"reference_arm": "nonee"}, "grids.e.reference_arm: 'nonee' is not an arm of grids.e.arms (did you "
                                          "mean 'none'?)"),
    ("study", {"sizes": {"mini-xxl": {}}}, "grids.e.sizes: 'mini-xxl' is not in grids.e.models"),
])
def test_a_preset_entry_is_held_to_its_kinds_checks_naming_it(kind, changes, needle):
    """A ``grids:`` entry of a preset kind gets the checks its section gets, before any cell is made, each
    problem named where the entry is written; the section's own problems keep their names."""
    section, entry = _as_entry(kind, **changes)
    with pytest.raises(PipelineConfigError, match=re.escape(needle)):
        check_config(entry)
    with pytest.raises(PipelineConfigError, match=re.escape(needle.replace("grids.e", kind))):
        check_config(section)


def test_a_preset_entrys_aggregate_runs_its_kinds_analysis_on_the_entry(tmp_path):
    """The dry run of a config with a plain ``grids:`` entry, a ``kind: dose`` and a ``kind: study`` entry:
    each preset entry's aggregate is its kind's analysis pointed at the entry's manifest, writing its tables
    and figures under ``tables/grids/<entry>/`` and ``figures/grids/<entry>/``; its shared warm starts are in
    the entry's folder; the plain entry keeps its one table; the ``grids`` target asks for all of them."""
    _, config = _as_entry("study", "st", tmp_path / "r", **_one_size())
    _, dose = _as_entry("dose", "pc", tmp_path / "r", doses=["none", 2], is_corrections=["off"],
                        old_logprobs=["trainer"], anchors={})
    config["models"]["tiny-qwen3"] = dose["models"]["tiny-qwen3"]
    config["grids"].update(dose["grids"])
    config["grids"]["plain"] = {"base": "experiments/train/collapse-walk.yaml", "seeds": [0],
                                "overrides": {"model": "tiny-qwen3"}, "axes": {"lr": {"hi": {"learning_rate": 1e-3}}}}
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    dry = snakemake("-n", "-p", "--cores", "2", "--configfile", str(cfg), "--", "grids")
    assert dry.returncode == 0, tail(dry)
    r = f"{tmp_path}/r"
    assert re.search(r"rule grids_dose_aggregate:\n(.*\n)*?    output: " + re.escape(
        f"{r}/tables/grids/pc/dose.csv, {r}/tables/grids/pc/dose.md, {r}/tables/grids/pc/dose_runs.csv, "
        f"{r}/tables/grids/pc/dose_sensitivity.csv, {r}/figures/grids/pc/dose_response.png"), dry.stdout)
    assert (f"python -m analysis.dose --results {r} --manifest {r}/grids/pc/manifest.json --out-dir "
            f"{r}/tables/grids/pc --figure {r}/figures/grids/pc/dose_response.png > {r}/logs/grids_pc.log"
            ) in dry.stdout
    assert (f"python -m analysis.study --results {r} --format png --manifest {r}/grids/st/manifest.json --out-dir "
            f"{r}/tables/grids/st --figure-dir {r}/figures/grids/st > {r}/logs/grids_st.log") in dry.stdout
    assert f"{r}/tables/grids/st/study_collapse.csv" in dry.stdout
    assert f"output: {r}/tables/grids/plain.csv, {r}/tables/grids/plain.md" in dry.stdout
    assert f"output: {r}/grids/pc/init/config.json" in dry.stdout
    assert f"output: {r}/grids/st/mini-xs/init/config.json" in dry.stdout
    assert f"{r}/dose/" not in dry.stdout and f"{r}/study/" not in dry.stdout
    for rule in ("grids_dose_aggregate", "grids_study_aggregate", "grids_aggregate"):
        assert re.search(rf"^{rule}\s+1$", dry.stdout, re.M), rule


@pytest.mark.parametrize("kind,reference,changes", [
    ("dose", "cpu", {"doses": ["none", 2], "is_corrections": ["off", "token_truncate"], "old_logprobs": ["trainer"],
                     "anchors": {}}),
    ("study", "study-cpu", _one_size(arms=["none", "all", "fp32"])),  # a few arms of one size: seconds
], ids=["dose", "study"])
def test_a_preset_entrys_analysis_writes_the_tables_its_section_writes(tmp_path, monkeypatch, kind, reference, changes):
    """The same analysis on any entry's manifest: the committed runs of a positive control / the study placed as
    the section's cells and again as a ``grids:`` entry's, each manifest written by the workflow's function from
    its config, the kind's analysis run on each (the entry's with its manifest and folders, as its aggregate
    runs it): every table is the same bytes, but the run table's cell column, which names the entry."""
    import importlib

    from rpa.workflow.experiments import entry_paths, manifest
    from rpa.workflow.manifest import dumps

    ref = REPO / "results/reference" / reference
    outputs = {}
    for form in ("section", "entry"):
        results = tmp_path / form
        section, entry = _as_entry(kind, "e", results, **changes)
        config, where, name = (section, kind, None) if form == "section" else (entry, "grids", "e")
        folder = results / where / (name or "")
        folder.mkdir(parents=True)
        for run in (ref / kind).iterdir():
            if run.is_dir():
                (folder / run.name).symlink_to(run)
        if (ref / "probe").is_dir():
            (results / "probe").symlink_to(ref / "probe")
        (folder / "manifest.json").write_text(dumps(manifest(config, where, name, check_config(config).cells[where])))
        paths = entry_paths(str(results), "e") if name else {"tables": f"{results}/tables",
                                                             "figures": f"{results}/figures"}
        args = (["--out-dir", paths["tables"], "--figure", f"{paths['figures']}/dose_response.png"] if kind == "dose"
                else ["--out-dir", paths["tables"], "--figure-dir", paths["figures"]])
        if name:
            args += ["--manifest", paths["manifest"]]
        monkeypatch.setattr(sys, "argv", [f"analysis.{kind}", "--results", str(results), *args])
        command = f"analysis.{kind}.command"  # a kind's package: its command
        importlib.import_module(command).main()  # the module's command line, in this process
        outputs[form] = {p.name: p.read_text() for p in Path(paths["tables"]).iterdir() if p.is_file()}
        assert sorted(p.name for p in Path(paths["figures"]).iterdir())
    assert sorted(outputs["entry"]) == sorted(outputs["section"]) and len(outputs["section"]) >= 4
    for table, text in outputs["section"].items():
        mine = outputs["entry"][table]
        if table == "dose_runs.csv":  # its cell column: the run's directory under grids/, the entry's name first
            mine = mine.replace(",e/", ",")
        assert mine == text, table


def test_a_grids_entry_carries_a_decision_read_by_its_table(tmp_path):
    """Issue 69: a decision (the keys of a search stage's) may sit on a plain ``grids:`` entry: checked with the
    entry's cells, written into its manifest, and read by the entry's table (analysis.grid_summary) with the
    search's own functions -- the statement, each question's answer and the effects' table, recomputed here from
    the raw runs."""
    from analysis import grid_summary
    from rpa.workflow.experiments import manifest as entry_manifest
    from tests.test_collapse_search import FALLS, STABLE, _write_run

    rule = {"arm_axis": "arm", "rung_axis": "lr", "reference_arm": "none", "control_arm": "fp32",
            "treatment_arm": "all", "min_reference_collapsed": 3, "max_control_collapsed": 0,
            "questions": {"Q1": {"question": "Does none collapse more often than fp32?", "a": "none", "b": "fp32"}},
            "outcome": "reward_auc", "effects": {"numerics": {"contrast": {"all": 1, "none": -1}}}}
    entry = {"base": "experiments/train/collapse-walk.yaml", "seeds": [0, 1, 2, 3], "overrides": {"model": "tiny-qwen3"},
             "axes": {"lr": {"lr1": {"learning_rate": 1e-4}},
                      "arm": {"none": {}, "all": {"numerics": {"regions": "all"}}, "fp32": {"numerics": {"precision": "fp32"}}}},
             "decision": rule}
    config = _with_grids(tmp_path, {"g": entry})
    cells = check_config(config).cells["grids"]
    made = entry_manifest(config, "grids", "g", cells)
    assert made["decision"]["effects"] == rule["effects"] and made["decision"]["reference_arm"] == "none"
    bad = copy.deepcopy(entry)
    bad["decision"]["questions"]["Q1"]["b"] = "none"
    with pytest.raises(PipelineConfigError, match="grids.g.decision.questions.Q1: compares 'none' with itself"):
        check_config(_with_grids(tmp_path, {"g": bad}))
    # the runs: none collapses in 3 of 4 seeds, fp32 and all never
    results = tmp_path / "results"
    rows = []
    for c in cells:
        falls = c.labels["arm"] == "none" and c.seed < 3
        _write_run(results.parent / "runs", c.name, FALLS if falls else STABLE, [0.01 * (i + 1) for i in range(12)])
        (results / "grids" / c.name).parent.mkdir(parents=True, exist_ok=True)
        (results.parent / "runs" / "search" / c.name).rename(results / "grids" / c.name)
        rows.append({"cell": c.name, "labels": dict(c.labels), "seed": c.seed, "model": "m"})
    (results / "grids" / "g" / "manifest.json").write_text(json.dumps({**made, "cells": rows}))
    out_md = tmp_path / "g.md"
    assert grid_summary.main(["--results", str(results), "--grid", "g", "--out-csv", str(tmp_path / "g.csv"),
                              "--out-md", str(out_md)]) == 0
    text = out_md.read_text()
    assert "**Decision** (rule fixed in the config before the grid g ran): " in text
    assert "collapses naturally" in text and "lr1" in text
    assert "**Q1** Does none collapse more often than fp32? `none` collapsed 3/4 vs `fp32` 0/4" in text
    assert "numerics" in text.split("Per run")[0]  # the effects' table, before the runs
