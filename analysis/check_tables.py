"""Compare the tables of a fresh pipeline run with a committed reference's, cell by cell.

    make main
    python -m analysis.check_tables --results results/cpu --reference results/reference/main

:mod:`analysis.check_reference` asks whether the committed tables follow from the committed raw
results; this asks whether running the job again gives the committed numbers. Every table the
reference commits (``tables/*.csv``) must exist in the fresh run with the same columns and rows, and
every cell must be the same text as written (no tolerance: the tables are written with fixed
formatting, so equal numbers are equal text). The ``.md`` tables are compared byte for byte. Each
difference is printed as ``table: row <key> column <name>: reference <a>, fresh <b>``; exit status 1
if any differs, 2 if nothing could be compared.

BF16 bits depend on the CPU's kernels, so a fresh run equals the reference only on the CPU type
that made it (:func:`rpa.core.provenance.cpu_type`: vendor and BF16/FP16 instruction-set features):
the reference's ``machine.json`` (written by :mod:`analysis.export_reference`) names it, and a run on
another CPU type is refused (exit 2) unless ``--any-cpu`` is given, in which case the differences are
printed as what they are.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

from analysis.refusal import run
from rpa.core.jsonfiles import read_record
from rpa.core.provenance import cpu_info, cpu_type, recorded_cpus

MACHINE = "machine.json"
"""A reference folder's record of the machine its run was made on (:func:`rpa.core.provenance.cpu_info`)."""
MIN_KEY_COLUMNS = 2
"""Rows are matched by their leading cells: the fewest leading columns (at least this many: the model and
the configuration) whose values are unique in both tables (``diagnose.csv`` needs model, config, layer
and boundary); where no prefix is unique, by position."""


def _rows(path: Path) -> tuple[list[str], list[list[str]]]:
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    return (rows[0], rows[1:]) if rows else ([], [])


def _key_columns(cols: list[str], *tables: list[list[str]]) -> int | None:
    """How many leading columns label a row uniquely in every table; None where no prefix does."""
    for n in range(min(MIN_KEY_COLUMNS, len(cols)), len(cols) + 1):
        if all(len({tuple(r[:n]) for r in rows}) == len(rows) for rows in tables):
            return n
    return None


def compare_table(reference: Path, fresh: Path) -> list[str]:
    """The differing cells of one CSV table (one line each, the table's name first). Rows are matched by
    their leading cells (:data:`MIN_KEY_COLUMNS`, more where those repeat; by position where no prefix is
    unique); a row only one side has is listed."""
    name = reference.name
    if not fresh.exists():
        return [f"{name}: missing from the fresh run"]
    ref_cols, ref_rows = _rows(reference)
    new_cols, new_rows = _rows(fresh)
    if ref_cols != new_cols:
        return [f"{name}: columns differ: reference {ref_cols}, fresh {new_cols}"]
    n = _key_columns(ref_cols, ref_rows, new_rows)
    if n is None:  # no unique label: row i against row i
        out = ([] if len(ref_rows) == len(new_rows)
               else [f"{name}: {len(ref_rows)} rows in the reference, {len(new_rows)} in the fresh run"])
        ref_by = {f"#{i + 1}": r for i, r in enumerate(ref_rows)}
        new_by = {f"#{i + 1}": r for i, r in enumerate(new_rows)}
    else:
        ref_by = {"/".join(r[:n]): r for r in ref_rows}
        new_by = {"/".join(r[:n]): r for r in new_rows}
        out = [f"{name}: row {k} only in the reference" for k in ref_by if k not in new_by]
        out += [f"{name}: row {k} only in the fresh run" for k in new_by if k not in ref_by]
    for k, a in ref_by.items():
        if k in new_by:
            out += [f"{name}: row {k} column {col}: reference {x}, fresh {y}"
                    for col, x, y in zip(ref_cols, a, new_by[k]) if x != y]
    return out


def compare(reference: Path, results: Path) -> tuple[int, list[str]]:
    """(tables compared, differences) between ``reference/tables`` and ``results/tables``."""
    tables = sorted(p for p in (reference / "tables").glob("*") if p.suffix in (".csv", ".md"))
    diffs: list[str] = []
    for table in tables:
        fresh = results / "tables" / table.name
        if table.suffix == ".csv":
            diffs += compare_table(table, fresh)
        elif not fresh.exists():
            diffs.append(f"{table.name}: missing from the fresh run")
        elif fresh.read_bytes() != table.read_bytes():
            diffs.append(f"{table.name}: differs byte for byte (a Markdown table: its cells are not compared one by one)")
    return len(tables), diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, type=Path, help="the fresh run's results folder")
    parser.add_argument("--reference", required=True, type=Path, help="a committed reference folder")
    parser.add_argument("--any-cpu", action="store_true",
                        help="compare even where this CPU type is not the reference's (differences expected)")
    args = parser.parse_args(argv)
    for path in (args.results / "tables", args.reference / "tables"):
        if not path.is_dir():
            parser.error(f"{path}: no such folder")
    machine = args.reference / MACHINE
    made_on = read_record(machine).get("cpu") if machine.exists() else None
    recorded, _ = recorded_cpus(args.results)  # the fresh run's CPU as its results record it
    if len(recorded) > 1:
        print(f"check_tables: {args.results} holds results of {len(recorded)} CPU types; compare one type's run",
              file=sys.stderr)
        return 2
    here = next(iter(recorded.values())) if recorded else cpu_info()  # unrecorded: made on this machine
    if cpu_type(made_on) != cpu_type(here) and not args.any_cpu:
        print(f"check_tables: the reference was made on {made_on or 'an unrecorded CPU'} ({machine}); the fresh "
              f"run on {here}: BF16 bits differ between CPU types, so compare on the reference's CPU type "
              f"(or pass --any-cpu to list the differences anyway)", file=sys.stderr)
        return 2
    count, diffs = compare(args.reference, args.results)
    if not count:
        print(f"check_tables: {args.reference / 'tables'} holds no table", file=sys.stderr)
        return 2
    for line in diffs:
        print(line)
    print(f"check_tables: {count} tables, {len(diffs)} difference{'s' if len(diffs) != 1 else ''}"
          + ("" if cpu_type(made_on) == cpu_type(here) else f" (made on {made_on}, compared on {here})"))
    return 1 if diffs else 0


if __name__ == "__main__":
    raise SystemExit(run(main))
