# Stage: the study (`study`): models x arms x seeds of GRPO, each cell one run directory
# `study/<model>/<arm>/seed<N>`; a job runs `study.runs_per_process` seeds of up to
# `study.arms_per_process` arms that share a sampler side (one process each, `study/<group>.json`
# its record), resources scaled by model size, the longest first (`STUDY_PRIORITY`); tables and
# figures across sizes.

STUDY_MODELS = config["study"]["models"] if STUDY else []  # STUDY_SHARED_INIT, STUDY_GROUPS: common.smk


def study_jobs(wildcards=None):
    return grid_records("study")


def study_outputs(wildcards=None):
    tables = [f"{R}/tables/study_{name}.{ext}" for name in ("collapse", "mismatch", "sensitivity")
              for ext in ("csv", "md", "tex")]
    figures = [f"{R}/figures/study_{name}.{FIGURES['format']}" for name in ("rewards", "mismatch_curves", "heatmap")]
    return tables + figures


rule study:
    input:
        study_outputs(),


# a one-line job that writes a file from the config: run by Snakemake itself, never submitted
localrules:
    study_manifest,


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
