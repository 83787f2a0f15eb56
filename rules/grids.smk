# Every grid's runs (rpa.workflow.grid; the cells come from the Snakefile's check_config as
# CELLS): one rule writes any cell's run config (`<grid>/<cell>/run.yaml`), one runs any shared
# warm start, and the run rules of the four grids -- a run of the GRPO grid, of the positive
# control or of the search is one job (its summary.json); the study's runs go by process group
# (`study/<group>.json`). The targets, manifests and tables of each grid are in its stage file.
#
# The run rules keep the command line each grid's finished runs were recorded with: Snakemake
# reruns a job whose shell command changed, and a rerun deletes the summary it would rewrite.

# every cell by its directory under the results: `train/...`, `dose/...`, `study/...`, `search/...`
GRID_CELLS = {f"{section}/{c.name}": c for section in ("train", "dose", "study", "search") for c in CELLS[section]}
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
        text=lambda wc: yaml_text(dict(GRID_CELLS[wc.run].config)),
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


# ---------------------------------------------------------------- the GRPO grid (`train_all`)

TRAIN_RES = (config.get("train") or {}).get("resources", {})


rule train:
    input:
        cfg=f"{R}/train/{{model}}/{{setting}}/{{regions}}/seed{{seed}}/run.yaml",
        model=model_input,
    output:
        # only the summary: Snakemake deletes a failed job's outputs, and the run directory
        # (checkpoints, metrics.jsonl) must survive for the rerun to resume from it
        f"{R}/train/{{model}}/{{setting}}/{{regions}}/seed{{seed}}/summary.json",
    params:
        out=lambda wc: f"{R}/train/{wc.model}/{wc.setting}/{wc.regions}/seed{wc.seed}",
        launch=gpu_launch(TRAIN_RES.get("gpu", 0)),
    log:
        f"{R}/logs/train/{{model}}/{{setting}}/{{regions}}/seed{{seed}}.log",
    conda:
        ENV
    resources:
        mem_mb=TRAIN_RES.get("mem_mb", 8000),
        runtime=TRAIN_RES.get("runtime", 120),
        cpus_per_task=TRAIN_RES.get("cpus_per_task", 2),
        gpu=TRAIN_RES.get("gpu", 0),
    shell:
        # a rerun after an interruption resumes from the run directory's last checkpoint
        "{params.launch}rpa train --config {input.cfg} --out {params.out} > {log} 2>&1"


# ---------------------------------------------------------------- the positive control (`dose_response`)


rule dose_train:
    input:
        cfg=f"{R}/dose/{{cell}}/run.yaml",
        init=f"{R}/dose/init/config.json",
    output:
        f"{R}/dose/{{cell}}/summary.json",  # only the summary: a failed job's run directory must survive to resume
    params:
        out=lambda wc: f"{R}/dose/{wc.cell}",
    log:
        f"{R}/logs/dose/{{cell}}.log",
    conda:
        ENV
    resources:
        mem_mb=6000,
        runtime=60,
    shell:
        "rpa train --config {input.cfg} --out {params.out} > {log} 2>&1"


# ---------------------------------------------------------------- the study (`study`)


def _group_model(wildcards):
    return wildcards.group.split("/")[0]


def _group_dirs(wildcards):
    """The run directories of the group's cells, in order."""
    return [f"{R}/study/{cell}" for cell in STUDY_GROUPS[wildcards.group]]


def _study_res(key):
    return lambda wc: study_resources(config, _group_model(wc), len(STUDY_GROUPS[wc.group]))[key]


def study_command(wildcards, input):
    """``rpa train`` on the model's GPUs for the group's runs: one process, or (one run)
    accelerate with its multi-GPU config."""
    res = study_resources(config, _group_model(wildcards))
    runs = " ".join(f"--config {d}/run.yaml --out {d}" for d in _group_dirs(wildcards))
    if res["launch"] == "single":
        cmd = f"rpa train {runs}"
    else:
        cmd = (f"accelerate launch --config_file experiments/accelerate/{res['launch']}.yaml "
               f"--num_processes {res['gpu']} -m rpa.cli train {runs}")
    return gpu_launch(res["gpu"]) + cmd


