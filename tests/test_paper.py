"""The paper: it states the collapse rule its results were judged with (written from the runs'
thresholds, never hard-coded), every generated table fits the text width whatever its column
count, and the figures' arms and models are told apart and in order."""

import json
import re
import shutil
import subprocess

import pandas as pd
import pytest

from tests.conftest import REPO, assert_figure, run_py, tail

REFERENCE = REPO / "results/reference/study-cpu"
DOSE = REPO / "results/reference/cpu"  # the committed positive control, another results directory
HAVE_TEX = bool(shutil.which("latexmk") and shutil.which("pdflatex"))


@pytest.fixture
def tex():
    """TeX for the tests that build a PDF: skipped without it, failed where it is required (tests.conftest)."""
    from tests.conftest import skip_unless_present

    skip_unless_present("tex", None if HAVE_TEX else "no latexmk/pdflatex")


def _macro(claims: str, name: str) -> str:
    match = re.search(r"^\\newcommand\{\\" + name + r"\}\{(.*)\}$", claims, re.M)
    assert match, f"no \\{name} in claims.tex"
    return match.group(1)


def _thresholds(paths):
    from rpa.train.collapse import CollapseThresholds

    return {CollapseThresholds(**json.loads(p.read_text())["collapse"]) for p in paths}


def _committed(path):
    """A committed reference path: the committed results are part of the contract, so a missing
    one fails the test (never skips it)."""
    assert path.exists(), f"committed reference data missing: {path}"
    return path


def test_claims_state_the_collapse_rule_of_the_runs_thresholds(tmp_path):
    _committed(REFERENCE / "study/manifest.json")
    from analysis.latex import escape
    from analysis.paper.claims import write_claims
    from rpa.train.collapse import rule_text

    write_claims(REFERENCE, tmp_path, {"dose": [DOSE]})
    claims = (tmp_path / "claims.tex").read_text()
    (study,) = _thresholds(REFERENCE.glob("study/*/*/seed*/config.json"))  # one set in the committed runs
    assert _macro(claims, "collapserule") == escape(rule_text(study))
    dose = _thresholds(DOSE.glob("dose/*/*/seed*/config.json"))
    doserule = _macro(claims, "doserule")
    assert doserule == ("Its runs were judged by the same collapse rule as the study's." if dose == {study}
                        else doserule) and doserule


def test_main_tex_takes_the_rule_from_claims_not_from_its_own_text():
    tex = (REPO / "paper/main.tex").read_text()
    assert "\\collapserule" in tex and "\\doserule" in tex
    prose = re.sub(r"%.*", "", tex).lower()
    for hard_coded in ("five steps", "five consecutive", "half of its running best", "5 steps"):
        assert hard_coded not in prose
    # the sensitivity table is a declared output of the study's tables (rules/experiments.smk), so the paper
    # inputs it outright: a missing one stops the build instead of leaving the section out unseen
    assert "\\input{study_sensitivity.tex}" in tex and "\\IfFileExists{study_sensitivity.tex}" not in tex


def _fake_study(root, cells, collapse_of):
    models = list(dict.fromkeys(m for m, _, _ in cells))
    arms = list(dict.fromkeys(a for _, a, _ in cells))
    manifest = {"models": models, "arms": arms, "seeds": sorted({s for _, _, s in cells}), "reference_arm": arms[0],
                "label": "fake", "cells": [{"cell": f"{m}/{a}/seed{s}", "model": m, "arm": a, "seed": s}
                                           for m, a, s in cells]}
    for m, a, s in cells:
        d = root / "study" / m / a / f"seed{s}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"collapse": collapse_of(m, a, s)}))
    return manifest


