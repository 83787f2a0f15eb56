# Stage: the probe grid. One configuration (the sampler) samples; every other configuration
# scores those identical tokens.


def probe_options():
    return probe_flags(config)  # rpa.workflow.pipeline: the flags ProbeOptions reads back


def probe_completions(wildcards):
    """Every configuration but the sampler scores the sampler's completions."""
    if wildcards.numerics == SAMPLER:
        return []
    return [f"{R}/probe/{wildcards.model}/{SAMPLER}/completions.jsonl"]


rule probe:
    input:
        model=start_input,
        parity=f"{R}/parity/{{model}}.json",
        completions=probe_completions,
    output:
        summary=f"{R}/probe/{{model}}/{{numerics}}/summary.json",
        tokens=f"{R}/probe/{{model}}/{{numerics}}/tokens.csv",
    params:
        model=start_path,
        out=lambda wc: f"{R}/probe/{wc.model}/{wc.numerics}",
        numerics=lambda wc: numerics_flags(PROBE["configs"][wc.numerics]) + f" --device {DEVICE}",
        completions=lambda wc, input: f"--completions {input.completions[0]}" if input.completions else "",
        options=probe_options(),
        launch=gpu_launch(GPU),
    log:
        f"{R}/logs/probe/{{model}}/{{numerics}}.log",
    conda:
        ENV
    resources:
        mem_mb=config["job_mem_mb"],
        runtime=60,
        gpu=GPU,
    shell:
        # Snakemake decided this cell runs again: the options recorded by its last run give way
        "rm -f {params.out}/options.json && {params.launch}rpa probe --model {params.model} {params.numerics} {params.options} {params.completions} "
        "--out {params.out} > {log} 2>&1"


# The sampler's own probe run samples the completions every other configuration scores.
use rule probe as probe_sampler with:
    output:
        summary=f"{R}/probe/{{model}}/{{numerics,{re.escape(SAMPLER)}}}/summary.json",
        tokens=f"{R}/probe/{{model}}/{{numerics,{re.escape(SAMPLER)}}}/tokens.csv",
        completions=f"{R}/probe/{{model}}/{{numerics,{re.escape(SAMPLER)}}}/completions.jsonl",


ruleorder: probe_sampler > probe
