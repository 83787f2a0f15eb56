# Stage: where the mismatch the regions leave lives (`rpa attribute`): the trainer rescores the
# sampler's tokens with vLLM's own GEMM / LM-head kernels swapped in, rung by rung.


localrules:
    write_attribution_job,


rule write_attribution_job:
    output:
        f"{R}/jobs/attribute/{{model}}/{{numerics}}.yaml",
    params:
        text=lambda wc: yaml_text(attribution_job(config, start_path(wc), wc.numerics,
                                                  f"{R}/probe/{wc.model}/{SAMPLER}/completions.jsonl", DEVICE)),
    shell:
        WRITE_TEXT


rule attribute:
    input:
        model=start_input,
        parity=f"{R}/parity/{{model}}.json",
        completions=f"{R}/probe/{{model}}/{SAMPLER}/completions.jsonl",
        job=f"{R}/jobs/attribute/{{model}}/{{numerics}}.yaml",
    output:
        summary=f"{R}/attribution/{{model}}/{{numerics}}/summary.json",
        tokens=f"{R}/attribution/{{model}}/{{numerics}}/tokens.csv",
    params:
        out=lambda wc: f"{R}/attribution/{wc.model}/{wc.numerics}",
        launch=gpu_launch(GPU),
    log:
        f"{R}/logs/attribute/{{model}}/{{numerics}}.log",
    conda:
        ENV
    resources:
        mem_mb=config["job_mem_mb"],
        runtime=30,
        gpu=GPU,
    shell:
        "{params.launch}rpa attribute --config {input.job} --out {params.out} --replace > {log} 2>&1"


rule attribution_table:
    input:
        expand(f"{R}/attribution/{{model}}/{{numerics}}/summary.json", model=ATTRIBUTION["models"],
               numerics=ATTRIBUTION["configs"]),
    output:
        csv=report(f"{R}/tables/attribution.csv", caption="report/attribution.rst", category="Attribution"),
        md=f"{R}/tables/attribution.md",
        ops=report(f"{R}/tables/attribution_ops.csv", caption="report/attribution.rst", category="Attribution"),
        figure=report(f"{R}/figures/attribution.{FIGURES['format']}", caption="report/attribution.rst",
                      category="Attribution"),
    log:
        f"{R}/logs/attribution.log",
    conda:
        ENV
    shell:
        "python -m analysis.attribution --results {R} --out-dir {R}/tables --figure {output.figure} > {log} 2>&1"
