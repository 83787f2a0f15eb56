# Stage: the study (`study`): models x arms x seeds of GRPO, each cell one run directory
# `study/<model>/<arm>/seed<N>`; a job runs `study.runs_per_process` seeds of up to
# `study.arms_per_process` arms that share a sampler side (one process each, `study/<group>.json`
# its record), resources scaled by model size, the longest first (`STUDY_PRIORITY`); tables and
# figures across sizes.

STUDY_MODELS = config["study"]["models"] if STUDY else []  # STUDY_SHARED_INIT, STUDY_GROUPS: common.smk


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


def study_jobs(wildcards=None):
    return [f"{R}/study/{group}.json" for group in STUDY_GROUPS]


def study_outputs(wildcards=None):
    tables = [f"{R}/tables/study_{name}.{ext}" for name in ("collapse", "mismatch", "sensitivity")
              for ext in ("csv", "md", "tex")]
    figures = [f"{R}/figures/study_{name}.{FIGURES['format']}" for name in ("rewards", "mismatch_curves", "heatmap")]
    return tables + figures


rule study:
    input:
        study_outputs(),


rule study_init:
    input:
        lambda wc: model_files(wc.model),
    output:
        f"{R}/study/{{model}}/init/config.json",
    params:
        cfg=lambda wc: f"{R}/study/{wc.model}/init.yaml",
        out=lambda wc: f"{R}/study/{wc.model}/init",
        text=lambda wc: yaml_text(dict(STUDY_INITS[wc.model].config)),
    log:
        f"{R}/logs/study/{{model}}/init.log",
    priority: lambda wc: STUDY_PRIORITY.get(wc.model, 0)
    conda:
        ENV
    resources:
        mem_mb=4000,
        runtime=60,
    shell:
        WARM_START


# one-line jobs that write a file from the config: run by Snakemake itself, never submitted
localrules:
    study_config,
    study_manifest,


rule study_config:
    output:
        f"{R}/study/{{cell}}/run.yaml",
    params:
        text=lambda wc: yaml_text(STUDY[wc.cell]["config"]),
    # a file written in milliseconds that a job waits for: before the jobs, or a job of many runs
    # would wait for its configs to be written a slot's turn at a time
    priority: lambda wc: STUDY_PRIORITY[STUDY[wc.cell]["model"]]
    shell:
        WRITE_TEXT


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


def study_manifest_text():
    """What the analysis needs of the config: models (in size order), arms, seeds, cells."""
    import json

    study = config["study"]
    cells = [{k: p[k] for k in ("cell", "model", "arm", "seed")} for p in STUDY.values()]
    return json.dumps({"models": study["models"], "arms": study_arm_names(study), "seeds": study["seeds"],
                       "reference_arm": study["reference_arm"], "label": study["label"],
                       "cells": cells, "probe_configs": CONFIGS}, indent=1)


rule study_manifest:
    output:
        f"{R}/study/manifest.json",
    params:
        text=study_manifest_text() + "\n" if STUDY else "",
    shell:
        WRITE_TEXT


rule study_aggregate:
    input:
        jobs=study_jobs(),
        manifest=f"{R}/study/manifest.json",
        probe=f"{R}/tables/probe.csv",
    output:
        study_outputs(),
    log:
        f"{R}/logs/study_aggregate.log",
    conda:
        ENV
    shell:
        "python -m analysis.study --results {R} --format {FIGURES[format]} > {log} 2>&1"
