import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rpa.sides.tiny import TinySpec, build_tiny

REPO = Path(__file__).resolve().parents[1]

SUBPROCESS_CALL = re.compile(r"\b(run_py|snakemake|subprocess\.\w+|rpa)\(")
"""How a test starts a process (the helpers here and in the test modules)."""


VEC_ISA_ENV = "TORCHINDUCTOR_VEC_ISA_OK"
"""Inductor's base check of the CPU's vector ISAs: unset, every process that starts a vLLM engine compiles (once,
cached) and then loads, each in a child Python, a probe library per ISA the CPU's flags list -- ~7 children a
process, 510 children and ~45 s of CPU in one ``make test`` here. The suite sets it to 1 (a user's own setting is
kept): Inductor skips that base probe and takes the ISAs the CPU's flags list; its further checks (AVX-512 BF16,
VNNI, AMX) still run, so the ISA and build flags are the ones the probes pick where the base probe passes, as it
does on the machines this suite runs on (where it would fail, Inductor's compile fails loudly instead of falling
back to a narrower ISA). The setting is part of Inductor's cache key: the suite's compiled graphs are its own."""


def pytest_configure(config):
    """A parallel worker (pytest-xdist) gets its own vLLM compile-cache base: two processes
    compiling the same configuration at once would write one cache entry together. The model-info
    cache (atomic files, nothing of the region set) stays one for all workers. :data:`VEC_ISA_ENV`. The session's
    environment is the one ``rpa`` commands are forked under (:mod:`tests.cli_fork`)."""
    os.environ.setdefault(VEC_ISA_ENV, "1")
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        from rpa.sides.engine import CACHE_BASE_ENV, cache_base, share_model_info_cache

        base = cache_base()
        os.environ[CACHE_BASE_ENV] = os.path.join(base, f"pytest-{worker}")
        share_model_info_cache(os.environ[CACHE_BASE_ENV], base)
    from tests import cli_fork

    cli_fork.set_base_env(dict(os.environ))  # the fork server imports under the session's environment


KIND_SECONDS = {"slurm": 100.0, "engine": 20.0, "cli": 3.0, "unit": 0.2}
"""A rough cost of one test of each kind on 2 cores, to order the test files (below)."""


def pytest_collection_modifyitems(config, items):
    """Every test gets one kind: ``engine`` or ``cli`` as marked, else ``cli`` when its body
    starts a process, else ``unit``; ``make test-fast`` runs ``not engine``.

    Then the files are put in order of their cost (:data:`KIND_SECONDS` summed over their tests),
    the dearest first, each file's tests in their own order: pytest-xdist's ``--dist loadfile``
    hands out whole files in this order (the Makefile turns off its own reordering, which puts the
    files with the most tests first and left the few-but-long ones, SLURM's, for the end)."""
    for item in items:
        if item.get_closest_marker("engine") or item.get_closest_marker("cli"):
            continue
        try:
            source = inspect.getsource(item.function)
        except (OSError, TypeError):
            source = ""
        item.add_marker("cli" if SUBPROCESS_CALL.search(source) else "unit")
    cost: dict[str, float] = {}
    for item in items:
        kind = next(k for k in KIND_SECONDS if item.get_closest_marker(k))
        cost[item.nodeid.split("::")[0]] = cost.get(item.nodeid.split("::")[0], 0.0) + KIND_SECONDS[kind]
    items.sort(key=lambda item: -cost[item.nodeid.split("::")[0]])  # stable: a file's tests keep their order


def _restore_environment(saved: dict[str, str]) -> None:
    for key in [k for k in os.environ if k not in saved]:
        del os.environ[key]
    os.environ.update(saved)


