"""Bad input gets one clear line and exit 2, before any model or engine loads."""

import pytest
import yaml

from tests.conftest import run_py, tail


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory):
    from transformers import MistralConfig

    path = tmp_path_factory.mktemp("mistral")
    MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2).save_pretrained(path)
    return path


def rpa(*args, timeout=120):
    """``rpa ARGS`` in a process of its own: the refusal as a user sees it (exit code, stderr)."""
    proc = run_py(["-m", "rpa.cli", *map(str, args)], timeout=timeout)
    return proc


def rpa_here(*args):
    """``rpa ARGS`` in this process (``rpa.cli.main``, as conftest's ``refused``): every case below is refused
    before a model or an engine loads, so a process of its own would only pay the imports again (~3 s each);
    its exit code and what it wrote, as a finished process's. test_missing_model_directory and the
    unsupported-architecture case keep a process."""
    import contextlib
    import io
    import subprocess

    from rpa.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return subprocess.CompletedProcess(["rpa", *map(str, args)], code, out.getvalue(), err.getvalue())


def one_line_refusal(proc, needle):
    assert proc.returncode == 2, tail(proc)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("rpa ")]
    assert len(lines) == 1 and needle in lines[0], tail(proc)
    assert "Traceback" not in proc.stderr, tail(proc)


def test_missing_model_directory(tmp_path):
    one_line_refusal(rpa("parity", "--model", "/nonexistent", "--regions", "all", "--out", tmp_path / "p.json"),
                     "model /nonexistent: no such directory")


def test_directory_that_is_not_a_checkpoint(tmp_path):
    one_line_refusal(rpa_here("probe", "--model", tmp_path, "--regions", "all", "--out", tmp_path / "o"),
                     "directory without config.json")


def test_unsupported_architecture_is_refused_before_vllm_starts(mistral_dir, tmp_path):
    # a process of its own: vLLM's log lines go to the streams its handlers were set up with, which only a
    # fresh process's stderr shows
    proc = rpa("parity", "--model", mistral_dir, "--regions", "all", "--out", tmp_path / "p.json")
    one_line_refusal(proc, "model_type='mistral'")
    assert "vllm" not in proc.stderr.lower().replace("rpa parity", "")  # no engine log lines


@pytest.mark.parametrize("content,needle", [
    ("", "no completions (empty file)"),
    ('{"seq": 0, "prompt_ids": [1]}\n', "missing key(s) completion_ids"),
    ("not json\n", "not a JSON line"),
    ('{"seq": 0, "prompt_ids": [], "completion_ids": [3]}\n', "non-empty lists of token ids"),
])
def test_bad_completions_file(tiny_dirs, tmp_path, content, needle):
    path = tmp_path / "completions.jsonl"
    path.write_text(content)
    one_line_refusal(rpa_here("probe", "--model", tiny_dirs["qwen3"], "--regions", "all", "--out", tmp_path / "o",
                         "--completions", path), needle)
    assert not (tmp_path / "o").exists()


def test_missing_completions_file(tiny_dirs, tmp_path):
    one_line_refusal(rpa_here("diagnose", "--model", tiny_dirs["qwen3"], "--regions", "all", "--out", tmp_path / "o",
                         "--completions", tmp_path / "nope.jsonl"), "no such file")


def test_trainer_on_another_device_type_than_vllm(tiny_dirs, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine vLLM and the trainer can both be on cuda")
    one_line_refusal(rpa_here("parity", "--model", tiny_dirs["qwen3"], "--regions", "all", "--out", tmp_path / "p.json",
                         "--device", "cuda"), "vLLM runs on 'cpu' here")


def test_bad_device_name(tiny_dirs, tmp_path):
    one_line_refusal(rpa_here("probe", "--model", tiny_dirs["qwen3"], "--regions", "all", "--out", tmp_path / "o",
                         "--device", "gpu0"), "device 'gpu0' is not one of")


@pytest.mark.parametrize("task,needle", [
    ({"name": "gsm8k", "path": "/nonexistent/gsm8k"}, "no such file or directory"),
    ({"name": "gsm8k", "path": "json", "data_files": "/nonexistent/train.jsonl"}, "data_files: no such file"),
])
def test_missing_task_data(tiny_dirs, tmp_path, task, needle):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(tiny_dirs["qwen3"]), "task": task}))
    proc = rpa_here("train", "--config", cfg, "--out", tmp_path / "run")
    assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr, tail(proc)
    assert not (tmp_path / "run").exists()


def test_train_with_missing_model(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": "/nonexistent/model"}))
    one_line_refusal(rpa_here("train", "--config", cfg, "--out", tmp_path / "run"), "no such directory")


def test_every_prompt_too_long(tiny_dirs, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(tiny_dirs["qwen3"]), "max_prompt_length": 2,
                                   "task": {"name": "synthetic-add", "num_prompts": 8}}))
    one_line_refusal(rpa_here("train", "--config", cfg, "--out", tmp_path / "run"),
                     "every prompt of the task is longer than 2 tokens")
    assert not (tmp_path / "run" / "config.json").exists()  # nothing of a run was written


EXIT_SCRIPT = """
import atexit, pathlib, sys, threading, time
from rpa.cli import exit_now
out = pathlib.Path(sys.argv[1])
atexit.register(lambda: (out / "atexit").write_text("ran"))
def late():
    time.sleep(0.5)
    (out / "thread").write_text("joined")
threading.Thread(target=late).start()
from concurrent.futures import ThreadPoolExecutor
pool = ThreadPoolExecutor(1)  # an idle worker: a normal exit stops it, so must exit_now
pool.submit(lambda: (out / "pool").write_text("ran")).result()
class Teardown:
    def __del__(self):
        (out / "teardown").write_text("ran")
keep = Teardown()  # collected only by the interpreter's teardown, which exit_now skips
sys.stdout.write("x" * 100000)  # into a pipe: still in the buffer when exit_now is called
exit_now(3)
"""


def test_the_cli_exit_skips_only_the_interpreters_teardown(tmp_path):
    """``rpa`` ends with :func:`rpa.cli.exit_now`: main's code, threads joined, ``atexit`` run, the
    buffered stdout complete -- and no module teardown (a normal exit would run ``__del__``)."""
    proc = run_py(["-c", EXIT_SCRIPT, str(tmp_path)], timeout=60)
    assert proc.returncode == 3, tail(proc)
    assert proc.stdout == "x" * 100000
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "pool").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()


def test_the_cli_entry_points_end_through_exit_now():
    """The console script and ``python -m rpa.cli`` both run :func:`rpa.cli.run`."""
    import tomllib

    from tests.conftest import REPO

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["rpa"] == "rpa.cli:run"
    proc = rpa("probe", "--regions", "all")  # no --model: refused by main with 2, through run()
    assert proc.returncode == 2, tail(proc)
