# Stage: the positive control (`dose_response`): a sampler-only mismatch dose x IS correction x
# old-logprob source x seeds, plus the x-axis anchors, on one shared warm-started model.


rule dose_response:
    input:
        f"{R}/tables/dose.csv",
        f"{R}/tables/dose.md",
        f"{R}/figures/dose_response.{FIGURES['format']}",


rule dose_init:
    input:
        lambda wc: model_files(config["dose"]["model"]),
    output:
        f"{R}/dose/init/config.json",
    params:
        out=f"{R}/dose/init",
        cfg=f"{R}/dose/init.yaml",
        text=lambda wc: yaml_text(DOSE_INIT),
    log:
        f"{R}/logs/dose/init.log",
    conda:
        ENV
    resources:
        mem_mb=4000,
        runtime=30,
    shell:
        WARM_START


localrules:
    dose_config,


rule dose_config:
    output:
        f"{R}/dose/{{cell}}/run.yaml",
    params:
        text=lambda wc: yaml_text(DOSE[wc.cell]),
    shell:
        WRITE_TEXT


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


rule dose_aggregate:
    input:
        [f"{R}/dose/{cell}/summary.json" for cell in DOSE],
    output:
        csv=f"{R}/tables/dose.csv",
        md=f"{R}/tables/dose.md",
        runs=f"{R}/tables/dose_runs.csv",
        sensitivity=f"{R}/tables/dose_sensitivity.csv",
        fig=f"{R}/figures/dose_response.{FIGURES['format']}",
    log:
        f"{R}/logs/dose_aggregate.log",
    conda:
        ENV
    shell:
        "python -m analysis.dose --results {R} --out-dir {R}/tables --figure {output.fig} > {log} 2>&1"
