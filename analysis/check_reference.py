"""Regenerate every committed reference table from its committed raw results and compare byte for byte.

    python -m analysis.check_reference                 # all of results/reference
    python -m analysis.check_reference --only study-cpu
    python -m analysis.check_reference --only collapse-cpu --write   # after an intended analysis change

``--write`` replaces each differing committed table with the regenerated one (atomically) and says
which; the diff is then the analysis change's effect on the committed references, to review and commit.

Each reference folder is copied without its ``tables/`` and ``figures/`` into a scratch folder.
Snakemake itself says how its tables are made: a dry run of the folder's config with ``results``
pointed at the scratch copy and the committed tables as targets prints each job's shell command
(``--printshellcmds``), and the commands of the jobs that write those tables -- the rules' own
command lines, not a copy of them -- are run there. Every table they write that is also committed
is compared with the committed file, byte for byte. Jobs upstream of them (a model conversion, a
probe whose checkpoint the export leaves out) are not run: the committed raw results stand in for
them. Figures are not compared (their pixels depend on the fonts and matplotlib build). Exit
status 1 if any table differs, 2 if the workflow cannot name a committed table's job.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from analysis.refusal import Refused, run
from rpa.core.jsonfiles import atomic_path

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "results" / "reference"

CONFIGS = {"main": "config.yaml", "main-xeon-amx": "config.yaml", "cpu": "toys.yaml", "study-cpu": "study-cpu.yaml",
           "collapse-cpu": "collapse-cpu.yaml", "collapse-smollm2": "collapse-smollm2.yaml",
           "precision-smollm2": "precision-smollm2.yaml"}
"""Reference folder -> the config under ``experiments/`` whose run it holds (each folder's README says so)."""


def _jobs(dry_run: str) -> list[tuple[str, list[str], str]]:
    """(rule, outputs, shell command) of each job a ``snakemake -n -p`` printout lists."""
    jobs, rule, outputs, command = [], None, [], None
    lines = dry_run.splitlines()
    for i, line in enumerate(lines):
        if m := re.match(r"^(?:local)?rule (\S+):$", line.strip()):
            rule, outputs, command = m.group(1), [], None
        elif rule and line.strip().startswith("output: "):
            outputs = [o.strip() for o in line.strip()[len("output: "):].split(",")]
        elif rule and line.startswith("Shell command: "):
            command = line[len("Shell command: "):]
            for more in lines[i + 1:]:  # a command of several lines runs to the next blank line or job
                if not more.strip() or more.startswith(("[", "Job stats", "rule ", "localrule ")):
                    break
                command += "\n" + more
            jobs.append((rule, outputs, command))
            rule = None
    return jobs


def commands(name: str, results: Path, targets: list[Path]) -> list[str]:
    """The shell commands of the jobs that write ``targets`` for reference ``name`` in ``results``."""
    argv = [sys.executable, "-m", "snakemake", "--dry-run", "--printshellcmds", "--rerun-triggers", "mtime",
            "--configfile", f"experiments/{CONFIGS[name]}", "--config", f"results={results}", "--",
            *map(str, targets)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode and (m := re.search(r"No rule to produce (\S+)", proc.stdout + proc.stderr)):
        raise Refused(f"check_reference: {name}: no rule of the workflow writes {Path(m.group(1)).name} "
                         "(a committed table the workflow does not declare)")
    if proc.returncode:
        raise Refused(f"check_reference: {name}: the workflow's dry run failed:\n{proc.stdout[-3000:]}"
                         f"{proc.stderr[-3000:]}")
    wanted = {str(t) for t in targets}
    chosen = [c for _, outputs, c in _jobs(proc.stdout) if wanted & set(outputs)]
    named = {o for _, outputs, _ in _jobs(proc.stdout) for o in outputs}
    if wanted - named:
        raise Refused(f"check_reference: {name}: no job of the workflow writes "
                         + ", ".join(sorted(Path(t).name for t in wanted - named)))
    return chosen


def check(name: str, scratch: Path, reference: Path = REFERENCE,
          write: bool = False) -> tuple[list[str], list[str]]:
    """Regenerate ``<reference>/<name>``'s tables in ``scratch``; (same, differing) table names. With
    ``write``, each differing committed table is replaced by the regenerated one."""
    ref = reference / name
    results = scratch / name
    if not (ref / "tables").is_dir():  # a grid measured but not yet tabled (no run of it finished)
        return [], []
    shutil.copytree(ref, results, ignore=shutil.ignore_patterns("tables", "figures", "paper"))
    (results / "figures").mkdir()
    (results / "tables").mkdir()
    committed = sorted(p.name for p in (ref / "tables").iterdir() if p.is_file())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    for command in commands(name, results, [results / "tables" / t for t in committed]):
        for log in re.findall(r">\s*(\S+)\s+2>&1", command):
            Path(log).parent.mkdir(parents=True, exist_ok=True)  # as Snakemake makes an output's folder
        proc = subprocess.run(["bash", "-c", f"set -euo pipefail; {command}"], cwd=REPO, env=env,
                              capture_output=True, text=True)
        if proc.returncode:  # the job's own log (its `> log 2>&1`) holds the cause; the scratch folder goes with it
            logs = [Path(log) for log in re.findall(r">\s*(\S+)\s+2>&1", command) if Path(log).is_file()]
            cause = "".join(log.read_text(errors="replace") for log in logs) + proc.stderr
            last = [line for line in cause.splitlines() if line.strip()][-12:] or ["(the job printed nothing)"]
            raise Refused(f"check_reference: {name}: `{command}` failed (exit {proc.returncode}); its output ends:\n"
                          + "\n".join(last))
    same, differ = [], []
    for table in committed:
        made = results / "tables" / table
        ok = made.exists() and made.read_bytes() == (ref / "tables" / table).read_bytes()
        (same if ok else differ).append(f"{name}/tables/{table}")
        if write and not ok and made.exists():
            with atomic_path(ref / "tables" / table) as tmp:
                tmp.write_bytes(made.read_bytes())
        elif write and not made.exists():
            print(f"check_reference: {name}/tables/{table} was not regenerated: not written", file=sys.stderr)
    return same, differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="reference folders to check")
    parser.add_argument("--reference", type=Path, default=REFERENCE, help="the folder holding them")
    parser.add_argument("--write", action="store_true",
                        help="replace each differing committed table with the regenerated one")
    args = parser.parse_args(argv)
    names = args.only or sorted(n for n in CONFIGS if (args.reference / n).is_dir())
    same: list[str] = []
    differ: list[str] = []
    missing: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rpa-reference-") as tmp:
        for name in names:
            if not (args.reference / name).is_dir():
                raise Refused(f"check_reference: no {args.reference / name}")
            s, d = check(name, Path(tmp), args.reference, args.write)
            same += s
            differ += d
            missing += [t for t in d if not (Path(tmp) / t).exists()]  # not regenerated: never written
            print(f"{name}: {len(s)} tables identical, {len(d)} differ"
                  + "".join(f"\n  differs: {t}" for t in d), flush=True)
    unwritten = missing if args.write else differ
    print(f"check_reference: {len(same)} identical, {len(differ)} differ"
          + (f" (written: {len(differ) - len(unwritten)})" if args.write and differ else ""))
    return 1 if unwritten else 0


if __name__ == "__main__":
    raise SystemExit(run(main))
