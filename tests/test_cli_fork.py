"""The tests' forked ``rpa`` commands (tests/cli_fork.py) against fresh processes."""

import os
import subprocess
import sys

from tests import cli_fork


def test_a_forked_command_ends_and_prints_as_a_fresh_process_does(tmp_path):
    """Same status, stdout, stderr and files for a refused command and a finished one, run in a folder of
    their own; a command whose environment differs in a variable read at import is not forked."""
    env = cli_fork.base_env()  # the session's environment (a test before this one may have changed os.environ)
    refused = ["parity", "--model", str(tmp_path / "missing"), "--regions", "all", "--out", "p.json"]
    finished = ["prompts", "--task", "synthetic-add", "--num-prompts", "3", "--out", "prompts.jsonl"]
    for argv, status in ((refused, 2), (finished, 0)):
        results = []
        for how in ("fresh", "forked"):
            cwd = tmp_path / argv[0] / how
            cwd.mkdir(parents=True)
            if how == "fresh":
                proc = subprocess.run([sys.executable, "-m", "rpa.cli", *argv], cwd=cwd, env=env,
                                      capture_output=True, text=True, timeout=300)
            else:
                proc = cli_fork.run(argv, env, cwd, timeout=300)
            files = {p.name: p.read_bytes() for p in cwd.iterdir()}
            results.append((proc.returncode, proc.stdout, proc.stderr, files))
        assert results[0] == results[1]
        assert results[0][0] == status, results[0]
    assert cli_fork.forkable(env)
    assert not cli_fork.forkable({**env, "VLLM_LOGGING_LEVEL": "DEBUG"})  # read at import (vllm.logger): fresh
    assert not cli_fork.forkable({**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert cli_fork.forkable({**env, "RPA_SOMETHING": "1"})
    assert cli_fork.forkable({**env, "VLLM_PLUGINS": "lora_filesystem_resolver"})  # read when an engine starts
    # what rpa sets itself before it builds an engine, left in a worker's environment by an in-process test
    assert cli_fork.forkable({**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"})
