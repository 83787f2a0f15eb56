"""The study as a SLURM user submits it: every job of the dry run under the SLURM profile, fed through
snakemake-executor-plugin-slurm's own sbatch builder (``get_submit_command`` and ``set_gres_string``,
as its ``run_job`` calls them), asks for one task on one node with its GPUs and at most the CPUs it
names, on the GPU partition when it takes GPUs and the CPU-only partition otherwise; config-writing
jobs are local (never submitted)."""

import os
import shlex
from types import SimpleNamespace

import pytest
import yaml
from snakemake_executor_plugin_slurm.validation import validate_slurm_extra
from snakemake_interface_common.exceptions import WorkflowError

from tests.conftest import REPO
from tests.slurm.jobs import dry_run_jobs, local_rules, sbatch_line

PROFILE = yaml.safe_load((REPO / "experiments/profiles/slurm/config.yaml").read_text())


def sbatch_problems(job: dict) -> list[str]:
    """What is wrong with the job's sbatch line: anything but one task on one node with the job's
    GPUs and at most its named CPUs, on the partition of its kind."""
    args = shlex.split(sbatch_line(job))
    opts = {}
    for i, arg in enumerate(args):
        if arg.startswith("--") and "=" in arg:
            opts[arg.split("=", 1)[0]] = arg.split("=", 1)[1]
        elif arg in ("-p", "-t", "--mem"):
            opts[arg] = args[i + 1]
    res, problems = job["resources"], []
    if opts.get("--nodes") != "1":
        problems.append(f"--nodes={opts.get('--nodes')} (want 1)")
    # no --ntasks* at all: sbatch's default, one task per node, with --nodes=1 one task
    for key in ("--ntasks-per-gpu", "--ntasks-per-node"):
        if key in opts:
            problems.append(f"{key}={opts[key]} (want none)")
    if opts.get("--ntasks", "1") != "1":
        problems.append(f"--ntasks={opts['--ntasks']} (want 1)")
    if "--cpus-per-gpu" in opts:
        problems.append(f"--cpus-per-gpu={opts['--cpus-per-gpu']} (CPUs per GPU, want per task)")
    cpus = int(opts.get("--cpus-per-task", 0))
    if not 1 <= cpus <= max(res.get("cpus_per_task") or job["threads"], 1):
        problems.append(f"--cpus-per-task={cpus} (named: {res.get('cpus_per_task')})")
    gpus = int(res.get("gpu") or 0)
    if opts.get("--gpus") != (str(gpus) if gpus else None):
        problems.append(f"--gpus={opts.get('--gpus')} (gpu resource {gpus})")
    want_partition = PROFILE["set-resources"]["grid_run"]["slurm_partition"] if gpus else \
        (PROFILE["default-resources"]["slurm_partition"] or None)
    if opts.get("-p") != want_partition:
        problems.append(f"-p {opts.get('-p')} (want {want_partition})")
    return problems


@pytest.fixture(scope="module")
def study_jobs(tmp_path_factory):
    jobs = dry_run_jobs(tmp_path_factory.mktemp("slurm"), "study")
    local = local_rules()
    return [j for j in jobs if j["rule"] not in local]


def test_every_study_job_is_one_task_on_one_node_in_the_plugins_sbatch_line(study_jobs):
    rules = {j["rule"] for j in study_jobs}
    assert {"grid_run", "probe", "probe_sampler", "parity", "diagnose", "study_aggregate"} <= rules, rules
    assert not rules & {"grid_run_file", "write_probe_job", "study"}, rules  # run by Snakemake itself
    problems = {f"{j['rule']} {j['wildcards']}": p for j in study_jobs if (p := sbatch_problems(j))}
    assert not problems, problems


def test_the_study_jobs_ask_for_their_sizes_gpus_and_cpus(study_jobs):
    """The multi-GPU sizes exactly as study.resources names them: 8 GPUs and 64 CPUs in one task."""
    study = yaml.safe_load((REPO / "experiments/study.yaml").read_text())["study"]
    seen = set()
    for job in (j for j in study_jobs if j["rule"] == "grid_run"):
        want = study["resources"][job["wildcards"].removeprefix("record=study/").split("/")[0]]
        line = sbatch_line(job)
        assert f"--gpus={want['gpu']}" in line and f"--cpus-per-task={want['cpus_per_task']}" in line, line
        assert "--nodes=1" in line and "--ntasks" not in line, line
        seen.add(want["gpu"])
    assert seen == {1, 4, 8}


def test_cpu_only_jobs_go_to_the_cpu_partition_setting(tmp_path, study_jobs):
    cpu_jobs = [j for j in study_jobs if not j["resources"].get("gpu")]
    assert cpu_jobs and all(" -p " not in sbatch_line(j) for j in cpu_jobs)  # "": the cluster's default
    moved = {**cpu_jobs[0], "resources": {**cpu_jobs[0]["resources"], "slurm_partition": "cpu"}}
    assert " -p cpu " in sbatch_line(moved) + " "
    assert " -p gpu " in sbatch_line(next(j for j in study_jobs if j["rule"] == "grid_run")) + " "


