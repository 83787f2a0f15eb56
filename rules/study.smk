# Stage: the study (`study`): models x arms x seeds of GRPO, each cell one run directory
# `study/<model>/<arm>/seed<N>`, resources scaled by model size; tables and figures across sizes.

STUDY_MODELS = config["study"]["models"] if STUDY else []  # STUDY_SHARED_INIT: common.smk


def _cell_model(wildcards):
    return wildcards.cell.split("/")[0]


def _study_res(key):
    return lambda wc: study_resources(config, _cell_model(wc))[key]


def study_command(wildcards, input):
    """``rpa train`` on the model's GPUs: one process, or accelerate with its multi-GPU config."""
    res = study_resources(config, _cell_model(wildcards))
    out = f"{R}/study/{wildcards.cell}"
    if res["launch"] == "single":
        cmd = f"rpa train --config {input.cfg} --out {out}"
    else:
        cmd = (f"accelerate launch --config_file experiments/accelerate/{res['launch']}.yaml "
               f"--num_processes {res['gpu']} -m rpa.cli train --config {input.cfg} --out {out}")
    return gpu_launch(res["gpu"]) + cmd


def study_init_input(wildcards):
    model = _cell_model(wildcards)
    return [f"{R}/study/{model}/init/config.json"] if model in STUDY_SHARED_INIT else model_files(model)


def study_summaries(wildcards=None):
    return [f"{R}/study/{cell}/summary.json" for cell in STUDY]


def study_outputs(wildcards=None):
    tables = [f"{R}/tables/study_{name}.{ext}" for name in ("collapse", "mismatch") for ext in ("csv", "md", "tex")]
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
    log:
        f"{R}/logs/study/{{model}}/init.log",
    conda:
        ENV
    resources:
        mem_mb=4000,
        runtime=60,
    run:
        import yaml

        with open(params.cfg, "w") as f:
            yaml.safe_dump(study_init_config(config, wildcards.model), f, sort_keys=False)
        shell("rpa warm-start --config {params.cfg} --out {params.out} > {log} 2>&1")


# one-line jobs that write a file from the config: run by Snakemake itself, never submitted
localrules:
    study_config,
    study_manifest,


rule study_config:
    output:
        f"{R}/study/{{cell}}/run.yaml",
    run:
        import yaml

        if wildcards.cell not in STUDY:
            raise ValueError(f"no study cell {wildcards.cell}")
        with open(output[0], "w") as f:
            yaml.safe_dump(STUDY[wildcards.cell]["config"], f, sort_keys=False)


rule study_train:
    input:
        cfg=f"{R}/study/{{cell}}/run.yaml",
        init=study_init_input,
    output:
        # the summary is written for every end of a run (ok, collapsed, error): a run that failed
        # is a result the tables show as failed; a run killed before it is missing and reruns
        f"{R}/study/{{cell}}/summary.json",
    params:
        command=study_command,
    log:
        f"{R}/logs/study/{{cell}}.log",
    conda:
        ENV
    resources:
        gpu=_study_res("gpu"),
        mem_mb=_study_res("mem_mb"),
        runtime=_study_res("runtime"),
        cpus_per_task=_study_res("cpus_per_task"),
    shell:
        "{params.command} > {log} 2>&1 || test -f {output}"


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
        text=study_manifest_text() if STUDY else "",
    run:
        with open(output[0], "w") as f:
            f.write(params.text + "\n")


rule study_aggregate:
    input:
        runs=study_summaries(),
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
