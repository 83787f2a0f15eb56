"""``python -m rpa.cli ...`` for the tests, forked from a server that has imported the heavy libraries once.

Each ``rpa`` command a test starts is a separate process (vLLM's region set is fixed per process), and most of its
CPU was the imports: torch, transformers, vLLM and TRL take ~6 s of CPU a process on 2 cores, more than half of a
tiny model's ``rpa parity`` (measured: ~10.5-11.5 s fresh, ~4.2-6.3 s forked, 2026-12-07, 2-core Intel Xeon).
Python's own ``multiprocessing`` forkserver with a preload list does that import once per pytest worker and forks a
child per command; the child runs the same entry point as the console script (:func:`rpa.cli.run`: ``main`` then
``exit_now``) with the command's argv, environment and working directory, its stdout and stderr in files.

What the forked child does not repeat is the import of :data:`PRELOAD` -- nothing of ``rpa`` runs in the server
(``rpa`` modules are imported in the child, as a fresh process imports them), no engine is built, no thread is
started, and vLLM's plugin (the region set) is loaded by the child's first engine, as in a fresh process. Where
the import itself is what a test checks (``-X importtime``, a script), :func:`run` is not used; where a command's
environment differs from the server's in a variable a preloaded module may read at import (:data:`IMPORT_TIME_ENV`),
or sets at import to another value (:func:`incompatible`), the command runs in a fresh process instead. What the
preload's imports set in the environment (vLLM and torch set ~10 variables when imported) is applied over the
command's environment in the child, as the same imports would have applied it in a fresh process.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import tempfile

PRELOAD = ("torch", "transformers", "vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.engine.llm_engine",
           "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "trl",
           "trl.trainer.grpo_trainer")
"""Imported once in the fork server (their import is most of a tiny model's command: ~6.7 s of CPU here, and
~0.4 s more for vLLM's engine modules, ~0.8 s for TRL's GRPO trainer, which ``vllm`` and ``trl`` import lazily;
``rpa`` is left out)."""

IMPORT_TIME_ENV = ("TORCH", "PYTORCH", "VLLM_", "TRANSFORMERS", "HF_", "TRL", "OMP_", "MKL_", "PYTHON", "CUDA",
                   "LD_", "TRITON", "ACCELERATE")
"""Prefixes of the environment variables a preloaded module may read at import: a command whose value of one
differs from the server's runs in a fresh process (unless it is one of :data:`READ_AT_USE`)."""

READ_AT_USE = ("VLLM_PLUGINS", "VLLM_CACHE_ROOT", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_ALLOW_INSECURE_SERIALIZATION",
               "VLLM_CPU_KVCACHE_SPACE", "TORCHINDUCTOR_CACHE_DIR")
"""vLLM variables read when used, not at import: ``vllm.envs`` reads them through its module ``__getattr__`` on
every access (its cache is turned on only once an engine has started, which the server never does), and no module
of vLLM 0.32 or TRL reads them at module level (grep) -- the plugin loader when an engine starts, the model-info and
compile caches when they are opened, the engine's process layout, serialization and KV cache when it is built. The
last four are the ones ``rpa`` sets itself before it builds an engine (:func:`rpa.sides.engine.make_llm_env`), so an
in-process engine leaves them in the environment of its test module's later commands (tests/conftest.py clears them
when the module ends). Inductor reads ``TORCHINDUCTOR_CACHE_DIR`` in each call of
its ``cache_dir()`` (and sets it there to the default where it is unset: another trace an in-process compile leaves)."""

NO_FORK_ENV = "RPA_TEST_NO_FORK"
"""Set (non-empty): every command a fresh process, as before this module (for comparing the two)."""

_SERVER: dict = {}


def set_base_env(env: dict[str, str]) -> None:
    """The environment the server imports under: the worker's as the session set it up (``tests/conftest.py``'s
    ``pytest_configure``), plus OMP_NUM_THREADS=1 as every command gets -- not whichever test's environment
    happens to start the server (a test may have changed it)."""
    _SERVER["env"] = {**env, "OMP_NUM_THREADS": "1"}


