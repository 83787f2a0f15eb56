"""``python -m analysis.study``: :func:`analysis.study.command.main`."""

from analysis.refusal import run
from analysis.study.command import main

raise SystemExit(run(main))