def study_init_input(wildcards):
    model = _group_model(wildcards)
    return [f"{R}/study/{model}/init/config.json"] if model in STUDY_SHARED_INIT else model_files(model)


rule study_train:
    input:
        cfgs=lambda wc: [f"{d}/run.yaml" for d in _group_dirs(wc)],
        init=study_init_input,
    output:
        # the job's record, written once every run has its summary.json (each run writes one for every
        # end: ok, collapsed, error -- a failed run is a result the tables show as failed, except one
        # stopped for a reason worth retrying (out of memory, a lost process), which fails the job up to
        # study.transient_retries times so that it runs again and resumes); the summaries
        # are not the job's outputs, so a job stopped half-way keeps its finished runs and its rerun
        # does only the rest (a killed run resumes from its checkpoint)
        f"{R}/study/{{group}}.json",
    params:
        command=study_command,
        dirs=lambda wc: " ".join(_group_dirs(wc)),
        retries=config["study"]["transient_retries"] if STUDY else 0,
    log:
        f"{R}/logs/study/{{group}}.log",
    priority: lambda wc: STUDY_PRIORITY[wc.group]
    conda:
        ENV
    resources:
        gpu=_study_res("gpu"),
        mem_mb=_study_res("mem_mb"),
        runtime=_study_res("runtime"),
        cpus_per_task=_study_res("cpus_per_task"),
    shell:
        # `;`: the record decides, from the runs' summaries, whether the job failed
        "{params.command} > {log} 2>&1; python -m rpa.workflow.runs --out {output} {params.dirs} "
        "--transient-retries {params.retries} >> {log} 2>&1"


# ---------------------------------------------------------------- the collapse search (`collapse_<stage>`)


def search_resources(cell):
    """A run's memory and minutes: its stage's ``resources`` (the largest ``label_mem_mb`` of its
    labels, else ``mem_mb``, else the config's ``job_mem_mb``)."""
    point = SEARCH[cell]
    res = config["search"]["stages"][point["stage"]].get("resources") or {}
    by_label = res.get("label_mem_mb", {})
    labelled = [by_label[v] for v in point["labels"].values() if v in by_label]
    return {"mem_mb": max(labelled, default=res.get("mem_mb", config["job_mem_mb"])),
            "runtime": res.get("runtime", 120)}


def search_train_input(wildcards):
    """The cell's starting checkpoint, as ``ancient`` input: a finished run (it has its summary)
    is not made stale by a warm start that is missing or rebuilt (deterministic: the same
    checkpoint), so a grid goes on from committed runs copied into place; and the set of inputs
    is the same before and after the run, so Snakemake's input trigger does not rerun finished
    runs either (a run that is not finished still has its checkpoint made first)."""
    point = SEARCH[wildcards.cell]
    if point["init"]:
        return [ancient(f"{R}/search/init/{point['init']['name']}/config.json")]
    return [ancient(f) for f in model_files(point["model"])]


rule search_train:
    input:
        cfg=f"{R}/search/{{cell}}/run.yaml",
        model=search_train_input,
    output:
        # the summary is written for every end of a run (ok, collapsed, diverged, error); a killed
        # run has none, so Snakemake reruns it and `rpa train` resumes from its last checkpoint
        f"{R}/search/{{cell}}/summary.json",
    params:
        out=lambda wc: f"{R}/search/{wc.cell}",
    log:
        f"{R}/logs/search/{{cell}}.log",
    conda:
        ENV
    resources:
        mem_mb=lambda wc: search_resources(wc.cell)["mem_mb"],
        runtime=lambda wc: search_resources(wc.cell)["runtime"],
    shell:
        "rpa train --config {input.cfg} --out {params.out} > {log} 2>&1 || test -f {output}"