def test_runs_judged_with_different_thresholds_get_one_rule_each_with_their_runs(tmp_path):
    from analysis.paper.provenance import dose_rule, study_rule
    from rpa.train.collapse import CollapseThresholds, rule_text
    from rpa.workflow.manifest import manifest_text

    base = {"smoothing_window": 5, "drop_fraction": 0.5, "min_best_reward": 0.05, "spike_factor": 10.0,
            "spike_warmup_steps": 5, "min_steps_after_drop": 5}
    cells = [(m, a, s) for m in ("xs", "l") for a in ("none", "all", "tis") for s in (0, 1)]

    def collapse_of(m, a, s):
        if a == "tis":  # a whole arm with a longer persistence window
            return {**base, "min_steps_after_drop": 8}
        if (m, a, s) == ("l", "all", 1):  # and one run with another drop fraction
            return {**base, "drop_fraction": 0.4}
        return base

    manifest = _fake_study(tmp_path, cells, collapse_of)
    text, used = study_rule(tmp_path, manifest)
    assert len(used) == 3 and text.startswith("The runs were judged with 3 different sets of thresholds.")
    for t in used:
        assert rule_text(t) in text
    assert "arm tis (every model)" in text and "l/all (seed 1)" in text
    assert "for 8 consecutive" in text and "below 0.4 times" in text

    same, _ = study_rule(tmp_path / "same", _fake_study(tmp_path / "same", cells, lambda *_: base))
    assert same == rule_text(CollapseThresholds(**base))

    dose = tmp_path / "dose-results"
    run = dose / "dose" / "perturb-mantissa2" / "off-sampler" / "seed0"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"collapse": {**base, "min_steps_after_drop": 3}}))
    (dose / "dose" / "manifest.json").write_text(manifest_text("dose", [{
        "cell": "perturb-mantissa2/off-sampler/seed0", "seed": 0, "model": "m",
        "labels": {"arm": "perturb-mantissa2", "is_correction": "off", "old_logprobs": "sampler"}}], {"doses": {}}))
    said = dose_rule(dose, {CollapseThresholds(**base)})
    assert "for 3 consecutive" in said and "same collapse rule" not in said


def test_a_wide_table_is_scaled_only_when_wider_and_long_headers_wrap():
    from analysis.latex import booktabs, wrap_header

    assert wrap_header("median_collapse_step", 8) == ["median_", "collapse_", "step"]
    assert wrap_header("arm", 8) == ["arm"]
    narrow = booktabs(pd.DataFrame({"model": ["a"], "arm": ["b"]}), "narrow", "tab:n")
    wide = booktabs(pd.DataFrame({f"column_number_{i}": [f"+{i}.0% [-1.0, +2.0]"] for i in range(14)}), "wide", "tab:w")
    for tex in (narrow, wide):  # the scaling is decided by TeX, measured against \linewidth
        assert "\\ifdim\\wd\\rpatablebox>\\linewidth\\resizebox{\\linewidth}{!}" in tex
        assert "\\toprule" in tex and "\\bottomrule" in tex
    assert "\\small" in narrow and "\\scriptsize" in wide


@pytest.mark.usefixtures("tex")
@pytest.mark.parametrize("columns", [2, 9, 16, 30])
def test_generated_tables_of_any_width_fit_the_text(tmp_path, columns):
    from analysis.latex import booktabs

    df = pd.DataFrame({f"a_long_column_name_{i}": [f"{i}.123 ± 0.045", "--", "mini-xs/positions-stock"][: 3]
                       for i in range(columns)})
    tables = "\n".join(booktabs(df, f"{columns} columns", f"tab:{k}") for k in range(2))  # the box is reused
    (tmp_path / "t.tex").write_text(
        "\\documentclass[10pt]{article}\\usepackage[margin=2.2cm]{geometry}\\usepackage{booktabs}"
        "\\usepackage{graphicx}\\begin{document}\n" + tables + "\\end{document}\n")
    proc = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", "t.tex"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:]
    log = (tmp_path / "t.log").read_text(errors="replace")
    assert "Overfull \\hbox" not in log and "Float too large" not in log


