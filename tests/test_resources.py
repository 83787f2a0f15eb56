"""What the scheduler is told of a grid's runs (rpa.workflow.resources): one ``resources`` schema for every
kind of experiment, its defaults in one place (the same whether or not Snakemake filled in the schema's),
one check of a multi-process launch and one GPU check, over every kind."""

import copy

import pytest
import yaml
from snakemake.utils import validate

from rpa.workflow.experiments import KINDS, entry_of, kind_cells
from rpa.workflow.pipeline import PipelineConfigError, check_config
from rpa.workflow.resources import RUN_DEFAULTS, gpu_shortfall, run_resources, study_resources
from tests.conftest import REPO

SCHEMA_PATH = REPO / "experiments/schema/config.schema.yaml"
SCHEMA = yaml.safe_load(SCHEMA_PATH.read_text())
REF = {"$ref": "#/$defs/resources"}
ENTRY = {"base": "experiments/train/collapse-walk.yaml", "seeds": [0, 1], "overrides": {"model": "tiny-qwen3"},
         "axes": {"arm": {"none": {}, "fp32": {"numerics": {"regions": "none", "precision": "fp32"}}}}}


def _config(name):
    return yaml.safe_load((REPO / "experiments" / name).read_text())


def test_every_kind_reserves_through_the_one_resources_schema():
    """Every section's ``resources`` (the study's per model size) is the one definition, and it fills in no
    default of its own (they are rpa.workflow.resources.entry_resources')."""
    props = SCHEMA["properties"]
    assert props["train"]["properties"]["resources"] == REF
    assert props["dose"]["properties"]["resources"] == REF
    assert props["study"]["properties"]["resources"]["additionalProperties"] == REF
    dose, study, plain = (kind["then"]["properties"] for kind in props["grids"]["additionalProperties"]["allOf"])
    assert dose["resources"] == REF and plain["resources"] == REF  # a grids: entry's, by its kind
    assert study["resources"]["additionalProperties"] == REF
    assert props["search"]["properties"]["stages"]["additionalProperties"]["properties"]["resources"] == REF
    one = SCHEMA["$defs"]["resources"]
    assert set(one["properties"]) == {"gpu", "mem_mb", "runtime", "cpus_per_task", "launch", "label_mem_mb"}
    assert not [k for v in (one, *one["properties"].values()) for k in v if k == "default"]
    assert set(RUN_DEFAULTS) | {"mem_mb"} == set(one["properties"])  # a default for every key (mem_mb: job_mem_mb)


def test_the_one_schema_refuses_and_accepts_alike_in_every_section():
    config = _config("config.yaml")
    config["grids"] = {"g": {**ENTRY, "resources": {"gpu": 1, "launch": "fsdp2", "label_mem_mb": {"fp32": 900}}}}
    config["train"]["resources"] = {"launch": "single", "label_mem_mb": {"none": 700}}  # keys a grids entry has
    validate(copy.deepcopy(config), str(SCHEMA_PATH))
    for section in (lambda c: c["train"], lambda c: c["dose"], lambda c: c["grids"]["g"]):
        for bad in ({"mem_mb": 0}, {"gpus": 1}, {"launch": "mpi"}):
            wrong = copy.deepcopy(config)
            section(wrong)["resources"] = bad
            with pytest.raises(Exception, match="resources"):
                validate(wrong, str(SCHEMA_PATH))


