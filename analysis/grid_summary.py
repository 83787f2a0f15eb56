"""The table of one entry of ``grids:`` (docs/pipeline.md#grids): one row per run and one per group.

``python -m analysis.grid_summary --results R --grid NAME --out-csv F --out-md F`` reads
``R/grids/NAME/manifest.json`` (its cells, axes and labels as the config wrote them) and each run
(:func:`analysis.runs.load_run`, by :func:`analysis.collapse_search.load_runs`: the same per-run
columns as a search stage). The CSV has one row per cell, missing and failed runs included
(``state``); the Markdown table one row per group (every axis but the seed: runs, finished,
collapsed with an exact interval at ``--confidence``, raw terminal reward, reward AUC, entropy,
mismatch before any collapse), then one per run. A ``grids:`` entry has no decision rule: its
statistics are for the reader (a rule belongs in a search's ``decision``, fixed before it runs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

from analysis.collapse_search import groups, load_runs
from rpa.core.jsonfiles import atomic_path, write_text

RUN_COLUMNS = ("seed", "state", "status", "steps", "collapsed", "collapse_step", "terminal_reward", "reward_auc",
               "final_entropy", "pre_collapse_mismatch", "final_eval_accuracy", "wall_s")
"""The per-run columns of the Markdown table (after the axes), where the runs have them."""


def tables(results: Path, name: str, confidence: float = 0.95) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(one row per cell, one row per group, the manifest) of grid ``name``."""
    manifest = json.loads((results / "grids" / name / "manifest.json").read_text())
    runs, _ = load_runs(results, manifest, section="grids")
    return runs, groups(runs, list(manifest["axes"]), confidence), manifest


def markdown(runs: pd.DataFrame, per_group: pd.DataFrame, manifest: dict, confidence: float) -> str:
    axes = list(manifest["axes"])
    shown = per_group[[c for c in [*axes, "runs", "finished", "failed", "missing", "collapsed", "collapse_rate_low",
                                   "collapse_rate_high", "terminal_reward", "reward_auc", "entropy",
                                   "pre_collapse_mismatch"] if c in per_group]]
    per_run = runs[[c for c in [*axes, *RUN_COLUMNS] if c in runs]]
    return (f"### grid {manifest['grid']}\n\nPer group ({len(per_group)}; collapse rate: exact {confidence:.0%} "
            f"interval over the finished runs):\n\n{shown.to_markdown(index=False, floatfmt='.3g')}\n\n"
            f"Per run ({len(runs)}):\n\n{per_run.to_markdown(index=False, floatfmt='.3g')}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--grid", required=True, help="a name of the config's grids: section")
    parser.add_argument("--out-csv", required=True, type=Path)
    parser.add_argument("--out-md", required=True, type=Path)
    parser.add_argument("--confidence", type=float, default=0.95, help="coverage of the collapse-rate intervals")
    args = parser.parse_args(argv)
    if not (args.results / "grids" / args.grid / "manifest.json").is_file():
        parser.error(f"{args.results}/grids/{args.grid}/manifest.json: no such grid manifest "
                     f"(snakemake writes it: the grid {args.grid!r} of the config's grids: section)")
    runs, per_group, manifest = tables(args.results, args.grid, args.confidence)
    for path in (args.out_csv, args.out_md):
        path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out_csv) as tmp:
        runs.to_csv(tmp, index=False)
    write_text(args.out_md, markdown(runs, per_group, manifest, args.confidence))
    print(f"grid {args.grid}: {len(runs)} runs ({(runs['state'] == 'finished').sum()} finished) -> {args.out_csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
