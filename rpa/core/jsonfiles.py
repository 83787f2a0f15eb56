"""Result files written so that a kill never leaves half of one: whole files by write + rename
(:func:`write_json`, :func:`write_text`, or any writer through :func:`atomic_path`), JSON-lines logs appended a whole line per write
(:func:`append_jsonl`) and read back with a torn last line (a kill mid-append) dropped and,
when asked, cut from the file (:func:`read_jsonl`)."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

from rpa.core.errors import InputError


class DamagedFile(InputError):
    """A result or record file that is there but cannot be read as what it must be: said in one line naming it."""


def write_text(path: Path, text: str) -> None:
    """Write ``path`` atomically: a temporary file beside it, flushed, then renamed over it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` (same suffix, so writers that go by it still do) for a
    writer to fill (``df.to_csv``, ``fig.savefig``, a ``csv`` writer); renamed over ``path``
    when the block ends without an error, removed otherwise."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: Any, **kwargs: Any) -> None:
    write_text(path, json.dumps(data, indent=2, **kwargs) + "\n")


def append_jsonl(path: Path, record: dict[str, Any], **kwargs: Any) -> None:
    """Append one record as one line in one write (a kill leaves it whole or torn at the end,
    which :func:`read_jsonl` drops)."""
    with open(path, "a") as f:
        f.write(json.dumps(record, **kwargs) + "\n")
        f.flush()


def read_jsonl(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """The records of a JSON-lines file. A last line without its newline that does not parse
    (an append cut short) is dropped -- and with ``repair`` cut from the file; any other bad
    line is an error naming the file and line."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            if i == len(lines) - 1:  # the last line, with no newline after it: a torn append
                if repair:
                    write_text(path, "".join(json.dumps(r) + "\n" for r in records))
                break
            raise DamagedFile(f"{path}:{i + 1}: not a JSON record ({err})") from None
    return records


def read_record(path: Path, kind: type = dict) -> Any:
    """The JSON file ``path`` as a ``kind`` (a record: a JSON object by default), or :class:`DamagedFile` in one line
    naming the file and what is wrong with it (cut, not UTF-8, a list where an object must be, a folder)."""
    path = Path(path)
    if path.is_dir():
        raise DamagedFile(f"{path}: a folder where a JSON file must be")
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError:
        raise DamagedFile(f"{path}: not text (binary or damaged); a JSON file must be") from None
    except json.JSONDecodeError as err:
        raise DamagedFile(f"{path}: not valid JSON (cut or damaged? {err.msg} at line {err.lineno}, column "
                          f"{err.colno})") from None
    if not isinstance(data, kind):
        raise DamagedFile(f"{path}: a JSON {type(data).__name__} where a JSON {kind.__name__} must be "
                          "(damaged, or another file)".replace("JSON dict", "JSON object"))
    return data
