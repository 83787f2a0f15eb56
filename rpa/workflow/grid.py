"""A grid of training runs as one value, and the one function that expands it into cells.

Every experiment of the pipeline -- the GRPO grid (``train``), the positive control (``dose``),
the study (``study``) and each stage of the collapse search (``search``) -- is a :class:`Grid`:
a base run config, axes of labelled overrides, seeds, the label combinations it leaves out and
where its cells share a warm start. :func:`expand` turns it into :class:`Cell` s, each holding its
run config (the mapping its ``run.yaml`` is written from) and, built once on first use, the
validated :class:`~rpa.train.config.TrainConfig`. How a config section becomes a grid is in
:mod:`rpa.workflow.experiments`; nothing here knows the sections.

A cell's run config, in order (every override merged key by key: :func:`deep_merge`):

1. the grid's ``base`` (the run YAML), then its ``overrides`` (what the whole grid sets);
2. one value of every axis, in the order the axes are written;
3. the seed, and a ``model`` naming an entry of ``models`` replaced by where it loads from;
4. with a shared warm start: ``model`` is the shared checkpoint and ``warm_start.steps`` 0.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from rpa.train.config import TrainConfig

BASE, CELL = "base", "cell"
"""The two :attr:`SharedWarmStart.level` s that are not axes: before any axis, and the whole cell."""

WARM_START_INPUTS = ("model", "task", "warm_start", "max_prompt_length", "seed")
"""The run keys a warm start reads (:func:`rpa.train.grpo.run_warm_start` depends on nothing else): a
warm start named by their digest is the same checkpoint wherever the digest is the same."""


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    """``base`` with ``override`` on top; nested mappings (``numerics``, ``task``, ...) merge
    key by key, so a grid setting can change one numerics knob and keep the others. Keys keep
    ``base``'s order, new ones follow (a run file lists its keys in this order)."""
    out = dict(base)
    for key, value in (override or {}).items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass(frozen=True)
class Axis:
    """One dimension of a grid: labels (its cells' directory names at this level) and the run
    config overrides each label stands for."""

    name: str
    values: Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class SharedWarmStart:
    """Cells that share one ``rpa warm-start``: the run config at ``level`` (:data:`BASE`, an axis
    of the grid, or :data:`CELL`) is the warm start's, and cells whose warm starts have the same
    directory start from one checkpoint.

    ``directory`` is a template over the labels up to ``level`` and ``{seed}`` (a cell's own),
    ``{steps}`` (its ``warm_start.steps``), ``{model_name}`` (the last part of its model's path)
    and ``{digest}`` (of :data:`WARM_START_INPUTS`: arms that change none of them share it)."""

    level: str
    directory: str
    only_with_steps: bool = True
    """No shared warm start where the run config has no warm-start steps (False: share the
    checkpoint anyway, e.g. the positive control's one model for every cell)."""


@dataclass(frozen=True)
class WarmStartRun:
    """One shared warm start: its directory name under its root, the directory, its run config."""

    name: str
    dir: str
    config: Mapping[str, Any]


@dataclass(frozen=True)
class Grid:
    """A grid of runs (see the module docstring for how a cell's config is made)."""

    name: str
    base: Mapping[str, Any]
    axes: tuple[Axis, ...]
    seeds: tuple[int, ...]
    overrides: Mapping[str, Any] = field(default_factory=dict)
    exclude: tuple[Mapping[str, tuple[str, ...]], ...] = ()
    """Label combinations left out: a cell is dropped where, for one entry, its label of every
    axis the entry names is among that entry's labels."""
    models: Mapping[str, str] = field(default_factory=dict)
    """Model names of the config's ``models`` -> where each loads from."""
    prefix: tuple[str, ...] = ()
    """Directory parts before the labels (a search stage's name)."""
    path: str | None = None
    """Template of a cell's directory over its labels (``{arm}/{is_correction}-{old_logprobs}``);
    default: the labels joined by ``/``. ``/seed<N>`` follows."""
    warm_start: SharedWarmStart | None = None
    replaced: tuple[str, ...] = ()
    """Top-level keys an axis value sets whole instead of key by key (the positive control's
    anchors: each a numerics configuration in full)."""

    def __post_init__(self) -> None:
        names = [axis.name for axis in self.axes]
        if len(set(names)) != len(names):
            raise ValueError(f"grid {self.name}: two axes named alike ({', '.join(names)})")
        unknown = sorted({axis for rule in self.exclude for axis in rule if axis not in names})
        if unknown:
            raise ValueError(f"grid {self.name}: exclude names no axis: {', '.join(unknown)}")
        labels = {axis.name: axis.values for axis in self.axes}
        absent = sorted({f"{axis}={label}" for rule in self.exclude for axis, allowed in rule.items()
                         for label in allowed if label not in labels[axis]})
        if absent:  # a misspelt label would leave out nothing
            raise ValueError(f"grid {self.name}: exclude names labels its axes do not have: {', '.join(absent)}")
        if self.warm_start is not None and self.warm_start.level not in (BASE, CELL, *names):
            raise ValueError(f"grid {self.name}: warm start level {self.warm_start.level!r} is not "
                             f"{BASE!r}, {CELL!r} or an axis ({', '.join(names)})")


