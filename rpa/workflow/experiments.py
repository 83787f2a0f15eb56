"""Every experiment of a pipeline config as grid entries of one shape, and what each kind adds to it.

An experiment is a grid entry (:func:`grid_of`: base, overrides, axes, seeds, exclude, path, replace,
shared_warm_start; docs/pipeline.md#grids). A config section holds entries of one *kind*; :data:`KINDS`
maps each kind to what it adds to the one grid machinery: its entry builder (the ``train:``, ``dose:`` and
``study:`` sections and the search stages are presets that write entries: :mod:`rpa.workflow.presets`),
its extra config checks (hooks of
:func:`rpa.workflow.pipeline.check_config`), its manifest's extra keys (:func:`manifest`) and its analysis
(the module its tables and figures come from, run by rules/experiments.smk). Cells are
``<kind>/[<entry>/]<labels>/seed<N>`` under the results. A ``grids:`` entry may take a preset kind
(:data:`PRESETS`: ``kind: dose``, ``kind: study``) and the keys of its section: the ``dose:`` and ``study:``
sections are shorthand for such an entry, whose cells are ``grids/<entry>/<labels>/seed<N>`` and whose tables
and figures are under ``tables/grids/<entry>/`` and ``figures/grids/<entry>/``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from rpa.workflow.grid import CELL, Axis, Cell, Grid, Group, SharedWarmStart, expand, group_cells
from rpa.workflow.jobs import model_location
from rpa.workflow.presets import (SEARCH_STAGES, dose_label, dose_spec, read_base, search_entries, study_arm_names,
                                  study_arms, study_spec, train_spec)


BYTES_PER_PARAMETER = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Bytes of one weight as vLLM holds it, by ``numerics.precision``."""


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

    Every key is open to a ``grids:`` entry; a fixed warm-start folder (the mapping form, as the positive
    control and the study use) makes its runs rerun when the warm start is rebuilt, where a digest-named
    one is the same checkpoint (:func:`ancient_start`). Cells are ``<section>/[<stage>/]<labels>/seed<N>``
    under the results; ``bases``: run YAMLs already
    read, by path (each read once)."""
    base = read_base(spec["base"], {} if bases is None else bases)
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


def entries(config: dict[str, Any], kind: str, bases: dict[str, Any] | None = None) -> dict[str | None, dict[str, Any]]:
    """The grid entries of a config's ``kind`` section, by name (None: the section's one entry), in the one
    shape :func:`grid_of` reads; empty where the config has no such section."""
    if not config.get(kind):
        return {}
    return KINDS[kind].entries(config, {} if bases is None else bases)


def kind_grids(config: dict[str, Any], kind: str) -> list[Grid]:
    """Each entry of ``kind`` as a :class:`~rpa.workflow.grid.Grid` (each base read once)."""
    bases: dict[str, Any] = {}
    return [grid_of(config, kind, spec, name, bases) for name, spec in entries(config, kind, bases).items()]


def written_entries(config: dict[str, Any], kind: str) -> dict[str | None, dict[str, Any]]:
    """The entries of a config's ``kind`` section as written, by name (None: the section's one entry; a search
    stage without the search's base); empty where the config has no such section."""
    node = config.get(kind)
    if not node:
        return {}
    at = KINDS[kind].entries_at
    if at is None:
        return {None: node}
    for key in at:
        node = node.get(key) or {}
    return dict(node)


def entry_key(kind: str, name: str | None) -> str:
    """Where an entry is written in the config, as a problem names it: ``train``, ``search.stages.grid``,
    ``grids.lr-sweep``."""
    at = KINDS[kind].entries_at
    return kind if at is None else ".".join((kind, *at, name))


def entry_of(config: dict[str, Any], kind: str, cell: Cell) -> dict[str, Any]:
    """The entry ``cell`` of ``kind`` belongs to, as written (a search stage: without the search's base)."""
    return written_entries(config, kind)[grid_stage(cell)]


def grid_groups(config: dict[str, Any], kind: str, cells: list[Cell]) -> list[Group]:
    """The cells of a kind by process (:func:`rpa.workflow.grid.group_cells`), by the
    ``runs_per_process`` and ``arms_per_process`` of their entry (each search stage, each entry of
    ``grids``; the section's own for train, dose, study)."""
    by_entry: dict[str | None, list[Cell]] = {}
    for c in cells:
        by_entry.setdefault(grid_stage(c), []).append(c)
    return [g for entry_cells in by_entry.values()
            for knobs in [entry_of(config, kind, entry_cells[0])]
            for g in group_cells(entry_cells, int(knobs.get("runs_per_process", 1)),
                                 int(knobs.get("arms_per_process", 1)))]


