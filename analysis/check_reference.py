"""Regenerate every committed reference table from its committed raw results and compare byte for byte.

    python -m analysis.check_reference                 # all of results/reference
    python -m analysis.check_reference --only study-cpu

Each reference folder is copied without its ``tables/`` into a scratch folder, the analyses the
Snakefile runs on it are run there with the same command lines, and every table they write that
is also committed is compared with the committed file, byte for byte. Figures are not compared
(their pixels depend on the fonts and matplotlib build). A table whose inputs an export left
out would be listed in :data:`NOT_REGENERABLE`, never counted as passed; none is today. Exit status 1 if any table differs.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "results" / "reference"


@dataclass(frozen=True)
class Analysis:
    """One analysis the Snakefile runs over a results folder: ``argv`` with ``{R}`` for that folder."""

    argv: tuple[str, ...]
    tables: tuple[str, ...]  # the tables it writes under {R}/tables


def _probe_configs(config: str) -> tuple[str, ...]:
    """The probe table's row order, as the Snakefile passes it (the config's ``probe.configs``)."""
    return tuple(yaml.safe_load((REPO / "experiments" / config).read_text())["probe"]["configs"])


def analyses() -> dict[str, tuple[Analysis, ...]]:
    """Reference folder -> the analyses that made its tables (command lines as in ``rules/``)."""
    return {
        "main": (
            Analysis(("analysis.aggregate", "--results", "{R}", "--out-dir", "{R}/tables", "--configs",
                      *_probe_configs("config.yaml")), ("probe.csv", "probe.md", "diagnose.csv")),
            Analysis(("analysis.attribution", "--results", "{R}", "--out-dir", "{R}/tables",
                      "--figure", "{R}/figures/attribution.png"),
                     ("attribution.csv", "attribution.md", "attribution_ops.csv")),
        ),
        "cpu": (
            Analysis(("analysis.aggregate", "--results", "{R}", "--out-dir", "{R}/tables", "--configs",
                      *_probe_configs("toys.yaml")), ("probe.csv", "probe.md", "diagnose.csv")),
            Analysis(("analysis.train_summary", "--results", "{R}", "--out-table", "{R}/tables/train.csv",
                      "--out-md", "{R}/tables/train.md", "--out-figure", "{R}/figures/train_curves.png"),
                     ("train.csv", "train.md")),
            Analysis(("analysis.dose", "--results", "{R}", "--out-dir", "{R}/tables",
                      "--figure", "{R}/figures/dose_response.png"),
                     ("dose.csv", "dose.md", "dose_runs.csv", "dose_sensitivity.csv")),
        ),
        "study-cpu": (
            Analysis(("analysis.aggregate", "--results", "{R}", "--out-dir", "{R}/tables", "--configs",
                      *_probe_configs("study-cpu.yaml")), ("probe.csv", "probe.md")),
            Analysis(("analysis.study", "--results", "{R}", "--format", "png"),
                     tuple(f"study_{t}.{ext}" for t in ("collapse", "mismatch", "sensitivity")
                           for ext in ("csv", "md", "tex"))),
        ),
        "collapse-cpu": tuple(
            Analysis(("analysis.collapse_search", "--results", "{R}", "--stage", stage,
                      "--figure", f"{{R}}/figures/search_{stage}.png"),
                     tuple(f"search_{stage}.{ext}" for ext in ("csv", "md", "json")))
            for stage in ("pilot", "grid", "ablation", "lever")),
    }


# committed tables whose inputs the export leaves out (see the folder's README): none since the
# probe pipeline's per-token files are exported (analysis.export_reference --what pipeline)
NOT_REGENERABLE: dict[str, tuple[str, ...]] = {}


def check(name: str, scratch: Path, reference: Path = REFERENCE) -> tuple[list[str], list[str]]:
    """Regenerate ``<reference>/<name>``'s tables in ``scratch``; (same, differing) table names."""
    ref = reference / name
    results = scratch / name
    shutil.copytree(ref, results, ignore=shutil.ignore_patterns("tables", "figures", "paper"))
    (results / "tables").mkdir()
    (results / "figures").mkdir()
    same, differ = [], []
    for analysis in analyses()[name]:
        committed = [t for t in analysis.tables if (ref / "tables" / t).exists()]
        if not committed:
            continue  # a stage that has not run (no committed table to regenerate)
        argv = [a.replace("{R}", str(results)) for a in analysis.argv]
        proc = subprocess.run([sys.executable, "-m", *argv], cwd=REPO, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"check_reference: {name}: {' '.join(analysis.argv[:1])} failed:\n{proc.stderr}")
        for table in committed:
            made = results / "tables" / table
            ok = made.exists() and made.read_bytes() == (ref / "tables" / table).read_bytes()
            (same if ok else differ).append(f"{name}/tables/{table}")
    return same, differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(analyses()), help="reference folders to check")
    parser.add_argument("--reference", type=Path, default=REFERENCE, help="the folder holding them")
    args = parser.parse_args(argv)
    names = args.only or sorted(analyses())
    same: list[str] = []
    differ: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rpa-reference-") as tmp:
        for name in names:
            if not (args.reference / name).is_dir():
                raise SystemExit(f"check_reference: no {args.reference / name}")
            s, d = check(name, Path(tmp), args.reference)
            same += s
            differ += d
            print(f"{name}: {len(s)} tables identical, {len(d)} differ"
                  + "".join(f"\n  differs: {t}" for t in d), flush=True)
    skipped = [f"{n}/tables/{t}" for n in names for t in NOT_REGENERABLE.get(n, ())]
    if skipped:
        print("not regenerable from the committed files (inputs not exported): " + ", ".join(skipped))
    print(f"check_reference: {len(same)} identical, {len(differ)} differ")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