def test_a_kinds_defaults_are_the_same_whether_or_not_the_schema_filled_them_in():
    """The workflow's config is filled in by Snakemake's validate; a config read by a test or an analysis is
    not: every run's resources are the same either way (train 8000 MB, dose 6000 MB for 60 minutes, a
    ``grids:`` entry the config's job_mem_mb), and they are the kinds' own where an entry sets none."""
    raw = {**_config("config.yaml"), "job_mem_mb": 5000}
    raw["grids"] = {"g": copy.deepcopy(ENTRY)}
    filled = copy.deepcopy(raw)
    validate(filled, str(SCHEMA_PATH))
    seen = {}
    for kind in ("train", "dose", "grids"):
        for c in kind_cells(raw, kind):
            res = run_resources(raw, kind, entry_of(raw, kind, c), c.labels)
            assert res == run_resources(filled, kind, entry_of(filled, kind, c), c.labels), c.name
            seen[kind] = res
    assert seen["train"] == {**seen["train"], "mem_mb": 8000, "runtime": 120}
    assert seen["dose"] == {**seen["dose"], "mem_mb": 6000, "runtime": 60}
    assert seen["grids"] == {"gpu": 0, "mem_mb": raw["job_mem_mb"], "runtime": 120, "cpus_per_task": 2,
                             "launch": "single"}
    assert {k: KINDS[k].resources for k in ("train", "dose", "grids")} == {
        "train": {"mem_mb": 8000}, "dose": {"mem_mb": 6000, "runtime": 60}, "grids": {}}


def test_an_entry_sets_its_runs_resources_and_a_label_its_memory_in_any_kind():
    config = _config("config.yaml")
    config["train"]["resources"] = {"runtime": 7, "label_mem_mb": {"all": 9000}}
    config["dose"]["resources"] = {"gpu": 1, "cpus_per_task": 3}
    runs = {(kind, c.name): run_resources(config, kind, config[kind], c.labels)
            for kind in ("train", "dose") for c in kind_cells(config, kind)}
    assert {r["runtime"] for (kind, _), r in runs.items() if kind == "train"} == {7}
    assert {name.split("/")[2] for (kind, name), r in runs.items() if kind == "train" and r["mem_mb"] == 9000} \
        == {"all"}  # the region set's label, the largest memory
    assert {(r["gpu"], r["cpus_per_task"], r["mem_mb"], r["runtime"]) for (kind, _), r in runs.items()
            if kind == "dose"} == {(1, 3, 6000, 60)}
    study = _config("study.yaml")
    assert study_resources(study, "qwen3-8b") == {**study["study"]["resources"]["qwen3-8b"]}
    assert study_resources(study, "qwen3-8b", 3)["runtime"] == 3 * study["study"]["resources"]["qwen3-8b"]["runtime"]


def test_a_multi_process_launch_holds_one_run_in_any_kind():
    """runs_per_process / arms_per_process above 1 where a run launches as several processes is refused
    before anything loads, in the study (by model size) as in a ``grids:`` entry."""
    study = _config("study.yaml")
    study["study"]["runs_per_process"] = 2
    with pytest.raises(PipelineConfigError) as err:
        check_config(study)
    assert ("study.runs_per_process: 2, but 'qwen3-4b' launches with 'fsdp2': a multi-process launch holds one "
            "run") in str(err.value) and "'qwen3-0.6b' launches" not in str(err.value)
    config = _config("toys.yaml")
    config["grids"] = {"g": {**ENTRY, "arms_per_process": 2}}
    check_config(config)  # the control: one process, several arms
    config["grids"]["g"]["resources"] = {"gpu": 2, "launch": "ddp"}
    with pytest.raises(PipelineConfigError, match="grids.g.arms_per_process: 2, but its runs launch with 'ddp'"):
        check_config(config)


def test_the_gpu_check_reads_every_kind():
    """A workstation's GPU check names every entry of every kind that asks for more GPUs than it lends."""
    config = _config("collapse-cpu.yaml")
    assert gpu_shortfall(config, 0) is None
    stage = next(iter(config["search"]["stages"]))
    config["search"]["stages"][stage]["resources"] = {"gpu": 2}
    config["grids"] = {"g": {**ENTRY, "resources": {"gpu": 1}}}
    line = gpu_shortfall(config, 1)
    assert f"search.stages.{stage}.resources.gpu 2" in line and "grids.g" not in line
    assert "grids.g.resources.gpu 1" in gpu_shortfall(config, 0)
