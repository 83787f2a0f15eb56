# Shared values and input functions of every stage.

import re

from rpa.workflow.pipeline import (diagnose_job, dose_init_config, dose_points, model_location, parity_job,
                                   probe_job, search_points, study_arm_names, study_groups, study_init_config,
                                   study_points, study_priorities, study_resources, tiny_flags, train_points)

R = config["results"]
MODELS = list(config["models"])
PROBE = config["probe"]
CONFIGS = list(PROBE["configs"])
SAMPLER = PROBE["sampler"]
DIAGNOSE = config["diagnose"]["configs"]
FIGURES = config["figures"]
# conda: paths in an included file are relative to that file (rules/), hence "../"
ENV = f"../envs/rpa-{config['env']}.yaml"
DEVICE = config["device"]  # trainer side of parity / probe / diagnose
GPU = config["gpus_per_job"]  # GPUs a parity / probe / diagnose job takes (0 on CPU)
TRAIN = {(p["model"], p["setting"], p["regions"], str(p["seed"])): p["config"] for p in train_points(config)} \
    if config.get("train") else {}
DOSE = {p["cell"]: p["config"] for p in dose_points(config)} if config.get("dose") else {}
STUDY = {p["cell"]: p for p in study_points(config)} if config.get("study") else {}
STUDY_GROUPS = study_groups(config) if config.get("study") else {}  # group -> its cells, one process each
# the ready job of highest priority runs first: a study job's minutes of training, or those it unlocks
STUDY_PRIORITY = study_priorities(config, STUDY_GROUPS) if config.get("study") else {}
SEARCH = {p["cell"]: p for p in search_points(config)} if config.get("search") else {}


wildcard_constraints:
    model="|".join(map(re.escape, MODELS)),
    numerics="|".join(map(re.escape, CONFIGS)),
    group="|".join(map(re.escape, STUDY_GROUPS)) or "(?!)",  # the study's jobs by name: no other .json under study/


def model_path(wildcards):
    """Local directory or hub id that rpa commands load."""
    return model_location(config, wildcards.model)


def model_files(name):
    """File dependency on a model built here (none for a path or hub id)."""
    return [f"{R}/models/{name}/config.json"] if "tiny" in config["models"][name] else []


def model_input(wildcards):
    return model_files(wildcards.model)


# The study's runs start from a shared warm start per model (``study/<model>/init``) where the
# run config has one; parity, probe and diagnose measure that checkpoint -- the policy that
# trains -- not the random-initialised model it was warm-started from.
STUDY_SHARED_INIT = [m for m in config["study"]["models"] if study_init_config(config, m) is not None] \
    if config.get("study") else []


def start_path(wildcards):
    """The checkpoint the runs of ``wildcards.model`` start from: its shared warm start, else the model."""
    if wildcards.model in STUDY_SHARED_INIT:
        return f"{R}/study/{wildcards.model}/init"
    return model_path(wildcards)


def start_input(wildcards):
    if wildcards.model in STUDY_SHARED_INIT:
        return [f"{R}/study/{wildcards.model}/init/config.json"]
    return model_input(wildcards)


def gpu_launch(count):
    """Prefix giving a job its own GPUs on a workstation (rpa.workflow.gpus); nothing on CPU."""
    return f"python -m rpa.workflow.gpus --count {count} -- " if count else ""


def probe_summaries(wildcards=None):
    return expand(f"{R}/probe/{{model}}/{{numerics}}/summary.json", model=MODELS, numerics=CONFIGS)


def diagnose_tables(wildcards=None):
    return expand(f"{R}/diagnose/{{model}}/{{numerics}}/layers.csv", model=MODELS, numerics=DIAGNOSE)


def probe_tables(wildcards=None):
    return [f"{R}/tables/probe.csv", f"{R}/tables/probe.md", f"{R}/tables/diagnose.csv"]


def analysis_figures(wildcards=None):
    names = ["mismatch", "dlogp_vs_prob"] + (["layers"] if DIAGNOSE else [])  # no diagnosis, no layer figure
    return expand(f"{R}/figures/{{name}}.{FIGURES['format']}", name=names)


def yaml_text(data):
    """A job or run file as the command reads it (``rpa probe|diagnose|parity --config``, ``rpa train
    --config``): YAML, keys in the config's order."""
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


# The shell of the one-file jobs (job files, run configs, manifests): `params.text` written whole
# or not at all. A shell job runs in Snakemake's own process; a `run:` job would be spawned as a new
# Snakemake process that parses the whole workflow again (~2 s each, ~200 of them in the CPU miniature).
WRITE_TEXT = "printf '%s' {params.text:q} > {output}.tmp && mv {output}.tmp {output}"
# A shared warm start: its run config (params.cfg, from params.text), then `rpa warm-start` on it.
WARM_START = ("printf '%s' {params.text:q} > {params.cfg}.tmp && mv {params.cfg}.tmp {params.cfg} && "
              "rpa warm-start --config {params.cfg} --out {params.out} > {log} 2>&1")
