"""A grid as one value (rpa.workflow.grid): how a cell's run config is made, which cells a grid
has, where cells share a warm start, and that each run config is validated once."""

import pytest
import yaml

from rpa.train.config import TrainConfig, TrainConfigError
from rpa.workflow.grid import BASE, CELL, Axis, Grid, SharedWarmStart, expand
from rpa.workflow.pipeline import check_config
from rpa.workflow.experiments import kind_cells, kind_grids
from tests.conftest import REPO

BASE_RUN = {"model": "tiny", "task": {"name": "count", "num_prompts": 8}, "numerics": {"regions": "none"},
            "learning_rate": 1e-3, "warm_start": {"steps": 5}, "seed": 0}


def _grid(**kw):
    spec = {"name": "g", "base": BASE_RUN,
            "axes": (Axis("lr", {"hi": {"learning_rate": 1e-2}, "lo": {"learning_rate": 1e-4}}),
                     Axis("arm", {"none": {}, "all": {"numerics": {"regions": "all"}}})),
            "seeds": (0, 1), "models": {"tiny": "results/x/models/tiny"}}
    return Grid(**{**spec, **kw})


def test_cells_are_every_label_combination_times_the_seeds_last_axis_fastest():
    cells = expand(_grid())
    assert [c.name for c in cells] == [f"{lr}/{arm}/seed{s}" for lr in ("hi", "lo") for arm in ("none", "all")
                                       for s in (0, 1)]
    c = next(c for c in cells if c.name == "lo/all/seed1")
    assert c.labels == {"lr": "lo", "arm": "all"} and c.seed == 1 and c.model == "tiny"
    # merged key by key (the task and the numerics keep what the axis does not set), the keys in the
    # base's order (a run file lists them so), the model located, the seed the cell's
    assert c.config == {**BASE_RUN, "model": "results/x/models/tiny", "numerics": {"regions": "all"},
                        "learning_rate": 1e-4, "seed": 1}
    assert list(c.config) == list(BASE_RUN)


def test_an_exclusion_drops_exactly_the_combinations_it_names():
    cells = expand(_grid(exclude=({"lr": ("hi",), "arm": ("all",)},)))
    names = {c.name.rsplit("/", 1)[0] for c in cells}
    assert names == {"hi/none", "lo/none", "lo/all"}, names
    assert len(expand(_grid())) == 8 and len(cells) == 6  # control: without it, the cell is there


def test_a_replaced_key_is_set_whole_and_the_others_merge():
    grid = _grid(axes=(Axis("arm", {"fp32": {"numerics": {"precision": "fp32"}, "task": {"num_prompts": 4}}}),),
                 replaced=("numerics",))
    (c, _) = expand(grid)
    assert c.config["numerics"] == {"precision": "fp32"}  # the base's regions are gone
    assert c.config["task"] == {"name": "count", "num_prompts": 4}  # merged


# at CELL, one per seed: no axis changes what a warm start reads (WARM_START_INPUTS)
@pytest.mark.parametrize("level,expected", [(BASE, 1), ("lr", 2), (CELL, 2)])
def test_cells_share_the_warm_start_of_their_level(level, expected):
    directory = {BASE: "init", "lr": "init-{lr}", CELL: "init/seed{seed}-{digest}"}[level]
    cells = expand(_grid(warm_start=SharedWarmStart(level=level, directory=directory)))
    inits = {c.init.dir: c.init for c in cells}
    assert len(inits) == expected, sorted(inits)
    for c in cells:  # every cell starts from its warm start's checkpoint and runs no warm start itself
        assert c.config["model"] == c.init.dir and c.config["warm_start"]["steps"] == 0
        assert c.init.config["warm_start"]["steps"] == 5 and c.init.config["model"] == "results/x/models/tiny"
    if level == "lr":  # the warm start's config is the one at its level: the lr axis applied, the arm not
        init = next(c.init for c in cells if c.labels["lr"] == "lo")
        assert init.config["learning_rate"] == 1e-4 and init.config["numerics"] == {"regions": "none"}


def test_a_digest_named_warm_start_is_shared_only_by_arms_that_change_none_of_its_inputs():
    axes = (Axis("arm", {"a": {}, "b": {"learning_rate": 1e-2}, "c": {"task": {"num_prompts": 4}}}),)
    cells = expand(_grid(axes=axes, seeds=(0,), warm_start=SharedWarmStart(level=CELL, directory="w/{digest}")))
    by_arm = {c.labels["arm"]: c.init.dir for c in cells}
    assert by_arm["a"] == by_arm["b"] != by_arm["c"]


