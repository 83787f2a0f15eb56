"""What the Snakefile needs from rpa: semantic config checks, grid expansion and the jobs' files.

The JSON schema (``experiments/schema/config.schema.yaml``) checks the shape of the config;
:func:`check_config` checks what a schema cannot: region names, numerics combinations
that mean nothing, tiny-model specs, and cross references between sections. Every
problem names its entry (``probe.configs.fp32x: ...``) and all are reported at once.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rpa.core.numerics_config import NumericsConfig, NumericsConfigError, perturbation_label
from rpa.core.yamlfiles import YamlError, load_yaml
from rpa.core.regions import RegionError, parse_regions, region_label
from rpa.workflow.grid import BASE, CELL, Axis, Cell, Grid, Group, SharedWarmStart, expand, group_cells


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
    ``config.json`` (no weights read): a local directory that is not there or not a checkpoint, or a
    family the aligned regions do not cover. A hub id is checked where it is loaded."""
    from rpa.core.errors import UserError, looks_like_hub_id

    if not isinstance(path, str) or not path:
        return f"must be a local directory or a hub id, got {path!r}"
    local = Path(path).expanduser()
    if not local.exists():
        return None if looks_like_hub_id(path) else f"{path}: no such directory, and not a hub id of the form org/name"
    if not (local / "config.json").is_file():
        return f"{path}: a directory without config.json (not a Hugging Face checkpoint)"
    try:
        from transformers import AutoConfig

        from rpa.sides.trainer import check_config as check_family

        check_family(AutoConfig.from_pretrained(str(local)))
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


def _options(cls: type, section: dict[str, Any]):
    """The dataclass ``cls`` of the options a config section names."""
    from rpa.core.fieldtypes import build

    return build(cls, {f.name: section[f.name] for f in fields(cls) if f.name in section})


MODEL_KINDS = ("tiny", "path", "gguf")
"""What a ``models`` entry is: built here (``tiny``: :class:`~rpa.sides.tiny.TinySpec` fields),
converted here from a GGUF file (``gguf``: :class:`~rpa.sides.convert.GgufSource` fields), or
loaded where it is (``path``: a local directory or hub id)."""


def model_kind(spec: dict[str, Any]) -> str:
    """``tiny``, ``gguf`` or ``path``: the one kind key of a ``models`` entry (the schema requires one)."""
    return next(k for k in MODEL_KINDS if k in spec)


def model_configs(config: dict[str, Any], model: str) -> list[str]:
    """The probe configurations ``model`` runs, in ``probe.configs`` order: its own
    ``models.<name>.probe.configs`` where given (the tiny models of the main job keep only the
    parity gate's and a few), else every one."""
    own = (config["models"][model].get("probe") or {}).get("configs")
    return [name for name in config["probe"]["configs"] if own is None or name in own]