def ancient_start(config: dict[str, Any], kind: str, cell: Cell) -> bool:
    """Whether a finished run of ``cell`` keeps its start as ``ancient`` input (rules/experiments.smk): a
    search stage's or ``grids:`` entry's model or digest-named warm start (``<kind>/init/<...>-<digest>``)
    is the same checkpoint when rebuilt, so committed runs restored into place
    (analysis.restore_reference) are not made stale by it; a fixed warm-start folder (``dose/init``,
    ``study/<model>/init``, those of a ``grids:`` entry of a preset kind, a ``grids:`` entry's mapping form
    without ``{digest}``) can be rebuilt from changed settings, which must rerun its runs; the GRPO grid's
    start is its model."""
    written = entry_of(config, kind, cell) if kind in MULTI_GRID_SECTIONS else {}
    if kind not in MULTI_GRID_SECTIONS or entry_kind(kind, written) != kind:
        return False
    shared = written.get("shared_warm_start")
    return not isinstance(shared, dict) or "{digest}" in shared.get("directory", "")


# ---------------------------------------------------------------- each kind's config checks
# Hooks of rpa.workflow.pipeline.check_config, which does what every kind needs: expand its entries, refuse
# cells that name no model, invalid run configs and two cells in one directory. Each hook checks one part of
# the config as written (a section, or a `grids:` entry of a preset kind: :func:`checked_parts`) and names
# its problems by `key`, where that part is written (``study``, ``grids.sizes``); `before` sees the part as
# written (problems there stop the kind's check); `after` sees its expanded, valid cells.


def _train_before(config: dict[str, Any], train: dict[str, Any], key: str) -> list[str]:
    model = train["model"]
    return [] if model in config.get("models", {}) else [f"{key}.model: {model!r} is not a name in models"]


def _dose_before(config: dict[str, Any], dose: dict[str, Any], key: str) -> list[str]:
    if dose["model"] not in config.get("models", {}):
        return [f"{key}.model: {dose['model']!r} is not a name in models"]
    arms = [dose_label(d) for d in dose["doses"]] + list(dose.get("anchors") or {})
    if len(set(arms)) != len(arms):
        return [f"{key}: two cells share a directory (a dose repeated, or an anchor named like a dose)"]
    return []


def _study_before(config: dict[str, Any], study: dict[str, Any], key: str) -> list[str]:
    problems = [f"{key}.models: {m!r} is not a name in models" for m in study["models"]
                if m not in config.get("models", {})]
    for part in ("sizes", "resources", "size_arms"):
        problems += [f"{key}.{part}: {m!r} is not in {key}.models" for m in (study.get(part) or {})
                     if m not in study["models"]]
    reference = study.get("reference_arm", "none")
    if reference not in study_arm_names(study):
        import difflib

        near = difflib.get_close_matches(str(reference), study_arm_names(study), n=1)
        problems.append(f"{key}.reference_arm: {reference!r} is not an arm of {key}.arms"
                        + (f" (did you mean {near[0]!r}?)" if near else ""))
    problems += [f"{key}.parameters: {m!r} is not in {key}.models" for m in (study.get("parameters") or {})
                 if m not in study["models"]]
    problems += [f"{key}.size_arms.{m}.{a}: also a name in {key}.arms" for m, arms in
                 (study.get("size_arms") or {}).items() for a in (arms or {}) if a in study["arms"]]
    first: dict[str, tuple[str, Any]] = {}  # a per-size arm is one arm of the grid: the same overrides on each size
    for m, arms in (study.get("size_arms") or {}).items():
        for a, overrides in (arms or {}).items():
            if a in first and (overrides or {}) != first[a][1]:
                problems.append(f"{key}.size_arms.{m}.{a}: also an arm of {first[a][0]!r} with other overrides; "
                                f"name the two arms differently")
            first.setdefault(a, (m, overrides or {}))
    return problems


