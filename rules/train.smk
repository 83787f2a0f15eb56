# Stage: the GRPO grid of one model (`train_all`): region sets x seeds x settings.


def train_runs(wildcards=None):
    return [f"{R}/train/{m}/{s}/{r}/seed{seed}/summary.json" for (m, s, r, seed) in TRAIN]


TRAIN_RES = (config.get("train") or {}).get("resources", {})


rule train_all:
    input:
        f"{R}/tables/train.csv",
        f"{R}/tables/train.md",
        f"{R}/figures/train_curves.{FIGURES['format']}",


localrules:
    train_config,


rule train_config:
    output:
        f"{R}/train/{{model}}/{{setting}}/{{regions}}/seed{{seed}}/run.yaml",
    params:
        text=lambda wc: yaml_text(TRAIN[(wc.model, wc.setting, wc.regions, wc.seed)]),
    shell:
        WRITE_TEXT


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


rule train_aggregate:
    input:
        train_runs(),
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
