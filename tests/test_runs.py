"""A grid job's record (rpa.workflow.runs): a run stopped for a reason worth retrying fails its job
(a bounded number of times, counted in the run directory), a deterministic error is recorded at once."""

import json

import pytest

from rpa.workflow.runs import TRANSIENT_LOG, TransientFailure, job_record, main, transient

TRANSIENT = [
    "OutOfMemoryError('CUDA out of memory. Tried to allocate 31.50 GiB. GPU 0 has a total capacity of 79.19 GiB')",
    "ValueError('No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
    "initializing the engine.')",
    "ValueError('Free memory on device (10.2/79.19 GiB) on startup is less than desired GPU memory utilization "
    "(0.3, 23.76 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.')",
    "RuntimeError('CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`')",
    "DistBackendError('NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote process exited')",
    "RuntimeError('[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=912, OpType=BROADCAST) "
    "ran for 1800087 milliseconds before timing out.')",
    "EngineDeadError('EngineCore encountered an issue. See stack trace (above) for the root cause.')",
    "ChildFailedError('rpa.cli FAILED: exitcode: -9 (pid: 4242)')",
    "RuntimeError('DataLoader worker (pid 77) is killed by signal: Killed.')",
]
DETERMINISTIC = [
    "TrainConfigError('vllm_gpu_memory_utilization: must be in (0, 1]')",
    "WeightSyncError('step 12: vLLM and the trainer differ by 0.9 nats on the probe after a weight sync')",
    "RuntimeError('vLLM engine does not match the numerics configuration: vLLM runs torch.bfloat16')",
    "KeyError('reward')",
    "ValueError('shape mismatch (4, 8) vs (4, 9)')",
    "NotImplementedError(\"rpa's GRPO runner handles text-only dense models\")",
    None,
    "",
]


@pytest.mark.parametrize("error", TRANSIENT)
def test_errors_worth_retrying(error):
    assert transient(error)


@pytest.mark.parametrize("error", DETERMINISTIC)
def test_deterministic_errors_are_not_retried(error):
    assert not transient(error)


def _run(root, name, status="ok", error=None, steps=20):
    d = root / name
    d.mkdir()
    (d / "summary.json").write_text(json.dumps({"status": status, "error": error, "steps": steps, "wall_s": 1.0}))
    return d


def test_a_transient_failure_fails_the_job_a_bounded_number_of_times(tmp_path):
    ok = _run(tmp_path, "seed0")
    oom = _run(tmp_path, "seed1", "error", TRANSIENT[0], steps=7)
    for attempt in (1, 2):  # two job attempts fail, so that Snakemake runs the job again
        with pytest.raises(TransientFailure, match=f"failure {attempt} of 2 allowed: OutOfMemoryError"):
            job_record([ok, oom], transient_retries=2)
    assert [json.loads(line)["steps"] for line in (oom / TRANSIENT_LOG).read_text().splitlines()] == [7, 7]
    assert not (ok / TRANSIENT_LOG).exists()
    record = job_record([ok, oom], transient_retries=2)  # the third: recorded as the run's result
    assert [(r["status"], r["transient_failures"]) for r in record["runs"]] == [("ok", 0), ("error", 2)]


def test_a_deterministic_error_is_recorded_at_once(tmp_path):
    bad = _run(tmp_path, "seed0", "error", DETERMINISTIC[1])
    record = job_record([bad], transient_retries=2)
    assert record["runs"][0]["status"] == "error" and not (bad / TRANSIENT_LOG).exists()


def test_collapsed_and_diverged_runs_are_results_even_with_a_memory_error(tmp_path):
    runs = [_run(tmp_path, "a", "collapsed", "RuntimeError('CUDA out of memory')"),
            _run(tmp_path, "b", "diverged", "EngineDivergence('gap 7.1 nats')")]
    assert [r["status"] for r in job_record(runs, transient_retries=2)["runs"]] == ["collapsed", "diverged"]


def test_the_command_fails_in_one_line_and_writes_no_record(tmp_path, capsys):
    run = _run(tmp_path, "seed0", "error", TRANSIENT[4])
    out = tmp_path / "job.json"
    assert main(["--out", str(out), str(run), "--transient-retries", "1"]) == 1 and not out.exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "worth running again" in err[0] and "DistBackendError" in err[0]
    assert main(["--out", str(out), str(run), "--transient-retries", "1"]) == 0 and out.exists()
    assert main(["--out", str(tmp_path / "j2.json"), str(run)]) == 0  # default 0: every error is a result


def test_a_finished_run_is_finished_whatever_its_logging_cadence(tmp_path):
    """A grid job reruns ``rpa train`` on its finished runs (it writes the record only): a run of 36
    optimizer steps at ``updates_per_generation`` 4 logs 9 of them, and is finished all the same
    (it was trained again from scratch when its 9 logged steps were read as 9 of 36 steps)."""
    from rpa.train.config import TrainConfig
    from rpa.train.rundir import finished_summary

    cfg = TrainConfig.from_dict({"model": "m", "task": {"name": "count", "num_prompts": 64, "eval_prompts": 2},
                                 "steps": 36, "updates_per_generation": 4})
    summary = {"status": "ok", "steps": 9, "config": cfg.to_dict()}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    assert finished_summary(tmp_path, cfg) == summary
    shorter = {**summary, "config": {**cfg.to_dict(), "steps": 20}}  # control: a summary of fewer steps
    (tmp_path / "summary.json").write_text(json.dumps(shorter))
    assert finished_summary(tmp_path, cfg) is None
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "status": "error"}))
    assert finished_summary(tmp_path, cfg) is None