def study_memory_problems(study: dict[str, Any], cells: list[Cell], key: str = "study") -> list[str]:
    """One line per model and arm of a study (its keys as written, where ``key`` names it) whose colocated vLLM
    cannot hold its weights in its share of one GPU: ``parameters`` x the precision's bytes
    (:data:`BYTES_PER_PARAMETER`) / the tensor-parallel ranks, against ``vllm_gpu_memory_utilization`` x
    ``gpu_memory_gb`` (the share vLLM takes; its KV cache needs room on top). Nothing is checked where either
    figure is missing."""
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
                f"{key}.arms.{arm} ({model}): vLLM's {precision} weights, {weights:.1f} GB ({count:.3g} "
                f"parameters x {BYTES_PER_PARAMETER[precision]} bytes{split}), do not fit its share of one "
                f"{memory:g} GB GPU (vllm_gpu_memory_utilization {cfg.vllm_gpu_memory_utilization:g}: "
                f"{share:.1f} GB); raise the arm's vllm_gpu_memory_utilization or run it on smaller sizes only "
                f"({key}.size_arms)")
    return problems


def _study_after(config: dict[str, Any], study: dict[str, Any], key: str, cells: list[Cell],
                 runs_valid: bool) -> list[str]:
    problems = study_memory_problems(study, cells, key) if runs_valid else []
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
    shared_init = any(c.init is not None for c in cells)
    for arm, overrides in {a: o for m in study["models"] for a, o in study_arms(study, m).items()}.items():
        shared = [k for k in ("warm_start", "task") if k in (overrides or {})]
        if shared and shared_init:
            problems.append(f"{key}.arms.{arm}: overrides {', '.join(shared)}, which the shared warm start of a "
                            f"model fixes for every arm; set it in the base or {key}.sizes")
    return problems


def _search_before(config: dict[str, Any], search: dict[str, Any], key: str) -> list[str]:
    return [f"{key}.stages.{s}: not a stage; valid: {', '.join(SEARCH_STAGES)}"
            for s in (search.get("stages") or {}) if s not in SEARCH_STAGES]


def _search_after(config: dict[str, Any], search: dict[str, Any], key: str, cells: list[Cell],
                  runs_valid: bool) -> list[str]:
    rule = search.get("decision") or {}
    has_grid = "grid" in (search.get("stages") or {})
    grid = [c for c in cells if grid_stage(c) == "grid"]
    problems = decision_problems(rule, grid, f"{key}.decision") if has_grid else []
    arms = {c.labels.get(rule.get("arm_axis", "")) for c in grid}
    for name, c in ((search.get("post_hoc") or {}).get("comparisons") or {}).items():
        named = [*(c["a"] if isinstance(c["a"], list) else [c["a"]]), c["b"]]
        if len(set(named)) < len(named):
            problems.append(f"{key}.post_hoc.comparisons.{name}: an arm named twice (a: {c['a']!r}, b: {c['b']!r}); "
                            "a comparison takes each arm once")
        problems += [f"{key}.post_hoc.comparisons.{name}: {arm!r} is not a label of the grid's "
                     f"{rule.get('arm_axis')!r} axis" for arm in named if arm not in arms]
    return problems


