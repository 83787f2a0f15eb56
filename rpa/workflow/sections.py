"""Every grid section of a pipeline config as an entry of the one grid shape, and each entry as a grid.

:func:`grid_of` makes a :class:`~rpa.workflow.grid.Grid` of one entry (an entry of ``grids:`` or a
search stage as written; what :func:`train_spec`, :func:`dose_spec` and :func:`study_spec` make of
their sections); the ``*_points`` functions list a section's cells as the rules and tables name
them, and :func:`grid_groups` splits a section's cells into processes.
"""

from __future__ import annotations

from typing import Any

from rpa.core.numerics_config import perturbation_label
from rpa.core.regions import parse_regions, region_label
from rpa.core.yamlfiles import load_yaml
from rpa.workflow.grid import BASE, CELL, Axis, Cell, Grid, Group, SharedWarmStart, expand, group_cells
from rpa.workflow.jobs import model_location


GRID_SECTIONS = ("train", "dose", "study", "search", "grids")
"""The config sections that are grids of training runs (:mod:`rpa.workflow.grid`): ``grids`` holds
entries in the one shape (:func:`grid_of`) as written; the others are sections of their own that
:func:`train_spec`, :func:`dose_spec`, :func:`study_spec` and :func:`search_grids` turn into it."""


MULTI_GRID_SECTIONS = ("search", "grids")
"""The sections of several grids, one per entry (:func:`grid_entries`)."""


def _located_models(config: dict[str, Any]) -> dict[str, str]:
    """Every name of ``models`` -> where it loads from (a grid's ``model: NAME``)."""
    return {name: model_location(config, name) for name in config.get("models") or {}}


