"""The pipeline on a real SLURM: a one-node cluster on this machine (tests/slurm/cluster.sh: Debian's slurm-wlm,
munge, slurmctld and slurmd started by the tests), the pipeline submitted through
snakemake-executor-plugin-slurm (`--executor slurm --workflow-profile experiments/profiles/slurm`): it completes,
its runs equal the local run's (analysis.check_runs), a job cancelled mid-run (`scancel`) is resubmitted and
resumes from its checkpoint with no step lost or repeated, and jobs over their time or memory limit are reported
failed with their log and leave nothing complete. Then every SLURM job of the GPU study's dry runs goes to a
modelled 8-GPU node with `sbatch --test-only`: all accepted, as the committed table says.

Marked `slurm` (and `engine`: the pipeline's jobs run vLLM and TRL). Skipped, with one line, only where SLURM's
packages are absent and cannot be installed here (not root, or no apt-get); `.ci/run` installs them.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, tail
from tests.slurm.jobs import dry_run_jobs, local_rules, sbatch_line
from tests.test_pipeline import DEFAULT, write_config

pytestmark = [pytest.mark.slurm, pytest.mark.engine, pytest.mark.slow, pytest.mark.xdist_group("slurm")]

CLUSTER = REPO / "tests/slurm/cluster.sh"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel")
REFERENCE = REPO / "results/reference/slurm/sbatch_test_only.csv"
STEPS, EVERY = 40, 4
"""A run's optimizer steps and checkpoint interval: enough steps after the first checkpoint to cancel it there. A
step of the tiny model takes ~0.1 s on a free core: at 12 steps the run once finished (0.5 s from checkpoint 8 to
its end) before the cancel reached it; 36 steps after the first checkpoint leave it seconds."""
RUN_MB = 5000
"""A run's job memory: its peak was 3.75-3.99 GB here, so at 3000 MB SLURM killed a run of the pipeline once
(OverMemoryKill) and the test passed on its retries, one run longer."""


def _slurm_missing() -> str | None:
    """Why this machine cannot start the test cluster (None: it can), after trying to install SLURM."""
    if all(shutil.which(d) for d in DAEMONS):
        return None if os.geteuid() == 0 else "not root (slurmd runs as root)"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "slurm-wlm and munge are not installed and cannot be installed here (needs root and apt-get)"
    proc = subprocess.run([str(CLUSTER), "install"], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0 or not all(shutil.which(d) for d in DAEMONS):
        return f"slurm-wlm and munge could not be installed: {(proc.stderr or proc.stdout).strip()[-200:]}"
    return None


def _start(tmp_path_factory, name: str, mode: str):
    why = _slurm_missing()
    from tests.conftest import skip_unless_present

    skip_unless_present("slurm", why and f"no SLURM test cluster: {why}")
    # not under pytest's folder, which only root may enter: munged and slurmctld run as their own users
    folder = Path(tempfile.mkdtemp(prefix=f"rpa-{name}-"))
    proc = subprocess.run([str(CLUSTER), "start", str(folder), mode], capture_output=True, text=True, timeout=180)
    if proc.returncode != 0:
        _stop(folder)
        pytest.fail(f"cluster.sh start {mode} failed: {proc.stderr.strip()}")
    return folder


def _stop(folder) -> None:
    subprocess.run([str(CLUSTER), "stop", str(folder)], capture_output=True, timeout=120)
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """The one-node cluster of this machine (cluster.sh `cpu`); yields the environment that reaches it."""
    folder = _start(tmp_path_factory, "slurm-cpu", "cpu")
    yield {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    _stop(folder)


@pytest.fixture(scope="session")
def gpu_model_cluster(tmp_path_factory):
    """A second cluster whose node models the study's 8-GPU node (cluster.sh `gpu-model`), for --test-only."""
    folder = _start(tmp_path_factory, "slurm-gpu", "gpu-model")
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(folder / "slurm.conf")
    yield folder
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old
    _stop(folder)


EAGER = {"vllm_enforce_eager": True}
"""The runs' vLLM engine: eager starts in ~6 s where a compiled one takes ~30 s on 2 cores, and nothing here is
about compilation (the plugin, the cancel, the resume and the limits are the same for either)."""


