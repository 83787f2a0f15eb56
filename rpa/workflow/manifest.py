"""A grid's manifest: what the analyses read of the config about a grid's cells, one schema for every kind.

The workflow writes it from the cells (:func:`manifest_text`) into the folder the cells live under:
``{results}/train/manifest.json``, ``{results}/dose/manifest.json``, ``{results}/study/manifest.json``,
``{results}/search/<stage>/manifest.json``, ``{results}/grids/<entry>/manifest.json``; the analyses read
it through :func:`analysis.runs.runs_table`. A JSON object (docs/pipeline.md):

* ``cells``: one object per cell, in the grid's order: ``cell`` (its directory under
  ``{results}/<section>``, the section being the first folder of the manifest's path under the results),
  ``labels`` ({axis: label}), ``seed``, ``model`` (the config's model name). The study's cells name their
  labels ``model`` and ``arm`` as keys of their own (``cell``, ``model``, ``arm``, ``seed``), as its
  manifest always did;
* ``axes``: {axis: [labels in order]} (given, else the cells' labels in the order they first appear);
* the kind's own keys (:data:`KEYS`): a search stage's ``stage``, ``label``, ``pilot_rule``, ``decision``,
  ``post_hoc``; a ``grids:`` entry's ``grid``; the study's ``models``, ``arms``, ``seeds``,
  ``reference_arm``, ``label``, ``probe_configs``; the positive control's ``doses`` ({arm label: mantissa
  bits, or null for stock BF16}).

Keys are written in the kind's order (:data:`KEYS`; the manifests written before keep their bytes); a key
the kind does not list follows them.
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Mapping

KINDS = ("train", "dose", "study", "search", "grids")
"""The kinds of grid, each the section (first folder under the results) its cells live in."""

KEYS = {"train": ("axes", "cells"),
        "dose": ("axes", "doses", "cells"),
        "study": ("models", "arms", "seeds", "reference_arm", "label", "cells", "probe_configs"),
        "search": ("stage", "label", "axes", "pilot_rule", "decision", "post_hoc", "cells"),
        "grids": ("grid", "axes", "cells")}
"""Each kind's keys, in the order written (``axes`` and ``cells`` made here where the extras lack them)."""


def _cell(cell: Any) -> dict[str, Any]:
    """A cell (a :class:`rpa.workflow.grid.Cell`, or a mapping with its fields) as the manifest lists it."""
    if isinstance(cell, Mapping):
        return {"cell": cell["cell"], "labels": dict(cell["labels"]), "seed": cell["seed"], "model": cell["model"]}
    return {"cell": cell.name, "labels": dict(cell.labels), "seed": cell.seed, "model": cell.model}


def axes_of(cells: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """{axis: labels} of listed cells, each axis' labels in the order they first appear."""
    axes: dict[str, list[str]] = {}
    for c in cells:
        for axis, label in c["labels"].items():
            if label not in axes.setdefault(axis, []):
                axes[axis].append(label)
    return axes


def manifest(kind: str, cells: Iterable[Any], extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of a grid of ``kind`` (:data:`KINDS`) with ``cells`` and the kind's own keys ``extras``."""
    if kind not in KEYS:
        raise ValueError(f"manifest: unknown kind {kind!r} (one of {', '.join(KINDS)})")
    listed = [_cell(c) for c in cells]
    if kind == "study":  # its cells carry their labels as keys of their own
        listed = [{"cell": c["cell"], "model": c["labels"]["model"], "arm": c["labels"]["arm"], "seed": c["seed"]}
                  for c in listed]
    extras = dict(extras or {})
    made = {"cells": listed}
    if "axes" in KEYS[kind] and "axes" not in extras:
        made["axes"] = axes_of(listed)
    values = {**extras, **made}
    return {**{k: values[k] for k in KEYS[kind] if k in values},
            **{k: v for k, v in values.items() if k not in KEYS[kind]}}


def dumps(made: Mapping[str, Any]) -> str:
    """A manifest as the file holds it (one space of indent, a final newline)."""
    return json.dumps(made, indent=1) + "\n"


def manifest_text(kind: str, cells: Iterable[Any], extras: Mapping[str, Any] | None = None) -> str:
    """:func:`manifest` as the file holds it (:func:`dumps`)."""
    return dumps(manifest(kind, cells, extras))
