"""The README's test command, what CI runs, and the `slow` set `make test` leaves out (issue 52)."""

import os
import re
import subprocess
import sys

from tests.conftest import REPO

STAMP = ".venv/.rpa-cpu-installed"  # the Makefile's set-up stamp: -o keeps `make -n` from planning the set-up


MAKE_ENV = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES", "TEST_SLOW", "TEST_WORKERS")
"""What a `make` that runs this test passes on to a `make` it starts (``make test TEST_SLOW=1`` passes TEST_SLOW=1
through MAKEFLAGS): left out, so `make -n` here answers for the Makefile's own defaults."""


def _make_n(*args: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in MAKE_ENV}
    proc = subprocess.run(["make", "-n", "-o", STAMP, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_ci_runs_the_readmes_test_command_with_the_slow_set():
    block = re.search(r"## The two commands\n\n```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    command = next(line.split("#")[0].strip() for line in block.splitlines() if line.startswith("make test"))
    assert command == "make test"
    calls = [line.strip() for line in (REPO / ".ci/run").read_text().splitlines()
             if line.strip().startswith("make ")]
    assert calls == ["make setup", f"{command} TEST_SLOW=1"], calls


def test_make_test_leaves_out_the_slow_tests_unless_asked():
    default, everything = _make_n("test"), _make_n("test", "TEST_SLOW=1")
    assert "pytest" in default and '-m "not slow"' in default, default
    assert "pytest" in everything and "not slow" not in everything, everything


def test_the_slow_set_is_the_whole_tools_end_to_end():
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # the whole suite's collection, as configured
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "-p", "no:cacheprovider",
                           "-n", "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ids = {line for line in proc.stdout.splitlines() if "::" in line}
    files = {i.split("::")[0] for i in ids}
    assert files == {"tests/test_slurm_cluster.py", "tests/test_pipeline.py", "tests/test_gpucheck.py"}, files
    assert {i for i in ids if not i.startswith("tests/test_slurm_cluster.py")} == {
        "tests/test_pipeline.py::test_small_pipeline_runs_end_to_end_and_resumes",
        "tests/test_gpucheck.py::test_gpu_check_runs_end_to_end_here"}, ids


def test_ci_requires_the_tex_and_slurm_tests_to_run(monkeypatch):
    """Issue 74: a failed TeX or SLURM install in .ci/run turned those tests into skips and CI stayed green. .ci/run
    names both as required, and a required part that is missing fails its test instead of skipping it."""
    import pytest as _pytest

    from tests.conftest import REQUIRE_ENV, skip_unless_present

    assert f"export {REQUIRE_ENV}=tex,slurm" in (REPO / ".ci/run").read_text()
    monkeypatch.setenv(REQUIRE_ENV, "tex,slurm")
    with _pytest.raises(_pytest.fail.Exception, match="slurm is required here"):
        skip_unless_present("slurm", "not installed")
    monkeypatch.setenv(REQUIRE_ENV, "tex")
    with _pytest.raises(_pytest.skip.Exception):
        skip_unless_present("slurm", "not installed")
    skip_unless_present("slurm", None)  # present: nothing happens
