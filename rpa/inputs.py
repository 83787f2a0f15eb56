"""Up-front checks of what a command is given, before anything heavy loads.

Each failure is an :class:`~rpa.errors.InputError` (or the checked module's own
:class:`~rpa.errors.UserError`) with one line naming the input; the CLI turns it into
exit 2.
"""

from __future__ import annotations

from pathlib import Path

from rpa.errors import InputError, looks_like_hub_id


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def check_model(spec: str) -> None:
    """A model directory with a ``config.json`` (or a hub id) whose architecture the
    aligned regions support (:func:`rpa.trainer.check_config`)."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InputError(f"model {spec}: directory without config.json (not a Hugging Face checkpoint)")
        source = str(path)
    elif path.exists():
        raise InputError(f"model {spec}: not a directory")
    elif looks_like_hub_id(spec):
        source = spec
    else:
        raise InputError(f"model {spec}: no such directory, and not a hub id of the form 'org/name'")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(source)
    except Exception as err:  # noqa: BLE001 - any failure to read the config is the user's input
        where = "its config.json" if path.is_dir() else "no such local directory; as a hub id"
        raise InputError(f"model {spec}: {where}: {_first_line(err)}") from None
    from rpa.trainer import UnsupportedModelError, check_config

    try:
        check_config(config)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"model {spec}: {err}") from None


def check_file(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what} {path}: no such file")
    if p.stat().st_size == 0:
        raise InputError(f"{what} {path}: empty file")
    return p
