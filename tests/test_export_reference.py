"""analysis.export_reference and analysis.restore_reference never remove what they were about to copy (issue 67):
one folder named twice or nested folders are refused, a reference is not replaced by fewer finished results unless
asked, a killed export leaves the reference whole, and two exports at once are refused -- each refusal one line, exit
2, the reference byte for byte as before."""

from __future__ import annotations

import json
import os

import pytest

from analysis import export_reference as ex
from analysis.refusal import Refused
from tests.test_collapse_search import _grid

pytestmark = pytest.mark.unit


def snapshot(root):
    """Every file under ``root`` with its bytes (what "removes nothing" is checked against)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _pipeline(root, cells=("none", "all")):
    """A results folder of the probe pipeline: a parity report, probe cells, a diagnosis."""
    (root / "parity").mkdir(parents=True)
    (root / "parity" / "m.json").write_text(json.dumps({"passed": True}))
    for cell in cells:
        probe = root / "probe" / "m" / cell
        probe.mkdir(parents=True)
        (probe / "summary.json").write_text(json.dumps({"mean_abs_dlogp": 0.01}))
        (probe / "tokens.csv").write_text("seq,position,token_id,logp_trainer,logp_sampler\n0,0,5,-1.0,-1.0\n")
    diag = root / "diagnose" / "m" / "none"
    diag.mkdir(parents=True)
    (diag / "summary.json").write_text("{}")
    (diag / "layers.csv").write_text("layer\n0\n")
    (root / "tables").mkdir()
    (root / "tables" / "probe.csv").write_text("model,config\nm,none\n")
    return root


def _reference(tmp_path, what):
    """A committed reference made by an export of a complete results folder."""
    src = tmp_path / "full"
    _grid(src, none_falls=0, fp32_falls=0) if what == "search" else _pipeline(src)
    ref = tmp_path / "reference"
    ex.export(src, ref, what)
    return src, ref


@pytest.mark.parametrize("what", ["search", "pipeline"])
def test_one_folder_named_twice_or_nested_is_refused_and_nothing_is_removed(tmp_path, what):
    src, ref = _reference(tmp_path, what)
    before, results_before = snapshot(ref), snapshot(src)
    inner = ref / "sub"  # results inside the reference
    inner.mkdir()
    (inner / "x").write_text("x")
    before = snapshot(ref)
    for results, out, says in ((ref, ref, "one folder"), (src, src, "one folder"), (inner, ref, "nested"),
                               (ref, ref / "sub" / "ref", "nested"), (ref / ".", ref, "one folder")):
        with pytest.raises(Refused, match=says):
            ex.export(results, out, what)
        assert snapshot(ref) == before and snapshot(src) == results_before
    assert not ex.stage_folder(ref).exists()


@pytest.mark.parametrize("what", ["search", "pipeline"])
def test_fewer_finished_results_do_not_replace_a_reference_unless_asked(tmp_path, what, capsys):
    src, ref = _reference(tmp_path, what)
    before = snapshot(ref)
    partial = tmp_path / "partial"  # a results folder holding part of what the reference holds
    if what == "search":
        _grid(partial, none_falls=0, fp32_falls=0)
        for run in sorted((partial / "search" / "grid").glob("*/*/seed*"))[2:]:
            (run / "summary.json").unlink()  # only 2 runs finished
    else:
        _pipeline(partial, cells=("none",))
    with pytest.raises(Refused, match="finished results and the export brings"):
        ex.export(partial, ref, what)
    assert snapshot(ref) == before and not ex.stage_folder(ref).exists()
    ex.export(partial, ref, what, allow_fewer=True)  # asked for: done, and said
    assert "finished results, now" in capsys.readouterr().err
    assert snapshot(ref) != before
    ex.export(src, ref, what)  # the complete results put back: the reference as it was
    assert snapshot(ref) == before


def test_a_killed_export_leaves_the_reference_whole_or_is_completed(tmp_path, monkeypatch):
    src, ref = _reference(tmp_path, "search")
    before = snapshot(ref)
    calls = []

    def killed_copy(*args, **kwargs):  # the build dies half-way: nothing of the reference was touched
        calls.append(args)
        if len(calls) > 5:
            raise KeyboardInterrupt
        return real_copy(*args, **kwargs)

    real_copy = ex.shutil.copy2
    monkeypatch.setattr(ex.shutil, "copy2", killed_copy)
    with pytest.raises(KeyboardInterrupt):
        ex.export(src, ref, "search")
    monkeypatch.undo()
    assert snapshot(ref) == before
    real_replace = os.replace

    def killed_swap(a, b):  # the swap dies between moving the old grid aside and putting the new one in
        if a == ex.stage_folder(ref) / "search" / "grid":
            raise KeyboardInterrupt
        return real_replace(a, b)

    monkeypatch.setattr(ex.os, "replace", killed_swap)
    with pytest.raises(KeyboardInterrupt):
        ex.export(src, ref, "search")
    monkeypatch.undo()
    assert not (ref / "search" / "grid").exists()  # moved aside, the new one not yet in place
    assert (ex.stage_folder(ref) / ex.SWAP_JOURNAL).is_file()
    ex.export(src, ref, "search")
    assert snapshot(ref) == before and not ex.stage_folder(ref).exists()


def test_a_second_export_into_the_same_reference_is_refused_while_one_runs(tmp_path):
    src, ref = _reference(tmp_path, "search")
    before = snapshot(ref)
    with ex.export_lock(ref):
        with pytest.raises(Refused, match="another export into"):
            ex.export(src, ref, "search")
    assert snapshot(ref) == before


@pytest.mark.cli
def test_the_commands_refuse_in_one_line_with_exit_2(tmp_path):
    from tests.conftest import run_py

    src, ref = _reference(tmp_path, "search")
    before = snapshot(ref)
    proc = run_py(["-m", "analysis.export_reference", "--results", str(ref), "--out", str(ref), "--what", "search"])
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "one folder" in proc.stderr and snapshot(ref) == before
    results = tmp_path / "results"
    for reference, out in ((ref, ref), (ref, ref / "search"), (ref / "search", ref)):
        proc = run_py(["-m", "analysis.restore_reference", "--reference", str(reference), "--results", str(out)])
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert snapshot(ref) == before and not results.exists()


@pytest.mark.cli
@pytest.mark.parametrize("argv, needle", [
    (["aggregate", "--out-dir", "{out}"], "no probe summaries under"),
    (["attribution", "--out-dir", "{out}", "--figure", "{out}/f.png"], "no attribution summaries under"),
    (["probe_sampling", "--out-dir", "{out}"], "no probe cells at other sampling settings"),
    (["study"], "no such grid manifest"),
    (["collapse_search", "--stage", "grid", "--figure", "{out}/f.png"], "no such grid manifest"),
])
def test_the_analysis_commands_refuse_with_exit_2_in_one_line(tmp_path, argv, needle):
    """Issue 67: the analysis commands' one-line refusals exited 1 where every other command exits 2."""
    from tests.conftest import run_py

    results, out = tmp_path / "results", tmp_path / "out"
    results.mkdir()
    args = [a.format(out=out) for a in argv]
    proc = run_py(["-m", f"analysis.{args[0]}", "--results", str(results), *args[1:]])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]