def decision_problems(rule: dict[str, Any], cells: list[Cell], key: str) -> list[str]:
    """What is wrong with a grid's registered decision ``rule`` over its ``cells``, one line each: axes and arms it
    names that the grid does not have (an unknown arm axis is one line, not one per arm), a question comparing an
    arm with itself, an effect whose weights are not finite, all zero or do not sum to 0, a collapse count no arm's
    seeds can reach."""
    import math

    axes = {axis for c in cells for axis in c.labels}
    arm_axis = rule.get("arm_axis")
    if arm_axis not in axes:
        return [f"{key}.arm_axis: {arm_axis!r} is not an axis of the grid ({', '.join(sorted(axes)) or 'none'})"]
    problems = []
    if "rung_axis" in rule and rule["rung_axis"] not in axes:
        problems.append(f"{key}.rung_axis: {rule['rung_axis']!r} is not an axis of the grid ({', '.join(sorted(axes))})")
    arms = {c.labels[arm_axis] for c in cells}
    named = f"a label of the grid's {arm_axis!r} axis ({', '.join(sorted(arms))})"
    for name in ("reference_arm", "control_arm", "treatment_arm"):
        if (name != "treatment_arm" or name in rule) and rule.get(name) not in arms:
            problems.append(f"{key}.{name}: {rule.get(name)!r} is not {named}")
    for name, q in (rule.get("questions") or {}).items():
        problems += [f"{key}.questions.{name}.{side}: {q[side]!r} is not {named}" for side in ("a", "b")
                     if q[side] not in arms]
        if q["a"] == q["b"]:
            problems.append(f"{key}.questions.{name}: compares {q['a']!r} with itself")
    for name, e in (rule.get("effects") or {}).items():
        weights = e.get("contrast") or {}
        problems += [f"{key}.effects.{name}: {arm!r} is not {named}" for arm in weights if arm not in arms]
        bad = {arm: w for arm, w in weights.items()
               if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w)}
        if bad:
            problems.append(f"{key}.effects.{name}: weights must be finite numbers, got {bad}")
        elif not any(weights.values()):
            problems.append(f"{key}.effects.{name}: every weight is 0 (an effect compares arms)")
        elif abs(sum(weights.values())) > 1e-9:
            problems.append(f"{key}.effects.{name}: the contrast's weights sum to {sum(weights.values()):g}, not 0 "
                            "(an effect compares arms)")
    dose = rule.get("dose_response")
    if dose:
        doses = dose.get("doses") or []
        problems += [f"{key}.dose_response.doses: {a!r} is not {named}" for a in doses if a not in arms]
        if len(set(doses)) != len(doses):
            problems.append(f"{key}.dose_response.doses: an arm is listed twice ({', '.join(doses)})")
        floor = dose.get("floor_arm") or rule.get("control_arm")
        if floor in doses:
            problems.append(f"{key}.dose_response.floor_arm: {floor!r} is also a dose (the floor is no-mismatch FP32, "
                            "apart from the curve)")
        elif "floor_arm" in dose and floor not in arms:
            problems.append(f"{key}.dose_response.floor_arm: {floor!r} is not {named}")
    rung = rule.get("rung_axis")
    runs: dict[tuple, int] = {}
    for c in cells:  # the runs of one arm at one rung: what a collapse count is taken over
        group = (c.labels[arm_axis], c.labels.get(rung))
        runs[group] = runs.get(group, 0) + 1
    most = max(runs.values(), default=0)
    wanted = rule.get("min_reference_collapsed")
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > most:
        problems.append(f"{key}.min_reference_collapsed: {wanted} is more than any arm's runs ({most}): no outcome "
                        "could reach it")
    return problems


# ---------------------------------------------------------------- each kind's manifest


def manifest(config: dict[str, Any], kind: str, entry: str | None, cells: list[Cell]) -> dict[str, Any]:
    """The manifest of one entry (``<kind>/[<entry>/]manifest.json``, docs/pipeline.md#manifests): its
    cells and axes (labels in order) and its kind's own keys (:attr:`Kind.manifest`; a ``grids:`` entry of a
    preset kind: that kind's, and ``grid``, its name), in the one schema :func:`rpa.workflow.manifest.manifest`
    writes."""
    from rpa.workflow.manifest import manifest as render

    cells = [c for c in cells if grid_stage(c) == entry]
    bases: dict[str, Any] = {}
    spec = entries(config, kind, bases)[entry]
    axes = {axis: list(labels) for axis, labels in spec["axes"].items()}
    written = written_entries(config, kind)[entry]
    own = entry_kind(kind, written)
    extras = KINDS[own].manifest(config, written, entry, axes)
    return render(own, cells, extras if own == kind else {**extras, "grid": entry})


def _plain_manifest(config, written, entry, axes):
    return {"axes": axes}


def _dose_manifest(config, dose, entry, axes):
    bits = {dose_label(d): None if d in (None, "none") else int(d) for d in dose["doses"]}
    return {"axes": axes, "doses": {arm: bits.get(arm) for arm in axes["arm"]}}


def _study_manifest(config, study, entry, axes):
    # the study's keys as they were before the one schema (committed manifests keep their bytes): no axes
    return {"models": study["models"], "arms": study_arm_names(study), "seeds": study["seeds"],
            "reference_arm": study["reference_arm"], "label": study["label"],
            "probe_configs": list(config["probe"]["configs"])}


