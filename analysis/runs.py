"""One run directory as every analysis reads it: its state, what it ran, its logs and its verdict
under the current collapse rule.

A run directory (``rpa train --out DIR``, :mod:`rpa.train.rundir`) holds ``summary.json`` once the
run ended (``ok``, ``collapsed``, ``diverged`` or ``error``), ``config.json`` (the validated run
config; an exported reference run may keep it only inside its summary), ``metrics.jsonl`` (one
record per logged step) and ``eval.jsonl`` (one per held-out evaluation). The rules, in one place:

* **state**: ``missing`` (no summary: not started, running or killed), ``failed`` (the summary's
  status is ``error``) or ``finished``;
* **what the run ran** comes from its config, never from its directory's name;
* **logs count only for a run that ended**: a killed or running run's partial log would give a
  ``missing`` row numbers the exported reference results cannot reproduce;
* **the verdict** is recomputed from the log with the run's own thresholds
  (:func:`rpa.train.collapse.run_verdict`), so tables follow the current rule
  (``rule_version``); ``superseded`` says whether the summary holds an earlier rule's different
  verdict. A blow-up may stop a run before a step is logged: a ``collapsed`` summary has a verdict
  without a log.

Each analysis keeps only its statistics; what it reads of a run comes from here: the rows of a grid
(:func:`runs_table`, one per cell its ``manifest.json`` expects, rpa/workflow/manifest.py), and the
results of the offline measurements (:func:`probe_results`, :func:`attribution_results`,
:func:`diagnose_layers`, :func:`decode_probes`, :func:`parity_passed`) and the provenance of a
grid's runs (:func:`run_summaries`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

from analysis.refusal import Refused
from rpa.core.jsonfiles import read_jsonl, read_record
from rpa.core.provenance import cpu_type
from rpa.train.collapse import CollapseThresholds, run_verdict, sensitivity, sensitivity_settings, summary_superseded

STATES = ("missing", "failed", "finished")
MANIFEST = "manifest.json"
"""Each grid's manifest, in the folder its cells live under (``{results}/<section>[/<entry>]``)."""
VERDICT_COLUMNS = ("verdict", "collapsed", "collapse_step", "unconfirmed_drop_step", "recovered_step", "grad_spikes",
                   "steps", "peak_reward", "final_reward", "terminal_reward", "absorbing", "first_dip_step",
                   "reward_auc", "rule_version")
"""The verdict's columns every run row carries (:attr:`Run.verdict`, in this order), where the run is judged."""
SPIKE_COLUMNS = ("first_grad_spike_step", "max_grad_spike_factor")
"""The verdict's detail of its grad-norm spike events (:attr:`Run.verdict`), for a table that shows them."""
RUN_SETTINGS = ("learning_rate", "temperature", "max_completion_length", "steps", "updates_per_generation")
"""Run-config values every judged run row carries (from its config, as ``config_<name>``: an axis label may
have the same name)."""
SENSITIVITY_LABELS = tuple(label for label, _ in sensitivity_settings(CollapseThresholds()))
"""The variations of the collapse rule's thresholds (:func:`rpa.train.collapse.sensitivity_settings`)."""


def sensitivity_column(label: str) -> str:
    """A run row's verdict under one variation ("drop 0.4" -> verdict_drop_0.4, "persist /2" ->
    verdict_persist_half, "persist x2" -> verdict_persist_x2)."""
    return "verdict_" + label.replace("/2", "half").replace(" ", "_")


def _json(path: Path) -> dict[str, Any] | None:
    return read_record(path) if path.exists() else None


