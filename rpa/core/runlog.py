"""Which process of a run this is, and the one way every command writes its progress lines
(stderr, timestamped, tagged with the rank in a multi-process run)."""

from __future__ import annotations

import os
import sys
import time


def world_size() -> int:
    """Processes of this run (``accelerate launch`` / ``torchrun`` set ``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def log(command: str, msg: str) -> None:
    """``[rpa COMMAND[ rank N] HH:MM:SS] msg`` on stderr."""
    who = f" rank {rank()}" if world_size() > 1 else ""
    print(f"[rpa {command}{who} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
