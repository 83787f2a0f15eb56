"""Every table and figure of every kind of experiment is a ``report()`` output: ``snakemake --report`` on
committed, finished results lists each with its caption (rules/experiments.smk, rules/report/)."""

import shutil
import zipfile

import pytest

from rpa.workflow.experiments import KINDS
from tests.conftest import REPO, tail
from tests.test_pipeline import snakemake


def test_every_table_and_figure_of_every_kind_is_reported():
    """The registry's side: a kind's every CSV table and every figure is among its reported outputs, and
    its caption exists (Markdown, LaTeX and JSON copies of a table are not shown twice)."""
    for kind in KINDS.values():
        shown = {name for name, path in kind.outputs.items() if path.endswith(".csv") or path.startswith("figures/")}
        assert shown and shown == set(kind.report), kind.name
        assert (REPO / "rules/report" / f"{kind.name}.rst").is_file(), kind.name


@pytest.mark.cli
@pytest.mark.parametrize("reference,configfile,tables,figures", [
    ("cpu", "toys.yaml", ["train.csv", "dose.csv", "dose_runs.csv", "dose_sensitivity.csv"],
     ["train_curves.png", "dose_response.png"]),
    ("collapse-cpu", "collapse-cpu.yaml", ["search_pilot.csv", "search_grid.csv", "search_lever.csv"], []),
], ids=["train-dose", "search"])
def test_snakemake_report_lists_every_table_and_figure(tmp_path, reference, configfile, tables, figures):
    """A real ``snakemake --report`` on a copy of a committed results folder: each table and figure the
    targets make is in the report, under its kind's heading."""
    res = tmp_path / reference
    shutil.copytree(REPO / "results/reference" / reference, res)
    targets = [str(res / "tables" / t) for t in tables]
    report = tmp_path / "report.zip"
    proc = snakemake("--report", str(report), "--configfile", f"experiments/{configfile}", "--config",
                     f"results={res}", "--", *targets)
    assert proc.returncode == 0, tail(proc)
    names = [n.rsplit("/", 1)[-1] for n in zipfile.ZipFile(report).namelist()]
    html = next(zipfile.ZipFile(report).read(n).decode() for n in zipfile.ZipFile(report).namelist()
                if n.endswith("report.html"))
    for f in tables + figures:
        assert f in names, (f, sorted(n for n in names if not n.endswith((".js", ".css", ".woff", ".woff2"))))
    headings = {"cpu": ["GRPO grid", "Positive control"], "collapse-cpu": ["Collapse search"]}[reference]
    assert all(h in html for h in headings)
