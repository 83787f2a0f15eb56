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

Each analysis keeps only its statistics; what it reads of a run comes from here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from rpa.core.jsonfiles import read_jsonl
from rpa.train.collapse import CollapseThresholds, run_verdict, sensitivity, summary_superseded

STATES = ("missing", "failed", "finished")


def _json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


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


def flags(column):
    """A table's flag column (``collapsed``, ``absorbing``, ``summary_superseded``: True, False or
    missing) as booleans, a missing flag False: through pandas' nullable ``boolean``, so an
    all-missing or object column is read the same way by every analysis."""
    return column.astype("boolean").fillna(False).astype(bool)