@pytest.mark.usefixtures("tex")
def test_paper_from_committed_results_has_nothing_off_the_margin(tmp_path):
    """The tables as the current code writes them (regenerated from the committed raw results),
    the committed figures, the paper: no line, table or figure wider than the text."""
    _committed(REFERENCE / "study/manifest.json")
    res = tmp_path / "r"
    shutil.copytree(REFERENCE, res)
    proc = run_py(["-m", "analysis.study", "--results", str(res)])
    assert proc.returncode == 0, tail(proc)
    proc = run_py(["-m", "analysis.paper", "--results", str(res), "--out-dir", str(res / "paper"),
                   *(f"--section={kind}={REPO / 'results/reference' / name}" for kind, name in (
                       ("dose", "cpu"), ("search", "collapse-cpu"), ("real-search", "collapse-smollm2"),
                       ("precision", "precision-smollm2"), ("probe", "main"), ("probe", "main-xeon-amx")))],
                  timeout=600)
    assert proc.returncode == 0, tail(proc)
    assert (res / "paper/real_search_section.tex").exists()  # both search sections are on the page
    assert (res / "paper/precision_section.tex").exists()  # and the precision grid's
    assert (res / "paper/probe_section.tex").exists()  # and the real model's probe, both CPU types
    aux = (res / "paper/main.aux").read_text()
    page = int(re.search(r"\\newlabel\{tab:claims\}\{\{\d+\}\{(\d+)\}", aux).group(1))
    assert page <= 2, f"the claims table is on page {page}"  # issue 71: on the first two pages
    log = (res / "paper/main.log").read_text(errors="replace")
    assert "There were undefined references" not in log and "LaTeX Warning: Reference `" not in log  # every § exists
    log = (res / "paper/main.log").read_text(errors="replace")
    overfull = [line for line in log.splitlines() if line.startswith(("Overfull \\hbox", "Overfull \\vbox", "! "))]
    assert not overfull, "\n".join(overfull)  # \\vbox: a float taller than the page runs over its foot
    assert "Float too large" not in log
    assert "\\collapserule" in (REPO / "paper/main.tex").read_text()


def test_every_arm_has_a_clearly_different_colour():
    from matplotlib.colors import to_rgb

    from analysis.study.figures import arm_colors, arm_styles

    arms = [f"arm{i}" for i in range(13)]
    colours = [to_rgb(c) for c in arm_colors(arms).values()]
    assert len(set(colours)) == 13
    # no two of the first thirteen within a small distance in RGB (tab20 paired light/dark shades of one hue)
    close = [(i, j) for i in range(13) for j in range(i) if sum((a - b) ** 2 for a, b in zip(colours[i], colours[j]))
             ** 0.5 < 0.25]
    assert not close
    styles = arm_styles(arms)
    assert styles["arm0"]["ls"] == "-" and styles["arm12"]["ls"] == "--"
    assert len(arm_colors([f"a{i}" for i in range(40)])) == 40


def test_probe_figure_panels_follow_the_configs_model_order(tmp_path):
    from analysis.figures import mismatch_figure, model_order

    (tmp_path / "study").mkdir()
    (tmp_path / "study/manifest.json").write_text(json.dumps({"models": ["mini-xs", "mini-s", "mini-m", "mini-l"]}))
    alphabetical = ["mini-l", "mini-m", "mini-s", "mini-xs", "other"]
    assert model_order(tmp_path, alphabetical) == ["mini-xs", "mini-s", "mini-m", "mini-l", "other"]
    assert model_order(tmp_path, alphabetical, ["other", "mini-l"]) == ["other", "mini-l", "mini-m", "mini-s",
                                                                         "mini-xs"]
    assert model_order(tmp_path / "none", ["b", "a"]) == ["b", "a"]
    probe = pd.DataFrame([{"model": m, "config": c, "mean_abs_dlogp": 1e-3, "batch_vs_single_mean_abs_dlogp": 1e-4}
                          for m in alphabetical[:4] for c in ("none", "all")])
    mismatch_figure(probe, tmp_path / "m.png", model_order(tmp_path, list(probe["model"])))
    assert_figure(tmp_path / "m.png")


