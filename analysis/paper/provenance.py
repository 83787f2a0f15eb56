"""What the paper's runs were: the collapse rules they were judged by (:func:`study_rule`,
:func:`dose_rule`, written by :func:`rpa.train.collapse.rule_text` from the thresholds in the runs'
``config.json``) and the commits they came from (:func:`commit_of`, :func:`provenance`), read
through :mod:`analysis.runs`.
"""

from __future__ import annotations

from pathlib import Path

from analysis.runs import cell_labels, cells_by_folder, decode_probes, probe_results, run_config, run_summary
from rpa.workflow.paper import SECTION_KINDS
from rpa.train.collapse import CollapseThresholds, rule_text


def _thresholds(run_dir: Path) -> CollapseThresholds | None:
    """The collapse thresholds of the run in ``run_dir`` (its config's; None without a config)."""
    collapse = (run_config(run_dir) or {}).get("collapse")
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
        t = _thresholds(results / "study" / c["cell"])
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
    for cell, run_dir in cells_by_folder(dose_results, "dose"):
        t = _thresholds(run_dir)
        if t is not None:
            by.setdefault(t, []).append(cell_labels(cell)["arm"])
    if not by:
        return ""
    if set(by) == study and len(by) == 1:
        return "Its runs were judged by the same collapse rule as the study's."
    if len(by) == 1:
        return f"Its runs were judged by this collapse rule: {rule_text(next(iter(by)))}"
    parts = [f"For arm{'s' if len(set(arms)) > 1 else ''} {', '.join(dict.fromkeys(arms))}: {rule_text(t)}"
             for t, arms in by.items()]
    return f"Its runs were judged with {len(by)} different sets of thresholds. " + " ".join(parts)


def _commits(summaries) -> list[str]:
    """The commits of runs' or probes' summaries (``provenance``), each once, in their order."""
    out = []
    for summary in summaries:
        prov = summary.get("provenance") or {}
        commit = (prov.get("git_commit") or "unknown")[:10] + ("+dirty" if prov.get("git_dirty") else "")
        if commit not in out:
            out.append(commit)
    return out


def commit_of(results: Path) -> str:
    """The commit(s) the runs came from, and the probes' where they differ (a probe stage may be
    re-run at a later commit than the training runs)."""
    runs = _commits(_ended(results, "study"))
    probes = _commits(p.summary for p in probe_results(results))
    text = ", ".join(runs) or "unknown"
    if probes and probes != runs:
        text = f"{text} (runs), {', '.join(probes)} (probes)"
    return text


def _ended(results: Path, section: str, entry: str | None = None) -> list[dict]:
    """The summaries of a grid's runs that ended, in the order of their folders."""
    return [s for _, run_dir in cells_by_folder(results, section, entry) if (s := run_summary(run_dir)) is not None]


def study_old_logprobs(results: Path, manifest: dict) -> set[str]:
    """Where the study's runs took PPO's old log-probabilities from (their configs)."""
    found = set()
    for c in manifest["cells"]:
        config = run_config(results / "study" / c["cell"])
        if config is not None:
            found.add(config.get("old_logprobs", "trainer"))
    return found


def _commits_of(summaries) -> list[str]:
    return [c for c in _commits(summaries) if c != "unknown"]


def provenance(results: Path, sections: dict[str, list[Path]] | None = None) -> str:
    """Every commit the results in the paper came from, by part (each run's ``provenance``): the study's
    ``results`` and the paper's further ``sections`` (kind -> directories)."""
    sections = sections or {}
    parts = [f"miniature runs {', '.join(_commits_of(_ended(results, 'study'))) or 'unknown'}"]
    probes = _commits_of(p.summary for p in probe_results(results))
    if probes:
        parts.append(f"its probes {', '.join(probes)}")
    dose_results = (sections.get("dose") or [results])[0]
    dose = _ended(dose_results, "dose")
    if dose:
        parts.append(f"{SECTION_KINDS['dose'].what} ({dose_results}) {', '.join(_commits_of(dose))}")
    for folder in sections.get("probe") or []:
        found = _commits_of(p.summary for p in probe_results(folder))
        parts.append(f"{SECTION_KINDS['probe'].what} ({folder}) {', '.join(found) or 'unknown'}")
    for kind in ("search", "real-search", "precision"):
        name = SECTION_KINDS[kind].what
        for folder in sections.get(kind) or []:
            for stage in ("pilot", "grid", "ablation", "lever"):
                found = _commits_of(_ended(folder, "search", stage))
                if found:
                    parts.append(f"{name} {stage} ({folder}) {', '.join(found)}")
            probes = _commits_of(decode_probes(folder / "decode").values())
            if probes:
                parts.append(f"{name} decode probes ({folder}) {', '.join(probes)}")
    return "; ".join(parts)