@dataclass(frozen=True)
class Cell:
    """One run of a grid."""

    grid: str
    name: str
    """Its directory under the grid's root: prefix, labels, ``seed<N>``."""
    labels: Mapping[str, str]
    seed: int
    model: Any
    """The ``model`` of its config before it is located (a name in ``models``, or a path)."""
    config: Mapping[str, Any]
    init: WarmStartRun | None = None

    @cached_property
    def run(self) -> "TrainConfig":
        """The validated run config, built on first use and kept (raises
        :class:`~rpa.train.config.TrainConfigError`)."""
        from rpa.train.config import TrainConfig

        return TrainConfig.from_dict(dict(self.config))


def _merge(grid: Grid, run: Mapping[str, Any], override: Mapping[str, Any] | None) -> dict[str, Any]:
    whole = {k: v for k, v in (override or {}).items() if k in grid.replaced}
    return {**deep_merge(run, {k: v for k, v in (override or {}).items() if k not in whole}), **whole}


def _excluded(grid: Grid, labels: Mapping[str, str]) -> bool:
    return any(all(labels[axis] in allowed for axis, allowed in rule.items()) for rule in grid.exclude)


def _located(grid: Grid, run: Mapping[str, Any]) -> dict[str, Any]:
    """``run`` with a ``model`` naming an entry of ``models`` replaced by where that model loads from."""
    model = run.get("model")
    return {**run, "model": grid.models[model]} if isinstance(model, str) and model in grid.models else dict(run)


def _warm_start(grid: Grid, config: Mapping[str, Any], labels: Mapping[str, str], seed: int) -> WarmStartRun | None:
    spec = grid.warm_start
    if spec is None or (spec.only_with_steps and (config.get("warm_start") or {}).get("steps", 0) <= 0):
        return None
    digest = hashlib.sha1(json.dumps({k: config.get(k) for k in WARM_START_INPUTS}, sort_keys=True).encode())
    name = spec.directory.format_map({**labels, "seed": seed, "steps": (config.get("warm_start") or {}).get("steps", 0),
                                      "model_name": Path(str(config.get("model"))).name,
                                      "digest": digest.hexdigest()[:8]})
    return WarmStartRun(name=Path(name).name, dir=name, config=config)


def _merged(grid: Grid, combo, level: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The run config (its ``model`` not yet located) and labels at ``level``: the base and the
    axes up to ``level`` (all of them at :data:`CELL`)."""
    run, labels = _merge(grid, grid.base, grid.overrides), {}
    for axis, (label, override) in zip(grid.axes, combo):
        if level == BASE:
            break
        run, labels[axis.name] = _merge(grid, run, override), label
        if axis.name == level:
            break
    return run, labels


def _inside(grid: Grid, key: str, directory: str, under_results: bool = False) -> None:
    """Refuse a cell's or a warm start's directory that would lie outside the grid's results folder (absolute, or
    climbing out with ``..``): its runs would be written, and found finished, elsewhere. ``under_results``: the
    directory is already the results folder's (which may be absolute) joined with the written one."""
    parts = Path(directory).parts
    if (Path(directory).is_absolute() and not under_results) or ".." in parts:
        raise ValueError(f"grid {grid.name}: {key} {directory!r} leaves the results folder (absolute or with '..'); "
                         "a directory under it, relative, is what it takes")


