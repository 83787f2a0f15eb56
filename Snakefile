# rpa pipeline: models -> parity gate -> probe grid + per-layer diagnosis -> tables + figures.
#
#   snakemake --cores 2                                   # CPU default (experiments/config.yaml)
#   snakemake --workflow-profile experiments/profiles/slurm --configfile my.yaml
#   (a --configfile replaces experiments/config.yaml; it is not merged into it)
#
# Stages (rules grouped below in this order): models, gate, probe, diagnose, analysis, and
# the GRPO grid (target `train_all`, not part of `all`: it takes longer).
# The config is validated twice before any job starts: its shape against
# experiments/schema/config.schema.yaml, its meaning by rpa.pipeline.check_config.

import re

from snakemake.utils import validate

from rpa.pipeline import check_config, dose_init_config, dose_points, numerics_flags, tiny_flags, train_points


# The default grid, unless a complete config came with --configfile (Snakemake would
# otherwise deep-merge the two, and a smaller grid would silently keep the default's
# entries). --config key=value overrides still apply on top of either.
if "models" not in config:

    configfile: "experiments/config.yaml"


validate(config, "experiments/schema/config.schema.yaml")
check_config(config)

R = config["results"]
MODELS = list(config["models"])
PROBE = config["probe"]
CONFIGS = list(PROBE["configs"])
SAMPLER = PROBE["sampler"]
DIAGNOSE = config["diagnose"].get("configs", [])
FIGURES = config["figures"]
ENV = f"envs/rpa-{config.get('env', 'cpu')}.yaml"
DEVICE = config.get("device", "auto")  # trainer side of parity / probe / diagnose
TRAIN = {(p["setting"], p["regions"], str(p["seed"])): p["config"] for p in train_points(config)} if config.get(
    "train") else {}
DOSE = {p["cell"]: p["config"] for p in dose_points(config)} if config.get("dose") else {}


wildcard_constraints:
    model="|".join(map(re.escape, MODELS)),
    numerics="|".join(map(re.escape, CONFIGS)),


def model_path(wildcards):
    """Local directory or hub id that rpa commands load."""
    spec = config["models"][wildcards.model]
    return f"{R}/models/{wildcards.model}" if "tiny" in spec else spec["path"]


def model_files(name):
    """File dependency on a model built here (none for a path or hub id)."""
    return [f"{R}/models/{name}/config.json"] if "tiny" in config["models"][name] else []


def model_input(wildcards):
    return model_files(wildcards.model)


def probe_summaries(wildcards=None):
    return expand(f"{R}/probe/{{model}}/{{numerics}}/summary.json", model=MODELS, numerics=CONFIGS)


def diagnose_tables(wildcards=None):
    return expand(f"{R}/diagnose/{{model}}/{{numerics}}/layers.csv", model=MODELS, numerics=DIAGNOSE)


rule all:
    input:
        f"{R}/tables/probe.csv",
        f"{R}/tables/probe.md",
        f"{R}/tables/diagnose.csv",
        expand(f"{R}/figures/{{name}}.{FIGURES['format']}", name=["mismatch", "dlogp_vs_prob", "layers"]),


# ----------------------------------------------------------------------------- models


rule tiny_model:
    output:
        f"{R}/models/{{model}}/config.json",
    params:
        flags=lambda wc: tiny_flags(config["models"][wc.model]["tiny"]),
        out=lambda wc: f"{R}/models/{wc.model}",
    log:
        f"{R}/logs/models/{{model}}.log",
    conda:
        ENV
    resources:
        mem_mb=2000,
        runtime=10,
    shell:
        "rpa tiny --out {params.out} {params.flags} > {log} 2>&1"


# ------------------------------------------------------------------------------- gate


rule parity:
    input:
        model_input,
    output:
        f"{R}/parity/{{model}}.json",
    params:
        model=model_path,
        regions=config["parity"]["regions"],
        compiled="--compiled" if config["parity"].get("compiled") else "",
    log:
        f"{R}/logs/parity/{{model}}.log",
    conda:
        ENV
    resources:
        mem_mb=6000,
        runtime=30,
    shell:
        "rpa parity --model {params.model} --regions {params.regions} {params.compiled} --device {DEVICE} "
        "--out {output} > {log} 2>&1"