@dataclass(frozen=True)
class Run:
    """One run directory, read once (:func:`load_run`)."""

    dir: Path
    summary: dict[str, Any] | None = field(repr=False)
    config: dict[str, Any] | None = field(repr=False)
    metrics: list[dict[str, Any]] = field(repr=False)
    evals: list[dict[str, Any]] = field(repr=False)

    @property
    def state(self) -> str:
        """``missing``, ``failed`` or ``finished`` (:data:`STATES`)."""
        if self.summary is None:
            return "missing"
        return "failed" if self.summary.get("status") == "error" else "finished"

    @property
    def status(self) -> str | None:
        """The summary's status (``ok``, ``collapsed``, ``diverged``, ``error``); None without one."""
        return None if self.summary is None else self.summary.get("status")

    @property
    def judged(self) -> bool:
        """Whether the run has a verdict: it ended, and logged a step or collapsed before one."""
        return self.summary is not None and (bool(self.metrics) or self.status == "collapsed")

    @cached_property
    def thresholds(self) -> CollapseThresholds | None:
        """The collapse rule's thresholds the run was configured with."""
        return None if self.config is None else CollapseThresholds(**self.config["collapse"])

    @cached_property
    def verdict(self) -> dict[str, Any] | None:
        """The verdict under the current rule, with the run's own thresholds (None if not :attr:`judged`)."""
        return run_verdict(self.metrics, self.thresholds, self.summary) if self.judged else None

    @cached_property
    def sensitivity(self) -> dict[str, str]:
        """The verdict under each variation of the thresholds (empty if not :attr:`judged`)."""
        return sensitivity(self.metrics, self.thresholds, self.summary) if self.judged else {}

    @property
    def superseded(self) -> bool | None:
        """Whether the summary holds an earlier rule's different verdict (None if not :attr:`judged`)."""
        return summary_superseded(self.summary, self.verdict) if self.judged else None


def load_run(run_dir: Path) -> Run:
    """The run in ``run_dir`` (:class:`Run`); its logs only if it ended."""
    run_dir = Path(run_dir)
    summary = _json(run_dir / "summary.json")
    config = _json(run_dir / "config.json")
    if config is None and summary is not None:
        config = summary.get("config")  # an exported reference run keeps its config in its summary
    ended = summary is not None
    return Run(dir=run_dir, summary=summary, config=config,
               metrics=read_jsonl(run_dir / "metrics.jsonl") if ended else [],
               evals=read_jsonl(run_dir / "eval.jsonl") if ended else [])


def ended_runs(root: Path) -> list[Path]:
    """Every ended run's folder under ``root`` (one holding a ``summary.json``), relative to ``root``, sorted: the
    runs of a tree that has no manifest -- a results folder to compare with a committed one
    (:mod:`analysis.check_runs`), or to export (:mod:`analysis.export_reference`)."""
    root = Path(root)
    return [p.parent.relative_to(root) for p in sorted(root.rglob("summary.json"))]


def flags(column):
    """A table's flag column (``collapsed``, ``absorbing``, ``summary_superseded``: True, False or
    missing) as booleans, a missing flag False: through pandas' nullable ``boolean``, so an
    all-missing or object column is read the same way by every analysis."""
    return column.astype("boolean").fillna(False).astype(bool)


# ------------------------------------------------------------------------------ a grid's rows


def read_manifest(path: Path) -> dict[str, Any]:
    """A grid's manifest (rpa/workflow/manifest.py), refused with its path where it is missing."""
    path = Path(path)
    if not path.is_file():
        raise Refused(f"{path}: no such grid manifest (the workflow writes it from the config's cells)")
    return read_record(path)


def cell_labels(cell: dict[str, Any]) -> dict[str, Any]:
    """A manifest cell's labels: its ``labels``; a cell without (the study's manifest: ``model``, ``arm``)
    has its other keys but ``cell`` and ``seed`` as labels."""
    if "labels" in cell:
        return dict(cell["labels"])
    return {k: v for k, v in cell.items() if k not in ("cell", "seed")}


@dataclass(frozen=True)
class RunRow:
    """One expected cell of a grid: its manifest entry, its row (:func:`run_row`) and its run."""

    cell: dict[str, Any]
    row: dict[str, Any]
    run: Run

    @property
    def labels(self) -> dict[str, Any]:
        return cell_labels(self.cell)


@dataclass(frozen=True)
class RunsTable:
    """The rows of one grid, one per cell its manifest expects, in the manifest's order."""

    manifest: dict[str, Any]
    section: str
    entries: tuple[RunRow, ...]

    def __iter__(self) -> Iterator[RunRow]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def frame(self):
        """The rows as a DataFrame (columns in the order the rows first name them)."""
        import pandas as pd

        return pd.DataFrame([e.row for e in self.entries])