def _config(results: Path, **train) -> dict:
    """The small target's config: the parity gate of a tiny Qwen3 and a GRPO grid of one run (regions none), a
    job of one CPU, on an eager engine. One run is enough: it is the one cancelled and resumed, and it must still
    equal the local run record for record (a second, uncancelled run cost a training process on each side)."""
    config = copy.deepcopy(DEFAULT)
    config.update({
        "results": str(results),
        "models": {"tiny-qwen3": {"tiny": {"arch": "qwen3", "seed": 0}}},
        "probe": {**config["probe"], "configs": {"none": {"regions": "none"}}},
        "diagnose": {"sequences": 2, "configs": ["none"]},
        "attribution": {"models": [], "configs": []},
        "figures": {"format": "png", "dlogp_vs_prob_configs": ["none"]},
        "job_mem_mb": 3000,
        "train": {"base": "experiments/train/tiny-synthetic.yaml", "model": "tiny-qwen3", "regions": ["none"],
                  "seeds": [0], "settings": {"short": {"steps": STEPS, "checkpoint_every": EVERY,
                                                       "warm_start": {"steps": 0}, **EAGER}},
                  "resources": {"mem_mb": RUN_MB, "runtime": 10, "cpus_per_task": 1}, **train},
    })
    return config


def _targets(results: Path) -> list[str]:
    return [str(results / "parity/tiny-qwen3.json"), "train_all"]


def _slurm_args(tmp_path: Path) -> list[str]:
    return ["--executor", "slurm", "--workflow-profile", "experiments/profiles/slurm",
            "--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "2",
            "--slurm-logdir", str(tmp_path / "slurm_logs")]


def _snakemake(args, env, timeout=900, **popen):
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout, **popen)


def _newest_checkpoint(run: Path) -> int | None:
    """The step of the newest checkpoint the run can resume from (the product's own rule: its trainer state whole),
    None before the first. A ``checkpoint-N`` folder being written at the cancel is not one: the run resumed from
    checkpoint 4 after a cancel that found folders 4 and 8, 8 half written (2026-12-07)."""
    from rpa.train.rundir import latest_checkpoint

    newest = latest_checkpoint(run)
    return None if newest is None else int(newest.name.split("-")[-1])


def _squeue(env) -> list[dict]:
    out = subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i|%T|%k|%r"], env=env, capture_output=True,
                         text=True, check=True).stdout
    return [dict(zip(("id", "state", "comment", "reason"), line.split("|"))) for line in out.splitlines()]


def _watch_nice(made: dict, needle: str) -> None:
    """Set ``made["nice"]`` to the nice value of the first ``rpa train`` process whose command line holds
    ``needle`` (field 19 of /proc/PID/stat), looking every 0.5 s while ``made["proc"]`` runs."""
    while made["proc"].poll() is None and made["nice"] is None:
        for stat in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                cmd = stat.read_bytes().replace(b"\0", b" ").decode()
                if "rpa train" in cmd and needle in cmd:
                    made["nice"] = int((stat.parent / "stat").read_text().rsplit(")", 1)[1].split()[16])
                    return
            except (OSError, ValueError, IndexError):
                continue
        time.sleep(0.5)


@pytest.fixture(scope="session")
def over_limit_run(slurm_cluster, tmp_path_factory):
    """The pipeline of the time/memory-limit test, submitted at once (Snakemake in the background, no
    retries): a run given 1 minute that needs more and the parity job given 500 MB. The pipeline test
    asks for it too, so that these jobs wait out their limits while that test's pipeline runs on the
    same cluster (SLURM shares the node's CPUs between the two); the limit test then waits for its end.
    Submitted at nice 19, which the cluster gives its jobs (PropagatePrioProcess): the over-time run trains until
    SLURM stops it, and on a 2-core machine that minute of CPU is best spent at the lowest priority (the limits are
    wall time and memory, which the nice value does not change). ``nice``: the nice value the over-time run's
    training process was seen with (a thread reads /proc until it finds it)."""
    root = tmp_path_factory.mktemp("over-limit")
    results = root / "results"
    (root / "c").mkdir()
    config = _config(results, regions=["none"], settings={"long": {"steps": 2000, "warm_start": {"steps": 0}, **EAGER}},
                     resources={"mem_mb": RUN_MB, "runtime": 1, "cpus_per_task": 1})
    cfg = write_config(root / "c", config)
    log = open(root / "snakemake.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "snakemake", *_targets(results), *_slurm_args(root),
                             "--configfile", str(cfg), "--retries", "0", "--set-resources", "parity:mem_mb=500",
                             "parity:cpus_per_task=1"], cwd=REPO, env=slurm_cluster, stdout=log,
                            stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: os.nice(19))
    made = {"proc": proc, "log": root / "snakemake.log", "results": results, "cfg": cfg, "logdir": root / "slurm_logs",
            "nice": None}
    threading.Thread(target=_watch_nice, args=(made, f"{results}/train/tiny-qwen3/long/"), daemon=True).start()
    yield made
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=120)
    log.close()


