"""The paper's generated parts and its PDF: ``python -m analysis.paper --results R --out-dir R/paper`` (the command).

Writes ``front.tex`` (the abstract and the claims table, :mod:`analysis.paper.front`), ``claims.tex`` (the
study's label, the commit the runs came from, the collapse rule as the runs were judged by it -- written by
:func:`rpa.train.collapse.rule_text` from the thresholds in the runs' ``config.json``, one paragraph per distinct
set of thresholds -- the miniature's mismatch claims and sensitivity; ``\\commits``: every commit the results
came from, by part), and a section for each further part the command is given (``--section KIND=DIR``, the
config's ``paper.sections``: the real model's probe, the searches, the precision grid; the positive control's
``dose_table.tex`` from a ``dose`` section, else from ``R`` where the study's results hold one); then builds ``paper/main.tex`` with ``latexmk``
(searching ``out-dir``, ``R/tables`` and ``R/figures`` for the generated files). Without a
TeX engine it says what to install and exits 1, after writing the generated parts.

The parts are written by :mod:`analysis.paper.claims` (``claims.tex``, ``dose_table.tex``; the rules
and commits from :mod:`analysis.paper.provenance`), :mod:`analysis.paper.front`, :mod:`analysis.paper.probe`
and :mod:`analysis.paper.search` (the search sections); this module is the command and the PDF build.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from analysis.paper.claims import write_claims
from analysis.paper.probe import probe_section
from analysis.paper.search import precision_section, real_search_section, search_section
from analysis.refusal import Refused
from rpa.workflow.paper import SECTION_KINDS, by_kind, first, parse_section, section_inputs, sections_problem

REPO = Path(__file__).resolve().parents[2]
TEX_INSTALL = ("apt-get install latexmk texlive-latex-base texlive-latex-recommended texlive-fonts-recommended lmodern "
               "(Debian/Ubuntu), or any TeX Live with latexmk, pdflatex and booktabs")


def build(results: Path, out_dir: Path, sections: dict[str, list[Path]]) -> int:
    if not shutil.which("latexmk") or not shutil.which("pdflatex"):
        print(f"analysis.paper: no TeX engine (latexmk + pdflatex) on PATH; the generated parts are in {out_dir}. "
              f"Install: {TEX_INSTALL}", file=sys.stderr)
        return 1
    # the figures a section includes by name: the study's, the positive control's and the search's (the other
    # sections copy theirs into out_dir)
    folders = [out_dir, results / "tables", results / "figures",
               *(folder / "figures" for kind in ("dose", "search") for folder in sections[kind])]
    search = os.pathsep.join(str(p.resolve()) for p in folders)
    env = {**os.environ, "TEXINPUTS": search + os.pathsep + os.environ.get("TEXINPUTS", "")}
    proc = subprocess.run(["latexmk", "-pdf", "-interaction=nonstopmode", "-halt-on-error",
                           f"-outdir={out_dir.resolve()}", str(REPO / "paper" / "main.tex")],
                          env=env, capture_output=True, text=True)
    if proc.returncode:
        print(proc.stdout[-4000:], proc.stderr[-2000:], file=sys.stderr)
        return proc.returncode
    print(f"analysis.paper: {out_dir / 'main.pdf'}")
    return 0


def _section(text: str) -> tuple[str, Path]:
    try:
        return parse_section(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--section", type=_section, action="append", default=[], metavar="KIND=DIR",
                        help="a further part of the paper: KIND one of " + ", ".join(SECTION_KINDS)
                             + " (rpa.workflow.paper.SECTION_KINDS), DIR its results directory; repeat for each "
                               "(probe once per CPU type)")
    args = parser.parse_args()
    problem = sections_problem(args.section)
    if problem:
        raise Refused(problem)
    missing = [f for f in section_inputs(args.section) if not Path(f).exists()]
    if missing:
        raise Refused(f"--section: {missing[0]} does not exist" + (f" (and {len(missing) - 1} more)"
                                                                     if len(missing) > 1 else ""))
    sections = by_kind(args.section)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_claims(args.results, args.out_dir, sections)
    probe_section(sections["probe"], args.out_dir)
    search_section(first(sections, "search"), args.out_dir)
    real_search_section(first(sections, "real-search"), args.out_dir)
    precision_section(first(sections, "precision"), args.out_dir)
    sys.exit(build(args.results, args.out_dir, sections))