def base_env() -> dict[str, str]:
    """:func:`set_base_env`'s environment (the current one if it was not set)."""
    return _SERVER.get("env") or {**os.environ, "OMP_NUM_THREADS": "1"}


def _context():
    """The forkserver context, started on first use with :func:`base_env` as its environment."""
    if "ctx" not in _SERVER:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        saved, base = dict(os.environ), base_env()
        os.environ.clear()
        os.environ.update(base)
        try:
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _SERVER.update(ctx=ctx, env=base)
    return _SERVER["ctx"]


def forkable() -> bool:
    """Whether commands are forked at all (:data:`NO_FORK_ENV`); whether one command's environment allows it is
    :func:`incompatible`'s, decided in the child, which knows what the preload's imports set."""
    return not os.environ.get(NO_FORK_ENV)


def incompatible(env: dict[str, str], base: dict[str, str], imported: dict[str, str | None]) -> list[str]:
    """The variables for which a fresh process given ``env`` would not import what the server imported under
    ``base`` (sorted; empty: the command may be forked): a variable the imports set (``imported``: its value after
    the imports, None where they removed it) present in ``env`` with another value (a worker that imported the same
    libraries holds the same one), or another variable a preloaded module may read at import
    (:data:`IMPORT_TIME_ENV`, less :data:`READ_AT_USE`) that differs from ``base``."""
    keys = []
    for key in {*env, *base, *imported}:
        if key in imported:
            if env.get(key) not in (None, imported[key]):
                keys.append(key)
        elif key.startswith(IMPORT_TIME_ENV) and key not in READ_AT_USE and env.get(key) != base.get(key):
            keys.append(key)
    return sorted(keys)


FALLBACK_STATUS = 213
"""A forked child's status when :func:`incompatible` refuses its environment (``rpa`` exits 0, 1 or 2): the command
then runs in a fresh process."""


def _child(argv: list[str], env: dict[str, str], base: dict[str, str], cwd: str, out: str, err: str) -> None:
    """In the forked child: the command's environment with what the preload's imports set applied over it, as they
    would have been in a fresh process (or :data:`FALLBACK_STATUS` where :func:`incompatible` refuses it), its folder,
    argv and output files, then the console script."""
    inherited = dict(os.environ)  # the server's: ``base`` and what its imports set
    imported = {k: v for k, v in inherited.items() if base.get(k) != v}
    imported.update({k: None for k in base if k not in inherited})
    refused = incompatible(env, base, imported)
    if refused:
        with open(err, "w") as f:  # for the parent's ``FRESH`` (no stdout file: the child did not run the command)
            f.write("\n".join(refused))
        os._exit(FALLBACK_STATUS)
    os.environ.clear()
    os.environ.update({**env, **{k: v for k, v in imported.items() if v is not None}})
    for key in (k for k, v in imported.items() if v is None):
        os.environ.pop(key, None)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    sys.argv = ["rpa", *argv]
    from rpa.cli import run

    run()  # main, then exit_now: os._exit with main's status (a traceback and status 1 on a bug)


def run(argv: list[str], env: dict[str, str], cwd: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -m rpa.cli argv`` in a forked child -- or a fresh process where the child finds the environment
    incompatible (:func:`incompatible`; counted in ``FRESH``) -- and what :func:`subprocess.run` with
    ``capture_output=True, text=True`` returns (``TimeoutExpired`` after ``timeout`` seconds, the child killed)."""
    ctx = _context()
    args = [sys.executable, "-m", "rpa.cli", *argv]
    with tempfile.TemporaryDirectory(prefix="rpa-fork-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = ctx.Process(target=_child, args=(list(argv), dict(env), base_env(), str(cwd), out, err))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(args, timeout)
        if child.exitcode == FALLBACK_STATUS and not os.path.exists(out):
            with open(err) as e:
                FRESH.append((list(argv), e.read().split()))
            return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        with open(out, errors="replace") as o, open(err, errors="replace") as e:
            stdout, stderr = o.read(), e.read()
    return subprocess.CompletedProcess(args, child.exitcode, stdout, stderr)


FRESH: list[tuple[list[str], list[str]]] = []
"""The commands of this worker that ran in a fresh process because their environment was not compatible, each with
the variables that refused it (:func:`incompatible`)."""
