"""The pipeline config's check: what the Snakefile runs before any job starts.

The JSON schema (``experiments/schema/config.schema.yaml``) checks the shape of the config;
:func:`check_config` checks what a schema cannot: region names, numerics combinations
that mean nothing, tiny-model specs, and cross references between sections. Every
problem names its entry (``probe.configs.fp32x: ...``) and all are reported at once. It expands
and validates every grid once and hands the workflow the cells (:class:`CheckedGrids`).

Each kind of experiment adds its own checks as hooks (:data:`rpa.workflow.experiments.KINDS`,
run by :func:`grid_problems`). The rest of what the workflow needs is by concern: the experiments of a config
(:mod:`rpa.workflow.experiments`, on :mod:`rpa.workflow.grid`), its models and job files
(:mod:`rpa.workflow.jobs`), what the scheduler is told (:mod:`rpa.workflow.resources`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rpa.core.numerics_config import NumericsConfig, NumericsConfigError
from rpa.core.regions import RegionError, parse_regions
from rpa.core.yamlfiles import load_yaml
from rpa.workflow.experiments import GRID_SECTIONS, checked_parts, grid_groups, grid_stage, kind_grids
from rpa.workflow.grid import WARM_START_INPUTS, Cell, Group, expand
from rpa.workflow.paper import REPLACED_KEYS, config_sections, sections_problem
from rpa.workflow.jobs import parity_options, probe_options, prompts_task
from rpa.workflow.resources import launch_problems


class PipelineConfigError(ValueError):
    """One or more entries of the pipeline config are invalid."""


def _tiny_problem(spec: Any) -> str | None:
    from rpa.sides.tiny import TinySpec

    if not isinstance(spec, dict):
        return "tiny must be a mapping of TinySpec fields"
    names = {f.name for f in fields(TinySpec)}
    unknown = sorted(set(spec) - names)
    if unknown:
        return f"unknown TinySpec field(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}"
    try:
        TinySpec(**spec).validate()
    except (TypeError, ValueError) as err:
        return str(err)
    return None


def _path_model_problem(path: Any) -> str | None:
    """Why a ``models.<name>.path`` entry cannot be used, checked at parse time from its
    ``config.json`` (no weights read): a local directory that is not there or not a checkpoint, a
    hub id (a relative path ``models/mine`` that is not there reads as one) the cache does not hold
    in offline mode (:func:`rpa.measure.inputs.hub_problem`) or the hub does not serve, or a family the
    aligned regions do not cover. A hub id the hub cannot be reached for from here (no connection,
    offline mode unset) is left to the job that loads it, which may run where the hub can be reached
    (and refuses it in one line where it cannot)."""
    from rpa.core.errors import HUB_ID_FORM, UserError, looks_like_hub_id

    if not isinstance(path, str) or not path:
        return f"must be a local directory or a hub id, got {path!r}"
    local = Path(path).expanduser()
    if not local.exists():
        if not looks_like_hub_id(path):
            return f"{path}: no such directory, and not {HUB_ID_FORM}"
        from huggingface_hub import constants

        from rpa.measure.inputs import hub_problem

        problem = hub_problem(path)
        if problem and constants.HF_HUB_OFFLINE:
            return f"{path}: {problem}"
        if problem:
            return None  # no connection from here: checked by the job (rpa.measure.inputs.check_model)
    elif not (local / "config.json").is_file():
        return f"{path}: a directory without config.json (not a Hugging Face checkpoint)"
    try:
        from transformers import AutoConfig

        from rpa.sides.trainer import check_config as check_family

        check_family(AutoConfig.from_pretrained(str(local) if local.exists() else path))
    except UserError as err:
        return f"{path}: {err}"
    except (OSError, ValueError) as err:
        return f"{path}: its config.json cannot be read ({type(err).__name__})"
    return None


def _gguf_problem(spec: Any) -> str | None:
    """Why a ``models.<name>.gguf`` mapping cannot be converted (the file is located now: a
    package not installed or a file not there is refused before any job starts)."""
    from rpa.core.errors import UserError
    from rpa.sides.convert import GgufSource

    if not isinstance(spec, dict):
        return "gguf must be a mapping of GgufSource fields (file, package, version, sha256)"
    names = {f.name for f in fields(GgufSource)}
    unknown = sorted(set(spec) - names)
    if unknown:
        return f"unknown field(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}"
    try:
        GgufSource(**spec).locate()
    except (TypeError, UserError) as err:
        return str(err)
    return None


def _model_probe_problems(config: dict[str, Any], name: str) -> list[str]:
    from rpa.core.errors import UserError
    from rpa.train.tasks import TaskSpec

    problems = []
    own = (config["models"][name].get("probe") or {}).get("configs")
    if own is not None:
        problems += _configs_problems(config, own, "its completions are the tokens every configuration scores")
    try:
        probe_options(config, name)
    except (ValueError, TypeError) as err:
        problems.append(str(err))
    task = prompts_task(config, name)
    if task is not None:
        names = {f.name for f in fields(TaskSpec)}
        unknown = sorted(set(task) - names)
        if unknown:
            problems.append(f"task: unknown field(s) {', '.join(unknown)}; valid: {', '.join(sorted(names))}")
        else:
            try:
                TaskSpec(**task)
            except (TypeError, UserError) as err:
                problems.append(f"task: {err}")
    return problems + [f"sampling: {p}" for p in _sampling_problems(config, name)]


def _sampling_problems(config: dict[str, Any], name: str) -> list[str]:
    """What is wrong with ``models.<name>.probe.sampling`` (the probe cells at other sampling settings)."""
    from rpa.core.errors import UserError
    from rpa.core.sampling import SamplingSettings

    sampling = (config["models"][name].get("probe") or {}).get("sampling")
    if not sampling:
        return []
    problems, labels = [], []
    for i, fields_ in enumerate(sampling["settings"]):
        try:
            labels.append(SamplingSettings(**fields_).label)
        except (TypeError, UserError) as err:
            problems.append(f"settings[{i}]: {err}")
    problems += [f"settings: {label} is given twice" for label in sorted({x for x in labels if labels.count(x) > 1})]
    return problems + _configs_problems(config, sampling["configs"], "samples at each setting")


def _dose_pilot_problems(config: dict[str, Any]) -> list[str]:
    """What is wrong with a dose pilot's rule (``dose_pilot``; its defaults filled in by the schema): a model or
    probe configuration it names that the config lacks, a candidate that perturbs nothing, ``low`` not below
    ``high``."""
    pilot = config.get("dose_pilot")
    if not pilot:
        return []
    problems = []
    if pilot["model"] not in (config.get("models") or {}):
        problems.append(f"dose_pilot.model: {pilot['model']!r} is not a name in models")
    configs = config["probe"]["configs"]
    problems += [f"dose_pilot: {c!r} is not a name in probe.configs" for c in [pilot["reference"], *pilot["candidates"]]
                 if c not in configs]
    problems += [f"dose_pilot.candidates: {c!r} has no sampler_perturbation (a dose perturbs the sampler)"
                 for c in pilot["candidates"] if c in configs and not configs[c].get("sampler_perturbation")]
    if pilot["low"] >= pilot["high"]:
        problems.append(f"dose_pilot: low ({pilot['low']}) must be below high ({pilot['high']})")
    return problems


def _configs_problems(config: dict[str, Any], names: list[str], sampler_role: str) -> list[str]:
    """What is wrong with a list of probe configuration ``names`` a model runs: a name not in
    ``probe.configs``, or the sampler missing (``sampler_role``: what it does for the others)."""
    sampler = config["probe"]["sampler"]
    problems = [f"configs: {c!r} is not a name in probe.configs" for c in names if c not in config["probe"]["configs"]]
    if sampler not in names:
        problems.append(f"configs: must include the sampler {sampler!r} (probe.sampler: {sampler_role})")
    return problems


def schema_problem(config: dict[str, Any], schema_path: str | Path) -> str:
    """The config's first violation of its JSON schema as one line: the key's path, what is wrong, and
    for a misspelt key the nearest valid one (Snakemake's own message prints the whole schema and
    config, ~840 lines for a misspelt section)."""
    import difflib

    import jsonschema

    schema = load_yaml(schema_path)
    error = jsonschema.exceptions.best_match(jsonschema.Draft202012Validator(schema).iter_errors(config))
    if error is None:
        return "the config does not match experiments/schema/config.schema.yaml"
    where = ".".join(map(str, error.absolute_path)) or "config"
    if error.validator == "additionalProperties":
        allowed = list((error.schema.get("properties") or {}))
        extra = [k for k in (error.instance or {}) if k not in allowed]
        replaced = [k for k in extra if not error.absolute_path and k in REPLACED_KEYS]
        if replaced:
            k = replaced[0]
            return (f"config: {k!r} was replaced by paper.sections: write `paper: {{sections: [{{kind: "
                    f"{REPLACED_KEYS[k]}, results: <its directory>}}]}}` (docs/pipeline.md)")
        hints = [f"{k!r} (did you mean {m[0]!r}?)" if (m := difflib.get_close_matches(str(k), allowed, n=1))
                 else repr(k) for k in extra]
        return f"{where}: unknown key(s) {', '.join(hints)}; valid: {', '.join(allowed)}"
    return f"{where}: {error.message.splitlines()[0][:200]}"


@dataclass(frozen=True)
class CheckedGrids:
    """What :func:`check_config` made of a config's grids, for the workflow to use as it is instead
    of expanding, validating and grouping them again."""

    cells: dict[str, list[Cell]]
    """Each section's cells (``GRID_SECTIONS``; empty where the config has none), each run config
    validated."""
    groups: dict[str, list[Group]]
    """Each section's cells by process (:func:`grid_groups`)."""


