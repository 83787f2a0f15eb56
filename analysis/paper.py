"""The paper's generated parts and its PDF: ``python -m analysis.paper --results R --out-dir R/paper``.

Writes ``front.tex`` (the abstract and the claims table, :mod:`analysis.paper_front`), ``claims.tex`` (the
study's label, the commit the runs came from, the collapse rule as the runs were judged by it -- written by
:func:`rpa.train.collapse.rule_text` from the thresholds in the runs' ``config.json``, one paragraph per distinct
set of thresholds -- the miniature's mismatch claims and sensitivity; ``\\commits``: every commit the results
came from, by part), ``probe_section.tex`` where main-job references are given (``--probe-results``) and, where the
positive control ran (in ``R`` or in ``--dose-results``: the dose grid and the study may live
in different results directories), ``dose_table.tex``; then builds ``paper/main.tex`` with ``latexmk``
(searching ``out-dir``, ``R/tables`` and ``R/figures`` for the generated files). Without a
TeX engine it says what to install and exits 1, after writing the generated parts.

The parts are written by :mod:`analysis.paper_claims` (``claims.tex``, ``dose_table.tex``; the rules
and commits from :mod:`analysis.paper_provenance`) and :mod:`analysis.paper_search` (the search
sections); this module is the command and the PDF build.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from analysis.paper_claims import dose_parts, write_claims  # noqa: F401
from analysis.paper_probe import probe_section
from analysis.paper_provenance import dose_rule, study_rule  # noqa: F401
from analysis.paper_search import precision_section, real_search_section, search_section
from analysis.refusal import run

REPO = Path(__file__).resolve().parents[1]
TEX_INSTALL = ("apt-get install latexmk texlive-latex-base texlive-latex-recommended texlive-fonts-recommended lmodern "
               "(Debian/Ubuntu), or any TeX Live with latexmk, pdflatex and booktabs")


def build(results: Path, out_dir: Path, dose_results: Path | None = None, search_results: Path | None = None,
          real_search_results: Path | None = None) -> int:
    if not shutil.which("latexmk") or not shutil.which("pdflatex"):
        print(f"analysis.paper: no TeX engine (latexmk + pdflatex) on PATH; the generated parts are in {out_dir}. "
              f"Install: {TEX_INSTALL}", file=sys.stderr)
        return 1
    folders = [out_dir, results / "tables", results / "figures"]
    if dose_results is not None:
        folders.append(dose_results / "figures")
    if search_results is not None:
        folders.append(search_results / "figures")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--dose-results", type=Path, default=None,
                        help="results directory of the positive control, if not --results")
    parser.add_argument("--search-results", type=Path, default=None,
                        help="results directory of the natural-collapse search (a section when it holds one)")
    parser.add_argument("--real-search-results", type=Path, default=None,
                        help="results directory of the real-model collapse search (a section when it holds one)")
    parser.add_argument("--precision-results", type=Path, default=None,
                        help="results directory of the precision x mismatch grid (a section when it holds one)")
    parser.add_argument("--probe-results", type=Path, action="append", default=[],
                        help="a main-job results directory whose SmolLM2 probe the paper reads (one per CPU type; "
                             "repeat the option for each)")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_claims(args.results, args.out_dir, args.dose_results, args.search_results, args.real_search_results,
                 args.precision_results, args.probe_results)
    probe_section(args.probe_results, args.out_dir)
    search_section(args.search_results, args.out_dir)
    real_search_section(args.real_search_results, args.out_dir)
    precision_section(args.precision_results, args.out_dir)
    sys.exit(build(args.results, args.out_dir, args.dose_results, args.search_results, args.real_search_results))


if __name__ == "__main__":
    raise SystemExit(run(main))
