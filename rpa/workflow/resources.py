"""What the scheduler is told of a pipeline config's runs: resources, priorities, what fits a GPU."""

from __future__ import annotations

from typing import Any, Mapping

from rpa.workflow.experiments import KINDS, entry_key, entry_kind, written_entries


RUN_DEFAULTS = {"gpu": 0, "runtime": 120, "cpus_per_task": 2, "launch": "single", "label_mem_mb": {}}
"""A run's resources where neither its entry nor its kind (:attr:`~rpa.workflow.experiments.Kind.resources`)
sets them: on the CPU, two cores, in one process, 120 minutes; ``mem_mb``: the config's ``job_mem_mb``."""


def entry_resources(kind: str, entry: dict[str, Any], label: str | None = None) -> dict[str, Any]:
    """The one ``resources`` mapping of an entry of ``kind`` as written
    (experiments/schema/config.schema.yaml ``$defs/resources``), its defaults filled in: :data:`RUN_DEFAULTS`,
    then the kind's (a ``grids:`` entry of a preset kind: that kind's), then the entry's (where the kind picks
    them by a label, :attr:`~rpa.workflow.experiments.Kind.resources_by`: those of ``label``). ``mem_mb`` is
    absent where none of them sets it (the config's ``job_mem_mb``)."""
    spec = KINDS[entry_kind(kind, entry)]
    given = entry.get("resources") or {}
    if spec.resources_by is not None:
        given = given.get(label) or {}
    return {**RUN_DEFAULTS, **spec.resources, **given}


def run_resources(config: dict[str, Any], kind: str, entry: dict[str, Any],
                  labels: Mapping[str, str]) -> dict[str, Any]:
    """Scheduler resources of one run of an experiment (``kind``, its ``entry`` as written, the run's
    ``labels``): ``gpu``, ``mem_mb``, ``runtime`` (minutes), ``cpus_per_task`` and ``launch`` (``single``: one
    process; else the accelerate config a multi-GPU run launches with), from :func:`entry_resources`; its
    ``label_mem_mb`` (the largest of the run's labels) before its ``mem_mb``, before the config's
    ``job_mem_mb``."""
    by = KINDS[entry_kind(kind, entry)].resources_by
    res = entry_resources(kind, entry, None if by is None else labels.get(by))
    labelled = [res["label_mem_mb"][v] for v in labels.values() if v in res["label_mem_mb"]]
    mem = max(labelled, default=res["mem_mb"] if "mem_mb" in res else config["job_mem_mb"])
    return {"gpu": res["gpu"], "mem_mb": mem, "runtime": res["runtime"], "cpus_per_task": res["cpus_per_task"],
            "launch": res["launch"]}


def group_resources(config: dict[str, Any], kind: str, entry: dict[str, Any], cells) -> dict[str, Any]:
    """The resources of one process of ``cells`` (a process group): its first run's, the runtime the sum
    of its runs'."""
    res = run_resources(config, kind, entry, cells[0].labels)
    return {**res, "runtime": res["runtime"] * len(cells)}


def study_resources(config: dict[str, Any], model: str, runs: int = 1) -> dict[str, Any]:
    """Scheduler resources of one process of ``runs`` training runs of ``model`` in the study
    (:func:`run_resources`; the runtime adds up)."""
    res = run_resources(config, "study", config["study"], {"model": model})
    return {**res, "runtime": res["runtime"] * runs}


def _resources_written(config: dict[str, Any], kind: str):
    """(entry name, entry as written, label, where its ``resources`` are in the config) of each ``resources``
    of a kind's entries: one per entry, or one per label where the kind picks them by a label (the study's
    models)."""
    for name, entry in written_entries(config, kind).items():
        if KINDS[entry_kind(kind, entry)].resources_by is None:
            yield name, entry, None, f"{entry_key(kind, name)}.resources"
        else:
            for label in entry.get("resources") or {}:
                yield name, entry, label, f"{entry_key(kind, name)}.resources.{label}"


def launch_problems(config: dict[str, Any], kind: str) -> list[str]:
    """One line per ``runs_per_process`` / ``arms_per_process`` above 1 of an entry whose runs launch as
    several processes (a ``launch`` other than ``single``): such a launch holds one run."""
    problems = []
    for knob in ("runs_per_process", "arms_per_process"):
        for name, entry, label, _ in _resources_written(config, kind):
            launch = entry_resources(kind, entry, label)["launch"]
            if int(entry.get(knob, 1)) > 1 and launch != "single":
                who = "its runs launch" if label is None else f"{label!r} launches"
                problems.append(f"{entry_key(kind, name)}.{knob}: {entry[knob]}, but {who} with {launch!r}: "
                                f"a multi-process launch holds one run")
    return problems


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
    needs = {"gpus_per_job": int(config.get("gpus_per_job") or 0)}
    needs.update({f"{where}.gpu": int(entry_resources(kind, entry, label)["gpu"])
                  for kind in KINDS for _, entry, label, where in _resources_written(config, kind)})
    over = [f"{key} {count}" for key, count in needs.items() if count > lent]
    if not over:
        return None
    return (f"this machine lends {lent} GPU(s) (Snakemake's gpu resource: --resources gpu=N or the profile's), "
            f"fewer than a job needs: {', '.join(over)}; drop those sizes from study.models here, or run them "
            f"where they fit (SLURM)")

