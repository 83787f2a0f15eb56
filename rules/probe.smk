# Stage: the probe grid. One configuration (the sampler) samples; every other configuration
# scores those identical tokens. Each cell is one job file (`rpa probe --config`), written here.


def probe_completions(wildcards):
    """Every configuration but the sampler scores the sampler's completions."""
    if wildcards.numerics == SAMPLER:
        return []
    return [f"{R}/probe/{wildcards.model}/{SAMPLER}/completions.jsonl"]


localrules:
    write_probe_job,


rule write_probe_job:
    output:
        f"{R}/jobs/probe/{{model}}/{{numerics}}.yaml",
    params:
        text=lambda wc: yaml_text(probe_job(config, start_path(wc), wc.numerics, (probe_completions(wc) or [None])[0],
                                            DEVICE, name=wc.model, prompts_file=(model_prompts(wc) or [None])[0])),
    shell:
        WRITE_TEXT


rule probe:
    input:
        model=start_input,
        parity=f"{R}/parity/{{model}}.json",
        completions=probe_completions,
        prompts=model_prompts,
        job=f"{R}/jobs/probe/{{model}}/{{numerics}}.yaml",
    output:
        summary=f"{R}/probe/{{model}}/{{numerics}}/summary.json",
        tokens=f"{R}/probe/{{model}}/{{numerics}}/tokens.csv",
    params:
        out=lambda wc: f"{R}/probe/{wc.model}/{wc.numerics}",
        launch=gpu_launch(GPU),
    log:
        f"{R}/logs/probe/{{model}}/{{numerics}}.log",
    # the longest cells first among those ready: FP16 on a CPU without FP16 arithmetic is ~8x a BF16 cell
    priority: lambda wc: 1 if PROBE["configs"][wc.numerics].get("precision") == "fp16" else 0
    conda:
        ENV
    resources:
        mem_mb=config["job_mem_mb"],
        runtime=60,
        gpu=GPU,
    shell:
        # Snakemake decided this cell runs again: --replace makes its last run's record give way (rpa.core.outdir.claim owns reruns)
        "{params.launch}rpa probe --config {input.job} --out {params.out} --replace > {log} 2>&1"


# The sampler's own probe run samples the completions every other configuration scores.
use rule probe as probe_sampler with:
    output:
        summary=f"{R}/probe/{{model}}/{{numerics,{re.escape(SAMPLER)}}}/summary.json",
        tokens=f"{R}/probe/{{model}}/{{numerics,{re.escape(SAMPLER)}}}/tokens.csv",
        completions=f"{R}/probe/{{model}}/{{numerics,{re.escape(SAMPLER)}}}/completions.jsonl",


ruleorder: probe_sampler > probe


# The gap beyond rounding: a model's probe cells at other sampling settings (models.<name>.probe.sampling),
# each setting sampled anew by the sampler configuration and scored by the others, with the gap split by source.


def sampling_completions(wildcards):
    if wildcards.numerics == SAMPLER:
        return []
    return [f"{R}/probe-sampling/{wildcards.model}/{wildcards.setting}/{SAMPLER}/completions.jsonl"]


localrules:
    write_sampling_probe_job,


rule write_sampling_probe_job:
    output:
        f"{R}/jobs/probe-sampling/{{model}}/{{setting}}/{{numerics}}.yaml",
    params:
        text=lambda wc: yaml_text(sampling_probe_job(config, start_path(wc), wc.numerics, wc.setting,
                                                     (sampling_completions(wc) or [None])[0], DEVICE, name=wc.model,
                                                     prompts_file=(model_prompts(wc) or [None])[0])),
    shell:
        WRITE_TEXT


rule probe_sampling:
    input:
        model=start_input,
        parity=f"{R}/parity/{{model}}.json",
        completions=sampling_completions,
        prompts=model_prompts,
        job=f"{R}/jobs/probe-sampling/{{model}}/{{setting}}/{{numerics}}.yaml",
    output:
        summary=f"{R}/probe-sampling/{{model}}/{{setting}}/{{numerics}}/summary.json",
        split=f"{R}/probe-sampling/{{model}}/{{setting}}/{{numerics}}/split.csv",
    params:
        out=lambda wc: f"{R}/probe-sampling/{wc.model}/{wc.setting}/{wc.numerics}",
        launch=gpu_launch(GPU),
    log:
        f"{R}/logs/probe-sampling/{{model}}/{{setting}}/{{numerics}}.log",
    conda:
        ENV
    resources:
        mem_mb=config["job_mem_mb"],
        runtime=60,
        gpu=GPU,
    shell:
        "{params.launch}rpa probe --config {input.job} --out {params.out} --replace > {log} 2>&1"


use rule probe_sampling as probe_sampling_sampler with:
    output:
        summary=f"{R}/probe-sampling/{{model}}/{{setting}}/{{numerics,{re.escape(SAMPLER)}}}/summary.json",
        split=f"{R}/probe-sampling/{{model}}/{{setting}}/{{numerics,{re.escape(SAMPLER)}}}/split.csv",
        completions=f"{R}/probe-sampling/{{model}}/{{setting}}/{{numerics,{re.escape(SAMPLER)}}}/completions.jsonl",


ruleorder: probe_sampling_sampler > probe_sampling
