"""Sum a process log written by tests/scripts/process_cpu/sitecustomize.py: CPU seconds by kind of process and by
test file, the largest first.

    RPA_PROCESS_LOG=/tmp/processes.jsonl PYTHONPATH=$PWD/tests/scripts/process_cpu make test
    (an absolute path: processes started in other folders find it too)
    python tests/scripts/process_cpu_report.py /tmp/processes.jsonl
"""

import argparse
import collections
import json
import sys
from pathlib import Path


def kind(argv: list[str]) -> str:
    """``rpa train`` / ``-m snakemake`` / a script's name / ``-c``: what a process was, from its command line."""
    args = [a for a in argv[1:] if not a.startswith("-X") and a != "importtime"]
    if not args:
        return "python"
    if args[0] == "-m" and len(args) > 1:
        name = args[1]
        sub = args[2] if len(args) > 2 and not args[2].startswith(("-", "/")) else ""
        return f"-m {name} {sub}".strip()
    if args[0] == "-c":
        return "-c (inline code)"
    name = Path(args[0]).name
    sub = args[1] if len(args) > 1 and not args[1].startswith(("-", "/")) else ""
    return f"{name} {sub}".strip()


def report(records: list[dict], top: int) -> str:
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    by_file: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for r in records:
        for table, key in ((by_kind, kind(r["argv"])), (by_file, (r["test"] or "(none)").split("::")[0])):
            table[key][0] += 1
            table[key][1] += r["cpu_s"]
    lines = [f"{len(records)} processes, {sum(r['cpu_s'] for r in records):.0f} s of CPU"]
    for title, table in (("by kind", by_kind), ("by test file", by_file)):
        lines.append(f"{title}:  CPU s  processes  mean")
        for key, (n, cpu) in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]:
            lines.append(f"  {cpu:8.1f} {n:5d} {cpu / n:6.1f}  {key}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in args.log.read_text().splitlines() if line.strip()]
    print(report(records, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