def test_no_shared_warm_start_without_steps_unless_asked():
    base = {**BASE_RUN, "warm_start": {"steps": 0}}
    assert all(c.init is None for c in expand(_grid(base=base, warm_start=SharedWarmStart(BASE, "init"))))
    shared = expand(_grid(base=base, warm_start=SharedWarmStart(BASE, "init", only_with_steps=False)))
    assert {c.init.dir for c in shared} == {"init"}


def test_a_grid_that_names_what_it_does_not_have_is_refused():
    with pytest.raises(ValueError, match="exclude names no axis: size"):
        _grid(exclude=({"size": ("s",)},))
    with pytest.raises(ValueError, match="exclude names labels its axes do not have: lr=high"):
        _grid(exclude=({"lr": ("high",), "arm": ("all",)},))  # a misspelt label would leave out nothing
    with pytest.raises(ValueError, match="warm start level 'size'"):
        _grid(warm_start=SharedWarmStart(level="size", directory="x"))


def test_a_cell_builds_its_run_config_once():
    (c, *_) = expand(_grid(base={**BASE_RUN, "task": {"name": "count", "num_prompts": 8, "eval_prompts": 2}}))
    assert isinstance(c.run, TrainConfig) and c.run is c.run
    (bad, *_) = expand(_grid(base={**BASE_RUN, "learning_rate": -1.0}, axes=()))
    with pytest.raises(TrainConfigError):
        bad.run


def _config(name):
    config = yaml.safe_load((REPO / "experiments" / name).read_text())
    from snakemake.utils import validate

    validate(config, str(REPO / "experiments/schema/config.schema.yaml"))  # the schema's defaults, as the Snakefile
    return config


def test_every_committed_experiment_is_a_grid_of_valid_cells():
    """The four kinds of the committed configs, each through the one expander: cells unique,
    every run config valid, and check_config hands the workflow those cells."""
    seen = set()
    for name in ("config.yaml", "study-cpu.yaml", "collapse-cpu.yaml", "collapse-smollm2.yaml"):
        config = _config(name)
        cells = check_config(config).cells if name != "collapse-smollm2.yaml" else None
        for section in ("train", "dose", "study", "search"):
            if not config.get(section):
                continue
            expanded = [c for g in kind_grids(config, section) for c in expand(g)]
            assert len({c.name for c in expanded}) == len(expanded), (name, section)
            if cells is not None:
                assert [c.name for c in cells[section]] == [c.name for c in expanded]
                assert all(isinstance(c.run, TrainConfig) for c in cells[section])
            seen.add(section)
    assert seen == {"train", "dose", "study", "search"}


@pytest.mark.parametrize("name,committed,section", [("config.yaml", "cpu", "train"),
                                                     ("collapse-cpu.yaml", "collapse-cpu", "search"),
                                                     ("collapse-smollm2.yaml", "collapse-smollm2", "search")])
def test_every_committed_run_is_its_cells_run(name, committed, section):
    """Every committed run's ``run.yaml`` is the run its grid's cell makes today: the same
    TrainConfig, written either as the cell's merged mapping (before run files were canonical) or
    as the canonical ``TrainConfig.to_dict()`` (of the fields TrainConfig had when it was written)
    -- an expansion that changed a finished run would make Snakemake run it again."""
    config = _config(name)
    cells = {f"{section}/{c.name}": c for c in kind_cells(config, section)}
    root = REPO / "results/reference" / committed
    files = {str(p.parent.relative_to(root)): p for p in root.glob(f"{section}/**/run.yaml")
             if "stale-lm-head" not in p.parts}
    assert len(files) >= 12, sorted(files)
    for cell, path in files.items():
        c = cells[cell]
        assert TrainConfig.from_yaml(path) == c.run, cell
        text, canonical = path.read_text(), c.run.to_dict()
        written = yaml.safe_load(text)  # canonical when written: TrainConfig's fields of that day, in order
        assert text == yaml.safe_dump(dict(c.config), sort_keys=False) or \
            text == yaml.safe_dump({k: canonical[k] for k in canonical if k in written}, sort_keys=False), cell


def test_a_run_file_is_the_canonical_config_rpa_train_reads_back(tmp_path):
    (c, *_) = expand(_grid(base={**BASE_RUN, "task": {"name": "count", "num_prompts": 8, "eval_prompts": 2}}))
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(c.run.to_dict(), sort_keys=False))  # what rules/experiments.smk writes
    assert TrainConfig.from_yaml(path) == c.run
    assert set(yaml.safe_load(path.read_text())) == {f.name for f in __import__("dataclasses").fields(TrainConfig)}
