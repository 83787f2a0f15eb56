"""Compare training runs made again with the committed runs of the same cells: the logs, not the tables.

    python -m analysis.check_runs --runs /tmp/mini/results/study --reference results/reference/study-cpu/study

Every run directory under ``--runs`` (one with a ``summary.json``) is matched with the directory of
the same name under ``--reference``. Compared exactly (``==`` on the parsed JSON, no tolerance): every
key the reference keeps of each ``metrics.jsonl`` and ``eval.jsonl`` line (an exported reference keeps
only the keys the analyses read; timing keys are left out, they differ from run to run) and the
summary's results (:data:`SUMMARY_KEYS`). A run with no reference counterpart is listed, not
compared. Exit status 1 if any compared run differs, 2 if none could be compared.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from analysis.refusal import run
from analysis.runs import ended_runs, load_run
from rpa.core.jsonfiles import write_json

LOGS = ("metrics", "evals")
"""What a run's logs are called on :class:`analysis.runs.Run`: ``metrics.jsonl`` and ``eval.jsonl``."""

SUMMARY_KEYS = ("status", "verdict", "collapsed", "collapse_step", "steps", "peak_reward", "final_reward",
                "reward_auc", "final_eval_accuracy", "final_eval_reward")
"""The results a run's ``summary.json`` holds (not its wall time, provenance or config)."""


def _timing(key: str) -> bool:
    """A log key that measures time (``step_time``, ``timing/...``): not a result."""
    return "time" in key


def compare_run(reference: Path, run: Path) -> list[str]:
    """What differs between the run in ``run`` and the one in ``reference``: one line per log's
    first differing record and one for the summary; empty if identical."""
    ref, new = load_run(reference), load_run(run)
    diffs = []
    for log in LOGS:
        a, b = getattr(ref, log), getattr(new, log)
        if len(a) != len(b):
            diffs.append(f"{log}: {len(a)} records in the reference, {len(b)} here")
            continue
        for i, (x, y) in enumerate(zip(a, b)):
            bad = [k for k in x if not _timing(k) and x[k] != y.get(k)]
            if bad:
                diffs.append(f"{log} record {i + 1}: {', '.join(bad)} (e.g. {bad[0]} {x[bad[0]]!r} -> {y.get(bad[0])!r})")
                break
    bad = [k for k in SUMMARY_KEYS if (ref.summary or {}).get(k) != (new.summary or {}).get(k)]
    if bad:
        diffs.append(f"summary: {', '.join(bad)}")
    return diffs


def compare(runs: Path, reference: Path) -> dict[str, Any]:
    """Every run under ``runs`` against its counterpart under ``reference``: cell -> ``identical``,
    ``no reference run`` or its differences (:func:`compare_run`)."""
    out: dict[str, Any] = {}
    ended = set(ended_runs(reference))
    for cell in ended_runs(runs):
        if cell not in ended:
            out[str(cell)] = "no reference run"
            continue
        diffs = compare_run(reference / cell, runs / cell)
        out[str(cell)] = "identical" if not diffs else diffs
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=Path, required=True, help="folder of the runs made again")
    ap.add_argument("--reference", type=Path, required=True, help="folder of the committed runs, same layout")
    ap.add_argument("--out", type=Path, help="also write the comparison as JSON here")
    args = ap.parse_args(argv)
    for folder in (args.runs, args.reference):
        if not folder.is_dir():
            ap.error(f"{folder} is not a folder")  # exit 2, nothing written
    result = compare(args.runs, args.reference)
    for cell, verdict in result.items():
        print(f"{cell}: {verdict if isinstance(verdict, str) else '; '.join(verdict)}")
    compared = [v for v in result.values() if v != "no reference run"]
    same = sum(v == "identical" for v in compared)
    print(f"check_runs: {same} of {len(compared)} compared runs identical"
          f" ({len(result) - len(compared)} without a reference run)")
    if args.out:
        write_json(args.out, {"runs": str(args.runs), "reference": str(args.reference), "cells": result})
    if not compared:
        return 2
    return 0 if same == len(compared) else 1


if __name__ == "__main__":
    raise SystemExit(run(main))
