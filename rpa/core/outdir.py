"""Output directories of the measuring commands (``rpa probe``, ``rpa diagnose``): one process
runs a directory at a time (``.lock``, an ``flock`` that dies with its process); each records the
options it was made with (``options.json``), and a rerun into it with other options is refused,
naming the keys that differ, instead of leaving one run's files beside another's. A rerun with
the same options into a finished directory (its ``summary.json`` is written last) does nothing;
into an unfinished one it runs again. ``replace`` (the commands' ``--replace``, which the workflow's
rules pass once Snakemake has decided a job runs again) makes the directory's earlier record and
summary give way instead: this module is the one owner of what a rerun does.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from rpa.core.errors import InputError, UserError
from rpa.core.jsonfiles import write_json

OPTIONS_FILE = "options.json"


class OutputDirectoryTaken(InputError):
    """``--out`` holds the output of the same command run with other options."""


class DamagedRecord(InputError):
    """``--out`` holds an ``options.json`` that cannot be read as a record."""


class DirectoryBusy(UserError):
    """Another process runs the directory."""


LOCK_FILE = ".lock"
_HELD: dict[str, Any] = {}  # directory -> the open lock file this process holds (for its lifetime)


def lock_dir(out: str | Path, command: str, busy: type[DirectoryBusy] = DirectoryBusy) -> None:
    """Hold an exclusive lock on ``out/.lock`` for the life of this process, or raise ``busy``.
    ``flock`` locks die with their process, so a killed run leaves no stale lock."""
    lock_file(Path(out) / LOCK_FILE, out, command, busy)


def lock_file(path: str | Path, out: str | Path, command: str, busy: type[DirectoryBusy] = DirectoryBusy) -> None:
    """Hold an exclusive lock on the file ``path`` (created) for the life of this process, or raise ``busy`` naming
    ``out``, the output it guards (a lock beside an output that appears by a rename: ``rpa convert``)."""
    import fcntl

    key = str(Path(path).resolve())
    if key in _HELD:
        return  # this process holds it already
    handle = open(path, "a+")  # noqa: SIM115 - held open: the lock lives as long as the process
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise busy(f"{out} is in use by a running rpa {command} ({holder}); wait for it to finish "
                   f"or use another directory") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    _HELD[key] = handle


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
    from rpa.core.numerics_config import OMITTED_WHEN_DEFAULT

    a, b = (flat(json.loads(json.dumps(d))) for d in (recorded, requested))
    for side in (a, b):  # a key a record leaves out at its default reads as that default
        for k in set(a) | set(b):
            if k not in side and k.rsplit(".", 1)[-1] in OMITTED_WHEN_DEFAULT:
                side[k] = OMITTED_WHEN_DEFAULT[k.rsplit(".", 1)[-1]]
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if resolved(a.get(k)) != resolved(b.get(k))]


def _recorded_diff(out: str | Path, command: str, options: dict[str, Any]) -> tuple[str, list[str]] | None:
    """(the recorded command, how its options differ from ``command`` with ``options``) for ``out``'s
    ``options.json``; None where it has none (:class:`DamagedRecord` where it cannot be read)."""
    path = Path(out) / OPTIONS_FILE
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        recorded = exc
    if not isinstance(recorded, dict) or not isinstance(recorded.get("options", {}), dict):
        # not a record this module wrote (its writes are atomic): the directory may hold a finished run made with
        # other options, so it is neither taken as unrecorded nor overwritten
        why = recorded if isinstance(recorded, Exception) else f"a JSON {type(recorded).__name__}, not a record"
        raise DamagedRecord(f"--out {out}: {path} is unreadable ({str(why).splitlines()[0] if str(why) else why!r}); "
                            f"delete it (or the directory) to run again")
    if recorded.get("command") != command:
        return recorded.get("command"), [f"command: {recorded.get('command')!r} -> {command!r}"]
    return command, differing_keys(recorded.get("options", {}), options)


def check_options(out: str | Path, command: str, options: dict[str, Any]) -> None:
    """Refuse ``out`` if it records ``command`` run with other ``options`` (nothing is written)."""
    record = _recorded_diff(out, command, options)
    if record and record[1]:
        was, diff = record
        raise OutputDirectoryTaken(f"--out {out} holds rpa {was} output made with other options "
                                   f"({'; '.join(diff[:4])}{'; ...' if len(diff) > 4 else ''}); use another "
                                   f"directory or delete it")


def finished(out: str | Path, command: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """The summary of ``command`` already run to the end with ``options`` in ``out``, else None."""
    record, summary = _recorded_diff(out, command, options), Path(out) / "summary.json"
    if record is None or record[1] or not summary.is_file():
        return None
    try:
        return json.loads(summary.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def claim(out: str | Path, command: str, options: dict[str, Any],
          replace: bool = False) -> tuple[Path, dict[str, Any] | None]:
    """Take ``out`` for ``command`` with ``options``: create it, lock it for this process
    (:class:`DirectoryBusy` while another runs it) and return ``(out, summary)`` where it holds
    a finished run with these options (nothing to do), else ``(out, None)`` after recording them
    (refused as :func:`check_options` refuses). With ``replace`` the directory's earlier summary
    and record give way (removed under the lock, the summary first: an interrupted rerun reads
    as unfinished) and the command runs again."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    lock_dir(out, command)
    if replace:
        for name in ("summary.json", OPTIONS_FILE):
            (out / name).unlink(missing_ok=True)
    done = finished(out, command, options)
    if done is not None:
        return out, done
    check_options(out, command, options)
    write_json(out / OPTIONS_FILE, {"command": command, "options": options})
    return out, None
