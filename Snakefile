# rpa pipeline: models -> parity gate -> probe grid + per-layer diagnosis -> tables + figures;
# the GRPO grid, the positive control, the study, and the paper as further targets.
#
#   snakemake --cores 2                                   # CPU default (experiments/config.yaml)
#   snakemake --cores 2 dose_response                     # positive control (~90 min on 2 cores)
#   snakemake study paper --cores 2 --configfile experiments/study-cpu.yaml   # the CPU miniature
#   snakemake study --workflow-profile experiments/profiles/slurm --configfile experiments/study.yaml
#   snakemake collapse_pilot --cores 2 --configfile experiments/collapse-cpu.yaml  # natural-collapse search
#   snakemake grids --cores 2 --configfile my-grids.yaml        # every entry of a grids: section
#   (a --configfile replaces experiments/config.yaml; it is not merged into it)
#
# Rules are grouped by stage in rules/*.smk (shared input functions in rules/common.smk); every
# experiment (GRPO grid, positive control, study, collapse search, grids: entries) in rules/experiments.smk.
# The config is validated twice before any job starts: its shape against
# experiments/schema/config.schema.yaml (which also holds every default), its meaning by
# rpa.workflow.pipeline.check_config.

import sys

from snakemake.exceptions import WorkflowError
from snakemake.utils import validate

from rpa.core.yamlfiles import YamlError, load_yaml
from rpa.workflow.pipeline import PipelineConfigError, check_config, schema_problem


# The default grid, unless a complete config came with --configfile (Snakemake would
# otherwise deep-merge the two, and a smaller grid would silently keep the default's
# entries). --config key=value overrides still apply on top of either.
if "models" not in config:

    configfile: "experiments/config.yaml"


try:
    # each config file read again by rpa's own YAML reader: a key written twice (Snakemake's loader keeps the last,
    # silently: a sampling block, a grid entry, a decision effect) is refused, naming the file, line and column
    for _configfile in [*workflow.configfiles, *([] if workflow.configfiles else ["experiments/config.yaml"])]:
        load_yaml(_configfile)
    validate(config, "experiments/schema/config.schema.yaml")  # also fills in the schema's defaults
    GRIDS = check_config(config)  # the grids' cells and process groups by section, made once (rules/common.smk)
    CELLS = GRIDS.cells
except WorkflowError:  # one line naming the key, not Snakemake's schema-and-config dump
    sys.exit(f"rpa config: error: {schema_problem(config, 'experiments/schema/config.schema.yaml')}")
except (PipelineConfigError, YamlError) as err:  # one line per invalid entry
    sys.exit(f"rpa config: error: {err}")


include: "rules/common.smk"


onstart:
    # before any job is submitted: a SLURM status command that can never see a job end is refused in one line
    from rpa.workflow.cluster import status_command_problem

    _problem = status_command_problem(getattr(workflow.executor_plugin, "name", None),
                                      getattr(workflow.executor_settings, "status_command", None))
    if _problem:
        raise SystemExit(f"rpa: error: {_problem}")


report: "rules/report/workflow.rst"  # snakemake --report report.html: the tables and figures with captions


rule all:
    input:
        probe_tables(),
        sampling_tables(),
        analysis_figures(),
        attribution_outputs(),


include: "rules/models.smk"
include: "rules/gate.smk"
include: "rules/probe.smk"
include: "rules/diagnose.smk"
include: "rules/attribution.smk"
include: "rules/analysis.smk"
include: "rules/experiments.smk"
include: "rules/paper.smk"
