"""Put a committed reference's finished runs where the workflow looks for them, so that it goes on
from them instead of running them again:

    python -m analysis.restore_reference --reference results/reference/collapse-cpu --results results/collapse-cpu
    snakemake collapse_grid --cores 2 --configfile experiments/collapse-cpu.yaml -n   # nothing left to run

Snakemake decides by file times that a job is done: its output (a grid job's record
``<group>.json``, :mod:`rpa.workflow.runs`) newer than its inputs (each run's ``run.yaml``). A git
clone gives the committed files the times it writes them at, in path order, and ``seed0.json`` (the
record) sorts before ``seed0/run.yaml``: copied as they are, every finished run would be run again
(its ``rpa train`` finds it finished and does nothing, but only after loading its model). This copies
``<reference>/search`` (and ``dose``/``study`` where the reference has them) into ``<results>`` and
gives the copies times in the order of the workflow's rules: run configs and manifests first, then
what a run writes, then the records.

Safe to run twice: a file already in ``<results>`` is kept as it is (a local run is never replaced
by the committed one) and only the files copied get times.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from pathlib import Path
from analysis.refusal import Refused, run


FOLDERS = ("search", "dose", "study")
"""The reference folders whose runs the workflow can go on from (the grids' results folders)."""
WRITTEN_FIRST = ("run.yaml", "manifest.json")
"""What the workflow writes before a run (its config, a stage's manifest): the oldest copies."""
RECORD_SCHEMAS = ("rpa.grid-job/1", "rpa.study-job/1")
"""A job record's schema (:data:`rpa.workflow.runs.SCHEMA`, and its name before every grid had
records): the newest copies."""


def is_record(path: Path) -> bool:
    """Whether ``path`` is a grid job's record (a JSON file whose schema says so)."""
    if path.suffix != ".json" or path.name in WRITTEN_FIRST:
        return False
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("schema") in RECORD_SCHEMAS


def rank(path: Path) -> int:
    """A copy's place in time: 0 what comes before a run, 1 what a run writes, 2 a job's record."""
    if path.name in WRITTEN_FIRST:
        return 0
    return 2 if is_record(path) else 1


def restore(reference: Path, results: Path, now: float | None = None) -> dict[str, int]:
    """Copy the reference's run folders into ``results`` (files already there kept) and set the
    copies' times ``rank`` seconds apart, ending at ``now``. The number of files copied per folder."""
    now = time.time() if now is None else now
    copied: dict[str, int] = {}
    placed: list[Path] = []
    for folder in FOLDERS:
        if not (reference / folder).is_dir():
            continue
        count = 0
        for src in sorted(p for p in (reference / folder).rglob("*") if p.is_file()):
            dst = results / src.relative_to(reference)
            if dst.exists():
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst.with_name(dst.name + ".restoring"))
            os.replace(dst.with_name(dst.name + ".restoring"), dst)  # a killed copy leaves no half file
            placed.append(dst)
            count += 1
        copied[folder] = count
    for dst in placed:
        t = now - 2 + rank(dst)  # the workflow's order: config, run, record
        os.utime(dst, (t, t))
    return copied


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, type=Path, help="a committed reference, results/reference/<name>")
    parser.add_argument("--results", required=True, type=Path, help="the results folder the workflow writes")
    args = parser.parse_args(argv)
    if not any((args.reference / f).is_dir() for f in FOLDERS):
        raise Refused(f"restore: {args.reference} has no {', '.join(FOLDERS)} folder of runs")  # nothing written
    src, dst = args.reference.resolve(), args.results.resolve()
    if src == dst or src.is_relative_to(dst) or dst.is_relative_to(src):  # copies into what is being copied
        raise Refused(f"restore: --reference {args.reference} and --results {args.results} are one folder or nested; "
                     "restore into a results folder beside the reference")
    copied = restore(args.reference, args.results)
    print("restore: " + ", ".join(f"{folder} {n} files" for folder, n in copied.items()) + f" -> {args.results}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
