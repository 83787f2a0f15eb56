"""Give a command its own GPUs on a workstation: ``python -m rpa.workflow.gpus --count N -- CMD ...``.

Snakemake's ``--resources gpu=N`` keeps the *number* of GPUs in use within N, but does not
say *which* GPUs a job may use: two one-GPU jobs would both land on GPU 0. This takes
``--count`` GPU ids with one lock file each (``flock``, released when the command ends,
however it ends), sets ``CUDA_VISIBLE_DEVICES`` to them and runs the command. With
``--count 0`` the command runs as it is (the CPU miniature). Under SLURM the scheduler
assigns GPUs itself (``SLURM_JOB_ID`` set, or ``RPA_GPUS=slurm``) and this steps aside.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import subprocess
import sys
import time
from pathlib import Path

LOCK_DIR_ENV = "RPA_GPU_LOCK_DIR"
GPUS_ENV = "RPA_GPUS"
"""Comma-separated GPU ids this machine lends to jobs (default: every visible GPU), or
``slurm`` (the scheduler already isolated them)."""


def available() -> list[str]:
    spec = os.environ.get(GPUS_ENV, "").strip()
    if spec:
        return [g.strip() for g in spec.split(",") if g.strip()]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def acquire(count: int, wait_s: float = 5.0) -> tuple[list[str], list]:
    """``count`` GPU ids and their held lock files; waits until that many are free."""
    ids = available()
    if count > len(ids):
        raise SystemExit(f"rpa.workflow.gpus: {count} GPUs asked for, this machine lends {len(ids)} ({GPUS_ENV} / "
                         f"nvidia-smi); lower the job's gpu resource")
    lock_dir = Path(os.environ.get(LOCK_DIR_ENV, "/tmp/rpa-gpu-locks"))
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        held = []
        for gpu in ids:
            handle = open(lock_dir / f"gpu{gpu}.lock", "a")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            held.append((gpu, handle))
            if len(held) == count:
                return [g for g, _ in held], [h for _, h in held]
        for _, handle in held:
            handle.close()
        time.sleep(wait_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, required=True, help="GPUs the command needs (0: none)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command after --")
    if args.count <= 0 or os.environ.get(GPUS_ENV, "").strip() == "slurm" or "SLURM_JOB_ID" in os.environ:
        return subprocess.call(command)
    ids, locks = acquire(args.count)
    print(f"[rpa.workflow.gpus] CUDA_VISIBLE_DEVICES={','.join(ids)}", file=sys.stderr, flush=True)
    try:
        return subprocess.call(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(ids)})
    finally:
        for handle in locks:
            handle.close()


if __name__ == "__main__":
    sys.exit(main())