def run_row(cell: dict[str, Any], run: Run) -> dict[str, Any]:
    """The columns every analysis reads of one run, in this order: its labels, ``seed``, ``cell``,
    ``state``; once it ended ``status``, ``wall_s`` and ``cpu_type`` (where its provenance names the CPU);
    once judged ``config_<setting>`` (:data:`RUN_SETTINGS`), the verdict (:data:`VERDICT_COLUMNS`),
    ``summary_superseded`` and its verdict under each variation (:func:`sensitivity_column`)."""
    row = {**cell_labels(cell), "seed": cell["seed"], "cell": cell["cell"], "state": run.state}
    if run.summary is not None:
        row.update(status=run.status, wall_s=run.summary.get("wall_s"))
        cpu = (run.summary.get("provenance") or {}).get("cpu")
        if cpu:  # the CPU type the run was made on (older runs record none: no column)
            row["cpu_type"] = "{} {}".format(*cpu_type(cpu)[:1], "+".join(cpu_type(cpu)[1]))
    if run.judged:
        row.update({f"config_{k}": run.config.get(k) for k in RUN_SETTINGS})
        row.update({k: run.verdict.get(k) for k in VERDICT_COLUMNS})
        row["summary_superseded"] = run.superseded
        row.update({sensitivity_column(label): verdict for label, verdict in run.sensitivity.items()})
    return row


def section_of(manifest: Path, results: Path) -> str:
    """The folder under ``results`` a grid's cells are under (``dose``, ``study``, ``grids``, ...): the first folder
    of its manifest's path under ``results``."""
    return Path(manifest).resolve().relative_to(Path(results).resolve()).parts[0]


def runs_table(manifest: Path | dict[str, Any], results: Path, section: str | None = None) -> RunsTable:
    """Every cell a grid's manifest expects (a path, or the manifest read: then ``section`` names the folder
    its cells are under, ``train``, ``dose``, ``study``, ``search`` or ``grids``), each run read once
    (:func:`load_run`) from ``results/<section>/<cell>``; a manifest's section is the first folder of its
    path under ``results``."""
    results = Path(results)
    if not isinstance(manifest, dict):
        path = Path(manifest)
        section = section or section_of(path, results)
        manifest = read_manifest(path)
    if section is None:
        raise ValueError("runs_table: a manifest given as read needs its section")
    entries = []
    for cell in manifest["cells"]:
        run = load_run(results / section / cell["cell"])
        entries.append(RunRow(cell=cell, row=run_row(cell, run), run=run))
    return RunsTable(manifest=manifest, section=section, entries=tuple(entries))


def run_config(run_dir: Path) -> dict[str, Any] | None:
    """A run's config (``config.json``, else the one its summary keeps), without reading its logs."""
    run_dir = Path(run_dir)
    config = _json(run_dir / "config.json")
    if config is None and (summary := _json(run_dir / "summary.json")) is not None:
        config = summary.get("config")
    return config


def run_summary(run_dir: Path) -> dict[str, Any] | None:
    """A run's summary (None until it ended), without reading its logs."""
    return _json(Path(run_dir) / "summary.json")


def cells_by_folder(results: Path, section: str, entry: str | None = None) -> list[tuple[dict[str, Any], Path]]:
    """(cell, its run directory) of every cell of the grid ``results/<section>[/<entry>]``'s manifest, in the
    order of their folders (none where the grid has no manifest: it never ran): where a grid's configs and
    provenance are read without its logs (:func:`run_config`, :func:`run_summary`)."""
    path = Path(results) / section / (entry or "") / MANIFEST
    if not path.is_file():
        return []
    cells = sorted(read_manifest(path)["cells"], key=lambda c: Path(c["cell"]))
    return [(c, Path(results) / section / c["cell"]) for c in cells]


def grid_table(results: Path, section: str, entry: str | None = None) -> RunsTable:
    """:func:`runs_table` of the grid whose manifest is ``results/<section>[/<entry>]/manifest.json``."""
    folder = Path(results) / section / (entry or "")
    return runs_table(read_manifest(folder / MANIFEST), results, section)


# ------------------------------------------------------------------------------ the offline measurements


@dataclass(frozen=True)
class Measurement:
    """One offline measurement's folder ``results/<kind>/<model>/<config>``: its summary, read once, and
    its per-token table (read on demand: :meth:`tokens`)."""

    model: str
    config: str
    dir: Path
    summary: dict[str, Any] = field(repr=False)

    @property
    def has_tokens(self) -> bool:
        return (self.dir / "tokens.csv").is_file()

    def tokens(self, **read_csv):
        """The per-token table (``tokens.csv``; pandas' ``read_csv`` options); None where there is none."""
        return read_tokens(self.dir / "tokens.csv", **read_csv) if self.has_tokens else None