def _search_manifest(config, written, stage, axes):
    search = config["search"]
    return {"stage": stage, "label": search.get("label", "natural-collapse search"), "axes": axes,
            "pilot_rule": search.get("pilot_rule", {}), "decision": search.get("decision", {}),
            **({"post_hoc": search["post_hoc"]} if search.get("post_hoc") and stage == "grid" else {})}


def _grids_manifest(config, written, name, axes):
    return {"grid": name, "axes": axes, **({"decision": written["decision"]} if written.get("decision") else {})}


def _grids_after(config: dict[str, Any], written: dict[str, Any], key: str, cells: list[Cell],
                 runs_valid: bool) -> list[str]:
    """A plain ``grids:`` entry's decision (``decision``, as a search stage's: :func:`decision_problems`)."""
    if not written.get("decision"):
        return []
    name = next((n for n, w in (config.get("grids") or {}).items() if w is written), None)
    own = [c for c in cells if name is None or grid_stage(c) == name]
    return decision_problems(written["decision"], own, f"grids.{name}.decision" if name else f"{key}.decision")


# ---------------------------------------------------------------- the kinds


@dataclass(frozen=True)
class Kind:
    """What one kind of experiment adds to the one grid machinery (rules/experiments.smk reads it: one
    manifest rule for every kind, one aggregate rule and one target per kind, and one aggregate rule per
    preset kind over the ``grids:`` entries of that kind)."""

    name: str
    """Its config section, and its folder under the results."""
    entries: Callable[[dict[str, Any], dict[str, Any]], dict[str | None, dict[str, Any]]]
    """The section's grid entries (config, bases read) -> {entry name or None: entry}."""
    where: Callable[[Cell, str], str]
    """How a config problem names a cell (the cell, where its part of the config is: :func:`checked_parts`)."""
    manifest: Callable[..., dict[str, Any]]
    """(config, its part as written, entry name, axes) -> the kind's own keys of its manifest (:func:`manifest`)."""
    analysis: str
    """The command (Snakemake's shell format; ``{params.results}``, ``{params.format}``, ``{params.tables}``
    (the folder of its tables), ``{params.scope}`` (:attr:`entry_args` for a ``grids:`` entry, else nothing),
    ``{output.<name>}``, ``{wildcards.entry}``, ``{log}``) of the analysis that writes its tables and figures."""
    outputs: dict[str, str]
    """The aggregate's outputs by name, under the results (``{entry}``: a named entry's, ``{format}``: the
    figures' format)."""
    report: tuple[str, ...]
    """The outputs ``snakemake --report`` shows (every table and figure; caption rules/report/<kind>.rst)."""
    category: str
    """The report's heading for them."""
    target: str
    """The target rule of its outputs (``{entry}``: one per name of ``target_entries``)."""
    log: str
    """The aggregate's log under the results' ``logs/``."""
    inputs: tuple[str, ...] = ()
    """Further inputs of the aggregate under the results (beyond its runs' records and its manifest)."""
    target_entries: tuple[str, ...] = ()
    before: Callable[[dict[str, Any], dict[str, Any], str], list[str]] | None = None
    """(config, its part as written, where that is) -> problems of the part as written."""
    after: Callable[[dict[str, Any], dict[str, Any], str, list[Cell], bool], list[str]] | None = None
    """(config, its part as written, where that is, its cells, whether every run config is valid) -> problems."""
    check_inits: bool = False
    """Validate each shared warm start's run config before the cells' (a fixed warm-start folder's)."""
    entries_at: tuple[str, ...] | None = None
    """Where its section holds its named entries (``search``: under ``stages``; ``grids``: at the top), whose
    cells and outputs carry the entry's name; None: the section is its one entry (:func:`written_entries`)."""
    resources: Mapping[str, Any] = field(default_factory=dict)
    """Its runs' resources where its entry sets none, over :data:`rpa.workflow.resources.RUN_DEFAULTS` (the
    entry's ``resources``: experiments/schema/config.schema.yaml ``$defs/resources``)."""
    resources_by: str | None = None
    """The label that picks a run's ``resources`` where its entry's are a mapping label -> resources (the
    study's: by model size); None: the entry's ``resources`` are every run's."""
    preset: Callable[[dict[str, Any], dict[str, Any], str], dict[str, Any]] | None = None
    """A preset kind (a ``grids:`` entry may take it, ``kind: <name>``): its entry builder (its keys as written,
    the bases read, the folder of its cells under the results) -> the grid entry (:func:`grid_of`)."""
    entry_args: str = ""
    """A preset's analysis arguments for a ``grids:`` entry (``{manifest}``, ``{tables}``, ``{figures}``:
    :func:`entry_paths`), where its own section's are the analysis' defaults."""