# ------------------------------------------------------------------------------ probe


def probe_options():
    lo, hi = PROBE.get("ratio_band", [0.8, 1.25])
    opts = (f"--prompts {PROBE.get('prompts', 16)} --samples {PROBE.get('samples', 2)} "
            f"--max-tokens {PROBE.get('max_tokens', 64)} --seed {PROBE.get('seed', 0)} "
            f"--full-kl-max-vocab {PROBE.get('full_kl_max_vocab', 4096)} --ratio-band {lo} {hi}")
    return opts + (" --compiled" if PROBE.get("compiled") else "")


def probe_completions(wildcards):
    """Every configuration but the sampler scores the sampler's completions."""
    if wildcards.numerics == SAMPLER:
        return []
    return [f"{R}/probe/{wildcards.model}/{SAMPLER}/completions.jsonl"]


rule probe:
    input:
        model=model_input,
        parity=f"{R}/parity/{{model}}.json",
        completions=probe_completions,
    output:
        summary=f"{R}/probe/{{model}}/{{numerics}}/summary.json",
        tokens=f"{R}/probe/{{model}}/{{numerics}}/tokens.csv",
    params:
        model=model_path,
        out=lambda wc: f"{R}/probe/{wc.model}/{wc.numerics}",
        numerics=lambda wc: numerics_flags(PROBE["configs"][wc.numerics]) + f" --device {DEVICE}",
        completions=lambda wc, input: f"--completions {input.completions[0]}" if input.completions else "",
        options=probe_options(),
    log:
        f"{R}/logs/probe/{{model}}/{{numerics}}.log",
    conda:
        ENV
    resources:
        mem_mb=6000,
        runtime=60,
    shell:
        "rpa probe --model {params.model} {params.numerics} {params.options} {params.completions} "
        "--out {params.out} > {log} 2>&1"


# The sampler's own probe run samples the completions every other configuration scores.
use rule probe as probe_sampler with:
    output:
        summary=f"{R}/probe/{{model}}/{{numerics,{re.escape(SAMPLER)}}}/summary.json",
        tokens=f"{R}/probe/{{model}}/{{numerics,{re.escape(SAMPLER)}}}/tokens.csv",
        completions=f"{R}/probe/{{model}}/{{numerics,{re.escape(SAMPLER)}}}/completions.jsonl",


ruleorder: probe_sampler > probe


# --------------------------------------------------------------------------- diagnose


rule diagnose:
    input:
        model=model_input,
        parity=f"{R}/parity/{{model}}.json",
        completions=f"{R}/probe/{{model}}/{SAMPLER}/completions.jsonl",
    output:
        layers=f"{R}/diagnose/{{model}}/{{numerics}}/layers.csv",
        summary=f"{R}/diagnose/{{model}}/{{numerics}}/summary.json",
    params:
        model=model_path,
        out=lambda wc: f"{R}/diagnose/{wc.model}/{wc.numerics}",
        numerics=lambda wc: numerics_flags(PROBE["configs"][wc.numerics]) + f" --device {DEVICE}",
        sequences=config["diagnose"].get("sequences", 4),
    log:
        f"{R}/logs/diagnose/{{model}}/{{numerics}}.log",
    conda:
        ENV
    resources:
        mem_mb=6000,
        runtime=30,
    shell:
        "rpa diagnose --model {params.model} {params.numerics} --sequences {params.sequences} "
        "--completions {input.completions} --out {params.out} > {log} 2>&1"


# --------------------------------------------------------------------------- analysis