def model_probe(config: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The ``probe:`` section with the model's own ``models.<name>.probe`` options on top (a
    real model samples longer completions from a task's prompts than the tiny ones)."""
    own = dict(((config["models"].get(model) or {}).get("probe") or {}) if model else {})
    own.pop("task", None)  # its prompts reach the probe as a prompts file (:func:`prompts_task`)
    own.pop("configs", None)  # which configurations, not an option of each (:func:`model_configs`)
    return {**config["probe"], **own}


def prompts_task(config: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The task (TaskSpec fields) whose prompts ``model``'s probe samples from, or None (the
    built-in prompts); ``num_prompts`` and ``seed`` default to the probe's ``prompts`` and ``seed``."""
    task = ((config["models"][model].get("probe") or {}).get("task"))
    if task is None:
        return None
    probe = model_probe(config, model)
    return {"num_prompts": probe.get("prompts", 16), "seed": probe.get("seed", 0), **task}


def prompts_flags(task: dict[str, Any]) -> str:
    """``rpa prompts`` flags for a task mapping (TaskSpec fields, ``name`` as ``--task``)."""
    return tiny_flags({("task" if k == "name" else k): v for k, v in task.items()})


def gguf_flags(spec: dict[str, Any]) -> str:
    """``rpa convert`` flags for a ``models.<name>.gguf`` mapping (``file`` as ``--gguf``)."""
    return tiny_flags({("gguf" if k == "file" else k): v for k, v in spec.items()})


def probe_options(config: dict[str, Any], model: str | None = None):
    """The :class:`~rpa.measure.probe.ProbeOptions` of the config's ``probe:`` section, with
    ``model``'s own options on top (:func:`model_probe`)."""
    from rpa.measure.probe import ProbeOptions

    return _options(ProbeOptions, model_probe(config, model))


def parity_options(config: dict[str, Any]):
    """The :class:`~rpa.measure.parity.ParityOptions` of the config's ``parity:`` section."""
    from rpa.measure.parity import ParityOptions

    return _options(ParityOptions, config["parity"])


def _job(options: dict[str, Any]) -> dict[str, Any]:
    """A job file's mapping: tuples as YAML lists (``yaml.safe_dump`` writes no tuples)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


def numerics_options(numerics: dict[str, Any], device: str) -> dict[str, Any]:
    """One ``probe.configs`` entry as ``rpa probe``/``rpa diagnose`` options (their ``--config`` keys:
    the flags' names), checked by :class:`NumericsConfig` and read back by the CLI into the same one."""
    n = NumericsConfig.from_dict({**numerics, "device": device}).to_dict()
    bits = (n.pop("sampler_perturbation") or {}).get("mantissa_bits")
    return {**n, "sampler_mantissa_bits": bits}


def probe_job(config: dict[str, Any], model: str, numerics: str, completions: str | None, device: str,
              name: str | None = None, prompts_file: str | None = None) -> dict:
    """The ``rpa probe --config`` file of one probe cell: model (``model`` is where it loads from,
    ``name`` its entry in ``models``), numerics, every probe option (the model's own on top) and
    the prompts file its task's prompts were written to."""
    import dataclasses

    options = dataclasses.asdict(probe_options(config, name))
    if prompts_file is not None:
        options["prompts_file"] = prompts_file
    return _job({"model": model, **numerics_options(config["probe"]["configs"][numerics], device),
                 **options, "completions": completions})


def diagnose_job(config: dict[str, Any], model: str, numerics: str, completions: str, device: str) -> dict:
    """The ``rpa diagnose --config`` file of one diagnosis cell."""
    return _job({"model": model, **numerics_options(config["probe"]["configs"][numerics], device),
                 "sequences": config["diagnose"]["sequences"], "completions": completions})


def attribution_job(config: dict[str, Any], model: str, numerics: str, completions: str, device: str) -> dict:
    """The ``rpa attribute --config`` file of one attribution cell."""
    return _job({"model": model, **numerics_options(config["probe"]["configs"][numerics], device),
                 "sequences": config["attribution"]["sequences"], "completions": completions})


def parity_job(config: dict[str, Any], model: str, device: str) -> dict:
    """The ``rpa parity --config`` file of one model's gate: the options the ``parity:`` section
    can set (the schema's), from :class:`~rpa.measure.parity.ParityOptions`."""
    return _job({"model": model, "regions": config["parity"]["regions"],
                 "compiled": parity_options(config).compiled, "device": device})


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


GRID_SECTIONS = ("train", "dose", "study", "search", "grids")
"""The config sections that are grids of training runs (:mod:`rpa.workflow.grid`): ``grids`` holds
entries in the one shape (:func:`grid_of`) as written; the others are sections of their own that
:func:`train_spec`, :func:`dose_spec`, :func:`study_spec` and :func:`search_grids` turn into it."""
MULTI_GRID_SECTIONS = ("search", "grids")
"""The sections of several grids, one per entry (:func:`grid_entries`)."""


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
                NumericsConfig.from_dict(configs[name]).precision != "bf16":
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


def tiny_flags(spec: dict[str, Any]) -> str:
    """``rpa tiny`` flags for a ``models.<name>.tiny`` mapping."""
    flags: list[str] = []
    for key, value in spec.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return shlex.join(flags)


def model_location(config: dict[str, Any], name: str) -> str:
    """Where a model of ``models`` is loaded from: built or converted here (``tiny``, ``gguf``), or
    its ``path``."""
    spec = config["models"][name]
    return spec["path"] if model_kind(spec) == "path" else f"{config['results']}/models/{name}"


def _located_models(config: dict[str, Any]) -> dict[str, str]:
    """Every name of ``models`` -> where it loads from (a grid's ``model: NAME``)."""
    return {name: model_location(config, name) for name in config.get("models") or {}}


def grid_of(config: dict[str, Any], section: str, spec: dict[str, Any], stage: str | None = None,
            bases: dict[str, Any] | None = None) -> Grid:
    """One grid entry as a :class:`~rpa.workflow.grid.Grid`: the one shape every experiment has --
    an entry of ``grids:`` or a stage of ``search.stages`` as written, and what :func:`train_spec`,
    :func:`dose_spec` and :func:`study_spec` make of their sections. Its keys (docs/pipeline.md#grids):

    * ``base`` (a run YAML), ``overrides`` (run-config overrides of every cell), ``seeds``;
    * ``axes``: axis -> {label: run-config overrides}, every combination a cell, merged in the order written;
    * ``exclude``: [{axis: [labels]}], the label combinations left out; ``path``: a cell's directory as a
      template over its labels (default: the labels joined by ``/``); ``replace``: keys an axis value sets
      whole;
    * ``shared_warm_start``: false; true (one ``rpa warm-start`` per model, warm-start settings and seed,
      ``<section>/init/<model>-ws<steps>-seed<N>-<digest>``); or {``level``, ``directory`` (under the
      results), ``only_with_steps``} (:class:`~rpa.workflow.grid.SharedWarmStart`).

    A ``grids:`` entry takes every key but ``replace`` and the mapping form of ``shared_warm_start``
    (fixed warm-start folders, which the positive control and the study use: their runs rerun when the
    warm start is rebuilt, where a digest-named one is the same checkpoint). Cells are ``<section>/[<stage>/]<labels>/seed<N>`` under the results; ``bases``: run YAMLs already
    read, by path (each read once)."""
    bases = {} if bases is None else bases
    if spec["base"] not in bases:
        bases[spec["base"]] = load_yaml(spec["base"])
    shared = spec.get("shared_warm_start") or False
    if shared is True:
        shared = {"level": CELL, "directory": f"{section}/init/{{model_name}}-ws{{steps}}-seed{{seed}}-{{digest}}"}
    warm_start = None if not shared else SharedWarmStart(
        level=shared.get("level", CELL), directory=f"{config['results']}/{shared['directory']}",
        only_with_steps=shared.get("only_with_steps", True))
    return Grid(name=section if stage is None else f"{section}/{stage}", base=bases[spec["base"]],
                overrides=spec.get("overrides") or {},
                axes=tuple(Axis(axis, values) for axis, values in (spec.get("axes") or {}).items()),
                seeds=tuple(spec["seeds"]),
                exclude=tuple({axis: tuple(labels) for axis, labels in rule.items()} for rule in spec.get("exclude") or ()),
                models=_located_models(config), prefix=() if stage is None else (stage,), path=spec.get("path"),
                warm_start=warm_start, replaced=tuple(spec.get("replace") or ()))


def grid_stage(cell: Cell) -> str | None:
    """The entry of a section of several grids (``search``, ``grids``) a cell belongs to: its grid
    is ``<section>/<entry>``; None for a section of one grid."""
    return cell.grid.partition("/")[2] or None


def train_spec(config: dict[str, Any]) -> dict[str, Any]:
    """The ``train:`` section as a grid entry (:func:`grid_of`): settings x region sets x seeds,
    ``<model>/<setting>/<regions>/seed<N>``."""
    train = config["train"]
    return {"base": train["base"], "overrides": {"model": train["model"]}, "seeds": train["seeds"],
            "axes": {"setting": train["settings"],
                     "regions": {region_label(r): {"numerics": {"regions": r}} for r in train["regions"]}},
            "path": f"{train['model']}/{{setting}}/{{regions}}"}


def train_grid(config: dict[str, Any]) -> Grid:
    """The GRPO grid of one model (:func:`train_spec`)."""
    return grid_of(config, "train", train_spec(config))


def train_points(config: dict[str, Any], cells: list[Cell] | None = None) -> list[dict[str, Any]]:
    """Every run of the GRPO grid: ``model``, ``setting``, ``regions`` (label), ``seed`` and its
    full run config (base <- setting <- regions, merged key by key)."""
    return [{"model": c.model, "setting": c.labels["setting"], "regions": c.labels["regions"], "seed": c.seed,
             "config": c.config} for c in (cells if cells is not None else expand(train_grid(config)))]


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


# ------------------------------------------------------------------ the dose-response grid


def dose_label(dose) -> str:
    """Directory / table name of a dose: ``bf16-none`` (no dose) or ``perturb-mantissa<K>``."""
    return "bf16-none" if dose in (None, "none") else perturbation_label(int(dose))


def dose_spec(config: dict[str, Any]) -> dict[str, Any]:
    """The ``dose:`` section as a grid entry (:func:`grid_of`), the positive control: arms (the
    sampler-only doses on the base's numerics, then the x-axis anchors, each a numerics configuration
    in full) x IS correction x old-logprob source x seeds, ``<arm>/<is_correction>-<old_logprobs>/seed<N>``,
    every cell from one shared warm start (``dose/init``). Left out: an IS correction with the
    sampler's old logprobs (the correction would be applied twice: TrainConfig refuses it), and the
    anchors with a correction (an anchor runs uncorrected)."""
    dose = config["dose"]
    base = load_yaml(dose["base"])
    doses = {dose_label(d): {"numerics": {
        **(base.get("numerics") or {}), "regions": "none", "precision": "bf16",
        **({} if d in (None, "none") else {"sampler_perturbation": {"mantissa_bits": int(d)}})}}
        for d in dose["doses"]}
    anchors = {name: {"numerics": numerics} for name, numerics in (dose.get("anchors") or {}).items()}
    corrections = list(dict.fromkeys([*dose["is_corrections"], "off"]))
    applied = [c for c in corrections if c != "off"]
    exclude = [{"is_correction": applied, "old_logprobs": ["sampler"]}, {"arm": list(anchors), "is_correction": applied}]
    if "off" not in dose["is_corrections"]:  # listed for the anchors only
        exclude.append({"arm": list(doses), "is_correction": ["off"]})
    return {"base": dose["base"], "overrides": {"model": dose["model"]}, "seeds": dose["seeds"],
            "axes": {"arm": {**doses, **anchors},
                     "is_correction": {c: {"is_correction": c} for c in corrections},
                     "old_logprobs": {o: {"old_logprobs": o} for o in dose["old_logprobs"]}},
            "exclude": exclude, "path": "{arm}/{is_correction}-{old_logprobs}", "replace": ["numerics"],
            "shared_warm_start": {"level": BASE, "directory": "dose/init", "only_with_steps": False}}


def dose_grid(config: dict[str, Any]) -> Grid:
    """The positive control (:func:`dose_spec`)."""
    return grid_of(config, "dose", dose_spec(config))


def dose_points(config: dict[str, Any], cells: list[Cell] | None = None) -> list[dict[str, Any]]:
    """Every cell of the positive control: ``cell`` (its directory under ``dose/``), ``arm``
    (dose or anchor label), ``dose`` (mantissa bits or None), ``is_correction``,
    ``old_logprobs``, ``seed`` and the full run config."""
    bits = {dose_label(d): None if d in (None, "none") else int(d) for d in config["dose"]["doses"]}
    return [{"cell": c.name, "arm": c.labels["arm"], "dose": bits.get(c.labels["arm"]),
             "is_correction": c.labels["is_correction"], "old_logprobs": c.labels["old_logprobs"], "seed": c.seed,
             "config": c.config} for c in (cells if cells is not None else expand(dose_grid(config)))]


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


# ------------------------------------------------------------------------------ the study


def study_spec(config: dict[str, Any]) -> dict[str, Any]:
    """The ``study:`` section as a grid entry (:func:`grid_of`): models (the base with each size's
    settings) x arms x seeds, ``<model>/<arm>/seed<N>``; a model's own arms (``study.size_arms``) only
    on that model. Models with a shared warm start (``warm_start.steps`` > 0) start from
    ``study/<model>/init``."""
    study = config["study"]
    sizes, own = study.get("sizes") or {}, study.get("size_arms") or {}
    arms = {name: {} for name in study_arm_names(study)}
    for model in study["models"]:
        arms.update(study_arms(study, model))
    owners = {arm: {m for m in study["models"] if arm in (own.get(m) or {})}
              for arm in arms if arm not in study["arms"]}
    return {"base": study["base"], "seeds": study["seeds"],
            "axes": {"model": {m: {**(sizes.get(m) or {}), "model": m} for m in study["models"]},
                     "arm": {arm: overrides or {} for arm, overrides in arms.items()}},
            "exclude": [{"model": [m for m in study["models"] if m not in models], "arm": [arm]}
                        for arm, models in owners.items()],
            "shared_warm_start": {"level": "model", "directory": "study/{model}/init"}}


def study_grid(config: dict[str, Any]) -> Grid:
    """The study (:func:`study_spec`)."""
    return grid_of(config, "study", study_spec(config))


def study_points(config: dict[str, Any], cells: list[Cell] | None = None) -> list[dict[str, Any]]:
    """Every cell of the study (:func:`study_grid`): ``cell`` (``<model>/<arm>/seed<N>``, its
    directory under ``study/``), ``model``, ``arm``, ``seed`` and the full run config: the base,
    then the model's size settings, then the arm's overrides, merged key by key."""
    return [{"cell": c.name, "model": c.labels["model"], "arm": c.labels["arm"], "seed": c.seed, "config": c.config}
            for c in (cells if cells is not None else expand(study_grid(config)))]


def grid_groups(config: dict[str, Any], section: str, cells: list[Cell]) -> list[Group]:
    """The cells of a grid section by process (:func:`rpa.workflow.grid.group_cells`), by the
    section's ``runs_per_process`` and ``arms_per_process`` (an entry's own in a section of several
    grids: each search stage, each entry of ``grids``)."""
    if section in MULTI_GRID_SECTIONS:
        return [g for name, knobs in grid_entries(config, section).items()
                for g in group_cells([c for c in cells if grid_stage(c) == name],
                                     int(knobs.get("runs_per_process", 1)), int(knobs.get("arms_per_process", 1)))]
    knobs = config[section]
    return group_cells(cells, int(knobs.get("runs_per_process", 1)), int(knobs.get("arms_per_process", 1)))


def study_groups(config: dict[str, Any], cells: list[Cell] | None = None) -> dict[str, list[str]]:
    """The study's cells by process (:func:`grid_groups`): group name -> its cells' names. Named
    ``<model>/<arm>[+<arm>...]/seed<N>[+<N>...]`` (``mini-xs/none/seed0+1+2``; a group of one is
    its cell's name). ``cells``: the study's, where already expanded."""
    cells = cells if cells is not None else expand(study_grid(config))
    return {g.name: [c.name for c in g.cells] for g in grid_groups(config, "study", cells)}


def study_priorities(config: dict[str, Any], groups: dict[str, list[str]]) -> dict[str, int]:
    """Snakemake's order among ready jobs: a study job's priority (a group of :func:`study_groups`)
    is the minutes of training it runs (its ``runtime`` resource), a model's warm start and
    tiny-model build have those of all the model's jobs (what they unlock). The longest work then
    starts first and the short jobs (probes, parity, tables; priority 0) fill in at the end, so the
    wall time on a few cores comes close to the total work divided by the cores. Keys: group names
    and model names."""
    own = {name: study_resources(config, name.split("/")[0], len(cells))["runtime"] for name, cells in groups.items()}
    unlocks = {model: sum(m for name, m in own.items() if name.split("/")[0] == model)
               for model in config["study"]["models"]}
    return {**own, **unlocks}


def study_arms(study: dict[str, Any], model: str) -> dict[str, Any]:
    """The arms ``model`` runs: every arm of ``study.arms``, then its own ``study.size_arms``
    (e.g. the sampler-perturbation positive control on the smallest size only)."""
    return {**study["arms"], **((study.get("size_arms") or {}).get(model) or {})}


def study_arm_names(study: dict[str, Any]) -> list[str]:
    """Every arm of the study in table order: the common arms, then the per-size ones."""
    names = list(study["arms"])
    for arms in (study.get("size_arms") or {}).values():
        names += [a for a in (arms or {}) if a not in names]
    return names


def study_resources(config: dict[str, Any], model: str, runs: int = 1) -> dict[str, Any]:
    """Scheduler resources of one process of ``runs`` training runs of ``model``
    (``study.resources`` gives one run's, by size; the runtime adds up)."""
    defaults = {"gpu": 0, "mem_mb": 8000, "runtime": 120, "cpus_per_task": 2, "launch": "single"}
    res = {**defaults, **((config["study"].get("resources") or {}).get(model) or {})}
    return {**res, "runtime": res["runtime"] * runs}


def gpu_shortfall(config: dict[str, Any], lent: int | None) -> str | None:
    """One line naming the jobs of ``config`` that need more GPUs than the machine lends
    (``lent``: Snakemake's ``gpu`` resource, ``--resources gpu=N`` or a profile's ``resources``;
    None: no limit, as under SLURM), or None. Snakemake would cap such a job's resource and start
    it, and the job would then wait for GPUs the machine does not have (:mod:`rpa.workflow.gpus`)."""
    if lent is None:
        return None
    needs = {"gpus_per_job": int(config.get("gpus_per_job") or 0),
             "train.resources.gpu": int(((config.get("train") or {}).get("resources") or {}).get("gpu", 0))}
    if config.get("study"):
        needs.update({f"study.resources.{m}.gpu": int(study_resources(config, m)["gpu"])
                      for m in config["study"]["models"]})
    needs.update({f"grids.{name}.resources.gpu": int((spec.get("resources") or {}).get("gpu", 0))
                  for name, spec in (config.get("grids") or {}).items()})
    over = [f"{key} {count}" for key, count in needs.items() if count > lent]
    if not over:
        return None
    return (f"this machine lends {lent} GPU(s) (Snakemake's gpu resource: --resources gpu=N or the profile's), "
            f"fewer than a job needs: {', '.join(over)}; drop those sizes from study.models here, or run them "
            f"where they fit (SLURM)")


BYTES_PER_PARAMETER = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one weight as vLLM holds it, by ``numerics.precision``."""


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


# ------------------------------------------------------------------ the natural-collapse search

SEARCH_STAGES = ("pilot", "grid", "ablation", "lever")
"""Stages of ``search`` (each optional): the pilot picks a setting, the grid tests it under
the decision rule written in the config, then the ablation (if it collapsed) or a further
lever (if it did not)."""


def search_grids(config: dict[str, Any]) -> list[Grid]:
    """Each stage of the natural-collapse search (``search.stages``) as a grid (:func:`grid_of`): the
    search's ``base`` under the stage's entry; cells ``<stage>/<label>/.../seed<N>``. With
    ``shared_warm_start``, every arm of a seed that changes none of what a warm start reads starts
    from one ``rpa warm-start`` (``search/init/<model>-ws<steps>-seed<N>-<digest>``), as it would
    from its own identical warm start, without repeating it."""
    search, bases = config["search"], {}
    return [grid_of(config, "search", {"base": search["base"], **stage}, name, bases)
            for name, stage in (search.get("stages") or {}).items()]


def search_stage(cell: Cell) -> str:
    """The search stage a cell of :func:`search_grids` belongs to (its grid is ``search/<stage>``)."""
    return grid_stage(cell)


def named_grids(config: dict[str, Any]) -> list[Grid]:
    """Each entry of ``grids:`` (:func:`grid_of`): cells ``grids/<name>/<label>/.../seed<N>``."""
    bases: dict[str, Any] = {}
    return [grid_of(config, "grids", spec, name, bases) for name, spec in (config.get("grids") or {}).items()]


def grid_entries(config: dict[str, Any], section: str) -> dict[str, dict[str, Any]]:
    """The entries of a section of several grids, by name: ``search.stages`` or ``grids``."""
    return (config.get("search") or {}).get("stages") or {} if section == "search" else config.get("grids") or {}


def search_points(config: dict[str, Any], stage: str | None = None,
                  cells: list[Cell] | None = None) -> list[dict[str, Any]]:
    """Every cell of the search (of ``stage`` only, if given): ``cell`` (its directory under
    ``search/``), ``stage``, ``labels`` (axis -> label), ``seed``, ``model`` (as the config names
    it), ``init`` (its shared warm start: ``name``, ``dir``, ``config``; or None) and the full run
    config."""
    if cells is None:
        cells = [c for grid in search_grids(config) for c in expand(grid)]
    return [{"cell": c.name, "stage": search_stage(c), "labels": dict(c.labels), "seed": c.seed,
             "model": c.model, "init": None if c.init is None else
             {"name": c.init.name, "dir": c.init.dir, "config": dict(c.init.config)}, "config": c.config}
            for c in cells if stage is None or search_stage(c) == stage]


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
    return problems, cells
