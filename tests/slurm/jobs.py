"""Every job of a dry run under the SLURM profile, and the sbatch line snakemake-executor-plugin-slurm
submits for it, formed by the plugin's own code (``validate_slurm_extra``, ``Executor.get_partition_arg``,
``get_submit_command``, ``set_gres_string``, as its ``Executor.run_job`` calls them). Used by
tests/test_slurm.py and tests/slurm/sbatch_test_only.py."""

from types import SimpleNamespace

from snakemake_executor_plugin_slurm import Executor
from snakemake_executor_plugin_slurm.submit_string import get_submit_command
from snakemake_executor_plugin_slurm.utils import set_gres_string
from snakemake_executor_plugin_slurm.validation import validate_slurm_extra

from tests.conftest import REPO, tail
from tests.test_pipeline import snakemake


def _value(text: str):
    return int(text) if text.lstrip("-").isdigit() else text


def _resources(line: str) -> dict:
    out = {}
    for part in line.split(": ", 1)[1].split(", "):
        key, _, value = part.partition("=")
        out[key] = _value(value)
    return out


def dry_run_jobs(tmp_path, *targets, configfile="experiments/study.yaml"):
    """Every job of the dry run under the SLURM profile: rule, wildcards, threads, resources."""
    proc = snakemake(*targets, "-n", "--workflow-profile", "experiments/profiles/slurm", "--configfile", configfile,
                     "--config", f"results={tmp_path / 'r'}")
    assert proc.returncode == 0, tail(proc)
    jobs, current = [], None
    for line in (proc.stdout + proc.stderr).splitlines():
        line = line.strip()
        if line.startswith(("rule ", "localrule ")):
            current = {"rule": line.split()[1].rstrip(":"), "resources": {}, "threads": 1, "wildcards": ""}
            jobs.append(current)
        elif current is not None and line.startswith("resources:"):
            current["resources"] = _resources(line)
        elif current is not None and line.startswith("threads:"):
            current["threads"] = int(line.split()[1])
        elif current is not None and line.startswith("wildcards:"):
            current["wildcards"] = line.split(": ", 1)[1]
    return jobs


def local_rules(configfile="experiments/study.yaml") -> set[str]:
    """The rules Snakemake runs itself (never submitted): its own ``Workflow.is_local``."""
    from pathlib import Path

    from snakemake.api import SnakemakeApi
    from snakemake.settings.types import ConfigSettings, DAGSettings, OutputSettings, ResourceSettings, StorageSettings

    with SnakemakeApi(OutputSettings(quiet=True)) as api:
        wf = api.workflow(resource_settings=ResourceSettings(), storage_settings=StorageSettings(),
                          config_settings=ConfigSettings(configfiles=[REPO / configfile],
                                                         config={"results": "/tmp/rpa-slurm-test"}),
                          snakefile=REPO / "Snakefile", workdir=Path(REPO))
        wf.dag(DAGSettings(targets={"study"}))
        workflow = wf._workflow
        # Workflow.is_local without its `local_exec` (true under the local executor this API uses)
        return {rule.name for rule in workflow.rules if rule.group is None and
                (rule.name in workflow._localrules or rule.norun or rule.is_template_engine)}


class _Resources(dict):
    """A job's resources as the plugin reads them: ``.get(key)`` and ``.key``."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def sbatch_line(job: dict, workdir: str = "/work") -> str:
    """The sbatch command line the plugin's ``Executor.run_job`` would submit for ``job`` (without
    ``--wrap``): its validation, its partition choice, ``get_submit_command``, then ``set_gres_string``."""
    fake = SimpleNamespace(resources=_Resources(job["resources"]), threads=job["threads"], name=job["rule"])
    validate_slurm_extra(fake)  # raises on what the plugin forbids in slurm_extra
    # the plugin's own partition choice; no partition file, and no sinfo here: its fallback is no -p
    executor = SimpleNamespace(_partitions=None, _fallback_partition="", logger=None)
    params = {"run_uuid": "uuid", "slurm_logfile": "/tmp/%j.log", "comment_str": f"rule_{job['rule']}",
              "account": "", "partition": Executor.get_partition_arg(executor, fake), "workdir": workdir}
    return get_submit_command(fake, params) + set_gres_string(fake)
