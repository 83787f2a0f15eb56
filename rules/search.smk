# Stage: the natural-collapse search (`collapse_pilot`, `collapse_grid`, `collapse_ablation`,
# `collapse_lever`): each stage's cells are every combination of its axes x seeds, one run
# directory `search/<stage>/<label>/.../seed<N>` each (its own warm start, same for every arm
# of a seed); tables and figures per stage from analysis/collapse_search.py.

SEARCH_STAGE_NAMES = list((config.get("search") or {}).get("stages") or {})


def search_summaries(stage):
    return [f"{R}/search/{cell}/summary.json" for cell, p in SEARCH.items() if p["stage"] == stage]


def search_outputs(stage):
    return [f"{R}/tables/search_{stage}.{ext}" for ext in ("csv", "md", "json")] + \
        [f"{R}/figures/search_{stage}.{FIGURES['format']}"]


for _stage in ("pilot", "grid", "ablation", "lever"):

    rule:
        name:
            f"collapse_{_stage}"
        input:
            search_outputs(_stage) if _stage in SEARCH_STAGE_NAMES else [],


def search_manifest_text(stage):
    import json

    search = config["search"]
    cells = [{"cell": c, "labels": p["labels"], "seed": p["seed"], "model": p["model"]}
             for c, p in SEARCH.items() if p["stage"] == stage]
    return json.dumps({"stage": stage, "label": search.get("label", "natural-collapse search"),
                       "axes": {k: list(v) for k, v in search["stages"][stage]["axes"].items()},
                       "pilot_rule": search.get("pilot_rule", {}), "decision": search.get("decision", {}),
                       "cells": cells}, indent=1)


localrules:
    search_config,
    search_manifest,


wildcard_constraints:
    stage="pilot|grid|ablation|lever",


rule search_manifest:
    output:
        f"{R}/search/{{stage}}/manifest.json",
    params:
        text=lambda wc: search_manifest_text(wc.stage) + "\n",
    shell:
        WRITE_TEXT


rule search_config:
    output:
        f"{R}/search/{{cell}}/run.yaml",
    params:
        text=lambda wc: yaml_text(SEARCH[wc.cell]["config"]),
    shell:
        WRITE_TEXT


SEARCH_INITS = {p["init"]["name"]: p for p in SEARCH.values() if p["init"]}


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


rule search_init:
    input:
        lambda wc: model_files(SEARCH_INITS[wc.name]["model"]),
    output:
        f"{R}/search/init/{{name}}/config.json",
    params:
        out=lambda wc: f"{R}/search/init/{wc.name}",
        cfg=lambda wc: f"{R}/search/init/{wc.name}.yaml",
        text=lambda wc: yaml_text(SEARCH_INITS[wc.name]["init"]["config"]),
    log:
        f"{R}/logs/search/init/{{name}}.log",
    conda:
        ENV
    resources:
        mem_mb=4000,
        runtime=60,
    shell:
        WARM_START


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


rule search_aggregate:
    input:
        runs=lambda wc: search_summaries(wc.stage),
        manifest=f"{R}/search/{{stage}}/manifest.json",
    output:
        csv=report(f"{R}/tables/search_{{stage}}.csv", caption="report/search.rst", category="Collapse search",
                   subcategory="{stage}"),
        md=f"{R}/tables/search_{{stage}}.md",
        json=f"{R}/tables/search_{{stage}}.json",
        fig=report(f"{R}/figures/search_{{stage}}.{FIGURES['format']}", caption="report/search.rst",
                   category="Collapse search", subcategory="{stage}"),
    log:
        f"{R}/logs/search_{{stage}}.log",
    conda:
        ENV
    shell:
        "python -m analysis.collapse_search --results {R} --stage {wildcards.stage} --figure {output.fig} > {log} 2>&1"