_STUDY_TABLES = {f"{name}_{ext}": f"tables/study_{name}.{ext}"
                 for name in ("collapse", "mismatch", "sensitivity") for ext in ("csv", "md", "tex")}
_STUDY_FIGURES = {f"{name}_fig": f"figures/study_{name}.{{format}}"
                  for name in ("rewards", "mismatch_curves", "heatmap")}


def _cell_where(c: Cell, key: str) -> str:
    return f"{key} cell {c.name}"


def _grids_entries(config: dict[str, Any], bases: dict[str, Any]) -> dict[str | None, dict[str, Any]]:
    """The ``grids:`` entries as grid entries: a plain one as written, one of a preset kind built by its
    preset (its cells and shared warm starts under ``grids/<entry>/``)."""
    built: dict[str | None, dict[str, Any]] = {}
    for name, written in (config.get("grids") or {}).items():
        preset = KINDS[entry_kind("grids", written)].preset
        built[name] = written if preset is None else preset(written, bases, f"grids/{name}")
    return built


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("train", lambda config, bases: {None: train_spec(config)},
         lambda c, key: f"{key}.settings.{c.labels['setting']} (regions {c.labels['regions']}, seed {c.seed})",
         _plain_manifest,
         "python -m analysis.train_summary --results {params.results} --out-table {output.csv} --out-md {output.md} "
         "--out-figure {output.fig} > {log} 2>&1",
         {"csv": "tables/train.csv", "md": "tables/train.md", "fig": "figures/train_curves.{format}"},
         ("csv", "fig"), "GRPO grid", "train_all", "train_aggregate.log", before=_train_before,
         resources={"mem_mb": 8000}),
    Kind("dose", lambda config, bases: {None: dose_spec(config["dose"], bases)}, _cell_where, _dose_manifest,
         "python -m analysis.dose --results {params.results}{params.scope} --out-dir {params.tables} "
         "--figure {output.fig} > {log} 2>&1",
         {"csv": "tables/dose.csv", "md": "tables/dose.md", "runs": "tables/dose_runs.csv",
          "sensitivity": "tables/dose_sensitivity.csv", "fig": "figures/dose_response.{format}"},
         ("csv", "runs", "sensitivity", "fig"), "Positive control", "dose_response", "dose_aggregate.log",
         before=_dose_before, check_inits=True, resources={"mem_mb": 6000, "runtime": 60}, preset=dose_spec,
         entry_args=" --manifest {manifest}"),
    Kind("study", lambda config, bases: {None: study_spec(config["study"], bases)},
         lambda c, key: f"{key}.arms.{c.labels['arm']} ({c.labels['model']}, seed {c.seed})",
         _study_manifest,
         "python -m analysis.study --results {params.results} --format {params.format}{params.scope} > {log} 2>&1",
         {**_STUDY_TABLES, **_STUDY_FIGURES}, (*(k for k in _STUDY_TABLES if k.endswith("_csv")), *_STUDY_FIGURES),
         "Study", "study", "study_aggregate.log", inputs=("tables/probe.csv",),
         before=_study_before, after=_study_after, check_inits=True, resources={"mem_mb": 8000},
         resources_by="model", preset=study_spec,
         entry_args=" --manifest {manifest} --out-dir {tables} --figure-dir {figures}"),
    Kind("search", lambda config, bases: search_entries(config), _cell_where, _search_manifest,
         "python -m analysis.collapse_search --results {params.results} --stage {wildcards.entry} "
         "--figure {output.fig} > {log} 2>&1",
         {"csv": "tables/search_{entry}.csv", "md": "tables/search_{entry}.md", "json": "tables/search_{entry}.json",
          "fig": "figures/search_{entry}.{format}"},
         ("csv", "fig"), "Collapse search", "collapse_{entry}", "search_{entry}.log", target_entries=SEARCH_STAGES,
         before=_search_before, after=_search_after, entries_at=("stages",)),
    Kind("grids", _grids_entries, _cell_where, _grids_manifest,
         "python -m analysis.grid_summary --results {params.results} --grid {wildcards.entry} --out-csv {output.csv} "
         "--out-md {output.md} > {log} 2>&1",
         {"csv": "tables/grids/{entry}.csv", "md": "tables/grids/{entry}.md"}, ("csv",), "Grids", "grids",
         "grids_{entry}.log", entries_at=(), after=_grids_after),
)}
"""Every kind of experiment by its config section, in the order the workflow lists them. A new kind is one
entry here (its preset, checks, manifest extras, analysis and outputs) and a caption rules/report/<kind>.rst."""

