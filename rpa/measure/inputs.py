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

from rpa.core.errors import HUB_ID_FORM, InputError, looks_like_hub_id

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
"""A checkpoint directory holds one of these (the sharded ones with every shard they index)."""

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
"""A checkpoint directory's tokenizer: one of these beside ``tokenizer_config.json``."""


def _first_line(err: BaseException, limit: int = 240) -> str:
    """An exception in one line: its message's lines joined (some libraries put the reason on the
    second), cut at ``limit`` characters."""
    text = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return f"{type(err).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"


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
        raise InputError(f"model {spec}: no such directory, and not {HUB_ID_FORM}")
    from transformers import AutoConfig

    if not path.is_dir():
        problem = hub_problem(spec)
        if problem:
            raise InputError(f"model {spec}: {problem}")
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
    check_config_values(config, spec, path / "generation_config.json" if path.is_dir() else None)
    if path.is_dir():
        check_causal_lm(config, spec)
        check_checkpoint(path, spec, config)
    return config


def _nonfinite(value: Any, key: str = "") -> str | None:
    """The key (``a.b``, ``a[1]``) of the first number in ``value`` that is not finite, or None."""
    import math

    if isinstance(value, float):
        return key if not math.isfinite(value) else None
    if isinstance(value, dict):
        return next((k for name, v in value.items() if (k := _nonfinite(v, f"{key}.{name}" if key else str(name)))),
                    None)
    if isinstance(value, (list, tuple)):
        return next((k for i, v in enumerate(value) if (k := _nonfinite(v, f"{key}[{i}]"))), None)
    return None


def _token_ids(value: Any) -> list[Any]:
    return list(value) if isinstance(value, (list, tuple)) else [] if value is None else [value]


def check_config_values(config, spec: str, generation_config: Path | None = None) -> None:
    """``config.json`` holds finite numbers (a NaN ``rms_norm_eps`` gives NaN logits, found only as
    an empty sample far downstream) and an ``eos_token_id`` inside the vocabulary (an engine would
    never sample it, so generation could not stop); the same of ``generation_config.json``'s
    ``eos_token_id`` where ``generation_config`` names one that exists."""
    key = _nonfinite(config.to_dict())
    if key is not None:
        raise InputError(f"model {spec}: config.json's {key} is not a finite number")
    vocab = getattr(config, "vocab_size", None)
    sources = [("config.json", getattr(config, "eos_token_id", None))]
    if generation_config is not None and generation_config.is_file():
        try:
            sources.append((generation_config.name, json.loads(generation_config.read_text()).get("eos_token_id")))
        except (OSError, ValueError, AttributeError) as err:
            raise InputError(f"model {spec}: {generation_config.name}: unreadable ({type(err).__name__})") from None
    for name, eos in sources:
        for token in _token_ids(eos):
            if isinstance(token, bool) or not isinstance(token, int) or (vocab and not 0 <= token < vocab):
                raise InputError(f"model {spec}: {name}'s eos_token_id {token!r} is outside the vocabulary "
                                 f"(0..{vocab - 1 if vocab else '?'}): no engine can sample it, so generation "
                                 f"would never stop on it")


def check_causal_lm(config, spec: str) -> None:
    """``config.json`` names the family's causal LM (what both engines load): not missing, not a
    classification or QA head."""
    from rpa.sides.trainer import ARCHITECTURES

    want = f"{ARCHITECTURES[config.model_type].prefix}ForCausalLM"
    names = getattr(config, "architectures", None)
    if not names:
        raise InputError(f"model {spec}: config.json names no architectures (expected [{want!r}])")
    if want not in names:
        raise InputError(f"model {spec}: config.json's architectures {names} is not the causal LM {want!r} both "
                         f"engines load (a classification or QA head is trained elsewhere)")


def hub_problem(spec: str, timeout_s: float = 3.0) -> str | None:
    """Why the hub id ``spec`` (no local directory) cannot be loaded now, or None: not in the local
    cache and the hub unreachable (offline mode, or no connection within ``timeout_s``) -- said at
    once, instead of after the hub client's retries (~30 s) or when a workflow's job loads it."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    cached = try_to_load_from_cache(spec, "config.json")
    if isinstance(cached, str):
        return None
    if constants.HF_HUB_OFFLINE:
        return "no such local directory, and not in the Hugging Face cache (HF_HUB_OFFLINE is set)"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
    except OSError as err:
        return (f"no such local directory, not in the Hugging Face cache, and the hub ({constants.ENDPOINT}) cannot "
                f"be reached ({type(err).__name__})")
    return None


def _ints(value: Any, count: int | None = None) -> bool:
    return isinstance(value, list) and (count is None or len(value) == count) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)


def safetensors_header(path: Path) -> tuple[dict[str, tuple[int, ...]] | None, str | None]:
    """``({tensor: shape}, None)`` from a ``.safetensors`` file's header, or ``(None, why)`` when the
    header cannot be read or does not describe whole tensors: not a mapping, an entry without
    ``dtype`` / ``shape`` / ``data_offsets``, or data past the end of the file (truncated)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                return None, f"{path.name}: header longer than the file (truncated?)"
            header = json.loads(f.read(length))
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
        return None, f"{path.name}: unreadable safetensors header ({type(err).__name__})"
    if not isinstance(header, dict):
        return None, f"{path.name}: safetensors header is a JSON {type(header).__name__}, not a mapping"
    shapes, end = {}, 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str) or not _ints(entry.get("shape")) \
                or not _ints(entry.get("data_offsets"), 2) or entry["data_offsets"][0] > entry["data_offsets"][1]:
            return None, (f"{path.name}: header entry {name!r} is not a tensor description (dtype, shape, "
                          f"data_offsets [begin, end])")
        shapes[name] = tuple(entry["shape"])
        end = max(end, entry["data_offsets"][1])
    if 8 + length + end > size:
        return None, f"{path.name}: {size} bytes, its header needs {8 + length + end} (truncated)"
    return shapes, None


