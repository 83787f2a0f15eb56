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