GRID_SECTIONS = tuple(KINDS)
"""The config sections that are grids of training runs: one per kind."""

MULTI_GRID_SECTIONS = tuple(name for name, kind in KINDS.items() if kind.entries_at is not None)
"""The kinds whose section holds several entries, each named (a search stage, a ``grids:`` entry): their
cells and outputs carry the entry's name; the other kinds' section is one entry."""

PRESETS = tuple(name for name, kind in KINDS.items() if kind.preset is not None)
"""The kinds a ``grids:`` entry may take (``kind: dose``, ``kind: study``): the entry then has the keys of that
kind's section (the ``dose:`` / ``study:`` section is shorthand for such an entry), its kind's checks, manifest
and analysis, its tables and figures under ``tables/grids/<entry>/`` and ``figures/grids/<entry>/``."""


def entry_kind(section: str, written: Mapping[str, Any]) -> str:
    """The kind of an entry of ``section`` as written: a ``grids:`` entry's ``kind`` (a preset of
    :data:`PRESETS`; ``grid`` or none: a plain entry, kind ``grids``), else the section's."""
    if section != "grids" or written.get("kind", "grid") == "grid":
        return section
    return written["kind"]


def checked_parts(config: dict[str, Any], section: str) -> list[tuple[Kind, dict[str, Any], str, str | None]]:
    """What a section's kind checks (:attr:`Kind.before`, :attr:`Kind.after`, :attr:`Kind.where`) are run on,
    each (its kind, the part as written, where it is written, the entry whose cells are its own or None for
    the section's every cell): the section as a whole; a ``grids:`` section entry by entry (``grids.<entry>``
    for an entry of a preset kind; a plain entry's cells are named ``grids cell ...``)."""
    if section != "grids":
        return [(KINDS[section], config[section], section, None)]
    return [(KINDS[own], written, "grids" if own == "grids" else f"grids.{name}", name)
            for name, written in config["grids"].items() for own in [entry_kind("grids", written)]]


def entry_paths(results: str, entry: str) -> dict[str, str]:
    """Where the aggregate of a ``grids:`` entry of a preset kind reads and writes: its ``manifest``, the folders
    of its ``tables`` and ``figures``."""
    return {"manifest": f"{results}/grids/{entry}/manifest.json", "tables": f"{results}/tables/grids/{entry}",
            "figures": f"{results}/figures/grids/{entry}"}


def entry_outputs(kind: str) -> dict[str, str]:
    """The outputs of a ``grids:`` entry of preset ``kind`` by name, under the results: the kind's tables and
    figures in the entry's folders (:func:`entry_paths`: ``tables/grids/{entry}/dose.csv``)."""
    folders = entry_paths("", "{entry}")
    return {name: f"{folders[path.split('/', 1)[0]].lstrip('/')}/{path.split('/', 1)[1]}"
            for name, path in KINDS[kind].outputs.items()}


def kind_outputs(config: dict[str, Any], section: str, entry: str | None = None) -> dict[str, str]:
    """The tables and figures of an entry of ``section`` (its aggregate rule's outputs) by name, under the
    results (``{format}`` left to fill): a ``grids:`` entry of a preset kind's by :func:`entry_outputs`."""
    own = section if entry is None else entry_kind(section, written_entries(config, section)[entry])
    paths = KINDS[section].outputs if own == section else entry_outputs(own)
    return {name: path.replace("{entry}", entry or "") for name, path in paths.items()}


def kind_cells(config: dict[str, Any], kind: str, entry: str | None = None) -> list[Cell]:
    """Every cell of a config's ``kind`` section (of its entry ``entry`` only, if given), expanded but not
    checked (:func:`rpa.workflow.pipeline.check_config` gives the checked ones)."""
    return [c for grid in kind_grids(config, kind) for c in expand(grid) if entry is None or grid_stage(c) == entry]