FLOAT_EXPONENTS: dict[str, tuple[str, int]] = {
    "BF16": ("<u2", 0x7F80), "F16": ("<u2", 0x7C00), "F32": ("<u4", 0x7F80_0000), "F64": ("<u8", 0x7FF0_0000_0000_0000),
}
"""safetensors dtype -> (the same-width unsigned integer, its exponent bits): an element with every
exponent bit set is NaN or infinite. FP8 and integer tensors are not scanned."""

SCAN_CHUNK_BYTES = 64 << 20
"""Bytes of one tensor examined at a time by :func:`nonfinite_tensor` (bounds its temporary arrays)."""


def nonfinite_tensor(path: Path) -> str | None:
    """The name of the first floating-point tensor of the ``.safetensors`` file ``path`` (whose
    header :func:`safetensors_header` accepted) that holds a NaN or an infinity, or None. The data
    are read through a memory map, a chunk at a time, by their exponent bits (no tensor is built)."""
    import numpy as np

    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + length)
    for name, entry in header.items():
        if name == "__metadata__" or entry["dtype"] not in FLOAT_EXPONENTS:
            continue
        kind, exponent = FLOAT_EXPONENTS[entry["dtype"]]
        width = np.dtype(kind).itemsize
        begin, end = entry["data_offsets"]
        step = SCAN_CHUNK_BYTES - SCAN_CHUNK_BYTES % width
        for lo in range(begin, end, step):
            chunk = data[lo:min(end, lo + step)].view(kind)
            if np.any((chunk & exponent) == exponent):
                return name
    return None


