"""Run timings: phases summed per name, and the benchmark's table a partition of the wall time."""

import importlib.util
import time

import pytest

from rpa.core.timing import Timings
from tests.conftest import REPO


def test_phases_sum_and_wrap():
    t = Timings()
    with t.phase("a"):
        time.sleep(0.01)
    f = t.wrap("b", lambda x: x + 1)
    assert f(1) == 2 and f(2) == 3
    d = t.as_dict()
    assert d["a"]["calls"] == 1 and d["a"]["seconds"] >= 0.01 and d["b"]["calls"] == 2


def test_bench_table_partitions_the_run():
    spec = importlib.util.spec_from_file_location("bench_run", REPO / "benchmarks/bench_run.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    timings = {"process_start_to_run": 10, "init_model": 5, "trainer_and_engine_start": 30, "train": 50,
               "training_step": 45, "generate_and_score": 30, "generate": 20, "sync_weights_and_check": 4,
               "trainer_logprobs_no_grad": 3, "evaluate": 1, "run_setup": 2}
    summary = {"wall_s": 95.0, "steps": 10, "timings": {k: {"seconds": v, "calls": 1} for k, v in timings.items()}}
    text = bench.table(summary)
    w = bench.LABEL_WIDTH
    rows = {line[:w].strip(): float(line[w:w + 10]) for line in text.splitlines()[1:-2]}
    top = {k: v for k, v in rows.items() if not k.startswith("of which")}
    assert sum(top.values()) == pytest.approx(105.0)  # process start + wall time, nothing counted twice
    assert rows["run set-up: provenance, training-stack imports, task, trainer model load"] == 2
    assert rows["loss forward + backward"] == 15 and rows["scoring: rewards, old logprobs, mismatch metrics, evaluation"] == 6
    assert "model floor (generation + trainer scoring + loss fwd/bwd): 38.0 s" in text


def test_the_process_log_records_each_python_process_and_the_report_sums_it(tmp_path):
    """tests/scripts/process_cpu (docs/testing.md): on PYTHONPATH with RPA_PROCESS_LOG set, every Python process
    that exits normally logs its own CPU once (here a parent and the child it starts); the report sums by kind."""
    import json
    import subprocess
    import sys

    from tests.scripts.process_cpu_report import report

    log = tmp_path / "processes.jsonl"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "tests/scripts/process_cpu"), "RPA_PROCESS_LOG": str(log),
           "PYTEST_CURRENT_TEST": "tests/test_x.py::test_y (call)"}
    child = "import subprocess, sys; subprocess.run([sys.executable, '-m', 'json.tool', '--help'], capture_output=True)"
    subprocess.run([sys.executable, "-c", f"sum(range(3 * 10**6)); {child}"], env=env, check=True)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 2 and {r["ppid"] for r in records} & {r["pid"] for r in records}
    assert all(r["cpu_s"] > 0 and r["test"] == "tests/test_x.py::test_y" for r in records)
    text = report(records, top=5)
    assert text.startswith("2 processes") and "-m json.tool" in text and "-c (inline code)" in text
    assert "tests/test_x.py" in text
    subprocess.run([sys.executable, "-c", "pass"], env={**env, "RPA_PROCESS_LOG": ""}, check=True)
    assert len(log.read_text().splitlines()) == 2  # without a log file named, nothing is written
