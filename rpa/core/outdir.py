"""Output directories of the measuring commands (``rpa probe``, ``rpa diagnose``): each records
the options it was made with (``options.json``), and a rerun into it with other options is
refused, naming the keys that differ, instead of leaving one run's files beside another's.
A rerun with the same options writes the directory again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rpa.core.errors import InputError
from rpa.core.jsonfiles import write_json

OPTIONS_FILE = "options.json"


class OutputDirectoryTaken(InputError):
    """``--out`` holds the output of the same command run with other options."""


def flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``a.b.c`` keys."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def resolved(value: Any) -> Any:
    """A local path as the file system resolves it (``/a/../a/q3`` is ``/a/q3``); anything else as is."""
    if isinstance(value, str) and ("/" in value or value.startswith(".")):
        path = Path(os.path.abspath(value))  # lexically normalised: x/../q3 is q3
        return str(path.resolve()) if path.exists() else str(path)
    return value


def differing_keys(recorded: dict[str, Any], requested: dict[str, Any]) -> list[str]:
    """``key: recorded -> requested`` for each (flattened) key whose values differ, local paths resolved."""
    a, b = (flat(json.loads(json.dumps(d))) for d in (recorded, requested))
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if resolved(a.get(k)) != resolved(b.get(k))]


def check_options(out: str | Path, command: str, options: dict[str, Any]) -> None:
    """Refuse ``out`` if it records ``command`` run with other ``options`` (nothing is written)."""
    path = Path(out) / OPTIONS_FILE
    if not path.is_file():
        return
    try:
        recorded = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return  # not a record this module wrote (its writes are atomic): claim the directory anew
    diff = differing_keys(recorded.get("options", {}), options) if recorded.get("command") == command else \
        [f"command: {recorded.get('command')!r} -> {command!r}"]
    if diff:
        raise OutputDirectoryTaken(f"--out {out} holds rpa {recorded.get('command')} output made with other options "
                                   f"({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}); use another "
                                   f"directory or delete it")


def claim(out: str | Path, command: str, options: dict[str, Any]) -> Path:
    """Create ``out`` (if needed) for ``command`` with ``options``, recording them; refused
    as :func:`check_options` refuses."""
    check_options(out, command, options)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / OPTIONS_FILE, {"command": command, "options": options})
    return out
