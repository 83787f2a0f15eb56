"""The GRPO grid's table under its older command (the train aggregate rule's):
``python -m analysis.train_summary --results R --out-table F --out-md F --out-figure F`` is
``python -m analysis.grid_summary --results R --train --out-csv F --out-md F --out-figure F``
(:func:`analysis.grid_summary.write_train`, which reads the grid from ``R/train/manifest.json``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from analysis.grid_summary import write_train
from analysis.refusal import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-table", required=True, type=Path)
    parser.add_argument("--out-md", required=True, type=Path)
    parser.add_argument("--out-figure", required=True, type=Path)
    args = parser.parse_args(argv)
    return write_train(args.results, args.out_table, args.out_md, args.out_figure)


if __name__ == "__main__":
    raise SystemExit(run(main))