def _weight_files(path: Path, spec: str) -> list[Path]:
    """The checkpoint's safetensors files (every shard its index names), or :class:`InputError`."""
    present = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not present:
        raise InputError(f"model {spec}: no weights ({' or '.join(WEIGHT_FILES[::2])}) in the directory")
    if not present[0].startswith("model.safetensors"):  # pytorch_model.bin[.index.json] only
        raise InputError(f"model {spec}: {present[0]} only: rpa checks a checkpoint's weights by their safetensors "
                         f"headers before any engine starts; save it with save_pretrained(safe_serialization=True)")
    files = [path / present[0]]
    if present[0].endswith(".index.json"):
        try:
            weight_map = json.loads(files[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise InputError(f"model {spec}: {present[0]}: unreadable index ({type(err).__name__})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in weight_map.items()):
            raise InputError(f"model {spec}: {present[0]}: weight_map must map tensor names to shard file names "
                             f"(strings)")
        files = [path / s for s in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise InputError(f"model {spec}: {present[0]} names missing shard(s) {', '.join(missing[:3])}")
    return files


def check_tokenizer(path: Path, spec: str, vocab_size: int | None) -> None:
    """A tokenizer present, its ``tokenizer.json`` (where it has one) readable, and no token id past
    the embedding (``vocab_size``): a sampled id outside it would crash an engine mid-run."""
    if not (path / "tokenizer_config.json").is_file() or not any((path / t).is_file() for t in TOKENIZER_FILES):
        raise InputError(f"model {spec}: no tokenizer (tokenizer_config.json with one of "
                         f"{', '.join(TOKENIZER_FILES)}) in the directory")
    fast = path / "tokenizer.json"
    if not fast.is_file():
        return
    try:
        data = json.loads(fast.read_text())
        vocab = data["model"]["vocab"]
        ids = [int(i) for i in (vocab.values() if isinstance(vocab, dict) else range(len(vocab)))]
        ids += [int(t["id"]) for t in data.get("added_tokens") or []]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise InputError(f"model {spec}: tokenizer.json: unreadable ({type(err).__name__}: "
                         f"{str(err).splitlines()[0][:80] if str(err) else ''})") from None
    if vocab_size is not None and ids and max(ids) >= vocab_size:
        raise InputError(f"model {spec}: the tokenizer has token id {max(ids)}, past the model's vocab_size "
                         f"{vocab_size} (config.json): the embedding has no row for it")


def check_weights_fit(config, shapes: dict[str, tuple[int, ...]], spec: str) -> None:
    """The checkpoint's tensors are the ones the config's model has, with their shapes (names and
    shapes from a model built on the ``meta`` device: no weights loaded). Refuses fewer layers, another
    head_dim, Qwen2 weights under a Qwen3 config (biases, no q/k norms), a vocabulary the embedding
    does not have."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = sorted(set(want) - set(shapes) - tied)
    if missing:
        raise InputError(f"model {spec}: the weights lack {len(missing)} tensor(s) the config's model has, e.g. "
                         f"{missing[0]} (fewer layers, or another architecture's weights?)")
    unexpected = sorted(k for k in set(shapes) - set(want) if not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise InputError(f"model {spec}: the weights hold {len(unexpected)} tensor(s) the config's model does not, "
                         f"e.g. {unexpected[0]} (another architecture's weights?)")
    for name, shape in sorted(shapes.items()):
        if name in want and want[name] != shape:
            raise InputError(f"model {spec}: tensor {name} is {list(shape)} in the weights, {list(want[name])} for "
                             f"the config (another head_dim, width or vocabulary?)")


def check_checkpoint(path: Path, spec: str, config=None) -> None:
    """Weights present (every shard an index names), whole by their safetensors headers and, with
    ``config``, the tensors the config's model has, every floating-point value finite
    (:func:`nonfinite_tensor`); a tokenizer present and within the vocabulary. Checked before any
    engine starts on them, without loading a weight into a model."""
    shapes: dict[str, tuple[int, ...]] = {}
    files = _weight_files(path, spec)
    for f in files:
        found, problem = safetensors_header(f)
        if problem:
            raise InputError(f"model {spec}: {problem}")
        shapes.update(found)
    check_tokenizer(path, spec, getattr(config, "vocab_size", None))
    if config is not None:
        check_weights_fit(config, shapes, spec)
    for f in files:
        bad = nonfinite_tensor(f)
        if bad is not None:
            raise InputError(f"model {spec}: tensor {bad} in {f.name} holds NaN or infinite values (damaged weights)")


def check_token_ids(completions: list[dict[str, Any]], vocab_size: int, source: str) -> None:
    """Every token id of ``completions`` within the model's vocabulary."""
    for c in completions:
        bad = [t for t in c["prompt_ids"] + c["completion_ids"] if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"completions {source}: record seq {c['seq']} has token id {bad[0]} outside the "
                             f"model's vocabulary (0..{vocab_size - 1})")


def check_lengths(sequences: list[tuple[str, int]], max_model_len: int, source: str, hint: str = "") -> None:
    """Every sequence vLLM is given (``(label, tokens)``) shorter than its context ``max_model_len``:
    vLLM samples a token after each, so one of ``max_model_len`` tokens or more is refused inside
    the engine, after it started. ``hint``: how to give the engine a longer context."""
    for label, tokens in sequences:
        if tokens >= max_model_len:
            raise InputError(f"{source}: {label} has {tokens} tokens; the engine's context (max_model_len "
                             f"{max_model_len}) holds at most {max_model_len - 1} before the token vLLM samples"
                             f"{hint}")


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


OUTPUT_MARKS: dict[str, tuple[str, ...]] = {
    "train": ("metrics.jsonl", "init_model"),
    "probe": ("tokens.csv",),
    "diagnose": ("layers.csv",),
    "attribute": ("ops.csv",),
    "convert": ("rpa_source.json",),
    "tiny": ("rpa_tiny.json",),
    "warm-start": ("rpa_init.json",),
}
"""Files that only one command writes into its output directory: a directory holding another
command's is refused (a train run into a finished probe's directory overwrote its summary)."""


def _made_by(path: Path) -> str | None:
    """The command whose output the directory ``path`` holds, by its files (or its options.json)."""
    try:
        recorded = json.loads((path / "options.json").read_text()).get("command")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded:
        return recorded
    return next((command for command, marks in OUTPUT_MARKS.items() if any((path / m).exists() for m in marks)),
                None)


def check_output(out: str | Path, kind: str, inputs: tuple[str | Path, ...] = (), command: str | None = None) -> None:
    """An output ``kind`` (``dir`` or ``file``) that can be written: not the other kind
    already, not empty or a dangling link, under a writable directory (not under a file), neither an
    input nor inside one (``inputs``: model directories, files read), and, for ``command``'s
    directory, not holding another command's output."""
    if str(out).strip() == "":
        raise InputError("--out is empty: name the output path")
    path = Path(out).expanduser()
    if path.is_symlink() and not path.exists():
        raise InputError(f"--out {out}: a symbolic link to {os.readlink(path)}, which does not exist")
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
    if kind == "dir" and command is not None and path.is_dir():
        other = _made_by(path)
        if other is not None and other != command:
            raise InputError(f"--out {out}: holds the output of rpa {other}; rpa {command} writes elsewhere (use "
                             f"another directory)")
