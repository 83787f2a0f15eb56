# Stage: the natural-collapse search (`collapse_pilot`, `collapse_grid`, `collapse_ablation`,
# `collapse_lever`): each stage's cells are every combination of its axes x seeds, one run
# directory `search/<stage>/<label>/.../seed<N>` each (its own warm start, same for every arm
# of a seed); tables and figures per stage from analysis/collapse_search.py.

SEARCH_STAGE_NAMES = list((config.get("search") or {}).get("stages") or {})


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
                       **({"post_hoc": search["post_hoc"]} if search.get("post_hoc") and stage == "grid" else {}),
                       "cells": cells}, indent=1)


localrules:
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


rule search_aggregate:
    input:
        runs=lambda wc: grid_records("search", wc.stage),
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
