"""What the scheduler is told of a pipeline config's runs: resources, priorities, what fits a GPU."""

from __future__ import annotations

from typing import Any


def study_resources(config: dict[str, Any], model: str, runs: int = 1) -> dict[str, Any]:
    """Scheduler resources of one process of ``runs`` training runs of ``model``
    (``study.resources`` gives one run's, by size; the runtime adds up)."""
    defaults = {"gpu": 0, "mem_mb": 8000, "runtime": 120, "cpus_per_task": 2, "launch": "single"}
    res = {**defaults, **((config["study"].get("resources") or {}).get(model) or {})}
    return {**res, "runtime": res["runtime"] * runs}


def study_priorities(config: dict[str, Any], groups: dict[str, list[str]]) -> dict[str, int]:
    """Snakemake's order among ready jobs: a study job's priority (a group of :func:`study_groups`)
    is the minutes of training it runs (its ``runtime`` resource), a model's warm start and
    tiny-model build have those of all the model's jobs (what they unlock). The longest work then
    starts first and the short jobs (probes, parity, tables; priority 0) fill in at the end, so the
    wall time on a few cores comes close to the total work divided by the cores. Keys: group names
    and model names."""
    own = {name: study_resources(config, name.split("/")[0], len(cells))["runtime"] for name, cells in groups.items()}
    unlocks = {model: sum(m for name, m in own.items() if name.split("/")[0] == model)
               for model in config["study"]["models"]}
    return {**own, **unlocks}


def gpu_shortfall(config: dict[str, Any], lent: int | None) -> str | None:
    """One line naming the jobs of ``config`` that need more GPUs than the machine lends
    (``lent``: Snakemake's ``gpu`` resource, ``--resources gpu=N`` or a profile's ``resources``;
    None: no limit, as under SLURM), or None. Snakemake would cap such a job's resource and start
    it, and the job would then wait for GPUs the machine does not have (:mod:`rpa.workflow.gpus`)."""
    if lent is None:
        return None
    needs = {"gpus_per_job": int(config.get("gpus_per_job") or 0),
             "train.resources.gpu": int(((config.get("train") or {}).get("resources") or {}).get("gpu", 0))}
    if config.get("study"):
        needs.update({f"study.resources.{m}.gpu": int(study_resources(config, m)["gpu"])
                      for m in config["study"]["models"]})
    needs.update({f"grids.{name}.resources.gpu": int((spec.get("resources") or {}).get("gpu", 0))
                  for name, spec in (config.get("grids") or {}).items()})
    over = [f"{key} {count}" for key, count in needs.items() if count > lent]
    if not over:
        return None
    return (f"this machine lends {lent} GPU(s) (Snakemake's gpu resource: --resources gpu=N or the profile's), "
            f"fewer than a job needs: {', '.join(over)}; drop those sizes from study.models here, or run them "
            f"where they fit (SLURM)")


BYTES_PER_PARAMETER = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one weight as vLLM holds it, by ``numerics.precision``."""
