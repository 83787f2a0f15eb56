# Shared values and input functions of every stage.

import re

from rpa.workflow.experiments import (GRID_SECTIONS, KINDS, MULTI_GRID_SECTIONS, PRESETS, ancient_start, entries,
                                      entry_kind, entry_of, entry_outputs, entry_paths, grid_stage, manifest,
                                      written_entries)
from rpa.workflow.experiments import kind_outputs as outputs_of_entry
from rpa.workflow.jobs import (attribution_job, diagnose_job, gguf_flags, model_configs, model_kind, model_location,
                               parity_job, probe_job, prompts_flags, prompts_task, sampling_cells, sampling_probe_job,
                               tiny_flags)
from rpa.workflow.pipeline import PipelineConfigError
from rpa.workflow.paper import config_sections, section_inputs
from rpa.workflow.resources import gpu_shortfall, study_priorities
from rpa.workflow.resources import group_resources as resources_of_group

R = config["results"]
MODELS = list(config["models"])
# model names by kind, as wildcard patterns of the rule that makes each (never matching: "(?!)")
TINY_MODELS = "|".join(re.escape(m) for m in MODELS if model_kind(config["models"][m]) == "tiny") or "(?!)"
GGUF_MODELS = "|".join(re.escape(m) for m in MODELS if model_kind(config["models"][m]) == "gguf") or "(?!)"
PROBE = config["probe"]
CONFIGS = list(PROBE["configs"])
SAMPLER = PROBE["sampler"]
DIAGNOSE = config["diagnose"]["configs"]
ATTRIBUTION = config.get("attribution") or {"models": [], "configs": []}  # the kernel-swap attribution
FIGURES = config["figures"]
PAPER_SECTIONS = config_sections(config)  # the paper's further parts: (kind, results directory)
# conda: paths in an included file are relative to that file (rules/), hence "../"
ENV = f"../envs/rpa-{config['env']}.yaml"
DEVICE = config["device"]  # trainer side of parity / probe / diagnose
GPU = config["gpus_per_job"]  # GPUs a parity / probe / diagnose job takes (0 on CPU)
# GRIDS, CELLS (the Snakefile's check_config): every grid's cells, expanded and validated once, and
# their process groups
# every grid's runs by process: `<section>/<group>` (its record's path under the results, less .json)
# -> (section, Group), one `rpa train` process (one job) each
GRID_GROUPS = {f"{section}/{g.name}": (section, g) for section in GRID_SECTIONS for g in GRIDS.groups[section]}
STUDY_GROUPS = {key.removeprefix("study/"): [c.name for c in g.cells] for key, (section, g) in GRID_GROUPS.items()
                if section == "study"}  # group -> its cells
# the ready job of highest priority runs first: a study job's minutes of training, or those it unlocks
STUDY_PRIORITY = study_priorities(config, STUDY_GROUPS) if config.get("study") else {}
# a workstation lends its GPUs through Snakemake's gpu resource: a job needing more is refused now,
# not started and left waiting for GPUs the machine does not have
_SHORT = gpu_shortfall(config, getattr(workflow.global_resources.get("gpu"), "value", None))
if _SHORT:
    raise PipelineConfigError(_SHORT)


wildcard_constraints:
    model="|".join(map(re.escape, MODELS)),
    numerics="|".join(map(re.escape, CONFIGS)),


def grid_records(section, stage=None):
    """The records of a grid's process groups (of one entry ``stage`` of a section of several grids only,
    if given: a search stage, a `grids` entry): what its tables wait for."""
    return [f"{R}/{key}.json" for key, (s, g) in GRID_GROUPS.items()
            if s == section and (stage is None or grid_stage(g.cells[0]) == stage)]


def model_path(wildcards):
    """Local directory or hub id that rpa commands load."""
    return model_location(config, wildcards.model)


def model_files(name):
    """File dependency on a model built or converted here (none for a path or hub id)."""
    return [f"{R}/models/{name}/config.json"] if model_kind(config["models"][name]) != "path" else []


