"""Up-front checks of what a command is given, before anything heavy loads.

Each failure is an :class:`~rpa.core.errors.InputError` (or the checked module's own
:class:`~rpa.core.errors.UserError`) with one line naming the input; the CLI turns it into
exit 2.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from rpa.core.errors import InputError, looks_like_hub_id

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""A checkpoint directory holds one of these (the sharded ones with every shard they index)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A checkpoint directory's tokenizer: one of these beside ``tokenizer_config.json``."""


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def check_model(spec: str) -> Any:
    """A model directory with a ``config.json`` (or a hub id) whose architecture the
    aligned regions support (:func:`rpa.sides.trainer.check_config`); a local directory also needs
    its weights (whole, by their headers) and a tokenizer (:func:`check_checkpoint`). Returns
    the model's config."""
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

    if not path.is_dir():
        _check_hub_reachable(spec)
    try:
        config = AutoConfig.from_pretrained(source)
    except Exception as err:  # noqa: BLE001 - any failure to read the config is the user's input
        where = "its config.json" if path.is_dir() else "no such local directory; as a hub id"
        raise InputError(f"model {spec}: {where}: {_first_line(err)}") from None
    from rpa.sides.trainer import UnsupportedModelError, check_config

    try:
        check_config(config)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"model {spec}: {err}") from None
    if path.is_dir():
        check_checkpoint(path, spec)
    return config


def _check_hub_reachable(spec: str, timeout_s: float = 3.0) -> None:
    """A hub id not in the local cache needs the hub: refuse at once when it cannot be reached
    (offline mode, or no connection within ``timeout_s``), instead of after the hub client's
    retries (~30 s)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(spec, "config.json")
    if isinstance(cached, str):
        return
    if constants.HF_HUB_OFFLINE:
        raise InputError(f"model {spec}: no such local directory, and not in the Hugging Face cache (HF_HUB_OFFLINE "
                         f"is set)")
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
    except OSError as err:
        raise InputError(f"model {spec}: no such local directory, not in the Hugging Face cache, and the hub "
                         f"({constants.ENDPOINT}) cannot be reached ({type(err).__name__})") from None


def _safetensors_complete(path: Path) -> str | None:
    """Why a ``.safetensors`` file cannot be whole (header unreadable, data cut short), or None."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                return f"{path.name}: header longer than the file (truncated?)"
            header = json.loads(f.read(length))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        return f"{path.name}: unreadable safetensors header ({type(err).__name__})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        return f"{path.name}: {size} bytes, its header needs {8 + length + end} (truncated)"
    return None


def check_checkpoint(path: Path, spec: str) -> None:
    """Weights present (every shard an index names) and, for safetensors, whole by their
    headers; a tokenizer present. Checked before any engine starts on them."""
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not present:
        raise InputError(f"model {spec}: no weights ({' or '.join(WEIGHT_FILES[::2])}) in the directory")
    files = [path / present[0]]
    if present[0].endswith(".index.json"):
        try:
            shards = sorted(set(json.loads(files[0].read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            raise InputError(f"model {spec}: {present[0]}: unreadable index ({type(err).__name__})") from None
        files = [path / s for s in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InputError(f"model {spec}: {present[0]} names missing shard(s) {', '.join(missing[:3])}")
    for f in files:
        problem = _safetensors_complete(f) if f.suffix == ".safetensors" else None
        if problem:
            raise InputError(f"model {spec}: {problem}")
    if not (path / "tokenizer_config.json").is_file() or not any((path / t).is_file() for t in TOKENIZER_FILES):
        raise InputError(f"model {spec}: no tokenizer (tokenizer_config.json with one of "
                         f"{', '.join(TOKENIZER_FILES)}) in the directory")


def check_token_ids(completions: list[dict[str, Any]], vocab_size: int, source: str) -> None:
    """Every token id of ``completions`` within the model's vocabulary."""
    for c in completions:
        bad = [t for t in c["prompt_ids"] + c["completion_ids"] if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"completions {source}: record seq {c['seq']} has token id {bad[0]} outside the "
                             f"model's vocabulary (0..{vocab_size - 1})")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_output(out: str | Path, kind: str, inputs: tuple[str | Path, ...] = ()) -> None:
    """An output ``kind`` (``dir`` or ``file``) that can be written: not the other kind
    already, under a writable directory (not under a file), and neither an input nor inside
    one (``inputs``: model directories, files read)."""
    path = Path(out).expanduser()
    if kind == "dir" and path.exists() and not path.is_dir():
        raise InputError(f"--out {out}: is a file, not a directory")
    if kind == "file" and path.is_dir():
        raise InputError(f"--out {out}: is a directory; give the report's file path")
    base = _nearest_existing(path.parent if kind == "file" else path)
    if not base.is_dir():
        raise InputError(f"--out {out}: {base} is a file, so nothing can be written under it")
    if not os.access(base, os.W_OK | os.X_OK):
        raise InputError(f"--out {out}: {base} is not writable")
    resolved = path.resolve()
    for given in inputs:
        source = Path(given).expanduser().resolve()
        if source.exists() and (resolved == source or source in resolved.parents):
            raise InputError(f"--out {out}: is (or is inside) the input {given}; write the output elsewhere")


def check_file(path: str | Path, what: str) -> Path:
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{what} {path}: no such file")
    if p.stat().st_size == 0:
        raise InputError(f"{what} {path}: empty file")
    return p
