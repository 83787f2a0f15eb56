"""The run directory of ``rpa train``: one process owns it, a finished run is left alone, a
killed one resumes from its last checkpoint with its metric log cut back to that step.

Layout: ``config.json``, ``init_model/``, ``checkpoint-N/``, ``metrics.jsonl``, ``eval.jsonl``,
``summary.json`` and ``.lock`` (an ``flock`` held while a process runs the directory).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rpa.core.jsonfiles import read_jsonl, read_record, write_text
from rpa.core.outdir import DirectoryBusy, differing_keys, lock_dir
from rpa.train.config import TrainConfig, TrainConfigError


class RunDirectoryBusy(DirectoryBusy):
    """Another ``rpa train`` holds the run directory."""


def lock_run_dir(out: Path) -> None:
    """An exclusive lock on ``out/.lock`` for the life of this process, or
    :class:`RunDirectoryBusy` (:func:`rpa.core.outdir.lock_dir`): a killed run leaves no stale
    lock, so its rerun resumes."""
    lock_dir(out, "train", RunDirectoryBusy)


def config_diff(recorded: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """The keys in which a run directory's ``config.json`` differs from the run ``cfg`` (after
    filling in the defaults of fields added since it was written, and resolving local paths):
    ``key: recorded -> requested``."""
    try:
        recorded = TrainConfig.from_dict(recorded).to_dict()
    except TrainConfigError as err:
        return [f"the recorded config is not valid now ({err})"]
    return differing_keys(recorded, cfg.to_dict())


def same_config(recorded: dict[str, Any], cfg: TrainConfig) -> bool:
    """Whether a run directory's ``config.json`` is the run ``cfg``: compared after filling in
    the defaults of fields added since it was written (a new option with its old behaviour as
    the default does not make a finished run "different") and resolving local paths."""
    return not config_diff(recorded, cfg)


def finished_summary(out: Path, cfg: TrainConfig) -> dict[str, Any] | None:
    """The summary of a run that has nothing left to do: all steps, or stopped by a blow-up
    (``collapsed``) or by the engines drifting apart (``diverged``) -- a rerun would stop there again.
    All steps: an ``ok`` summary of a run of at least ``cfg.steps`` steps, read from the config the
    summary records -- not from its ``steps``, which counts the logged steps (one per generated batch:
    9 for 36 optimizer steps at ``updates_per_generation`` 4)."""
    path = out / "summary.json"
    if not path.exists():
        return None
    summary = read_record(path)
    stopped = summary.get("status") in ("collapsed", "diverged")
    trained = (summary.get("config") or {}).get("steps", summary.get("steps", 0))
    if stopped or (summary.get("status") == "ok" and trained >= cfg.steps):
        return summary
    return None


def read_metrics(path: Path, repair: bool = False) -> list[dict[str, Any]]:
    """``metrics.jsonl`` / ``eval.jsonl`` records; a line torn by a kill mid-append is dropped."""
    return read_jsonl(path, repair=repair)


def _whole_state(checkpoint: Path) -> bool:
    """Whether ``checkpoint/trainer_state.json`` is there and parses (a kill can cut it short)."""
    try:
        json.loads((checkpoint / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return False
    return True


def latest_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint a run can resume from: one whose trainer state is whole."""
    ckpts = [p for p in out.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and _whole_state(p)]
    return max(ckpts, key=lambda p: int(p.name.split("-")[-1]), default=None)


def _logged_steps(checkpoint: Path) -> set[int]:
    """The optimizer steps the trainer had logged (a reward among the logs) when ``checkpoint`` was written."""
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    return {int(e["step"]) for e in state.get("log_history") or () if "reward" in e and "step" in e}


def resumable_checkpoint(out: Path, metrics: Path) -> Path | None:
    """The newest whole checkpoint whose logged steps are all in ``metrics`` (``metrics.jsonl``). A kill can cut the
    log's last line after a later checkpoint was written: resuming from that checkpoint would leave the cut step out
    of the log for good (the run reported success with a step missing), so an older checkpoint is taken instead, and
    with none the run starts again."""
    logged = {int(r["step"]) for r in read_metrics(metrics) if "step" in r}
    ckpts = sorted((p for p in out.glob("checkpoint-*") if p.name.split("-")[-1].isdigit() and _whole_state(p)),
                   key=lambda p: int(p.name.split("-")[-1]), reverse=True)
    return next((c for c in ckpts if _logged_steps(c) <= logged), None)


def drop_checkpoints(out: Path) -> list[str]:
    """Delete a finished run's ``checkpoint-*`` directories (``keep_checkpoints: false``); the names."""
    import shutil

    gone = sorted(p.name for p in out.glob("checkpoint-*") if p.is_dir())
    for name in gone:
        shutil.rmtree(out / name)
    return gone


def truncate_metrics(path: Path, last_step: int) -> int:
    """Keep records up to ``last_step`` (a resumed run re-logs the steps after its checkpoint)."""
    kept = [r for r in read_metrics(path, repair=True) if r["step"] <= last_step]
    write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(kept)


def wait_for(path: Path, rank: int, log, timeout_s: float = 3600) -> None:
    """Ranks other than 0 wait for a file rank 0 writes (before any process group exists)."""
    deadline = time.time() + timeout_s
    if not path.exists():
        log(f"waiting for rank 0 to write {path}")
    while not path.exists():
        if time.time() > deadline:
            raise TimeoutError(f"rank {rank}: {path} did not appear within {timeout_s:.0f} s")
        time.sleep(1.0)