def test_the_check_fails_the_plugins_defaults_for_a_multi_gpu_job(study_jobs):
    """The control: without the profile's tasks_per_gpu 0 / nodes 1 the plugin asks for 8 tasks of
    64 CPUs each (--ntasks-per-gpu=1), on any number of nodes -- which the check above refuses."""
    job = next(j for j in study_jobs if j["resources"].get("gpu") == 8)
    stock = {**job, "resources": {k: v for k, v in job["resources"].items() if k not in ("tasks_per_gpu", "nodes")}}
    line = sbatch_line(stock)
    assert "--ntasks-per-gpu=1" in line and "--nodes" not in line, line
    problems = sbatch_problems(stock)
    assert any("--ntasks-per-gpu=1" in p for p in problems) and any("--nodes=None" in p for p in problems)


def test_every_pilot_job_is_one_task_on_one_node_too(tmp_path):
    jobs = [j for j in dry_run_jobs(tmp_path, "study", configfile="experiments/study-pilot.yaml")
            if j["rule"] not in local_rules("experiments/study-pilot.yaml")]
    assert sum(j["rule"] == "grid_run" for j in jobs) == 8
    problems = {f"{j['rule']} {j['wildcards']}": p for j in jobs if (p := sbatch_problems(j))}
    assert not problems, problems


def test_config_writing_jobs_are_local_rules():
    """~145 one-line jobs that only write a file from the config must not become SLURM jobs."""
    local = local_rules()
    assert {"grid_run_file", "manifest"} <= local
    assert not local & {"grid_run", "probe", "parity", "diagnose", "study_aggregate"}


def test_the_validation_used_above_rejects_gres_in_slurm_extra():
    """The control: what the rules used to set is refused by the validation sbatch_line runs."""
    with pytest.raises(WorkflowError, match="GRES"):
        validate_slurm_extra(SimpleNamespace(resources=SimpleNamespace(slurm_extra="--gres=gpu:1")))


def test_the_cluster_page_names_the_plugins_flags_and_the_profiles_keys():
    """docs/cluster.md (issue 73): every --slurm-* flag it names is one of the plugin's settings, the resources it
    says to set (qos, constraint, gpu_model) become the sbatch flags it says through the plugin's own code, the
    profile holds the keys it says to edit, and its one command names files that exist."""
    import dataclasses
    import re

    from snakemake_executor_plugin_slurm import ExecutorSettings

    page = (REPO / "docs/cluster.md").read_text()
    settings = {f.name for f in dataclasses.fields(ExecutorSettings)}
    flags = set(re.findall(r"--slurm-([a-z-]+)", page))
    assert {"status-command", "logdir"} <= flags and all(f.replace("-", "_") in settings for f in flags), flags
    job = {"rule": "grid_run", "threads": 4,
           "resources": {"gpu": 2, "gpu_model": "a100", "qos": "long", "constraint": "ib", "cpus_per_task": 4,
                         "mem_mb": 1000, "runtime": 60, "nodes": 1, "tasks_per_gpu": 0, "slurm_partition": "gpu"}}
    line = sbatch_line(job)
    assert "--qos=long" in line and "-C ib" in line and "--gpus=a100:2" in line, line
    assert {"slurm_partition", "slurm_account"} <= set(PROFILE["default-resources"])
    assert PROFILE["set-resources"]["grid_run"]["slurm_partition"]
    command = re.search(r"^snakemake study paper (.*)$", page, re.M).group(1).split()
    for flag in ("--workflow-profile", "--configfile"):
        assert (REPO / command[command.index(flag) + 1]).exists(), flag


def test_the_status_command_check_reads_what_sacct_answers(tmp_path, monkeypatch):
    """rpa.workflow.cluster.status_command_problem with a real ``sacct`` executable on PATH answering as a cluster
    without accounting storage does, and as one with it: refused only for the SLURM executor asking sacct there."""
    from rpa.workflow.cluster import status_command_problem

    sacct = tmp_path / "sacct"
    sacct.write_text("#!/bin/sh\necho 'Slurm accounting storage is disabled' >&2\nexit 1\n")
    sacct.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    problem = status_command_problem("slurm", "sacct")
    assert problem and "--slurm-status-command squeue" in problem and "\n" not in problem
    assert status_command_problem("slurm", "squeue") is None and status_command_problem("local", "sacct") is None
    sacct.write_text("#!/bin/sh\nexit 0\n")  # accounting on: nothing to refuse
    assert status_command_problem("slurm", "sacct") is None
