"""What the scheduler is told of a pipeline config's runs: resources, priorities, what fits a GPU."""

from __future__ import annotations

from typing import Any, Mapping


RUN_DEFAULTS = {"gpu": 0, "cpus_per_task": 2, "launch": "single"}
"""A run's resources where its entry sets none: on the CPU, in one process."""


def run_resources(config: dict[str, Any], kind: str, entry: dict[str, Any], labels: Mapping[str, str],
                  model: str | None = None) -> dict[str, Any]:
    """Scheduler resources of one run of an experiment (``kind``, its ``entry`` as written, the run's
    ``labels``): ``gpu``, ``mem_mb``, ``runtime`` (minutes), ``cpus_per_task`` and ``launch`` (``single``: one
    process; else the accelerate config a multi-GPU run launches with). One ``resources`` mapping
    (experiments/schema/config.schema.yaml, ``x-run-resources``): the entry's, else the study's by
    ``model`` size; its ``label_mem_mb`` (the largest of the run's labels) before its ``mem_mb``, before the
    config's ``job_mem_mb``; ``runtime`` 120 where none is given."""
    if kind == "study":
        return study_resources(config, model)
    res = entry.get("resources") or {}
    by_label = res.get("label_mem_mb") or {}
    labelled = [by_label[v] for v in labels.values() if v in by_label]
    return {**RUN_DEFAULTS, **{k: res[k] for k in ("gpu", "cpus_per_task") if k in res},
            "mem_mb": max(labelled, default=res.get("mem_mb", config["job_mem_mb"])),
            "runtime": res.get("runtime", 120)}


def group_resources(config: dict[str, Any], kind: str, entry: dict[str, Any], cells) -> dict[str, Any]:
    """The resources of one process of ``cells`` (a process group): its first run's, the runtime the sum
    of its runs'."""
    first = cells[0]
    res = run_resources(config, kind, entry, first.labels, first.labels.get("model"))
    return {**res, "runtime": res["runtime"] * len(cells)}


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
