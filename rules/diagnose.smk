# Stage: per-layer divergence of the two engines on the sampler's tokens (one job file a cell).


localrules:
    write_diagnose_job,


rule write_diagnose_job:
    output:
        f"{R}/jobs/diagnose/{{model}}/{{numerics}}.yaml",
    params:
        text=lambda wc: yaml_text(diagnose_job(config, start_path(wc), wc.numerics,
                                               f"{R}/probe/{wc.model}/{SAMPLER}/completions.jsonl", DEVICE)),
    shell:
        WRITE_TEXT


rule diagnose:
    input:
        model=start_input,
        parity=f"{R}/parity/{{model}}.json",
        completions=f"{R}/probe/{{model}}/{SAMPLER}/completions.jsonl",
        job=f"{R}/jobs/diagnose/{{model}}/{{numerics}}.yaml",
    output:
        layers=f"{R}/diagnose/{{model}}/{{numerics}}/layers.csv",
        summary=f"{R}/diagnose/{{model}}/{{numerics}}/summary.json",
    params:
        out=lambda wc: f"{R}/diagnose/{wc.model}/{wc.numerics}",
        launch=gpu_launch(GPU),
    log:
        f"{R}/logs/diagnose/{{model}}/{{numerics}}.log",
    conda:
        ENV
    resources:
        mem_mb=config["job_mem_mb"],
        runtime=30,
        gpu=GPU,
    shell:
        # Snakemake decided this cell runs again: --replace makes its last run's record give way (rpa.core.outdir.claim owns reruns)
        "{params.launch}rpa diagnose --config {input.job} --out {params.out} --replace > {log} 2>&1"