rule aggregate:
    input:
        probe=probe_summaries(),
        diagnose=diagnose_tables(),
        parity=expand(f"{R}/parity/{{model}}.json", model=MODELS),
    output:
        csv=f"{R}/tables/probe.csv",
        md=f"{R}/tables/probe.md",
        diagnose=f"{R}/tables/diagnose.csv",
    params:
        configs=" ".join(CONFIGS),
    log:
        f"{R}/logs/aggregate.log",
    conda:
        ENV
    shell:
        "python -m analysis.aggregate --results {R} --out-dir {R}/tables --configs {params.configs} > {log} 2>&1"


rule figures:
    input:
        probe=f"{R}/tables/probe.csv",
        diagnose=f"{R}/tables/diagnose.csv",
        tokens=expand(f"{R}/probe/{{model}}/{{numerics}}/tokens.csv", model=MODELS,
                      numerics=FIGURES.get("dlogp_vs_prob_configs", [])),
    output:
        expand(f"{R}/figures/{{name}}.{FIGURES['format']}", name=["mismatch", "dlogp_vs_prob", "layers"]),
    params:
        configs=" ".join(FIGURES.get("dlogp_vs_prob_configs", [])) or "none",
    log:
        f"{R}/logs/figures.log",
    conda:
        ENV
    shell:
        "python -m analysis.figures --results {R} --out-dir {R}/figures --format {FIGURES[format]} "
        "--dlogp-configs {params.configs} > {log} 2>&1"


# ------------------------------------------------------------------------ GRPO grid


def train_runs(wildcards=None):
    return [f"{R}/train/{s}/{r}/seed{seed}/summary.json" for (s, r, seed) in TRAIN]


rule train_all:
    input:
        f"{R}/tables/train.csv",
        f"{R}/tables/train.md",
        f"{R}/figures/train_curves.{FIGURES['format']}",


rule train_config:
    output:
        f"{R}/train/{{setting}}/{{regions}}/seed{{seed}}/run.yaml",
    run:
        import yaml

        key = (wildcards.setting, wildcards.regions, wildcards.seed)
        if key not in TRAIN:
            raise ValueError(f"no train grid point {key}")
        with open(output[0], "w") as f:
            yaml.safe_dump(TRAIN[key], f, sort_keys=False)


rule train:
    input:
        cfg=f"{R}/train/{{setting}}/{{regions}}/seed{{seed}}/run.yaml",
        model=lambda wc: model_files(config["train"]["model"]),
    output:
        # only the summary: Snakemake deletes a failed job's outputs, and the run directory
        # (checkpoints, metrics.jsonl) must survive for the rerun to resume from it
        f"{R}/train/{{setting}}/{{regions}}/seed{{seed}}/summary.json",
    params:
        out=lambda wc: f"{R}/train/{wc.setting}/{wc.regions}/seed{wc.seed}",
    log:
        f"{R}/logs/train/{{setting}}/{{regions}}/seed{{seed}}.log",
    conda:
        ENV
    resources:
        mem_mb=8000,
        runtime=120,
    shell:
        # a rerun after an interruption resumes from the run directory's last checkpoint
        "rpa train --config {input.cfg} --out {params.out} > {log} 2>&1"


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


# ------------------------------------------------------------ positive control (dose)


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
    log:
        f"{R}/logs/dose/init.log",
    conda:
        ENV
    resources:
        mem_mb=4000,
        runtime=30,
    run:
        import yaml

        with open(params.cfg, "w") as f:
            yaml.safe_dump(dose_init_config(config), f, sort_keys=False)
        shell("rpa warm-start --config {params.cfg} --out {params.out} > {log} 2>&1")


rule dose_config:
    output:
        f"{R}/dose/{{cell}}/run.yaml",
    run:
        import yaml

        if wildcards.cell not in DOSE:
            raise ValueError(f"no dose cell {wildcards.cell}")
        with open(output[0], "w") as f:
            yaml.safe_dump(DOSE[wildcards.cell], f, sort_keys=False)


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
        fig=f"{R}/figures/dose_response.{FIGURES['format']}",
    log:
        f"{R}/logs/dose_aggregate.log",
    conda:
        ENV
    shell:
        "python -m analysis.dose --results {R} --out-dir {R}/tables --figure {output.fig} > {log} 2>&1"