def _measurements(results: Path, kind: str) -> list[Measurement]:
    return [Measurement(model=p.parent.parent.name, config=p.parent.name, dir=p.parent,
                        summary=read_record(p))
            for p in sorted(Path(results).glob(f"{kind}/*/*/summary.json"))]


def probe_results(results: Path) -> list[Measurement]:
    """Every probe (``results/probe/<model>/<config>``), in the order of their folders."""
    return _measurements(results, "probe")


@dataclass(frozen=True)
class SamplingProbe:
    """One probe cell at another sampling setting (``results/probe-sampling/<model>/<setting>/<config>``):
    its summary (with ``sampling_split``), read once, and its per-token split (:meth:`split`)."""

    model: str
    setting: str
    config: str
    dir: Path
    summary: dict[str, Any] = field(repr=False)

    def split(self):
        """``split.csv``: each split token's logprobs and parts (:data:`rpa.measure.probe.SPLIT_COLUMNS`)."""
        return read_tokens(self.dir / "split.csv")


def sampling_probe_results(results: Path) -> list[SamplingProbe]:
    """Every probe cell at another sampling setting, in the order of their folders."""
    return [SamplingProbe(model=p.parents[2].name, setting=p.parent.parent.name, config=p.parent.name, dir=p.parent,
                          summary=read_record(p))
            for p in sorted(Path(results).glob("probe-sampling/*/*/*/summary.json"))]


def probe_result(results: Path, model: str, config: str) -> Measurement | None:
    """The probe of ``model`` under configuration ``config``; None where it has not run."""
    path = probe_folder(results, model, config)
    if not (path / "summary.json").is_file():
        return None
    return Measurement(model=model, config=config, dir=path, summary=read_record(path / "summary.json"))


def probe_token_tables(results: Path) -> list[tuple[str, str, Path]]:
    """(model, config, its ``tokens.csv``) of every probe with a per-token table, in the order of their folders
    (read each with :func:`read_tokens`)."""
    return [(p.parent.parent.name, p.parent.name, p) for p in sorted(Path(results).glob("probe/*/*/tokens.csv"))]


def read_table(path: Path, **options):
    """A result table (pandas' ``read_csv`` with ``options``), or one line naming the file where it cannot be read as
    one (binary, cut, a folder)."""
    import pandas as pd

    path = Path(path)
    if path.is_dir():
        raise Refused(f"{path}: a folder where a CSV table must be")
    try:
        return pd.read_csv(path, **options)
    except UnicodeDecodeError:
        raise Refused(f"{path}: not text (binary or damaged); a CSV table must be") from None
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as err:
        raise Refused(f"{path}: not a readable CSV table ({str(err).splitlines()[0]})") from None


def read_tokens(path: Path, **read_csv):
    """A per-token table (``tokens.csv`` of a probe or an attribution; pandas' ``read_csv`` options)."""
    return read_table(path, **read_csv)


def probe_folder(results: Path, model: str, config: str) -> Path:
    """Where the probe of ``model`` under configuration ``config`` writes (whether or not it ran)."""
    return Path(results) / "probe" / model / config


def probe_tokens(results: Path, model: str, config: str, **read_csv):
    """The per-token table of the probe of ``model`` under ``config``; None where it wrote none."""
    path = probe_folder(results, model, config) / "tokens.csv"
    return read_tokens(path, **read_csv) if path.is_file() else None


def attribution_results(results: Path) -> list[Measurement]:
    """Every kernel-swap attribution (``results/attribution/<model>/<config>``), in the order of their folders."""
    return _measurements(results, "attribution")


def diagnose_layers(results: Path):
    """Every diagnosis' per-layer table with its ``model`` and ``config`` first, concatenated (empty if none)."""
    import pandas as pd

    frames = []
    for path in sorted(Path(results).glob("diagnose/*/*/layers.csv")):
        frame = read_table(path)
        frame.insert(0, "config", path.parent.name)
        frame.insert(0, "model", path.parent.parent.name)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def parity_passed(results: Path, model: str) -> bool | None:
    """Whether ``model``'s parity check passed; None where it has none."""
    path = Path(results) / "parity" / f"{model}.json"
    return read_record(path).get("passed") if path.exists() else None


def decode_probes(folder: Path) -> dict[str, dict[str, Any]]:
    """The decode probes' summaries under ``folder`` (``<folder>/<config>/summary.json``), by configuration."""
    return {p.parent.name: read_record(p) for p in sorted(Path(folder).glob("*/summary.json"))}

