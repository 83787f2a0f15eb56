"""The study as a SLURM user submits it: every job of the dry run under the SLURM profile passes
snakemake-executor-plugin-slurm's own validation, GPU jobs carry the `gpu` resource the plugin
turns into --gpus, and config-writing jobs are local (never submitted)."""

from types import SimpleNamespace

import pytest
from snakemake_executor_plugin_slurm.validation import validate_slurm_extra
from snakemake_interface_common.exceptions import WorkflowError

from tests.conftest import tail
from tests.test_pipeline import snakemake


def _resources(line: str) -> dict[str, str]:
    out = {}
    for part in line.split(": ", 1)[1].split(", "):
        key, _, value = part.partition("=")
        out[key] = value
    return out


def dry_run_jobs(tmp_path, *targets, configfile="experiments/study.yaml"):
    proc = snakemake(*targets, "-n", "--workflow-profile", "experiments/profiles/slurm", "--configfile", configfile,
                     "--config", f"results={tmp_path / 'r'}")
    assert proc.returncode == 0, tail(proc)
    jobs, current = [], None
    for line in (proc.stdout + proc.stderr).splitlines():
        line = line.strip()
        if line.startswith(("rule ", "localrule ")):
            current = {"rule": line.split()[1].rstrip(":"), "local": line.startswith("localrule"), "resources": {}}
            jobs.append(current)
        elif current is not None and line.startswith("resources:"):
            current["resources"] = _resources(line)
    return jobs


def test_every_study_job_passes_the_slurm_plugins_validation(tmp_path):
    jobs = dry_run_jobs(tmp_path, "study")
    submitted = [j for j in jobs if not j["local"] and j["rule"] != "study"]
    assert {"study_train", "probe", "parity"} <= {j["rule"] for j in submitted}
    for job in submitted:
        validate_slurm_extra(SimpleNamespace(resources=SimpleNamespace(**job["resources"])))  # raises if forbidden
        if job["rule"] in ("study_train", "probe", "probe_sampler", "parity", "diagnose"):
            assert int(job["resources"]["gpu"]) >= 1, job


def test_config_writing_jobs_are_local_rules():
    """~145 one-line jobs that only write a file from the config must not become SLURM jobs."""
    from pathlib import Path

    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, ResourceSettings, StorageSettings

    from tests.conftest import REPO

    with SnakemakeApi(OutputSettings(quiet=True)) as api:
        wf = api.workflow(resource_settings=ResourceSettings(), storage_settings=StorageSettings(),
                          config_settings=ConfigSettings(configfiles=[REPO / "experiments/study.yaml"],
                                                         config={"results": "/tmp/rpa-slurm-test"}),
                          snakefile=REPO / "Snakefile", workdir=Path(REPO))
        wf.dag(DAGSettings(targets={"study"}))
        local = set(wf._workflow._localrules)  # snakemake's own record of the localrules directives
    assert {"study_config", "study_manifest", "dose_config", "train_config", "search_config"} <= local


def test_the_validation_used_above_rejects_gres_in_slurm_extra():
    """The control: what the rules used to set is refused by the same call."""
    with pytest.raises(WorkflowError, match="GRES"):
        validate_slurm_extra(SimpleNamespace(resources=SimpleNamespace(slurm_extra="--gres=gpu:1")))