def test_the_search_section_comes_from_the_committed_search(tmp_path):
    from analysis.paper.search import search_section

    committed = REPO / "results/reference/collapse-cpu"
    _committed(committed / "tables/search_pilot.json")
    path = search_section(committed, tmp_path)
    text = path.read_text()
    chosen = json.loads((committed / "tables/search_pilot.json").read_text())["chosen"]
    assert "\\section{A natural collapse?" in text and chosen.replace("_", "\\_") in text.replace("\\_", "_") or chosen in text
    grid = committed / "tables/search_grid.json"
    if grid.exists():
        assert json.loads(grid.read_text())["decision"]["statement"][:40].split("(")[0] in text.replace("\\", "")
        finished = [g for g in json.loads(grid.read_text())["groups"] if g["finished"]]
        if finished:  # what has run is shown, per group, even before the verdict
            assert "tab:searchgrid" in text and text.count("\\\\\n") >= len(finished), text
    else:
        assert "The grid has not run yet" in text
    assert search_section(None, tmp_path) is None and not path.exists()  # no search: no section, none left over


def test_the_search_section_says_plainly_when_nothing_collapsed(tmp_path):
    """A grid and a lever stage without a natural collapse: the section gives the envelope the
    baseline explored, every run of the top rung, the lever's decision and, for each of the
    study's two claims, that it could not be tested here."""
    import shutil

    from analysis.collapse_search import main as search
    from analysis.paper.search import search_section
    from tests.test_collapse_search import _grid

    committed = REPO / "results/reference/collapse-cpu"
    shutil.copytree(committed / "tables", tmp_path / "tables")
    for stage in ("grid", "lever"):
        _grid(tmp_path, none_falls=0, fp32_falls=0, stage=stage)
        assert search(["--results", str(tmp_path), "--stage", stage, "--figure", str(tmp_path / f"{stage}.png")]) == 0
    (tmp_path / "paper").mkdir()
    text = search_section(tmp_path, tmp_path / "paper").read_text().replace("\\_", "_")
    assert "does not collapse naturally" in text and "The envelope explored by the 8 stock BF16 runs" in text
    assert "tab:searchtop" in text and "every run of the top rung (lr2)" in text
    assert "tab:searchlever" in text and "The further lever" in text
    assert "(1) Aligning all three regions prevents the BF16 baseline's collapse: not testable here" in text
    assert "(2) RoPE alone suffices: not testable either" in text
    assert "the lever stage has not run yet" not in text


SEARCH = REPO / "results/reference/collapse-cpu"


def test_the_real_model_section_comes_from_the_committed_search_and_its_decode_probes(tmp_path):
    """The SmolLM2 section: the paired pilot's rule and choice, the grid's questions as its rules answer
    them (or that it has not run), every finished run, and -- where decode probes ran -- the trainer's own
    decode-vs-recompute gap beside the trainer-vs-vLLM one, as numbers read from their summaries."""
    import shutil

    from analysis.paper.search import real_search_section

    committed = _committed(REPO / "results/reference/collapse-smollm2")
    res = tmp_path / "search"
    shutil.copytree(committed, res)
    pilot = json.loads((res / "tables/search_pilot.json").read_text())
    text = real_search_section(res, tmp_path).read_text().replace("\\_", "_")
    assert "\\section{A real pretrained model" in text and f"chosen: {pilot['chosen']}" in text
    assert "tab:realpilot" in text and (tmp_path / "real_search_pilot.png").exists()
    grid = res / "tables/search_grid.json"
    if grid.exists():
        questions = json.loads(grid.read_text())["questions"]["questions"]
        assert "tab:realquestions" in text and all(q["answer"] in text for q in questions.values())
        outcome = json.loads(grid.read_text())["decision"]["outcome"]
        assert ("The envelope explored by the" in text) == (outcome == "does not collapse naturally")
        appendix = (tmp_path / "real_search_appendix.tex").read_text()  # every run: the appendix's, named in the text
        assert "tab:realruns" in appendix and "tab:realruns" not in text and "\\ref{sec:realruns}" in text
    else:
        assert "The grid has not run yet" in text
    if not (res / "decode/none/summary.json").exists():  # a decode probe as rpa probe writes its summary
        (res / "decode/none").mkdir(parents=True)
        (res / "decode/none/summary.json").write_text(json.dumps({
            "mean_abs_dlogp": 0.04, "trainer_batch_variance": {"batch_vs_single": {"mean_abs_dlogp": 0.03}},
            "trainer_decode_variance": {"tokens": 100, "decode_vs_single": {"mean_abs_dlogp": 0.02,
                                                                           "frac_bitwise_equal": 0.1}}}))
    s = json.loads((res / "decode/none/summary.json").read_text())
    own = s["trainer_decode_variance"]["decode_vs_single"]["mean_abs_dlogp"]
    text = real_search_section(res, tmp_path).read_text()
    assert "tab:realdecode" in text and f"{own:.3g}" in text and f"(ratio {own / s['mean_abs_dlogp']:.2f})" in text
    assert real_search_section(None, tmp_path) is None and not (tmp_path / "real_search_section.tex").exists()
    assert not (tmp_path / "real_search_appendix.tex").exists()  # none left over from an earlier build


