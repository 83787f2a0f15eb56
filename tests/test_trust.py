"""What the study's numbers are measured on: the probe scores the checkpoint the runs start
from (the shared warm start), with the engine mode training samples with; both grids carry
an FP32 negative control."""

import copy

import pytest
import yaml

from rpa.workflow.pipeline import PipelineConfigError, check_config
from rpa.workflow.experiments import kind_cells
from tests.conftest import REPO, tail
from tests.test_pipeline import snakemake, write_config

STUDY = yaml.safe_load((REPO / "experiments/study.yaml").read_text())
STUDY_CPU = yaml.safe_load((REPO / "experiments/study-cpu.yaml").read_text())


def test_probe_parity_and_diagnose_score_the_warm_started_checkpoint(tmp_path):
    res = tmp_path / "r"
    proc = snakemake("-n", "-p", "--cores", "2", "aggregate", "--configfile", "experiments/study-cpu.yaml",
                     "--config", f"results={res}")
    assert proc.returncode == 0, tail(proc)
    out = proc.stdout + proc.stderr
    commands = [line.split("Shell command: ", 1)[1] for line in out.splitlines() if "Shell command: " in line]
    probes = [c for c in commands if "rpa probe --config" in c]
    assert len(probes) == len(STUDY_CPU["models"]) * len(STUDY_CPU["probe"]["configs"])
    jobs = sorted({c.split("--config ")[1].split()[0] for c in commands if "--config " in c and "/jobs/" in c})
    assert len(jobs) == len(probes) + len(STUDY_CPU["models"]) * (1 + len(STUDY_CPU["diagnose"]["configs"]))
    # write a parity job and two probe jobs (the sampler's and one scoring its tokens) per model --
    # local rules, no engine -- and read the checkpoint each scores (one rule writes every probe job)
    sampler, other = STUDY_CPU["probe"]["sampler"], next(c for c in STUDY_CPU["probe"]["configs"]
                                                         if c != STUDY_CPU["probe"]["sampler"])
    some = [j for j in jobs if "/jobs/parity/" in j or j.endswith((f"/{sampler}.yaml", f"/{other}.yaml"))]
    assert len(some) == 3 * len(STUDY_CPU["models"])
    proc = snakemake("--cores", "1", *some, "--configfile", "experiments/study-cpu.yaml", "--config", f"results={res}")
    assert proc.returncode == 0, tail(proc)
    assert yaml.safe_load(open(next(j for j in some if j.endswith(f"/{other}.yaml"))))["completions"].endswith(
        f"/{sampler}/completions.jsonl")  # the other configurations score the sampler's tokens
    for job in some:
        model = yaml.safe_load(open(job))["model"]
        assert model.startswith(f"{res}/study/") and model.endswith("/init"), job  # not .../models/<name>


def test_probe_mode_must_match_the_engine_training_samples_with():
    check_config(STUDY)
    check_config(STUDY_CPU)
    bad = copy.deepcopy(STUDY)
    bad["probe"]["compiled"] = False
    with pytest.raises(PipelineConfigError, match="probe.compiled: false, but the study's runs of 'qwen3-0.6b' "
                                                  "sample with vLLM compiled"):
        check_config(bad)
    bad = copy.deepcopy(STUDY_CPU)  # the miniature trains eager: a compiled probe measures another engine
    bad["probe"]["compiled"] = True
    with pytest.raises(PipelineConfigError, match="sample with vLLM eager"):
        check_config(bad)


@pytest.mark.parametrize("config", [STUDY, STUDY_CPU], ids=["gpu-study", "cpu-miniature"])
def test_both_study_grids_have_an_fp32_negative_control_with_its_probe(config):
    runs = [c for c in kind_cells(config, "study") if c.labels["arm"] == "fp32"]
    assert len(runs) == len(config["study"]["models"]) * len(config["study"]["seeds"])
    assert all(c.config["numerics"]["precision"] == "fp32" for c in runs)
    assert config["probe"]["configs"]["fp32"]["precision"] == "fp32"


def test_dry_run_with_a_bad_probe_mode_stops_before_any_job(tmp_path):
    config = copy.deepcopy(STUDY_CPU)
    config["results"] = str(tmp_path / "results")
    config["probe"]["compiled"] = True
    proc = snakemake("-n", "--cores", "1", "aggregate", "--configfile", str(write_config(tmp_path, config)))
    assert proc.returncode != 0 and "probe.compiled: true" in proc.stdout + proc.stderr, tail(proc)
