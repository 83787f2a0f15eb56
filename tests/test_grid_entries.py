"""The config's ``grids:`` section: an experiment written as a grid entry in the one shape every
experiment has (rpa.workflow.experiments.grid_of), checked before anything loads, run by the one grid
rule file and tabled by analysis.grid_summary."""

import copy
import json

import pandas as pd
import pytest
import yaml

from rpa.workflow.grid import expand
from rpa.workflow.pipeline import PipelineConfigError, check_config
from rpa.workflow.experiments import grid_of, kind_cells, kind_grids, train_spec
from tests.conftest import REPO, tail
from tests.test_grid import _config
from tests.test_pipeline import snakemake

TOYS = yaml.safe_load((REPO / "experiments/toys.yaml").read_text())
RUN = {"steps": 2, "eval_every": 0, "checkpoint_every": 2, "warm_start": {"steps": 0}, "max_completion_length": 16,
       "task": {"length": 6}}


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


@pytest.mark.engine
def test_a_grids_entry_runs_is_tabled_and_is_not_run_again(tmp_path):
    """A grid written only in YAML: two arms of one seed (one sampler side: the same vLLM engine) in one
    process (arms_per_process), a table
    with a row per run from the one run loader, and nothing to do the second time."""
    grids = {"arms": {"base": "experiments/train/collapse-walk.yaml", "seeds": [0], "overrides": {**RUN, "model": "tiny-qwen3"},
                      "arms_per_process": 2, "resources": {"mem_mb": 3500, "runtime": 9},
                      "axes": {"lr": {"hi": {"learning_rate": 1e-3}, "lo": {"learning_rate": 1e-5}}}}}
    config = _with_grids(tmp_path, grids)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(config, sort_keys=False))
    dry = snakemake("-n", "--cores", "2", "grids", "--configfile", str(cfg))
    assert dry.returncode == 0, tail(dry)
    assert "mem_mb=3500" in dry.stdout and "runtime=18" in dry.stdout  # one process of two runs
    proc = snakemake("--cores", "2", "grids", "--configfile", str(cfg))
    assert proc.returncode == 0, tail(proc, 6000)
    r = tmp_path / "r"
    assert (r / "grids/arms/hi+lo/seed0.json").is_file()
    table = pd.read_csv(r / "tables/grids/arms.csv")
    assert list(table["lr"]) == ["hi", "lo"] and set(table["state"]) == {"finished"}
    assert (table["steps"] == 2).all() and table["reward_auc"].notna().all()
    assert "### grid arms" in (r / "tables/grids/arms.md").read_text()
    again = snakemake("--cores", "2", "grids", "--configfile", str(cfg))
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, tail(again)


def test_the_documented_grids_entry_is_a_valid_config(tmp_path):
    """docs/pipeline.md's example entry, as written, passes the schema and the config check: 2 x 2 labels
    less the one combination it excludes, times 3 seeds."""
    text = (REPO / "docs/pipeline.md").read_text()
    block = text[text.index("```yaml\ngrids:") + len("```yaml\n"):]
    entry = yaml.safe_load(block[:block.index("```")])["grids"]
    cells = check_config(_with_grids(tmp_path, entry)).cells["grids"]
    assert len(cells) == 9 and cells[0].name == "lr-sweep/none/hi/seed0"
    assert not [c for c in cells if c.labels == {"regions": "all", "lr": "lo"}]


@pytest.mark.engine
def test_an_arm_added_in_yaml_only_reaches_the_table(tmp_path):
    """The README's recipe "add an arm": the cheapest grids: entry (one arm, tiny model, 2 steps) is run,
    then one more label is written on its axis in the YAML and nothing else; the next `snakemake grids`
    runs the new cell only and the entry's table gains its row (the first run is not run again)."""
    entry = {"base": "experiments/train/collapse-walk.yaml", "seeds": [0], "overrides": {**RUN, "model": "tiny-qwen3"},
             "resources": {"mem_mb": 3500, "runtime": 9}, "axes": {"lr": {"hi": {"learning_rate": 1e-3}}}}
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
    proc = snakemake("--cores", "2", "grids", "--configfile", str(cfg))
    assert proc.returncode == 0, tail(proc, 6000)
    table = pd.read_csv(r / "tables/grids/arms.csv")
    assert list(table["lr"]) == ["hi", "lo"] and set(table["state"]) == {"finished"}
    assert (r / "grids/arms/hi/seed0/summary.json").stat().st_mtime_ns == first  # the first arm not run again
    manifest = json.loads((r / "grids/arms/manifest.json").read_text())
    assert manifest["axes"] == {"lr": ["hi", "lo"]}
    assert [c["cell"] for c in manifest["cells"]] == ["arms/hi/seed0", "arms/lo/seed0"]