def test_the_precision_section_reads_each_effect_by_the_rule_written_before_the_grid(tmp_path):
    """The precision grid (issue 56): each pre-registered effect with its shift, interval and p from the committed
    table and its reading as the config's rule names it (below / above 0 only where the interval excludes 0 at the
    config's alpha), each arm's mismatch, the figure; an unfinished grid is said to be unfinished and not read."""
    import shutil

    from analysis.paper.search import contrast_words, effect_reading, precision_section

    committed = _committed(REPO / "results/reference/precision-smollm2/tables/search_grid.json")
    grid = json.loads(committed.read_text())
    text = precision_section(committed.parents[1], tmp_path).read_text().replace("\\_", "_")
    assert "\\section{Precision or mismatch?" in text and "tab:preceffects" in text and "tab:precquestions" in text
    alpha = grid["questions"]["alpha"]
    for name, e in grid["effects"]["effects"].items():
        row = next(line for line in text.splitlines() if line.lstrip().startswith(contrast_words(e["contrast"]) + " "))
        assert name not in row and f"\\item[{contrast_words(e['contrast'])}] {e['question']}" in text  # in words
        assert f"{e['shift']['low']:+.3f} to {e['shift']['high']:+.3f}" in row and effect_reading(e, alpha) in row, row
    assert (tmp_path / "precision_search_grid.png").exists()
    assert all(f"{g['arm']} {g['pre_collapse_mismatch']:.3g}" in text for g in grid["groups"])
    effect = {"shift": {"estimate": -0.1, "low": -0.2, "high": -0.01}, "signed_rank_p": 0.0078}
    assert effect_reading(effect, 0.05) == "below 0"
    assert effect_reading({**effect, "signed_rank_p": 0.055}, 0.05) == "not resolved"
    assert effect_reading({**effect, "shift": {"estimate": 0.1, "low": 0.02, "high": 0.2}}, 0.05) == "above 0"
    assert effect_reading({**effect, "shift": {"estimate": -0.06, "low": -0.12, "high": 0.002}}, 0.05) == "not resolved"
    partial = tmp_path / "partial"
    (partial / "tables").mkdir(parents=True)
    (partial / "tables/search_grid.json").write_text(json.dumps(
        {**grid, "decision": {**grid["decision"], "outcome": "incomplete", "unfinished": 3},
         "effects": {**grid["effects"], "unfinished": 3}}))
    (tmp_path / "p").mkdir()
    text = precision_section(partial, tmp_path / "p").read_text()
    assert "has not finished (3 runs left)" in text and "tab:preceffects" not in text
    assert precision_section(tmp_path / "nothing", tmp_path / "p") is None
    assert not (tmp_path / "p/precision_section.tex").exists()  # an earlier build's section is not left over
    from analysis.paper.claims import write_claims

    claims = write_claims(REFERENCE, tmp_path, {"dose": [DOSE], "precision": [committed.parents[1]]}).read_text() \
        .replace("\\_", "_")
    assert "precision grid grid (" in claims  # its runs' commits are listed with the others
    front = (tmp_path / "front.tex").read_text().replace("\\_", "_")
    answers = {"below 0": "a loss", "above 0": "a gain", "not resolved": "not resolved"}
    for e in grid["effects"]["effects"].values():  # each effect a row of the claims table, answered by its reading
        row = next(line for line in front.splitlines() if line.startswith(e["question"][:40]))
        s = e["shift"]
        assert f"{s['estimate']:+.3f} \\mbox{{[{s['low']:+.3f}, {s['high']:+.3f}]}}" in row, row
        assert f"\\textbf{{{answers[effect_reading(e, alpha)]}}}" in row, row


