# Every grid's runs (rpa.workflow.grid; the cells come from the Snakefile's check_config as
# CELLS, their process groups as GRID_GROUPS: rules/common.smk): one rule writes any cell's run
# config (`<grid>/<cell>/run.yaml`), one runs any shared warm start, one runs any process group
# (`<grid>/<group>.json`, its record: rpa.workflow.runs). The targets, manifests and tables of each
# grid are in its stage file.

# every cell by its directory under the results: `train/...`, `dose/...`, `study/...`, `search/...`,
# `grids/...`
GRID_CELLS = {f"{section}/{c.name}": c for section in GRID_SECTIONS for c in CELLS[section]}
# every shared warm start by its directory under the results, with the cells that start from it
GRID_WARM_STARTS = {}
for _cell in GRID_CELLS.values():
    if _cell.init is not None:
        GRID_WARM_STARTS.setdefault(_cell.init.dir.removeprefix(f"{R}/"), []).append(_cell)


def _one_of(names):
    return "|".join(map(re.escape, names)) or "(?!)"


def grid_priority(cells):
    """A study cell's run config and its model's warm start: before the work they unlock (the model's
    STUDY_PRIORITY); 0 for the other grids."""
    return max((STUDY_PRIORITY.get(c.labels["model"], 0) for c in cells if c.grid == "study"), default=0)


# one-line jobs that write a file from the config: run by Snakemake itself, never submitted
localrules:
    grid_run_file,


rule grid_run_file:
    output:
        f"{R}/{{run,{_one_of(GRID_CELLS)}}}/run.yaml",
    params:
        # the validated run config in full (TrainConfig.to_dict: every option, its value or default),
        # the same TrainConfig rpa train reads back
        text=lambda wc: yaml_text(GRID_CELLS[wc.run].run.to_dict()),
    # a file written in milliseconds that a job waits for: before the jobs, or a job of many runs
    # would wait for its configs to be written a slot's turn at a time
    priority: lambda wc: grid_priority([GRID_CELLS[wc.run]])
    shell:
        WRITE_TEXT


rule grid_warm_start:
    input:
        lambda wc: model_files(GRID_WARM_STARTS[wc.init][0].model),
    output:
        f"{R}/{{init,{_one_of(GRID_WARM_STARTS)}}}/config.json",
    params:
        out=lambda wc: f"{R}/{wc.init}",
        cfg=lambda wc: f"{R}/{wc.init}.yaml",
        text=lambda wc: yaml_text(dict(GRID_WARM_STARTS[wc.init][0].init.config)),
    log:
        f"{R}/logs/{{init}}.log",
    priority: lambda wc: grid_priority(GRID_WARM_STARTS[wc.init])
    conda:
        ENV
    resources:
        mem_mb=4000,
        runtime=60,
    shell:
        WARM_START


# ---------------------------------------------------------------- the runs, one process per group

# where a grid's finished runs keep their start as `ancient` input: the warm starts of the search and of
# the `grids` entries are named by what they read (<section>/init/<...>-<digest>), so a rebuilt one is
# the same checkpoint and committed runs restored into place (analysis.restore_reference) are not made
# stale by it; the other grids' fixed init directories (dose/init, study/<model>/init) can be rebuilt
# from changed settings, which must rerun their runs
ANCIENT_START = {"search", "grids"}


def entry_resources(section, cell):
    """A run's memory and minutes in a section of several grids (a search stage, a `grids` entry): its
    entry's ``resources`` (the largest ``label_mem_mb`` of its labels, else ``mem_mb``, else the
    config's ``job_mem_mb``; a `grids` entry's ``gpu`` and ``cpus_per_task`` too)."""
    res = grid_entries(config, section)[grid_stage(cell)].get("resources") or {}
    by_label = res.get("label_mem_mb", {})
    labelled = [by_label[v] for v in cell.labels.values() if v in by_label]
    return {**{k: res[k] for k in ("gpu", "cpus_per_task") if k in res},
            "mem_mb": max(labelled, default=res.get("mem_mb", config["job_mem_mb"])),
            "runtime": res.get("runtime", 120)}


