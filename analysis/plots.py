"""What every figure module shares: pyplot on the Agg backend (files only; no display on a cluster
node), set when this module is first imported -- figure modules import it, library code does not --
and :func:`save_figure`, which writes a figure atomically and frees it."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402

from rpa.core.jsonfiles import atomic_path  # noqa: E402

__all__ = ["plt", "save_figure"]


def save_figure(fig, path: Path, **savefig) -> None:
    """Write ``fig`` to ``path`` atomically (``savefig``: the keywords of ``Figure.savefig``) and close it."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, **savefig)
    plt.close(fig)
