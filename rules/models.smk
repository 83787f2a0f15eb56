# Stage: models. Tiny random models built here, GGUF files converted here (`rpa convert`: an
# FP32 checkpoint, once); `path` models are loaded where they are.


rule tiny_model:
    output:
        f"{R}/models/{{model,{TINY_MODELS}}}/config.json",
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


rule gguf_model:
    output:
        f"{R}/models/{{model,{GGUF_MODELS}}}/config.json",
    params:
        flags=lambda wc: gguf_flags(config["models"][wc.model]["gguf"]),
        out=lambda wc: f"{R}/models/{wc.model}",
    log:
        f"{R}/logs/models/{{model}}.log",
    priority: lambda wc: STUDY_PRIORITY.get(wc.model, 0)
    conda:
        ENV
    resources:
        mem_mb=4000,
        runtime=10,
    shell:
        "rpa convert {params.flags} --out {params.out} > {log} 2>&1"


# The prompts a model's probe samples from, where its `models.<name>.probe.task` names a task.
rule task_prompts:
    output:
        f"{R}/prompts/{{model}}.jsonl",
    params:
        flags=lambda wc: prompts_flags(prompts_task(config, wc.model)),
    log:
        f"{R}/logs/prompts/{{model}}.log",
    conda:
        ENV
    shell:
        "rpa prompts {params.flags} --out {output} > {log} 2>&1"
