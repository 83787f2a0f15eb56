"""The colocated vLLM engine one ``rpa train`` process keeps from one run for the next (several runs in one
process, :func:`rpa.train.grpo.run_trains`). No TRL and no vLLM at import: a process whose runs are all finished
decides so without them (its engine is built by TRL, through :mod:`rpa.train.trl_adapter`, only when a run trains).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


ENGINE_FILES_SKIPPED = (".safetensors", ".bin", ".pt", "rpa_init.json")
"""Files of a checkpoint directory that do not make an engine: the weights (replaced when an
engine is taken over) and rpa's own notes."""


def checkpoint_layout(path: str) -> str:
    """A fingerprint of what a vLLM engine reads from checkpoint ``path`` besides the weights
    (``config.json``, the generation config, the tokenizer): two runs whose layouts are equal
    can share an engine once the second run's weights are loaded into it."""
    import hashlib

    digest = hashlib.sha256()
    if not Path(path).is_dir():  # a hub id: nothing local to compare, so only the same id matches
        return f"id:{path}"
    for file in sorted(Path(path).iterdir()):
        if file.is_file() and not file.name.endswith(ENGINE_FILES_SKIPPED):
            digest.update(file.name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


class EnginePool:
    """The colocated vLLM engine of the previous run of this process, kept for the next one
    (``rpa train`` with several runs). TRL builds one engine per trainer; a run whose engine
    would be built with the same arguments from a checkpoint of the same layout
    (:func:`checkpoint_layout`) takes the kept one instead: seeded at once as a new engine
    seeds itself (:func:`rpa.sides.engine.reseed_engine`), and given the run's weights before
    anything reads it (:class:`~rpa.train.trl_adapter.RpaGRPOTrainer`). A run that fails drops the engine."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.llm = None

    def get(self, build, kwargs: dict[str, Any]):
        """The engine for ``build(**kwargs)``, and whether it was taken over (True) or built."""
        from rpa.sides.engine import reseed_engine

        key = (checkpoint_layout(kwargs["model"]),
               tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k != "model")))
        if self.llm is not None and key == self.key:
            reseed_engine(self.llm)
            return self.llm, True
        self.drop()
        self.llm, self.key = build(**kwargs), key
        return self.llm, False

    def drop(self) -> None:
        from rpa.sides.engine import close_llm, release_memory

        if self.llm is not None:
            close_llm(self.llm)
            self.llm, self.key = None, None
            release_memory()
