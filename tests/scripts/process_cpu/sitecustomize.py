"""Log every Python process's own CPU time at exit, for finding where ``make test``'s time goes (docs/testing.md).

Active only where this folder is on ``PYTHONPATH`` and ``RPA_PROCESS_LOG`` names a file: each process that exits
through ``atexit`` appends one JSON line (pid, parent pid, argv, wall and CPU seconds, the pytest-xdist worker and
the test that was running when it started, from ``PYTEST_CURRENT_TEST``). Processes killed by a signal or left
through ``os._exit`` write nothing. ``tests/scripts/process_cpu_report.py`` sums a log.
"""

import atexit
import json
import os
import resource
import sys
import time

_LOG = os.environ.get("RPA_PROCESS_LOG")
_START = time.time()


def _write() -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = {"pid": os.getpid(), "ppid": os.getppid(), "argv": [a[:200] for a in sys.orig_argv[:6]],
              "wall_s": round(time.time() - _START, 3), "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
              "worker": os.environ.get("PYTEST_XDIST_WORKER"),
              "test": (os.environ.get("PYTEST_CURRENT_TEST") or "").split(" ")[0] or None}
    try:
        with open(_LOG, "a") as f:  # one short line per process: appends from many processes stay whole
            f.write(json.dumps(record) + "\n")
    except OSError:
        pass


if _LOG:
    atexit.register(_write)