def _front_text(tmp_path, **given):
    from analysis.paper.front import abstract, claims_rows, gather
    from analysis.runs import MANIFEST, read_manifest

    manifest = read_manifest(_committed(REFERENCE / "study" / MANIFEST))
    front = gather(REFERENCE, manifest, {"dose": [DOSE], **given})
    return front, abstract(front), claims_rows(front)


def test_the_real_model_grid_reaches_the_front_once_with_its_post_hoc_label(tmp_path):
    """The real-model grid reaches the abstract and the claims table as one number -- the post-hoc learning-gain
    shift of the BF16 arms against FP32 with its exact interval, labelled post hoc -- read from the grid's own
    table; its per-question detail stays in its section; without the grid neither says anything of it."""
    committed = _committed(REPO / "results/reference/collapse-smollm2")
    grid = json.loads((committed / "tables/search_grid.json").read_text())
    gain = next(c for c in grid["post_hoc"]["comparisons"].values() if c["outcome"] == "learning_gain")
    s = gain["shift"]
    quoted = f"{s['estimate']:+.3f} [{s['low']:+.3f}, {s['high']:+.3f}]"
    _, text, rows = _front_text(tmp_path, **{"real-search": [committed]})
    assert f"learning gain {quoted}, post hoc" in text
    row = next(r for r in rows if r.source == "this suite, post hoc")
    assert quoted in row.number and row.verdict == ("holds" if s["high"] < 0 else "not resolved")
    assert "Q1" not in text and "Fisher" not in text  # the questions' detail is the section's
    _, text, rows = _front_text(tmp_path)
    assert "post hoc" not in text and all(r.source != "this suite, post hoc" for r in rows)


def test_claims_state_the_miniatures_findings_once_and_every_commit(tmp_path):
    """The miniature's section states both mismatch measurements of its two claims (offline and in training) and
    its insensitivity to a collapse, once; every commit the results came from is named."""
    from analysis.paper.claims import write_claims

    _committed(REFERENCE / "study/manifest.json")
    write_claims(REFERENCE, tmp_path, {"dose": [DOSE], "search": [_committed(SEARCH)]})
    claims = (tmp_path / "claims.tex").read_text()
    note = _macro(claims, "miniaturenote")
    assert "Aligning all three regions lowers the mismatch with a 95\\% interval below zero on 3 of 4 sizes offline " \
           "and on 2 of 4 during training" in note
    assert "Aligning RoPE alone" in note and "could not have seen one" in note and "0 of 54 runs collapsed" in note
    assert _macro(claims, "ruleversion") == "v4" and "\\findings" not in claims and "\\claims" not in claims
    commits = _macro(claims, "commits")
    for commit in ("08dde42250", "84bf996c39", "1ee31be45b", "1fbc4a1bb4", "3721a5a8c8", "45a051cd20", "bcad31cda7"):
        assert commit in commits


def test_main_tex_puts_the_front_first_and_places_every_float_where_it_is_input():
    tex = re.sub(r"%.*", "", (REPO / "paper/main.tex").read_text())
    front = tex.split("\\section{Setup}")[0]
    assert "\\abstracttext" in tex.split("\\end{abstract}")[0] and "\\claimstable" in front
    assert "\\papersubtitle" in tex.split("\\begin{document}")[0] and "\\commits" in tex
    assert "\\findings" not in tex and "\\abstractresults" not in tex  # each finding once: the front, then the sections
    assert "study_heatmap" not in tex  # one nonzero cell: the collapse table says it
    assert "\\begin{figure}[H]" in tex and "[tbp]" not in tex and "[htbp]" not in tex


