# Stage: models. Tiny random Qwen models built here; `path` models are loaded where they are.


rule tiny_model:
    output:
        f"{R}/models/{{model}}/config.json",
    params:
        flags=lambda wc: tiny_flags(config["models"][wc.model]["tiny"]),
        out=lambda wc: f"{R}/models/{wc.model}",
    log:
        f"{R}/logs/models/{{model}}.log",
    priority: lambda wc: STUDY_PRIORITY.get(wc.model, 0)  # a study model: before the work it unlocks
    conda:
        ENV
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "rpa tiny --out {params.out} {params.flags} > {log} 2>&1"
