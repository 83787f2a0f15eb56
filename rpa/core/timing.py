"""Where a run's wall time goes: named phases timed with ``time.perf_counter`` and summed, for
``summary.json`` (``timings``) and ``benchmarks/bench_run.py``. Pure bookkeeping, no torch."""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from typing import Any, Callable


class Timings:
    """Seconds and calls per phase. Nested phases are each counted in full (``train`` holds
    ``generate``, which holds nothing else), so shares are of the run's wall time, not a partition."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def wrap(self, name: str, fn: Callable) -> Callable:
        """``fn`` timed as ``name`` on every call."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        return timed

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.calls[name] += 1

    def as_dict(self) -> dict[str, Any]:
        return {name: {"seconds": round(self.seconds[name], 3), "calls": self.calls[name]} for name in self.seconds}


def process_age_s() -> float | None:
    """Seconds since this process started (interpreter start and imports before a run begins)."""
    try:
        import psutil
    except ImportError:
        return None
    return time.time() - psutil.Process().create_time()
