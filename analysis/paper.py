"""The paper's generated parts and its PDF: ``python -m analysis.paper --results R --out-dir R/paper``.

Writes ``claims.tex`` (the study's label, the commit the runs came from, the collapse rule as
the runs were judged by it -- written by :func:`rpa.train.collapse.rule_text` from the thresholds in
the runs' ``config.json``, one paragraph per distinct set of thresholds -- and, computed from
the result tables, which claims of the study reproduced at this scale) and, where the
positive control ran (in ``R`` or in ``--dose-results``: the dose grid and the study may live
in different results directories), ``dose_table.tex``; then builds ``paper/main.tex`` with ``latexmk``
(searching ``out-dir``, ``R/tables`` and ``R/figures`` for the generated files). Without a
TeX engine it says what to install and exits 1, after writing the generated parts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

from analysis.latex import booktabs, escape
from rpa.train.collapse import CollapseThresholds, rule_text
from rpa.core.jsonfiles import write_text

REPO = Path(__file__).resolve().parents[1]
TEX_INSTALL = ("apt-get install latexmk texlive-latex-base texlive-latex-recommended texlive-fonts-recommended lmodern "
               "(Debian/Ubuntu), or any TeX Live with latexmk, pdflatex and booktabs")


def _collapsed(cell: str) -> tuple[int, int] | None:
    if not isinstance(cell, str) or "/" not in cell:
        return None
    k, n = cell.split("/")
    return int(k), int(n)


def collapse_claim(table: pd.DataFrame, arm: str, claim: str, reference: str) -> str:
    """One claim ('aligning <arm> prevents the BF16 baseline's collapse'), judged per model
    against the ``reference`` arm (the BF16 baseline)."""
    verdicts = []
    for model, rows in table.groupby("model", sort=False):
        by = rows.set_index("arm")["collapsed"]
        base, treated = _collapsed(by.get(reference)), _collapsed(by.get(arm))
        if base is None or treated is None:
            verdicts.append((model, "missing", "runs missing"))
        elif base[0] == 0:
            verdicts.append((model, "untestable", f"the baseline did not collapse (0/{base[1]})"))
        elif treated[0] == 0:
            verdicts.append((model, "reproduced", f"baseline {base[0]}/{base[1]}, {arm} 0/{treated[1]}"))
        elif treated[0] / treated[1] < base[0] / base[1]:
            verdicts.append((model, "partly", f"baseline {base[0]}/{base[1]}, {arm} {treated[0]}/{treated[1]}"))
        else:
            verdicts.append((model, "not reproduced", f"baseline {base[0]}/{base[1]}, {arm} {treated[0]}/{treated[1]}"))
    kinds = {v for _, v, _ in verdicts}
    overall = ("reproduced" if kinds == {"reproduced"} else "could not be tested (no baseline collapsed)"
               if kinds == {"untestable"} else "not reproduced" if kinds == {"not reproduced"} else "mixed")
    detail = "; ".join(f"{m}: {why}" for m, _, why in verdicts)
    return f"\\item \\textbf{{{escape(claim)}}} --- {overall}. {escape(detail)}."


def mismatch_claim(table: pd.DataFrame, arm: str, reference: str) -> str:
    rows = table[(table["arm"] == arm) & table["probe_mean_abs_dlogp_change"].notna()]
    if rows.empty:
        return f"\\item No probe of {escape(arm)}."
    parts = [f"{m}: {100 * c:+.1f}% [{100 * lo:+.1f}, {100 * hi:+.1f}]" for m, c, lo, hi in
             zip(rows["model"], rows["probe_mean_abs_dlogp_change"], rows["probe_mean_abs_dlogp_low"],
                 rows["probe_mean_abs_dlogp_high"])]
    below = (rows["probe_mean_abs_dlogp_high"] < 0).sum()
    verdict = "lower on every model (interval below zero)" if below == len(rows) else \
        f"lower with an interval below zero on {below} of {len(rows)} models"
    return (f"\\item \\textbf{{Aligning {escape(arm)} lowers the trainer-vs-sampler mismatch}} "
            f"(offline probe, identical tokens, change of mean $|\\Delta\\log p|$ vs {escape(reference)}, "
            f"paired bootstrap 95\\% interval): "
            f"{verdict}. {escape('; '.join(parts))}.")


def _thresholds(config: Path) -> CollapseThresholds | None:
    collapse = json.loads(config.read_text()).get("collapse") if config.exists() else None
    return None if collapse is None else CollapseThresholds(**collapse)


def _runs_text(cells: list[tuple[str, str, int]], models: list[str], arms: list[str],
               seeds: dict[tuple[str, str], set]) -> str:
    """The runs ``cells`` (model, arm, seed) in few words: whole arms, then model/arm pairs,
    with their seeds where only some of a pair's seeds are in ``cells``."""
    have: dict[tuple[str, str], set] = {}
    for model, arm, seed in cells:
        have.setdefault((model, arm), set()).add(seed)
    whole = {pair for pair, s in have.items() if s == seeds.get(pair, s)}
    parts = []
    for arm in arms:
        if all((m, arm) in whole for m in models):
            parts.append(f"arm {arm} (every model)")
            whole -= {(m, arm) for m in models}
            have = {p: s for p, s in have.items() if p[1] != arm}
    for (model, arm), s in have.items():
        parts.append(f"{model}/{arm}" + ("" if (model, arm) in whole else
                                         f" (seed{'s' if len(s) > 1 else ''} {', '.join(map(str, sorted(s)))})"))
    return "; ".join(parts)


def study_rule(results: Path, manifest: dict) -> tuple[str, set[CollapseThresholds]]:
    """The collapse rule the study's runs were judged by (from their configs): one paragraph,
    or, where runs used different thresholds, one per set with the runs that used it."""
    by: dict[CollapseThresholds, list] = {}
    seeds: dict[tuple[str, str], set] = {}
    for c in manifest["cells"]:
        seeds.setdefault((c["model"], c["arm"]), set()).add(c["seed"])
        t = _thresholds(results / "study" / c["cell"] / "config.json")
        if t is not None:
            by.setdefault(t, []).append((c["model"], c["arm"], c["seed"]))
    if not by:
        return (rule_text(CollapseThresholds()) + " (The default thresholds: no run's config was found.)",
                {CollapseThresholds()})
    if len(by) == 1:
        return rule_text(next(iter(by))), set(by)
    text = [f"The runs were judged with {len(by)} different sets of thresholds."]
    for i, (t, cells) in enumerate(sorted(by.items(), key=lambda kv: -len(kv[1])), 1):
        text.append(f"({i}) For {_runs_text(cells, manifest['models'], manifest['arms'], seeds)}: {rule_text(t)}")
    return " ".join(text), set(by)


def dose_rule(dose_results: Path, study: set[CollapseThresholds]) -> str:
    """The collapse rule of the dose grid's runs, said in full only where it is not the study's."""
    by: dict[CollapseThresholds, list[str]] = {}
    for config in sorted(dose_results.glob("dose/*/*/seed*/config.json")):
        t = _thresholds(config)
        if t is not None:
            by.setdefault(t, []).append(config.parts[-4])
    if not by:
        return ""
    if set(by) == study and len(by) == 1:
        return "Its runs were judged by the same collapse rule as the study's."
    if len(by) == 1:
        return f"Its runs were judged by this collapse rule: {rule_text(next(iter(by)))}"
    parts = [f"For arm{'s' if len(set(arms)) > 1 else ''} {', '.join(dict.fromkeys(arms))}: {rule_text(t)}"
             for t, arms in by.items()]
    return f"Its runs were judged with {len(by)} different sets of thresholds. " + " ".join(parts)


def dose_parts(results: Path, out_dir: Path) -> str:
    runs_path = results / "tables" / "dose_runs.csv"
    if not runs_path.exists():
        return ""
    from analysis.dose import anchor_positions, groups, statement, thresholds

    runs = pd.read_csv(runs_path)
    per_group = groups(runs)
    cols = ["arm", "is_correction", "old_logprobs", "invalid", "runs", "collapsed", "unconfirmed", "grad_spike_runs",
            "mean_abs_dlogp", "phantom_clip_rate", "final_reward"]
    window = int(per_group["mismatch_steps"].dropna().iloc[0]) if per_group["mismatch_steps"].notna().any() else None
    over = f"over steps 1-{window}" if window else "over all steps"
    write_text(out_dir / "dose_table.tex", booktabs(
        per_group[[c for c in cols if c in per_group]],
        f"Positive control per arm (mean over seeds; mean_abs_dlogp and phantom_clip_rate {over} of each run, "
        f"before any collapse; grad_spike_runs: runs with a gradient-norm spike, an event, not a collapse; "
        f"invalid: IS with old logprobs from the sampler, which applied the correction twice)",
        "tab:dose"))
    lines = statement(thresholds(runs), anchor_positions(runs))
    return "\\begin{itemize}" + "".join(f"\\item {escape(line.removeprefix('- '))}" for line in lines) + \
        "\\end{itemize}"


def _commits(paths) -> list[str]:
    out = []
    for path in paths:
        prov = json.loads(path.read_text()).get("provenance") or {}
        commit = (prov.get("git_commit") or "unknown")[:10] + ("+dirty" if prov.get("git_dirty") else "")
        if commit not in out:
            out.append(commit)
    return out


def commit_of(results: Path) -> str:
    """The commit(s) the runs came from, and the probes' where they differ (a probe stage may be
    re-run at a later commit than the training runs)."""
    runs = _commits(sorted(results.glob("study/*/*/seed*/summary.json")))
    probes = _commits(sorted(results.glob("probe/*/*/summary.json")))
    text = ", ".join(runs) or "unknown"
    if probes and probes != runs:
        text = f"{text} (runs), {', '.join(probes)} (probes)"
    return text


def write_claims(results: Path, out_dir: Path, dose_results: Path | None = None) -> Path:
    manifest = json.loads((results / "study" / "manifest.json").read_text())
    collapse = pd.read_csv(results / "tables" / "study_collapse.csv")
    mismatch = pd.read_csv(results / "tables" / "study_mismatch.csv")
    ref = manifest["reference_arm"]
    items = [collapse_claim(collapse, "all", "Aligning all three regions prevents the BF16 baseline's collapse", ref),
             collapse_claim(collapse, "rope", "RoPE alone suffices", ref),
             mismatch_claim(mismatch, "all", ref), mismatch_claim(mismatch, "rope", ref)]
    dose = dose_parts(dose_results or results, out_dir)
    rule, used = study_rule(results, manifest)
    setup = (f"Models: {', '.join(manifest['models'])}; arms: {', '.join(manifest['arms'])}; seeds: "
             f"{', '.join(map(str, manifest['seeds']))}.")
    text = [f"\\newcommand{{\\studylabel}}{{{escape(manifest['label'])}}}",
            f"\\newcommand{{\\resultsdir}}{{{escape(str(results))}}}",
            f"\\newcommand{{\\commit}}{{{escape(commit_of(results))}}}",
            f"\\newcommand{{\\setupnote}}{{{escape(setup)}}}",
            f"\\newcommand{{\\collapserule}}{{{escape(rule)}}}",
            f"\\newcommand{{\\doserule}}{{{escape(dose_rule(dose_results or results, used))}}}",
            "\\newcommand{\\claims}{\\begin{itemize}" + "\n".join(items) + "\\end{itemize}}",
            f"\\newcommand{{\\dosenote}}{{{dose}}}"]
    path = out_dir / "claims.tex"
    write_text(path, "\n".join(text) + "\n")
    return path


def search_section(search_results: Path | None, out_dir: Path) -> Path | None:
    """``search_section.tex``: the natural-collapse search (pilot table, the pilot's choice, the
    grid's decision under the rule written in its config, or how much of the grid has run), from
    ``<search_results>/tables/search_*.json`` -- or nothing where no search ran."""
    path = out_dir / "search_section.tex"
    pilot_json = None if search_results is None else search_results / "tables" / "search_pilot.json"
    if pilot_json is None or not pilot_json.exists():
        path.unlink(missing_ok=True)
        return None
    pilot = json.loads(pilot_json.read_text())
    table = pd.read_csv(search_results / "tables" / "search_pilot.csv")
    cols = [c for c in ("model", "temperature", "warmup", "initial_reward", "step1_entropy", "step1_mismatch",
                        "eligible", "chosen") if c in table]
    rule = pilot["rule"]
    parts = ["\\section{A natural collapse? The search on CPU}",
             escape("Stock BF16 GRPO is run where mismatch is larger than in the miniature: deeper tiny models, the "
                    "walk task (six equally rewarded continuations per position, so a best policy need not be "
                    "deterministic; the entropy column below shows what GRPO made of it), "
                    "~100-token completions, PPO's old log-probabilities from the sampler, a constant learning rate "
                    "and vLLM compiled. A 10-step pilot picks the setting: step-1 entropy at least "
                    f"{rule['min_entropy']} nats/token, initial reward in [{rule['reward_low']}, "
                    f"{rule['reward_high']}], then the largest step-1 mismatch; chosen: "
                    f"{pilot.get('chosen') or 'no cell was eligible'}."),
             booktabs(table[cols], "Natural-collapse search: the pilot (BF16 none, 10 steps)", "tab:pilot")]
    tables = search_results / "tables"
    grid_json = tables / "search_grid.json"
    if not grid_json.exists():
        parts.append(escape("The grid has not run yet; the paper says nothing about it."))
        write_text(path, "\n\n".join(parts) + "\n")
        return path
    grid = json.loads(grid_json.read_text())
    decision = grid["decision"]
    parts.append(escape(f"The grid (FP32, stock BF16 and all three regions aligned, at several learning "
                        f"rates and four seeds, judged by the collapse rule and decision rule written in its "
                        f"config before it ran): {decision['statement']}"))
    parts += _stage_groups(grid, "Natural-collapse search: the grid's finished runs per group", "tab:searchgrid")
    if decision.get("outcome") == "collapses naturally":
        parts.append(escape("The study's two claims are tested at the collapsing rung(s) by the ablation stage."))
    elif decision.get("outcome") == "does not collapse naturally":
        parts.append(escape(_envelope_text(grid.get("envelope") or {})))
        top = _top_rung_runs(tables / "search_grid.csv", decision)
        if top is not None:
            parts.append(top)
        lever_json = tables / "search_lever.json"
        lever = json.loads(lever_json.read_text()) if lever_json.exists() else None
        if lever is not None:
            parts.append(escape(f"The further lever, written in the config before any of it ran: "
                                f"{_settings_text(lever.get('envelope') or {})}; the grid's arms, seeds, warm "
                                f"starts and rules. {lever['decision']['statement']}"))
            parts += _stage_groups(lever, "Natural-collapse search: the lever stage per group", "tab:searchlever")
        else:
            parts.append(escape("The further lever (the config's lever stage) has not run yet."))
        parts.append(_claims_text(grid, lever))
    write_text(path, "\n\n".join(parts) + "\n")
    return path


def _stage_groups(stage: dict, caption: str, label: str) -> list[str]:
    """A stage's finished groups as a table (collapsed with the exact upper bound on the rate)."""
    groups = pd.DataFrame(stage.get("groups") or [])
    if groups.empty or not (groups["finished"] > 0).any():
        return []
    shown = groups[groups["finished"] > 0]
    cols = [c for c in ("lr", "arm", "finished", "collapsed", "collapse_rate_high", "final_reward", "reward_auc",
                        "entropy", "pre_collapse_mismatch", "max_pre_collapse_phantom_clip") if c in shown]
    confidence = stage["decision"]["rule"].get("confidence", 0.95)
    return [booktabs(shown[cols], f"{caption} (collapsed with the exact {100 * confidence:.0f}% upper bound on the "
                                  f"rate; entropy and mismatch are means over the steps, the mismatch before any "
                                  f"collapse)", label)]


def _span(values: list, unit: str = "") -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return f"{lo:.3g}{unit}" if lo == hi else f"{lo:.3g}-{hi:.3g}{unit}"


def _settings_text(env: dict) -> str:
    lr = ", ".join(f"{v:g}" for v in env.get("learning_rate") or [])
    steps, logged = env.get("steps") or [], env.get("logged_steps") or []
    # TRL logs once per generated batch: with several updates per batch the collapse rule's windows
    # (counted in logged steps) span that many optimizer steps each
    rows = f" ({_span(logged)} logged, one per generated batch: the collapse rule's windows count these)" \
        if logged and steps and set(logged) != set(steps) else ""
    return (f"model {', '.join(env.get('models') or []) or 'n/a'}, sampling temperature "
            f"{_span(env.get('temperature') or [])}, {_span(env.get('max_completion_length') or [])}-token "
            f"completions, {_span(steps)} optimizer steps{rows} at learning rate(s) {lr or 'n/a'}, "
            f"{_span(env.get('updates_per_generation') or [])} optimizer update(s) per generated batch")


def _envelope_text(env: dict) -> str:
    """The envelope the stock-BF16 arm explored, from the stage summary's ``envelope``."""
    if not env.get("runs"):
        return "No stock BF16 run finished."
    return (f"The envelope explored by the {env['runs']} stock BF16 runs: {_settings_text(env)}; policy entropy "
            f"{_span(env.get('step1_entropy') or [])} nats/token at step 1 and "
            f"{_span(env.get('final_entropy') or [])} over each run's last steps (mean over all steps "
            f"{_span([env.get('mean_entropy')])}); mean |dlogp| before any collapse up to "
            f"{_span([env.get('max_pre_collapse_mismatch')])} (largest step) and a phantom-clip rate up to "
            f"{_span([env.get('max_pre_collapse_phantom_clip')])}.")


def _top_rung_runs(csv: Path, decision: dict) -> str | None:
    """The runs of the grid's last (largest) rung, one row each."""
    if not csv.exists() or not decision.get("rungs"):
        return None
    runs = pd.read_csv(csv)
    rung_axis = decision["rule"]["rung_axis"]
    top = decision["rungs"][-1]["rung"]
    rows = runs[(runs[rung_axis] == top) & (runs["state"] == "finished")]
    cols = [c for c in (decision["rule"]["arm_axis"], "seed", "verdict", "collapse_step", "peak_reward", "final_reward",
                        "final_entropy", "max_pre_collapse_mismatch", "max_pre_collapse_phantom_clip") if c in rows]
    return booktabs(rows[cols], f"Natural-collapse search: every run of the top rung ({top})", "tab:searchtop")


def _claims_text(grid: dict, lever: dict | None) -> str:
    """What the search says about the study's two claims, from the stages' decisions and comparisons."""
    stages = [("grid", grid)] + ([("lever", lever)] if lever else [])
    collapsing = [name for name, st in stages if st["decision"].get("outcome") == "collapses naturally"]
    seen, significant, learning = [], [], []  # learning: exploratory, paired by seed (not part of any rule)
    for name, st in stages:
        c = st.get("comparison") or {}
        if c.get("reference", [0, 0])[1] and c.get("treatment", [0, 0])[1]:
            p = c.get("fisher_p")
            seen.append(f"{name}: {c['treatment_arm']} {c['treatment'][0]}/{c['treatment'][1]} collapsed against "
                        f"{c['reference_arm']} {c['reference'][0]}/{c['reference'][1]} (Fisher exact p = {p:.2g})")
            if p < 0.05:
                significant.append(name)
        for other, pair in (c.get("reward_auc_paired") or {}).items():
            if pair["pairs"] > pair.get("ties", 0):
                ties = f", {pair['ties']} tied" if pair.get("ties") else ""
                learning.append(f"{name}: {c['reference_arm']} below {other} in {pair['reference_lower']} of "
                                f"{pair['pairs'] - pair.get('ties', 0)} paired seeds{ties} (sign test p = "
                                f"{pair['sign_test_p']:.2g})")
    verdict = (f"the difference is significant at p < 0.05 in the {' and '.join(significant)} stage"
               if significant else "at these counts no difference between the arms is significant (p >= 0.05)")
    beside = f"beside it, {'; '.join(seen)}: {verdict}" if seen else "no aligned arm ran beside it"
    if learning:
        beside += (". Not part of any rule, and looked at after the runs: reward AUC (how fast a run learned), "
                   + "; ".join(learning))
    if collapsing:
        return escape(f"Stock BF16 collapsed naturally in the {' and '.join(collapsing)} stage: the study's claims are "
                      f"judged there by the ablation stage.")
    finished = "" if lever else " (the lever stage has not run yet)"
    return escape(f"What this says about the study's two claims{finished}. (1) Aligning all three regions prevents "
                  f"the BF16 baseline's collapse: not testable here, since the baseline did not collapse by itself; "
                  f"{beside}. (2) RoPE alone suffices: not testable either; the ablation stage runs only where "
                  f"the baseline collapses, and it did not.")


def build(results: Path, out_dir: Path, dose_results: Path | None = None) -> int:
    if not shutil.which("latexmk") or not shutil.which("pdflatex"):
        print(f"analysis.paper: no TeX engine (latexmk + pdflatex) on PATH; the generated parts are in {out_dir}. "
              f"Install: {TEX_INSTALL}", file=sys.stderr)
        return 1
    folders = [out_dir, results / "tables", results / "figures"]
    if dose_results is not None:
        folders.append(dose_results / "figures")
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
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_claims(args.results, args.out_dir, args.dose_results)
    search_section(args.search_results, args.out_dir)
    sys.exit(build(args.results, args.out_dir, args.dose_results))


if __name__ == "__main__":
    main()
