# Stage: the GRPO grid of one model (`train_all`): region sets x seeds x settings.


def train_runs(wildcards=None):
    return grid_records("train")


rule train_all:
    input:
        f"{R}/tables/train.csv",
        f"{R}/tables/train.md",
        f"{R}/figures/train_curves.{FIGURES['format']}",


# a one-line job that writes a file from the config: run by Snakemake itself, never submitted
localrules:
    train_manifest,


rule train_manifest:
    output:
        f"{R}/train/manifest.json",
    params:
        text=manifest_text("train", CELLS["train"]) if CELLS["train"] else "",
    shell:
        WRITE_TEXT


rule train_aggregate:
    input:
        train_runs(),
        manifest=f"{R}/train/manifest.json",
    output:
        csv=f"{R}/tables/train.csv",
        md=f"{R}/tables/train.md",
        fig=f"{R}/figures/train_curves.{FIGURES['format']}",
    log:
        f"{R}/logs/train_aggregate.log",
    conda:
        ENV
    shell:
        "python -m analysis.train_summary --results {R} --out-table {output.csv} --out-md {output.md} "
        "--out-figure {output.fig} > {log} 2>&1"