@pytest.fixture(autouse=True, scope="module")
def _module_environment():
    """A test module's changes to ``os.environ`` end with the module (autouse: set up before the module's own
    fixtures, so an engine a module fixture builds is inside). vLLM sets ~5 variables when it configures an engine
    in-process (``VLLM_WORKER_MULTIPROC_METHOD``, ``TORCHINDUCTOR_CPP_DYNAMIC_THREADS``, ...), an in-process import of
    OpenCV sets ``LD_LIBRARY_PATH``; left in a worker's environment they reached every later command of that worker
    (:func:`run_py` passes it on) -- which then ran in a fresh process, not forked (3 commands of one ``make test``,
    counted against a run with this fixture: a train, a parity, a convert), and a test's command depended on which
    tests ran before it on its worker."""
    saved = dict(os.environ)
    yield
    _restore_environment(saved)


@pytest.fixture(autouse=True)
def _test_environment():
    """A test's own changes to ``os.environ`` end with the test (:func:`_module_environment`)."""
    saved = dict(os.environ)
    yield
    _restore_environment(saved)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Qwen2, Qwen3 and Llama checkpoints (local tokenizer, no hub)."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: build_tiny(root / arch, TinySpec(arch=arch)) for arch in ("qwen2", "qwen3", "llama")}


def run_py(args: list[str], env: dict[str, str] | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    """Run ``python args...`` in a process of its own (vLLM's region set is fixed per process). ``-m rpa.cli ...``
    is forked from a server that has imported torch, transformers, vLLM and TRL once (:mod:`tests.cli_fork`)
    unless the environment differs from the server's in a variable read at import; anything else is a fresh
    process."""
    from tests import cli_fork

    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    if args[:2] == ["-m", "rpa.cli"] and cli_fork.forkable():
        return cli_fork.run(args[2:], full_env, REPO, timeout)
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=full_env, capture_output=True,
                          text=True, timeout=timeout)
    return proc


def tail(proc: subprocess.CompletedProcess, n: int = 3000) -> str:
    return f"rc={proc.returncode}\nstdout:\n{proc.stdout[-n:]}\nstderr:\n{proc.stderr[-n:]}"


def assert_figure(path, min_side: int = 200) -> None:
    """A PNG that decodes, is at least ``min_side`` pixels on each side and is not blank."""
    from matplotlib.image import imread

    img = imread(path)
    assert img.shape[0] >= min_side and img.shape[1] >= min_side, (path, img.shape)
    assert float(img[..., :3].std()) > 0.01, f"{path} is blank"



def refused(capsys, argv, needle, absent=None):
    """``rpa argv`` (in-process, ``rpa.cli.main``) exits 2 with one ``rpa <command>: error: ...`` line
    on stderr containing ``needle`` and creates nothing at ``absent``."""
    from rpa.cli import main

    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"rpa {argv[0]}: error: ") and needle in lines[0], err
    if absent is not None:
        assert not absent.exists(), f"{absent} was created"
    return lines[0]


def write_run_config(tmp_path, model, **overrides):
    """A small run config for ``model`` (overrides on top) at ``tmp_path/run.yaml``."""
    import yaml

    cfg = {"model": str(model), "task": {"name": "synthetic-add", "num_prompts": 64}, "steps": 2, **overrides}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


REQUIRE_ENV = "RPA_TEST_REQUIRE"
"""Comma-separated system parts (``tex``, ``slurm``) whose tests must run: where one is missing, its tests fail instead
of skipping. ``.ci/run`` sets it, so a failed TeX or SLURM install cannot turn those tests into a green skip."""


def skip_unless_present(part: str, missing: str | None) -> None:
    """Skip the calling test because ``missing`` (why ``part`` is not there), or fail it where :data:`REQUIRE_ENV`
    names ``part``; nothing when ``missing`` is None."""
    if missing is None:
        return
    required = {p.strip() for p in os.environ.get(REQUIRE_ENV, "").split(",") if p.strip()}
    if part in required:
        pytest.fail(f"{part} is required here ({REQUIRE_ENV}) but missing: {missing}")
    pytest.skip(missing)
