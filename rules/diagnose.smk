# Stage: per-layer divergence of the two engines on the sampler's tokens.


rule diagnose:
    input:
        model=start_input,
        parity=f"{R}/parity/{{model}}.json",
        completions=f"{R}/probe/{{model}}/{SAMPLER}/completions.jsonl",
    output:
        layers=f"{R}/diagnose/{{model}}/{{numerics}}/layers.csv",
        summary=f"{R}/diagnose/{{model}}/{{numerics}}/summary.json",
    params:
        model=start_path,
        out=lambda wc: f"{R}/diagnose/{wc.model}/{wc.numerics}",
        numerics=lambda wc: numerics_flags(PROBE["configs"][wc.numerics]) + f" --device {DEVICE}",
        sequences=config["diagnose"]["sequences"],
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
        # Snakemake decided this cell runs again: the options recorded by its last run give way
        "rm -f {params.out}/options.json && {params.launch}rpa diagnose --model {params.model} {params.numerics} --sequences {params.sequences} "
        "--completions {input.completions} --out {params.out} > {log} 2>&1"