def _base(path: str, bases: dict[str, Any]) -> dict[str, Any]:
    """The run YAML ``path``, read once: ``bases`` keeps what was read, by path."""
    if path not in bases:
        bases[path] = load_yaml(path)
    return bases[path]


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
    base = _base(spec["base"], {} if bases is None else bases)
    shared = spec.get("shared_warm_start") or False
    if shared is True:
        shared = {"level": CELL, "directory": f"{section}/init/{{model_name}}-ws{{steps}}-seed{{seed}}-{{digest}}"}
    warm_start = None if not shared else SharedWarmStart(
        level=shared.get("level", CELL), directory=f"{config['results']}/{shared['directory']}",
        only_with_steps=shared.get("only_with_steps", True))
    return Grid(name=section if stage is None else f"{section}/{stage}", base=base,
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


def grid_entries(config: dict[str, Any], section: str) -> dict[str, dict[str, Any]]:
    """The entries of a section of several grids, by name: ``search.stages`` or ``grids``."""
    return (config.get("search") or {}).get("stages") or {} if section == "search" else config.get("grids") or {}


def train_spec(config: dict[str, Any]) -> dict[str, Any]:
    """The ``train:`` section as a grid entry (:func:`grid_of`): settings x region sets x seeds,
    ``<model>/<setting>/<regions>/seed<N>``."""
    train = config["train"]
    return {"base": train["base"], "overrides": {"model": train["model"]}, "seeds": train["seeds"],
            "axes": {"setting": train["settings"],
                     "regions": {region_label(parse_regions(r)): {"numerics": {"regions": r}} for r in train["regions"]}},
            "path": f"{train['model']}/{{setting}}/{{regions}}"}


def train_grid(config: dict[str, Any]) -> Grid:
    """The GRPO grid of one model (:func:`train_spec`)."""
    return grid_of(config, "train", train_spec(config))


def train_points(config: dict[str, Any], cells: list[Cell] | None = None) -> list[dict[str, Any]]:
    """Every run of the GRPO grid: ``model``, ``setting``, ``regions`` (label), ``seed`` and its
    full run config (base <- setting <- regions, merged key by key)."""
    return [{"model": c.model, "setting": c.labels["setting"], "regions": c.labels["regions"], "seed": c.seed,
             "config": c.config} for c in (cells if cells is not None else expand(train_grid(config)))]


def dose_label(dose) -> str:
    """Directory / table name of a dose: ``bf16-none`` (no dose) or ``perturb-mantissa<K>``."""
    return "bf16-none" if dose in (None, "none") else perturbation_label(int(dose))


def dose_spec(config: dict[str, Any], bases: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``dose:`` section as a grid entry (:func:`grid_of`), the positive control: arms (the
    sampler-only doses on the base's numerics, then the x-axis anchors, each a numerics configuration
    in full) x IS correction x old-logprob source x seeds, ``<arm>/<is_correction>-<old_logprobs>/seed<N>``,
    every cell from one shared warm start (``dose/init``). Left out: an IS correction with the
    sampler's old logprobs (the correction would be applied twice: TrainConfig refuses it), and the
    anchors with a correction (an anchor runs uncorrected)."""
    dose = config["dose"]
    base = _base(dose["base"], {} if bases is None else bases)
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
    exclude = [rule for rule in exclude if all(rule.values()) and  # what the grid has: nothing to leave out else
               ("sampler" in dose["old_logprobs"] or "old_logprobs" not in rule)]
    return {"base": dose["base"], "overrides": {"model": dose["model"]}, "seeds": dose["seeds"],
            "axes": {"arm": {**doses, **anchors},
                     "is_correction": {c: {"is_correction": c} for c in corrections},
                     "old_logprobs": {o: {"old_logprobs": o} for o in dose["old_logprobs"]}},
            "exclude": exclude, "path": "{arm}/{is_correction}-{old_logprobs}", "replace": ["numerics"],
            "shared_warm_start": {"level": BASE, "directory": "dose/init", "only_with_steps": False}}


def dose_grid(config: dict[str, Any]) -> Grid:
    """The positive control (:func:`dose_spec`)."""
    bases: dict[str, Any] = {}  # the base is read once, for the doses' numerics and the grid
    return grid_of(config, "dose", dose_spec(config, bases), bases=bases)


def dose_points(config: dict[str, Any], cells: list[Cell] | None = None) -> list[dict[str, Any]]:
    """Every cell of the positive control: ``cell`` (its directory under ``dose/``), ``arm``
    (dose or anchor label), ``dose`` (mantissa bits or None), ``is_correction``,
    ``old_logprobs``, ``seed`` and the full run config."""
    bits = {dose_label(d): None if d in (None, "none") else int(d) for d in config["dose"]["doses"]}
    return [{"cell": c.name, "arm": c.labels["arm"], "dose": bits.get(c.labels["arm"]),
             "is_correction": c.labels["is_correction"], "old_logprobs": c.labels["old_logprobs"], "seed": c.seed,
             "config": c.config} for c in (cells if cells is not None else expand(dose_grid(config)))]


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


def search_points(config: dict[str, Any], stage: str | None = None,
                  cells: list[Cell] | None = None) -> list[dict[str, Any]]:
    """Every cell of the search (of ``stage`` only, if given): ``cell`` (its directory under
    ``search/``), ``stage``, ``labels`` (axis -> label), ``seed``, ``model`` (as the config names
    it), ``init`` (its shared warm start: ``name``, ``dir``, ``config``; or None) and the full run
    config."""
    if cells is None:
        cells = [c for grid in search_grids(config) for c in expand(grid)]
    return [{"cell": c.name, "stage": grid_stage(c), "labels": dict(c.labels), "seed": c.seed,
             "model": c.model, "init": None if c.init is None else
             {"name": c.init.name, "dir": c.init.dir, "config": dict(c.init.config)}, "config": c.config}
            for c in cells if stage is None or grid_stage(c) == stage]


def named_grids(config: dict[str, Any]) -> list[Grid]:
    """Each entry of ``grids:`` (:func:`grid_of`): cells ``grids/<name>/<label>/.../seed<N>``."""
    bases: dict[str, Any] = {}
    return [grid_of(config, "grids", spec, name, bases) for name, spec in (config.get("grids") or {}).items()]


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
