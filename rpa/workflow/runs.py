"""The record of one grid job: ``python -m rpa.workflow.runs --out RECORD RUN_DIR ...``.

A job of a grid (the GRPO grid, the positive control, the study, a search stage) runs one process
group's runs in one ``rpa train`` process (``runs_per_process`` seeds of up to ``arms_per_process``
arms; one run by default); Snakemake tracks the job by this record, not by the runs'
``summary.json`` files, so that a job stopped half-way leaves its finished runs in place (a
failed job's outputs are deleted) and its rerun does only what is left. Written once every run
has its summary -- a run that failed is a result the tables show as failed; a run without a
summary is not, and the job fails.

A run whose summary says it stopped for a reason worth running again (:func:`transient`: out of
memory, a lost process or collective) fails the job instead (exit 1, no record), so that Snakemake
runs it again (``retries``) and the run resumes from its checkpoint -- up to ``--transient-retries``
times per run (counted in the run directory's :data:`TRANSIENT_LOG`); after that, or at once for any
other error (a rerun would repeat it), the run is recorded as failed and the job succeeds.

Schema ``rpa.grid-job/1`` (named ``rpa.study-job/1`` while only the study had records; the same
fields): ``runs``, one entry per run directory in order, with its ``dir``,
``status``, ``steps``, ``wall_s`` and ``engine_taken_over`` (whether it ran on the previous
run's vLLM engine) from its summary, and ``transient_failures`` (the job attempts that failed it
before).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from rpa.core.errors import UserError
from rpa.core.jsonfiles import append_jsonl, read_jsonl, read_record, write_json

SCHEMA = "rpa.grid-job/1"
TRANSIENT_LOG = "transient_failures.jsonl"
"""In a run directory: one line per job attempt failed for the run's transient error."""

TRANSIENT_PATTERNS = (
    r"OutOfMemoryError", r"CUDA out of memory", r"\bout of memory\b", r"CUBLAS_STATUS_ALLOC_FAILED",
    r"No available memory for the cache blocks",  # vLLM's KV cache at start: the GPU's memory was taken
    r"Free memory on device .* is less than desired GPU memory utilization",  # another process on the GPU
    r"\bNCCL\b", r"DistBackendError", r"DistNetworkError", r"Watchdog caught collective operation timeout",
    r"EngineDeadError", r"EngineCore.*(died|dead|failed unexpectedly)", r"ChildFailedError",
    r"(killed|terminated) by signal", r"\bSIGKILL\b", r"\bSIGTERM\b", r"exitcode\W+-9\b",
    r"ECC error", r"CUDA error: (an illegal memory access|unspecified launch failure|uncorrectable)",
    r"BrokenPipeError", r"ConnectionResetError",
)
"""What a run's error (the ``repr`` of its exception, in its summary) says when a rerun can succeed:
memory the run did not get (CUDA, cuBLAS, vLLM's start-up), a process or collective lost (NCCL, a
killed rank or engine core), a failing GPU. Anything else is deterministic: a rerun would repeat it."""

_TRANSIENT = re.compile("|".join(TRANSIENT_PATTERNS), re.IGNORECASE)


class TransientFailure(UserError):
    """Runs of the job stopped for a reason worth running again: the job fails so that it is."""


def transient(error: str | None) -> bool:
    """Whether a run's recorded error (:data:`TRANSIENT_PATTERNS`) is worth running it again for."""
    return bool(error) and _TRANSIENT.search(error) is not None


def job_record(run_dirs: list[Path], transient_retries: int = 0) -> dict[str, Any]:
    """The record of the runs ``run_dirs``; ``FileNotFoundError`` names the runs without a summary,
    :class:`TransientFailure` those that failed transiently fewer than ``transient_retries`` times
    before (each such failure is counted in the run's :data:`TRANSIENT_LOG`)."""
    missing = [str(d) for d in run_dirs if not (d / "summary.json").exists()]
    if missing:
        raise FileNotFoundError(f"no summary.json in {', '.join(missing)} (see the job's log)")
    runs, again = [], []
    for d in run_dirs:
        s = read_record(d / "summary.json")
        failures = len(read_jsonl(d / TRANSIENT_LOG)) if (d / TRANSIENT_LOG).exists() else 0
        if s.get("status") == "error" and transient(s.get("error")) and failures < transient_retries:
            again.append((d, s.get("error"), failures, s.get("steps")))
        runs.append({"dir": str(d), "status": s.get("status"), "steps": s.get("steps"), "wall_s": s.get("wall_s"),
                     "engine_taken_over": s.get("engine_taken_over", False), "transient_failures": failures})
    if again:
        for d, error, _, steps in again:
            append_jsonl(d / TRANSIENT_LOG, {"error": error, "steps": steps, "time": time.time()})
        first, error, failures, _ = again[0]
        raise TransientFailure(f"{len(again)} run(s) stopped for a reason worth running again, first {first} "
                               f"(failure {failures + 1} of {transient_retries} allowed: {str(error)[:300]}); "
                               f"the job fails so that it runs again and resumes")
    return {"schema": SCHEMA, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the job's record (JSON, written atomically)")
    parser.add_argument("runs", nargs="+", type=Path, help="the job's run directories, in order")
    parser.add_argument("--transient-retries", type=int, default=0,
                        help="fail the job (to be run again) for a run's transient error up to this many times per run "
                             "(default 0: record every error as the run's result)")
    args = parser.parse_args(argv)
    try:
        record = job_record(args.runs, args.transient_retries)
    except (FileNotFoundError, TransientFailure) as err:
        print(f"rpa.workflow.runs: {err}", file=sys.stderr)
        return 1
    write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