def test_the_cluster_is_this_machine_with_its_cpus_and_memory(slurm_cluster, tmp_path):
    node = subprocess.run(["scontrol", "show", "node"], env=slurm_cluster, capture_output=True, text=True).stdout
    real = subprocess.run(["slurmd", "-C"], capture_output=True, text=True).stdout.split()
    for key in ("CPUs", "RealMemory"):
        want = next(p for p in real if p.startswith(f"{key}="))
        assert (want.replace("CPUs=", "CPUTot=") if key == "CPUs" else want) in node, (want, node)
    parts = subprocess.run(["sinfo", "-h", "-o", "%P"], env=slurm_cluster, capture_output=True, text=True).stdout
    assert parts.split() == ["cpu*", "gpu"]


def test_the_pipeline_through_the_plugin_equals_the_local_run_and_resumes_a_cancelled_job(slurm_cluster, tmp_path,
                                                                                          over_limit_run):
    # the local run of the grid: the reference
    local = tmp_path / "local"
    (tmp_path / "l").mkdir()
    cfg = write_config(tmp_path / "l", _config(local))
    records = [str(local / "train/tiny-qwen3/short/none/seed0.json")]
    proc = _snakemake([*records, "--cores", "2", "--configfile", str(cfg)], slurm_cluster)
    assert proc.returncode == 0, tail(proc)

    # the same target submitted to SLURM; the run of `none` cancelled once it has a checkpoint
    results = tmp_path / "slurm"
    (tmp_path / "s").mkdir()
    cfg = write_config(tmp_path / "s", _config(results))
    log = open(tmp_path / "snakemake.log", "w")
    run = subprocess.Popen([sys.executable, "-m", "snakemake", *_targets(results), *_slurm_args(tmp_path),
                            "--configfile", str(cfg)], cwd=REPO, env=slurm_cluster, stdout=log,
                           stderr=subprocess.STDOUT, text=True)
    victim = results / "train/tiny-qwen3/short/none/seed0"
    cancelled, deadline = None, time.monotonic() + 600
    while cancelled is None and run.poll() is None and time.monotonic() < deadline:
        if _newest_checkpoint(victim) is not None and not (victim / "summary.json").exists():
            job = next(j for j in _squeue(slurm_cluster) if j["state"] == "RUNNING"
                       and j["comment"].startswith("rule_grid_run_wildcards_train_tiny-qwen3_short_none_"))
            subprocess.run(["scancel", job["id"]], env=slurm_cluster, check=True)
            cancelled = (job["id"], _newest_checkpoint(victim))
        time.sleep(0.05)
    rc = run.wait(timeout=900)
    log.close()
    text = (tmp_path / "snakemake.log").read_text()
    assert rc == 0, text[-6000:]
    assert cancelled, f"the run of none finished before it could be cancelled:\n{text[-3000:]}"
    states = {j["id"]: j["state"] for j in _squeue(slurm_cluster)}
    assert states[cancelled[0]] == "CANCELLED", states
    assert f"SLURM-job '{cancelled[0]}' failed, SLURM status is: 'CANCELLED'" in text, text[-3000:]
    # Snakemake submitted the job again (the profile's retries) and the run resumed from its checkpoint
    run_log = (results / "logs/train/tiny-qwen3/short/none/seed0.log").read_text()
    resumed = [int(n) for n in re.findall(r"resuming from checkpoint-(\d+)", run_log)]
    assert resumed and resumed[0] >= cancelled[1], (cancelled, run_log[-2000:])  # its newest at the cancel, or later
    steps = [json.loads(line)["step"] for line in (victim / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), steps  # no step lost or logged twice
    # every run equals the local run's, record for record (analysis.check_runs)
    check = subprocess.run([sys.executable, "-m", "analysis.check_runs", "--runs", str(results / "train"),
                            "--reference", str(local / "train")], cwd=REPO, capture_output=True, text=True)
    assert check.returncode == 0 and "1 of 1 compared runs identical" in check.stdout + check.stderr, tail(check)
    assert json.loads((results / "parity/tiny-qwen3.json").read_text())["passed"]
    assert (results / "tables/train.csv").exists()


def test_jobs_over_their_time_or_memory_are_reported_failed_with_their_log_and_leave_nothing_complete(
        slurm_cluster, over_limit_run):
    """A run given 1 minute that needs more (SLURM: TIMEOUT) and the parity job given 500 MB (SLURM's
    OverMemoryKill: FAILED); no retries (the `over_limit_run` fixture submitted them)."""
    results, cfg = over_limit_run["results"], over_limit_run["cfg"]
    rc = over_limit_run["proc"].wait(timeout=900)
    text = over_limit_run["log"].read_text()
    assert rc != 0, text[-3000:]
    assert over_limit_run["nice"] == 19, over_limit_run["nice"]  # the cluster ran the job at its submitter's nice
    mine = set(re.findall(r"has been submitted with SLURM jobid (\d+)", text))  # this pipeline's jobs, not the other's
    jobs = {j["comment"].split("_wildcards_")[0]: j for j in _squeue(slurm_cluster)
            if j["id"] in mine and j["comment"].startswith(("rule_grid_run_wildcards_train_tiny-qwen3_long", "rule_parity"))}
    assert jobs["rule_grid_run"]["state"] == "TIMEOUT" and jobs["rule_parity"]["state"] in ("FAILED",
                                                                                              "OUT_OF_MEMORY"), jobs
    for rule, why in (("grid_run", "DUE TO TIME LIMIT"), ("parity", "exceeded memory limit")):
        job = jobs[f"rule_{rule}"]
        assert f"SLURM-job '{job['id']}' failed, SLURM status is: '{job['state']}'" in text, text[-3000:]
        slurm_log = next((over_limit_run["logdir"] / f"rule_{rule}").glob(f"*/{job['id']}.log"))
        assert str(slurm_log) in text, (slurm_log, text[-3000:])  # Snakemake names the job's log
        assert why in slurm_log.read_text(), slurm_log.read_text()[-2000:]
    # nothing half-written left as complete: no outputs, no summary; a rerun would run both jobs again
    assert not (results / "parity/tiny-qwen3.json").exists()
    assert not list(results.glob("train/**/summary.json")) and not list(results.glob("train/**/seed0.json"))
    again = _snakemake([*_targets(results), "-n", "--cores", "1", "--configfile", str(cfg)], slurm_cluster)
    assert again.returncode == 0 and "parity" in again.stdout and "grid_run" in again.stdout, tail(again)


def test_every_gpu_study_job_is_accepted_by_sbatch_test_only_on_the_modelled_gpu_node(gpu_model_cluster, tmp_path):
    from tests.slurm.sbatch_test_only import rows, test_only

    table = rows()
    refused = [(r["config"], r["job_kind"], r["wildcards"], r["answer"]) for r in table if r["accepted"] != "yes"]
    assert not refused, refused
    assert {r["job_kind"] for r in table} >= {"grid_run", "parity", "probe", "probe_sampler", "diagnose"}
    assert {r["gpus"] for r in table} == {"0", "1", "4", "8"}
    # the committed table is this one: every job, its shape and its answer
    shape = ("config", "job_kind", "wildcards", "gpus", "cpus", "mem", "time", "partition", "accepted")
    with open(REFERENCE) as f:
        committed = sorted(tuple(r[k] for k in shape) for r in csv.DictReader(f))
    assert sorted(tuple(r[k] for k in shape) for r in table) == committed
    # the control: the plugin's own default shape of an 8-GPU job (--ntasks-per-gpu=1, no --nodes) is refused
    job = next(j for j in dry_run_jobs(tmp_path, "study") if j["resources"].get("gpu") == 8
               and j["rule"] not in local_rules())
    stock = {**job, "resources": {k: v for k, v in job["resources"].items() if k not in ("tasks_per_gpu", "nodes")}}
    accepted, answer = test_only(sbatch_line(stock, workdir=str(REPO)))
    assert not accepted and "Requested node configuration is not available" in answer, answer


def test_a_status_command_that_cannot_see_a_job_end_is_refused_before_any_submission(slurm_cluster, tmp_path):
    """Issue 73: with sacct installed and accounting storage disabled (this cluster), the plugin's default status
    command made Snakemake wait forever for a finished job. The workflow refuses it in one line before submitting
    anything, naming the flag to set."""
    results = tmp_path / "r"
    before = {j["id"] for j in _squeue(slurm_cluster)}
    proc = _snakemake([str(results / "parity/tiny-qwen3.json"), "--executor", "slurm", "--workflow-profile",
                       "experiments/profiles/slurm", "--jobs", "1", "--configfile", "experiments/toys.yaml",
                       "--config", f"results={results}"], slurm_cluster, timeout=300)
    assert proc.returncode != 0, tail(proc)
    assert "rpa: error: the SLURM plugin would ask sacct" in proc.stderr + proc.stdout, tail(proc)
    assert "--slurm-status-command squeue" in proc.stderr + proc.stdout
    assert {j["id"] for j in _squeue(slurm_cluster)} == before and not results.exists()  # nothing submitted or run
