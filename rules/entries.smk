# Stage: the entries of the config's `grids:` section (`grids`: every entry's table), each a grid in the
# one shape every experiment has (docs/pipeline.md#grids): cells `grids/<name>/<label>/.../seed<N>`, run by
# rules/grids.smk; per entry a manifest (its cells and labels as the config wrote them) and a table of
# its runs (analysis/grid_summary.py).

GRID_ENTRY_NAMES = list(config.get("grids") or {})


def entry_tables(name):
    return [f"{R}/tables/grids/{name}.csv", f"{R}/tables/grids/{name}.md"]


rule grids:
    input:
        [f for name in GRID_ENTRY_NAMES for f in entry_tables(name)],


def entry_manifest_text(name):
    import json

    cells = [{"cell": c.name, "labels": dict(c.labels), "seed": c.seed, "model": c.model}
             for c in CELLS["grids"] if grid_stage(c) == name]
    return json.dumps({"grid": name, "axes": {k: list(v) for k, v in config["grids"][name]["axes"].items()},
                       "cells": cells}, indent=1)


localrules:
    entry_manifest,


rule entry_manifest:
    output:
        f"{R}/grids/{{entry,{_one_of(GRID_ENTRY_NAMES)}}}/manifest.json",
    params:
        text=lambda wc: entry_manifest_text(wc.entry) + "\n",
    shell:
        WRITE_TEXT


rule entry_table:
    input:
        runs=lambda wc: grid_records("grids", wc.entry),
        manifest=f"{R}/grids/{{entry}}/manifest.json",
    output:
        csv=report(f"{R}/tables/grids/{{entry,{_one_of(GRID_ENTRY_NAMES)}}}.csv", caption="report/grids.rst",
                   category="Grids", subcategory="{entry}"),
        md=f"{R}/tables/grids/{{entry}}.md",
    log:
        f"{R}/logs/grids_{{entry}}.log",
    conda:
        ENV
    shell:
        "python -m analysis.grid_summary --results {R} --grid {wildcards.entry} --out-csv {output.csv} "
        "--out-md {output.md} > {log} 2>&1"