def model_prompts(wildcards):
    """The prompts file of the model's probe task, or nothing (the built-in prompts)."""
    return [f"{R}/prompts/{wildcards.model}.jsonl"] if prompts_task(config, wildcards.model) else []


def model_input(wildcards):
    return model_files(wildcards.model)


# The study's runs start from a shared warm start per model (``study/<model>/init``) where the
# run config has one; parity, probe and diagnose measure that checkpoint -- the policy that
# trains -- not the random-initialised model it was warm-started from.
STUDY_INITS = {c.labels["model"]: c.init for c in CELLS["study"]}  # model -> its shared warm start, or None
STUDY_SHARED_INIT = [m for m, init in STUDY_INITS.items() if init is not None]


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


def probe_cells():
    """(model, configuration) of every probe cell: each model's own configurations."""
    return [(m, c) for m in MODELS for c in model_configs(config, m)]


def probe_summaries(wildcards=None):
    return [f"{R}/probe/{m}/{c}/summary.json" for m, c in probe_cells()]


SAMPLING_CELLS = sampling_cells(config)  # (model, setting label, configuration) at other sampling settings


def sampling_summaries(wildcards=None):
    return [f"{R}/probe-sampling/{m}/{s}/{c}/summary.json" for m, s, c in SAMPLING_CELLS]


def sampling_tables(wildcards=None):
    """The gap beyond rounding's table, where some model probes other sampling settings."""
    return [f"{R}/tables/probe_sampling.csv", f"{R}/tables/probe_sampling.md"] if SAMPLING_CELLS else []


def figure_tokens(wildcards=None):
    """The per-token tables the dlogp-vs-probability figure draws: its configurations each model ran."""
    return [f"{R}/probe/{m}/{c}/tokens.csv" for m, c in probe_cells() if c in FIGURES["dlogp_vs_prob_configs"]]


def diagnose_tables(wildcards=None):
    return expand(f"{R}/diagnose/{{model}}/{{numerics}}/layers.csv", model=MODELS, numerics=DIAGNOSE)


def probe_tables(wildcards=None):
    return [f"{R}/tables/probe.csv", f"{R}/tables/probe.md", f"{R}/tables/diagnose.csv"]


def analysis_figures(wildcards=None):
    names = ["mismatch", "dlogp_vs_prob"] + (["layers"] if DIAGNOSE else [])  # no diagnosis, no layer figure
    return expand(f"{R}/figures/{{name}}.{FIGURES['format']}", name=names)


def attribution_outputs(wildcards=None):
    """The attribution's table and figure, where the config asks for one."""
    if not (ATTRIBUTION["models"] and ATTRIBUTION["configs"]):
        return []
    return [f"{R}/tables/attribution.csv", f"{R}/tables/attribution.md", f"{R}/tables/attribution_ops.csv",
            f"{R}/figures/attribution.{FIGURES['format']}"]


def yaml_text(data):
    """A job or run file as the command reads it (``rpa probe|diagnose|parity --config``, ``rpa train
    --config``, ``rpa warm-start --config``): YAML, keys in the order given (a run file's: TrainConfig's
    fields)."""
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


# The shell of the one-file jobs (job files, run configs, manifests): `params.text` written whole
# or not at all. A shell job runs in Snakemake's own process; a `run:` job would be spawned as a new
# Snakemake process that parses the whole workflow again (~2 s each, ~200 of them in the CPU miniature).
WRITE_TEXT = "printf '%s' {params.text:q} > {output}.tmp && mv {output}.tmp {output}"
# A shared warm start: its run config (params.cfg, from params.text), then `rpa warm-start` on it.
WARM_START = ("printf '%s' {params.text:q} > {params.cfg}.tmp && mv {params.cfg}.tmp {params.cfg} && "
              "rpa warm-start --config {params.cfg} --out {params.out} > {log} 2>&1")