def check_config(config: dict[str, Any]) -> CheckedGrids:
    """Raise :class:`PipelineConfigError` listing every invalid entry of ``config``; else return
    its grids' cells and process groups by section."""
    problems: list[str] = []
    if not isinstance(config.get("results"), str) or not config["results"].strip():
        problems.append(f"results: must be a directory path (a string), got {config.get('results')!r}")
    for name, model in (config.get("models") or {}).items():
        if "path" in model:
            problem = _path_model_problem(model["path"])
            if problem:
                problems.append(f"models.{name}.path: {problem}")
        if "tiny" in model:
            problem = _tiny_problem(model["tiny"])
            if problem:
                problems.append(f"models.{name}.tiny: {problem}")
        if "gguf" in model:
            problem = _gguf_problem(model["gguf"])
            if problem:
                problems.append(f"models.{name}.gguf: {problem}")
        if model.get("probe"):
            problems += [f"models.{name}.probe: {p}" for p in _model_probe_problems(config, name)]
    problem = sections_problem(config_sections(config))
    if problem:
        problems.append(problem)
    problems += _dose_pilot_problems(config)
    try:
        if not parse_regions(config["parity"]["regions"]):
            problems.append("parity.regions: 'none' has nothing to check; use 'all' or a region subset")
    except RegionError as err:
        problems.append(f"parity.regions: {err}")
    try:
        parity_options(config)
    except (ValueError, TypeError) as err:
        problems.append(f"parity: {err}")
    configs = config["probe"]["configs"]
    for name, numerics in configs.items():
        try:
            NumericsConfig.from_dict(numerics)
        except NumericsConfigError as err:
            problems.append(f"probe.configs.{name}: {err}")
    sampler = config["probe"]["sampler"]
    if sampler not in configs:
        problems.append(f"probe.sampler: {sampler!r} is not a name in probe.configs")
    try:
        probe_options(config)
    except (ValueError, TypeError) as err:
        problems.append(f"probe: {err}")
    attribution = config.get("attribution") or {}
    for name in attribution.get("models") or []:
        if name not in (config.get("models") or {}):
            problems.append(f"attribution.models: {name!r} is not a name in models")
    for name in attribution.get("configs") or []:
        if name in configs and _valid_numerics(configs[name]) and \
                NumericsConfig.from_dict(configs[name]).trainer_precision_name != "bf16":
            problems.append(f"attribution.configs: {name!r} is not a BF16 configuration (the swap is of BF16 kernels)")
    for section, key in (("diagnose", "configs"), ("figures", "dlogp_vs_prob_configs"), ("attribution", "configs")):
        for name in (config.get(section) or {}).get(key) or []:
            if name not in configs:
                problems.append(f"{section}.{key}: {name!r} is not a name in probe.configs")
    cells: dict[str, list[Cell]] = {section: [] for section in GRID_SECTIONS}
    groups: dict[str, list[Group]] = {section: [] for section in GRID_SECTIONS}
    for section in GRID_SECTIONS:
        if config.get(section):
            found, cells[section] = grid_problems(config, section)
            problems += found
            if not found:  # the groups read every run's numerics
                try:
                    groups[section] = grid_groups(config, section, cells[section])
                except ValueError as err:
                    problems.append(f"{section}: {err}")
    if problems:
        raise PipelineConfigError("invalid pipeline config:\n  " + "\n  ".join(problems))
    return CheckedGrids(cells=cells, groups=groups)