def expand(grid: Grid) -> list[Cell]:
    """Every cell of ``grid``: every combination of one label per axis (in the axes' order, the
    last varying fastest) that no :attr:`Grid.exclude` entry drops, times the seeds."""
    cells = []
    names = [axis.name for axis in grid.axes]
    for combo in itertools.product(*(list(axis.values.items()) for axis in grid.axes)):
        labels = dict(zip(names, (label for label, _ in combo)))
        if _excluded(grid, labels):
            continue
        directory = [grid.path.format_map(labels)] if grid.path else list(labels.values())
        _inside(grid, "path", directory[0] if grid.path else "/".join(directory))
        merged, _ = _merged(grid, combo, CELL)
        for seed in grid.seeds:
            run = _located(grid, {**merged, "seed": seed})
            init = None
            if grid.warm_start is not None:
                level = grid.warm_start.level
                at, at_labels = (run, labels) if level == CELL else _merged(grid, combo, level)
                init = _warm_start(grid, _located(grid, at), at_labels, seed)
            if init is not None:
                _inside(grid, "shared_warm_start.directory", init.dir, under_results=True)
                run = {**run, "model": init.dir, "warm_start": {**(run.get("warm_start") or {}), "steps": 0}}
            cells.append(Cell(grid=grid.name, name="/".join([*grid.prefix, *directory, f"seed{seed}"]), labels=labels,
                              seed=seed, model=merged.get("model"), config=run, init=init))
    return cells


@dataclass(frozen=True)
class Group:
    """Runs of one grid that one ``rpa train`` process runs, one after another (sharing its imports
    and, where it would be the same, its vLLM engine): one Snakemake job, tracked by its record
    (:mod:`rpa.workflow.runs`) ``<name>.json`` beside the run directories."""

    name: str
    cells: tuple[Cell, ...]


def _sampler_side(cell: Cell):
    """What fixes a process's vLLM engine: the plugin's region set and perturbation."""
    return cell.run.numerics.sampler_process_key


def group_cells(cells: list[Cell], runs_per_process: int = 1, arms_per_process: int = 1,
                side=_sampler_side) -> list[Group]:
    """``cells`` (one grid's, in order) by process: cells whose labels differ only in the last axis
    (the arm) and whose sampler side is the same (``side``) join, up to ``arms_per_process`` of them,
    in the grid's order, times their seeds in chunks of ``runs_per_process``; a group's runs arm by
    arm. A group of one cell is named as the cell; a larger one ``<labels>/<arm>[+<arm>...]/seed<N>
    [+<N>...]`` (``mini-xs/none+rope/seed0+1+2``)."""
    by_arm: dict[tuple, list[Cell]] = {}
    for c in cells:
        by_arm.setdefault(tuple(c.labels.items()), []).append(c)
    by_side: dict[tuple, list[list[Cell]]] = {}  # arms of the same other labels, by sampler side
    for labels, arm_cells in by_arm.items():
        by_side.setdefault((labels[:-1], side(arm_cells[0])), []).append(arm_cells)
    groups: dict[str, Group] = {}
    for arms in by_side.values():
        for a in range(0, len(arms), arms_per_process):
            together = arms[a:a + arms_per_process]
            for i in range(0, len(together[0]), runs_per_process):
                chunks = [arm_cells[i:i + runs_per_process] for arm_cells in together]
                name = _group_name(chunks)
                if name in groups:
                    raise ValueError(f"two process groups are named {name!r} (an arm named like arms joined by '+')")
                groups[name] = Group(name=name, cells=tuple(c for chunk in chunks for c in chunk))
    return list(groups.values())


def _group_name(chunks: list[list[Cell]]) -> str:
    """A group of one cell: the cell's name; else the first cell's directory above its arm, the arms'
    directory names joined by ``+``, ``seed`` and the seeds joined by ``+``."""
    first = chunks[0][0]
    if len(chunks) == 1 and len(chunks[0]) == 1:
        return first.name
    head = first.name.rsplit("/", 1)[0].rpartition("/")[0] if "/" in first.name else ""
    arms = "+".join(chunk[0].name.rsplit("/", 1)[0].rpartition("/")[2] for chunk in chunks if "/" in chunk[0].name)
    seeds = "seed" + "+".join(str(c.seed) for c in chunks[0])
    return "/".join(part for part in (head, arms, seeds) if part)
