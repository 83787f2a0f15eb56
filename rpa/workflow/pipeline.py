"""The pipeline config's check: what the Snakefile runs before any job starts.

The JSON schema (``experiments/schema/config.schema.yaml``) checks the shape of the config;
:func:`check_config` checks what a schema cannot: region names, numerics combinations
that mean nothing, tiny-model specs, and cross references between sections. Every
problem names its entry (``probe.configs.fp32x: ...``) and all are reported at once. It expands
and validates every grid once and hands the workflow the cells (:class:`CheckedGrids`).

The rest of what the workflow needs is by concern: the grids of a config (:mod:`rpa.workflow.sections`,
on :mod:`rpa.workflow.grid`), its models and job files (:mod:`rpa.workflow.jobs`), what the scheduler
is told (:mod:`rpa.workflow.resources`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rpa.core.numerics_config import NumericsConfig, NumericsConfigError
from rpa.core.regions import RegionError, parse_regions
from rpa.core.yamlfiles import YamlError, load_yaml
from rpa.workflow.grid import Cell, Grid, Group, expand
from rpa.workflow.jobs import parity_options, probe_options, prompts_task
from rpa.workflow.resources import BYTES_PER_PARAMETER, study_resources
from rpa.workflow.sections import (GRID_SECTIONS, SEARCH_STAGES, dose_grid, dose_label, grid_groups, named_grids,
                                   search_grids, search_points, study_arm_names, study_arms, study_grid, train_grid)


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
        problems += [f"configs: {c!r} is not a name in probe.configs" for c in own if c not in config["probe"]["configs"]]
        sampler = config["probe"]["sampler"]
        if sampler not in own:
            problems.append(f"configs: must include the sampler {sampler!r} (probe.sampler: its completions are the "
                            f"tokens every configuration scores)")
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
    checks = {"train": _train_problems, "dose": _dose_problems, "study": _study_problems, "search": _search_problems,
              "grids": _grids_problems}
    cells: dict[str, list[Cell]] = {section: [] for section in GRID_SECTIONS}
    groups: dict[str, list[Group]] = {section: [] for section in GRID_SECTIONS}
    for section in GRID_SECTIONS:
        if config.get(section):
            found, cells[section] = checks[section](config)
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


def _train_problems(config: dict[str, Any]) -> tuple[list[str], list[Cell]]:
    train = config["train"]
    if train["model"] not in config.get("models", {}):
        return [f"train.model: {train['model']!r} is not a name in models"], []
    try:
        cells = expand(train_grid(config))
    except (OSError, RegionError, YamlError) as err:
        return [f"train: {err}"], []
    return _invalid_runs(cells, lambda c: f"train.settings.{c.labels['setting']} (regions {c.labels['regions']}, "
                                          f"seed {c.seed})"), cells


def _dose_problems(config: dict[str, Any]) -> tuple[list[str], list[Cell]]:
    from rpa.train.config import TrainConfig, TrainConfigError

    dose = config["dose"]
    if dose["model"] not in config.get("models", {}):
        return [f"dose.model: {dose['model']!r} is not a name in models"], []
    arms = [dose_label(d) for d in dose["doses"]] + list(dose.get("anchors") or {})
    if len(set(arms)) != len(arms):
        return ["dose: two cells share a directory (a dose repeated, or an anchor named like a dose)"], []
    try:
        cells = expand(dose_grid(config))
        for init in {c.init.dir: c.init for c in cells if c.init}.values():
            TrainConfig.from_dict(dict(init.config))
    except (OSError, TrainConfigError, ValueError) as err:
        return [f"dose: {err}"], []
    return _invalid_runs(cells, lambda c: f"dose cell {c.name}"), cells


def study_memory_problems(config: dict[str, Any], cells: list[Cell]) -> list[str]:
    """One line per model and arm whose colocated vLLM cannot hold its weights in its share of one
    GPU: ``study.parameters`` x the precision's bytes (:data:`BYTES_PER_PARAMETER`) / the tensor-parallel
    ranks, against ``vllm_gpu_memory_utilization`` x ``study.gpu_memory_gb`` (the share vLLM takes;
    its KV cache needs room on top). Nothing is checked where either figure is missing."""
    study = config["study"]
    memory, sizes = study.get("gpu_memory_gb"), study.get("parameters") or {}
    if not memory:
        return []
    problems, seen = [], set()
    for c in cells:
        model, arm = c.labels["model"], c.labels["arm"]
        if (model, arm) in seen or model not in sizes:
            continue
        seen.add((model, arm))
        cfg = c.run
        if cfg.rollouts != "vllm":  # no engine: the trainer samples
            continue
        precision, count = cfg.numerics.precision, sizes[model]
        weights = count * BYTES_PER_PARAMETER[precision] / cfg.vllm_tensor_parallel_size / 1e9
        share = cfg.vllm_gpu_memory_utilization * memory
        if weights >= share:
            split = f" / {cfg.vllm_tensor_parallel_size} ranks" if cfg.vllm_tensor_parallel_size > 1 else ""
            problems.append(
                f"study.arms.{arm} ({model}): vLLM's {precision} weights, {weights:.1f} GB ({count:.3g} "
                f"parameters x {BYTES_PER_PARAMETER[precision]} bytes{split}), do not fit its share of one "
                f"{memory:g} GB GPU (vllm_gpu_memory_utilization {cfg.vllm_gpu_memory_utilization:g}: "
                f"{share:.1f} GB); raise the arm's vllm_gpu_memory_utilization or run it on smaller sizes only "
                f"(study.size_arms)")
    return problems


def _study_problems(config: dict[str, Any]) -> tuple[list[str], list[Cell]]:
    from rpa.train.config import TrainConfig, TrainConfigError

    study = config["study"]
    problems = [f"study.models: {m!r} is not a name in models" for m in study["models"]
                if m not in config.get("models", {})]
    problems += [f"study.sizes: {m!r} is not in study.models" for m in (study.get("sizes") or {})
                 if m not in study["models"]]
    problems += [f"study.resources: {m!r} is not in study.models" for m in (study.get("resources") or {})
                 if m not in study["models"]]
    problems += [f"study.size_arms: {m!r} is not in study.models" for m in (study.get("size_arms") or {})
                 if m not in study["models"]]
    reference = study.get("reference_arm", "none")
    if reference not in study_arm_names(study):
        import difflib

        near = difflib.get_close_matches(str(reference), study_arm_names(study), n=1)
        problems.append(f"study.reference_arm: {reference!r} is not an arm of study.arms"
                        + (f" (did you mean {near[0]!r}?)" if near else ""))
    problems += [f"study.parameters: {m!r} is not in study.models" for m in (study.get("parameters") or {})
                 if m not in study["models"]]
    problems += [f"study.size_arms.{m}.{a}: also a name in study.arms" for m, arms in
                 (study.get("size_arms") or {}).items() for a in (arms or {}) if a in study["arms"]]
    first: dict[str, tuple[str, Any]] = {}  # a per-size arm is one arm of the grid: the same overrides on each size
    for m, arms in (study.get("size_arms") or {}).items():
        for a, overrides in (arms or {}).items():
            if a in first and (overrides or {}) != first[a][1]:
                problems.append(f"study.size_arms.{m}.{a}: also an arm of {first[a][0]!r} with other overrides; "
                                f"name the two arms differently")
            first.setdefault(a, (m, overrides or {}))
    for knob in ("runs_per_process", "arms_per_process"):
        if int(study.get(knob, 1)) > 1:
            problems += [f"study.{knob}: {study[knob]}, but {m!r} launches with "
                         f"{study_resources(config, m)['launch']!r}: a multi-process launch holds one run"
                         for m in study["models"] if study_resources(config, m)["launch"] != "single"]
    if problems:
        return problems, []
    try:
        cells = expand(study_grid(config))
        inits = {c.labels["model"]: c.init for c in cells}  # a model's cells share one warm start, or none
        for init in inits.values():
            if init is not None:
                TrainConfig.from_dict(dict(init.config))
    except (OSError, TrainConfigError, ValueError) as err:
        return [f"study: {err}"], []
    invalid = _invalid_runs(cells, lambda c: f"study.arms.{c.labels['arm']} ({c.labels['model']}, seed {c.seed})")
    problems += invalid
    if not invalid:
        problems += study_memory_problems(config, cells)
    # the probe measures the engine training samples from: eager and compiled vLLM round differently
    probe_compiled = bool((config.get("probe") or {}).get("compiled", False))
    for model in study["models"]:
        modes = {not bool(c.config.get("vllm_enforce_eager", False)) for c in cells if c.labels["model"] == model}
        if modes and modes != {probe_compiled}:
            train_mode = {frozenset({True}): "compiled", frozenset({False}): "eager"}.get(frozenset(modes),
                                                                                        "both eager and compiled")
            problems.append(f"probe.compiled: {str(probe_compiled).lower()}, but the study's runs of {model!r} "
                            f"sample with vLLM {train_mode} (vllm_enforce_eager); the probe must score with the "
                            f"engine mode training uses")
    shared_init = any(init is not None for init in inits.values())
    for arm, overrides in {a: o for m in study["models"] for a, o in study_arms(study, m).items()}.items():
        shared = [k for k in ("warm_start", "task") if k in (overrides or {})]
        if shared and shared_init:
            problems.append(f"study.arms.{arm}: overrides {', '.join(shared)}, which the shared warm start of a "
                            f"model fixes for every arm; set it in the base or study.sizes")
    return problems, cells


def _entries_problems(config: dict[str, Any], section: str, grids: list[Grid]) -> tuple[list[str], list[Cell]]:
    """What is wrong with the grids of a section of several (``search``, ``grids``): cells that name
    no model, invalid run configs, two cells in one directory."""
    where = "search cell" if section == "search" else "grids cell"
    try:
        cells = [c for grid in grids for c in expand(grid)]
    except (OSError, ValueError, KeyError) as err:
        return [f"{section}: {err}"], []
    problems = [f"{where} {c.name}: model {c.model!r} is not a name in models" for c in cells
                if c.model not in config["models"]]
    if problems:
        return sorted(set(problems)), []
    problems += _invalid_runs(cells, lambda c: f"{where} {c.name}")
    names = [c.name for c in cells]
    if len(set(names)) != len(names):
        problems.append(f"{section}: two cells share a directory (repeated labels)")
    return problems, cells


def _grids_problems(config: dict[str, Any]) -> tuple[list[str], list[Cell]]:
    try:
        grids = named_grids(config)
    except (OSError, YamlError, ValueError) as err:
        return [f"grids: {err}"], []
    return _entries_problems(config, "grids", grids)


def _search_problems(config: dict[str, Any]) -> tuple[list[str], list[Cell]]:
    search = config["search"]
    problems = [f"search.stages.{s}: not a stage; valid: {', '.join(SEARCH_STAGES)}"
                for s in (search.get("stages") or {}) if s not in SEARCH_STAGES]
    if problems:
        return problems, []
    try:
        grids = search_grids(config)
    except (OSError, YamlError, ValueError) as err:
        return [f"search: {err}"], []
    problems, cells = _entries_problems(config, "search", grids)
    if not cells:
        return problems, cells
    points = search_points(config, cells=cells)
    rule = search.get("decision") or {}
    arms = {label for p in points if p["stage"] == "grid" for label in [p["labels"].get(rule.get("arm_axis", ""))]}
    for key in ("reference_arm", "control_arm"):
        if "grid" in (search.get("stages") or {}) and rule.get(key) not in arms:
            problems.append(f"search.decision.{key}: {rule.get(key)!r} is not a label of the grid's "
                            f"{rule.get('arm_axis')!r} axis")
    for name, q in (rule.get("questions") or {}).items() if "grid" in (search.get("stages") or {}) else ():
        problems += [f"search.decision.questions.{name}.{side}: {q[side]!r} is not a label of the grid's "
                     f"{rule.get('arm_axis')!r} axis" for side in ("a", "b") if q[side] not in arms]
    for name, e in (rule.get("effects") or {}).items():
        weights = e.get("contrast") or {}
        problems += [f"search.decision.effects.{name}: {arm!r} is not a label of the grid's "
                     f"{rule.get('arm_axis')!r} axis" for arm in weights if arm not in arms]
        if abs(sum(weights.values())) > 1e-9:
            problems.append(f"search.decision.effects.{name}: the contrast's weights sum to {sum(weights.values()):g}, "
                            "not 0 (an effect compares arms)")
    for name, c in ((search.get("post_hoc") or {}).get("comparisons") or {}).items():
        named = [*(c["a"] if isinstance(c["a"], list) else [c["a"]]), c["b"]]
        if len(set(named)) < len(named):
            problems.append(f"search.post_hoc.comparisons.{name}: an arm named twice (a: {c['a']!r}, b: {c['b']!r}); "
                            "a comparison takes each arm once")
        problems += [f"search.post_hoc.comparisons.{name}: {arm!r} is not a label of the grid's "
                     f"{rule.get('arm_axis')!r} axis" for arm in named if arm not in arms]
    return problems, cells
