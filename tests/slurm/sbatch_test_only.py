"""Every job of the GPU study's dry runs, submitted with ``sbatch --test-only`` to a modelled GPU node.

    tests/slurm/cluster.sh start /tmp/rpa-slurm-gpu gpu-model
    SLURM_CONF=/tmp/rpa-slurm-gpu/slurm.conf python -m tests.slurm.sbatch_test_only --out results/reference/slurm
    tests/slurm/cluster.sh stop /tmp/rpa-slurm-gpu

(``--start`` does the first and last step itself, in a temporary folder.) For each config
(``experiments/study.yaml``, ``experiments/study-pilot.yaml``) every job of the ``study`` target's dry run
under ``experiments/profiles/slurm`` that SLURM would get (not the local rules) has its sbatch line formed
by snakemake-executor-plugin-slurm's own code (:func:`tests.slurm.jobs.sbatch_line`), and that line goes
to the cluster's slurmctld with ``--test-only``: accepted when sbatch says when and where the job would
start. Writes ``sbatch_test_only.csv`` (one row a job) and ``sbatch_test_only.md`` (one row a job shape:
config, job kind, GPUs, CPUs, memory, time; how many jobs; accepted) under ``--out``. Exit status 1 if
any job is refused.
"""

from __future__ import annotations

import argparse
import csv
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from tests.conftest import REPO
from tests.slurm.jobs import dry_run_jobs, local_rules, sbatch_line

CONFIGS = ("experiments/study.yaml", "experiments/study-pilot.yaml")
CLUSTER = REPO / "tests/slurm/cluster.sh"
FIELDS = ("config", "job_kind", "wildcards", "gpus", "cpus", "mem", "time", "partition", "accepted", "answer",
          "sbatch")


def _option(args: list[str], *names: str) -> str:
    for i, arg in enumerate(args):
        for name in names:
            if name.startswith("--") and arg.startswith(name + "="):
                return arg.split("=", 1)[1]
            if arg == name and i + 1 < len(args):
                return args[i + 1]
    return ""


def test_only(line: str) -> tuple[bool, str]:
    """``line`` (an sbatch command without its script) submitted with ``--test-only``: accepted?, sbatch's answer."""
    args = shlex.split(line)
    assert args[0] == "sbatch", line
    proc = subprocess.run(["sbatch", "--test-only", *args[1:], "--wrap=true"], capture_output=True, text=True,
                          timeout=60)
    answer = " ".join((proc.stdout + proc.stderr).split())
    return proc.returncode == 0 and "to start at" in answer, answer


def rows(configs=CONFIGS) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for configfile in configs:
            local = local_rules(configfile)
            for job in dry_run_jobs(Path(tmp), "study", configfile=configfile):
                if job["rule"] in local:
                    continue
                line = sbatch_line(job, workdir=str(REPO))
                args = shlex.split(line)
                accepted, answer = test_only(line)
                out.append({"config": configfile, "job_kind": job["rule"], "wildcards": job["wildcards"],
                            "gpus": _option(args, "--gpus") or "0", "cpus": _option(args, "--cpus-per-task"),
                            "mem": _option(args, "--mem") + " MB", "time": _option(args, "-t") + " min",
                            "partition": _option(args, "-p") or "(default)", "accepted": "yes" if accepted else "no",
                            "answer": answer.split(" using ")[-1] if accepted else answer,
                            "sbatch": line.replace(str(REPO), "<repo>")})
    return sorted(out, key=lambda r: (CONFIGS.index(r["config"]) if r["config"] in CONFIGS else len(CONFIGS),
                                      r["job_kind"], r["wildcards"]))


def write(table: list[dict], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sbatch_test_only.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(table)
    shape = ("config", "job_kind", "gpus", "cpus", "mem", "time", "partition", "accepted")
    counts = Counter(tuple(r[k] for k in shape) for r in table)
    accepted = sum(r["accepted"] == "yes" for r in table)
    answers = sorted({r["answer"] for r in table if r["accepted"] != "yes"})
    lines = [
        "# Every SLURM job of the GPU study's dry runs, `sbatch --test-only` on a modelled 8-GPU node",
        "",
        "Written by `python -m tests.slurm.sbatch_test_only --start --out results/reference/slurm` "
        "(tests/slurm/sbatch_test_only.py): each job's sbatch line formed by snakemake-executor-plugin-slurm's own "
        "code under `experiments/profiles/slurm`, submitted with `--test-only` to a slurmctld "
        f"({_version()}) whose node models the study's GPU node (tests/slurm/cluster.sh `gpu-model`: GRES "
        "gpu:8, 128 CPUs, 2,000,000 MB, partitions `gpu` and `cpu` with a 24-hour MaxTime enforced at "
        "submission). One row a job shape; `sbatch_test_only.csv` has every job and its full sbatch line.",
        "",
        f"**{accepted} of {len(table)} jobs accepted ({100 * accepted / max(len(table), 1):.0f}%).**",
        "",
        "| config | job kind | GPUs | CPUs | memory | time | partition | jobs | accepted |",
        "|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for key, n in counts.items():
        c, kind, gpus, cpus, mem, time, part, ok = key
        lines.append(f"| {Path(c).name} | {kind} | {gpus} | {cpus} | {mem} | {time} | {part} | {n} | {ok} |")
    if answers:
        lines += ["", "Refusals:", ""] + [f"- {a}" for a in answers]
    (out / "sbatch_test_only.md").write_text("\n".join(lines) + "\n")


def _version() -> str:
    proc = subprocess.run(["sbatch", "--version"], capture_output=True, text=True)
    return proc.stdout.strip() or "slurm"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--start", action="store_true",
                        help="start a gpu-model cluster (tests/slurm/cluster.sh) in a temporary folder, stop it after")
    args = parser.parse_args(argv)
    if not args.start and not os.environ.get("SLURM_CONF"):
        parser.error("no cluster: set SLURM_CONF to a gpu-model cluster's slurm.conf, or pass --start")
    tmp = tempfile.mkdtemp(prefix="rpa-slurm-gpu-") if args.start else None
    try:
        if tmp:
            subprocess.run([str(CLUSTER), "start", tmp, "gpu-model"], check=True)
            os.environ["SLURM_CONF"] = f"{tmp}/slurm.conf"
        table = rows()
    finally:
        if tmp:
            subprocess.run([str(CLUSTER), "stop", tmp], check=False)
            shutil.rmtree(tmp, ignore_errors=True)
    write(table, args.out)
    refused = [r for r in table if r["accepted"] != "yes"]
    print(f"sbatch --test-only: {len(table) - len(refused)} of {len(table)} jobs accepted -> {args.out}")
    for r in refused:
        print(f"  refused: {r['config']} {r['job_kind']} {r['wildcards']}: {r['answer']}", file=sys.stderr)
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