def run_resources(section, cell):
    """Scheduler resources of one run of ``cell`` (of grid ``section``): ``gpu``, ``mem_mb``,
    ``runtime`` (minutes), ``cpus_per_task`` and ``launch`` (``single``: one process; else the
    accelerate config a multi-GPU run launches with)."""
    base = {"gpu": 0, "cpus_per_task": 2, "launch": "single"}  # a run on the CPU, in one process
    if section == "study":
        return study_resources(config, cell.labels["model"])
    if section in MULTI_GRID_SECTIONS:
        return {**base, **entry_resources(section, cell)}
    return {**base, **config[section]["resources"]}  # train, dose: the schema's defaults filled in


def group_resources(record):
    """A group's resources: its first run's, the runtime the sum of its runs'."""
    section, group = GRID_GROUPS[record]
    res = run_resources(section, group.cells[0])
    return {**res, "runtime": res["runtime"] * len(group.cells)}


def group_dirs(record):
    section, group = GRID_GROUPS[record]
    return [f"{R}/{section}/{c.name}" for c in group.cells]


def group_start(wildcards):
    """The checkpoints a group's runs start from: their shared warm starts, else their models."""
    section, group = GRID_GROUPS[wildcards.record]
    files = sorted({f"{c.init.dir}/config.json" for c in group.cells if c.init}
                   | {f for c in group.cells if not c.init for f in model_files(c.model)})
    return [ancient(f) for f in files] if section in ANCIENT_START else files


def group_command(wildcards, input):
    """``rpa train`` on the group's GPUs for its runs: one process, or (one run) accelerate with its
    multi-GPU config."""
    res = group_resources(wildcards.record)
    runs = " ".join(f"--config {d}/run.yaml --out {d}" for d in group_dirs(wildcards.record))
    if res["launch"] == "single":
        cmd = f"rpa train {runs}"
    else:
        cmd = (f"accelerate launch --config_file experiments/accelerate/{res['launch']}.yaml "
               f"--num_processes {res['gpu']} -m rpa.cli train {runs}")
    return gpu_launch(res["gpu"]) + cmd


def group_retries(record):
    section, group = GRID_GROUPS[record]
    if section in MULTI_GRID_SECTIONS:
        return grid_entries(config, section)[grid_stage(group.cells[0])]["transient_retries"]
    return config[section]["transient_retries"]


def group_priority(record):
    """The study's by STUDY_PRIORITY; every other group its minutes of training (the longest first)."""
    section, group = GRID_GROUPS[record]
    if section == "study":
        return STUDY_PRIORITY[group.name]
    return group_resources(record)["runtime"]


rule grid_run:
    input:
        cfgs=lambda wc: [f"{d}/run.yaml" for d in group_dirs(wc.record)],
        start=group_start,
    output:
        # the job's record, written once every run has its summary.json (each run writes one for every
        # end: ok, collapsed, error -- a failed run is a result the tables show as failed, except one
        # stopped for a reason worth retrying (out of memory, a lost process), which fails the job up to
        # transient_retries times so that it runs again and resumes); the summaries are not the job's
        # outputs, so a job stopped half-way keeps its finished runs and its rerun does only the rest
        # (a killed run resumes from its checkpoint, a finished one does nothing)
        f"{R}/{{record,{_one_of(GRID_GROUPS)}}}.json",
    params:
        command=group_command,
        dirs=lambda wc: " ".join(group_dirs(wc.record)),
        retries=lambda wc: group_retries(wc.record),
    log:
        f"{R}/logs/{{record}}.log",
    priority: lambda wc: group_priority(wc.record)
    conda:
        ENV
    resources:
        gpu=lambda wc: group_resources(wc.record)["gpu"],
        mem_mb=lambda wc: group_resources(wc.record)["mem_mb"],
        runtime=lambda wc: group_resources(wc.record)["runtime"],
        cpus_per_task=lambda wc: group_resources(wc.record)["cpus_per_task"],
    shell:
        # `;`: the record decides, from the runs' summaries, whether the job failed
        "{params.command} > {log} 2>&1; python -m rpa.workflow.runs --out {output} {params.dirs} "
        "--transient-retries {params.retries} >> {log} 2>&1"