def test_the_committed_search_section_has_its_figures_readable_headers_and_one_p_precision(tmp_path):
    from analysis.paper.search import search_section

    text = search_section(_committed(SEARCH), tmp_path).read_text()
    assert "search_grid.png" in text and "search_lever.png" in text
    assert "[tbp]" not in text and "\\begin{table}[H]" in text
    header_rows = [part.split("\\midrule")[0] for part in text.split("\\toprule")[1:]]
    assert len(header_rows) == 4  # pilot, grid, top rung, lever
    for row in header_rows:  # readable headers, never raw identifiers
        assert "\\_" not in row, row
    assert "sign test p = 0.125" in text and "p = 0.12)" not in text
    assert "0.00-0.60" in text and "raw reward" in text


def test_generated_dose_table_has_readable_headers(tmp_path):
    from analysis.paper.claims import dose_parts

    dose_parts(_committed(DOSE), tmp_path)
    header = (tmp_path / "dose_table.tex").read_text().split("\\toprule")[1].split("\\midrule")[0]
    assert "\\_" not in header and "IS correction" in header


def test_the_precision_section_says_what_the_rule_leaves_out_from_the_runs(tmp_path):
    """Issue 68, item 4, generated from the committed raw runs: each effect beside its rule on the reward AUC and
    with each seed left out (the seeds whose removal changes the reading named); the FP32-trainer arm's mismatch
    course (the jump at the first sync, then its range, and in how many runs it still rises); the entropy caveat
    per arm. A contrast is computed again here from the per-run table, not from the section's helpers."""
    import numpy as np

    from analysis.collapse_stats import signed_rank_p
    from analysis.paper.search import contrast_words, precision_section
    from rpa.core.jsonfiles import read_jsonl

    ref = _committed(REPO / "results/reference/precision-smollm2")
    grid = json.loads((ref / "tables/search_grid.json").read_text())
    text = precision_section(ref, tmp_path).read_text().replace("\\_", "_")
    runs = pd.read_csv(ref / "tables/search_grid.csv").query("state == 'finished'")
    gain = (runs["reward_auc"] - runs["step1_reward"]).groupby([runs["arm"], runs["seed"]]).first().unstack(0)
    alpha = grid["questions"]["alpha"]
    table = text.split("tab:precrobust")[1]
    for e in grid["effects"]["effects"].values():
        diff = sum(gain[arm] * w for arm, w in e["contrast"].items())
        ps = [signed_rank_p(diff.drop(seed).tolist()) for seed in diff.index]
        row = next(line for line in table.splitlines() if line.startswith(contrast_words(e["contrast"]) + " "))
        shown = f"{min(ps):.2g}" if f"{min(ps):.2g}" == f"{max(ps):.2g}" else f"{min(ps):.2g}-{max(ps):.2g}"
        assert f"& {shown} &" in row, (row, shown)
        flips = [s for s, p in zip(diff.index, ps) if (p < alpha) != (e["signed_rank_p"] < alpha)]
        assert (row.rstrip(" \\").endswith("none")) == (not flips), row
    first = [read_jsonl(p)[0]["mismatch/mean_abs_dlogp"]
             for p in sorted((ref / "search/grid/lr1e-5-c48-u4/trainer-fp32").glob("seed*/metrics.jsonl"))]
    assert f"goes from {np.mean(first):.3g} at logged step 1" in text
    assert "in trainer-fp32 the mismatch does not follow the entropy" in text
    assert "below half a BF16 ulp move the trainer's policy and not the sampler's" not in text  # the wrong mechanism
    assert "-0.190" in text.split("tab:preceffects")[1]  # three decimals, as the claims table and README quote it
