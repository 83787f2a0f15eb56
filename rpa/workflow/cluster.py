"""Checks of the cluster a workflow is submitted to, run before any job is (the Snakefile's ``onstart``)."""

from __future__ import annotations

import shutil
import subprocess

ACCOUNTING_DISABLED = "accounting storage is disabled"
"""What ``sacct`` answers on a cluster without accounting storage (SLURM 22.05: "Slurm accounting storage is
disabled")."""


def status_command_problem(executor: str | None, status_command: str | None, timeout_s: float = 30) -> str | None:
    """Why the SLURM executor would never see a job end, in one line; None where it can. snakemake-executor-plugin-slurm
    2.6 asks ``sacct`` whenever the binary exists; on a cluster whose accounting storage is disabled ``sacct`` answers
    that for every job, and Snakemake then waited forever (ignoring SIGTERM; reproduced on the test cluster)."""
    if executor != "slurm" or status_command != "sacct" or shutil.which("sacct") is None:
        return None
    try:
        proc = subprocess.run(["sacct", "-X", "-n", "-j", "1"], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"sacct, the SLURM plugin's status command, did not answer ({type(err).__name__}): use " \
               "--slurm-status-command squeue (docs/cluster.md)"
    if ACCOUNTING_DISABLED in (proc.stdout + proc.stderr).lower():
        return ("the SLURM plugin would ask sacct for each job's state, and sacct answers 'accounting storage is "
                "disabled' here: Snakemake would never see a job end. Use --slurm-status-command squeue (and a "
                "MinJobAge longer than the plugin's polling; docs/cluster.md)")
    return None