def _valid_numerics(numerics: dict[str, Any]) -> bool:
    try:
        NumericsConfig.from_dict(numerics)
    except NumericsConfigError:
        return False
    return True


def _invalid_runs(cells: list[Cell], where) -> list[str]:
    """A problem line (``where(cell): error``) for every cell whose run config is invalid (each
    cell's :class:`~rpa.train.config.TrainConfig` is built here, once, and kept)."""
    from rpa.train.config import TrainConfigError

    failing: dict[str, list[str]] = {}  # one line per distinct error, not one per cell that repeats it
    for c in cells:
        try:
            c.run
        except TrainConfigError as err:
            failing.setdefault(str(err), []).append(where(c))
    return [f"{names[0]}{f' and {len(names) - 1} more' if len(names) > 1 else ''}: {err}"
            for err, names in failing.items()]


def grid_problems(config: dict[str, Any], kind: str) -> tuple[list[str], list[Cell]]:
    """What is wrong with the entries of a config's ``kind`` section, and its cells where nothing is: the
    kind's own checks of the section as written (:attr:`~rpa.workflow.experiments.Kind.before`; a ``grids:``
    entry of a preset kind: that kind's, on the entry: :func:`~rpa.workflow.experiments.checked_parts`),
    entries that do not expand, cells that name no model, invalid run configs, two cells in one directory,
    then the kind's checks of its cells (:attr:`~rpa.workflow.experiments.Kind.after`)."""
    from rpa.train.config import TrainConfig, TrainConfigError

    parts = checked_parts(config, kind)
    problems = [p for spec, part, key, _ in parts if spec.before for p in spec.before(config, part, key)]
    problems += launch_problems(config, kind)
    if problems:
        return problems, []
    by_entry = {name: (spec, key) for spec, _, key, name in parts}

    def where(c: Cell) -> str:  # a cell as the problems of its part of the config name it
        spec, key = by_entry.get(grid_stage(c)) or by_entry[None]
        return spec.where(c, key)

    try:
        cells = [c for grid in kind_grids(config, kind) for c in expand(grid)]
        checked = {name for spec, _, _, name in parts if spec.check_inits}
        # a fixed warm-start folder's run config, before its cells'
        for init in {c.init.dir: c.init for c in cells if c.init and {None, grid_stage(c)} & checked}.values():
            TrainConfig.from_dict(dict(init.config))
    except (OSError, KeyError, ValueError, TrainConfigError) as err:  # YamlError, RegionError: ValueErrors
        return [f"{kind}: {err}"], []
    problems = [f"{where(c)}: model {c.model!r} is not a name in models" for c in cells
                if c.model not in config["models"]]
    if problems:
        return sorted(set(problems)), []
    invalid = _invalid_runs(cells, where)
    problems += invalid
    names = [c.name for c in cells]
    if len(set(names)) != len(names):
        problems.append(f"{kind}: two cells share a directory (repeated labels)")
    inits: dict[str, Any] = {}
    for c in cells:  # a warm-start folder is one checkpoint: the cells that share it must agree on what it reads
        read = None if c.init is None else {k: c.init.config.get(k) for k in WARM_START_INPUTS}
        if c.init is not None and inits.setdefault(c.init.dir, read) != read:
            problems.append(f"{where(c)}: its shared warm start {c.init.dir} has other settings than another "
                            f"cell's there (put {{seed}} or {{digest}} in shared_warm_start.directory)")
            break
    for spec, part, key, name in parts:
        mine = [c for c in cells if name is None or grid_stage(c) == name]
        if spec.after and mine:
            problems += spec.after(config, part, key, mine, not invalid)
    return problems, cells
