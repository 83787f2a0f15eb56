"""``python -m analysis.paper``: :func:`analysis.paper.build.main`."""

from analysis.paper.build import main
from analysis.refusal import run

raise SystemExit(run(main))
