"""The record of one study job: ``python -m rpa.workflow.runs --out RECORD RUN_DIR ...``.

A job of the study runs the seeds of one model and arm in one ``rpa train`` process
(``study.runs_per_process``); Snakemake tracks the job by this record, not by the runs'
``summary.json`` files, so that a job stopped half-way leaves its finished runs in place (a
failed job's outputs are deleted) and its rerun does only what is left. Written once every run
has its summary -- a run that failed is a result the tables show as failed; a run without a
summary is not, and the job fails.

Schema ``rpa.study-job/1``: ``runs``, one entry per run directory in order, with its ``dir``,
``status``, ``steps``, ``wall_s`` and ``engine_taken_over`` (whether it ran on the previous
run's vLLM engine) from its summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from rpa.core.jsonfiles import write_json

SCHEMA = "rpa.study-job/1"


def job_record(run_dirs: list[Path]) -> dict[str, Any]:
    """The record of the runs ``run_dirs``; ``FileNotFoundError`` names the runs without a summary."""
    missing = [str(d) for d in run_dirs if not (d / "summary.json").exists()]
    if missing:
        raise FileNotFoundError(f"no summary.json in {', '.join(missing)} (see the job's log)")
    runs = []
    for d in run_dirs:
        s = json.loads((d / "summary.json").read_text())
        runs.append({"dir": str(d), "status": s.get("status"), "steps": s.get("steps"), "wall_s": s.get("wall_s"),
                     "engine_taken_over": s.get("engine_taken_over", False)})
    return {"schema": SCHEMA, "runs": runs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the job's record (JSON, written atomically)")
    parser.add_argument("runs", nargs="+", type=Path, help="the job's run directories, in order")
    args = parser.parse_args(argv)
    try:
        record = job_record(args.runs)
    except FileNotFoundError as err:
        print(f"rpa.workflow.runs: {err}", file=sys.stderr)
        return 1
    write_json(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
