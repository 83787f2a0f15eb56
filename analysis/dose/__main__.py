"""``python -m analysis.dose``: :func:`analysis.dose.command.main`."""

from analysis.dose.command import main
from analysis.refusal import run

raise SystemExit(run(main))
