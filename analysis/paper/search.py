"""The paper's search sections: ``search_section.tex`` (the natural-collapse search on CPU:
:func:`search_section`), ``real_search_section.tex`` (the real-model search: :func:`real_search_section`) and
``precision_section.tex`` (the precision x mismatch grid: :func:`precision_section`), from a search's
``tables/search_*.{json,csv}``, its figures and its decode probes; nothing where no search ran.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.collapse_stats import leave_one_out, paired_contrast, paired_reading
from analysis.latex import booktabs, escape, readable
from analysis.runs import cells_by_folder, decode_probes
from rpa.core.jsonfiles import read_jsonl, write_text
from rpa.train.collapse import RULE_VERSION, TERMINAL_STEPS


def _p(value) -> str:
    """A p-value as every text of the suite prints it (three significant digits)."""
    return "n/a" if value is None else f"{value:.3g}"


def _search_pilot(search_results: Path | None, section: Path) -> dict | None:
    """A search's pilot summary (``tables/search_pilot.json``); None -- and no ``section`` file left
    over from an earlier build -- where no search ran."""
    pilot_json = None if search_results is None else search_results / "tables" / "search_pilot.json"
    if pilot_json is None or not pilot_json.exists():
        section.unlink(missing_ok=True)
        return None
    return json.loads(pilot_json.read_text())


def search_section(search_results: Path | None, out_dir: Path) -> Path | None:
    """``search_section.tex``: the natural-collapse search (pilot table, the pilot's choice, the
    grid's decision under the rule written in its config, or how much of the grid has run), from
    ``<search_results>/tables/search_*.json`` -- or nothing where no search ran."""
    path = out_dir / "search_section.tex"
    pilot = _search_pilot(search_results, path)
    if pilot is None:
        return None
    table = pd.read_csv(search_results / "tables" / "search_pilot.csv")
    cols = [c for c in ("model", "temperature", "warmup", "initial_reward", "step1_entropy", "step1_mismatch",
                        "eligible", "chosen") if c in table]
    figures = search_results / "figures"
    rule = pilot["rule"]
    parts = ["\\section{A natural collapse? The search on CPU}\\label{sec:search}",
             escape("Stock BF16 GRPO is run where mismatch is larger than in the miniature: deeper tiny models, the "
                    "walk task (six equally rewarded continuations per position, so a best policy need not be "
                    "deterministic; the entropy column below shows what GRPO made of it), "
                    "~100-token completions, PPO's old log-probabilities from the sampler, a constant learning rate "
                    "and vLLM compiled. A 10-step pilot picks the setting: step-1 entropy at least "
                    f"{rule['min_entropy']} nats/token, initial reward in [{rule['reward_low']}, "
                    f"{rule['reward_high']}], then the largest step-1 mismatch; chosen: "
                    f"{pilot.get('chosen') or 'no cell was eligible'}."),
             booktabs(readable(table[cols]), "Natural-collapse search: the pilot (BF16 none, 10 steps)", "tab:pilot",
                      placement="H")]
    tables = search_results / "tables"
    grid_json = tables / "search_grid.json"
    if not grid_json.exists():
        parts.append(escape("The grid has not run yet; the paper says nothing about it."))
        write_text(path, "\n\n".join(parts) + "\n")
        return path
    grid = json.loads(grid_json.read_text())
    decision = grid["decision"]
    parts += _stage_section(grid, "The grid (FP32, stock BF16 and all three regions aligned, at several learning "
                            "rates and four seeds, judged by the collapse rule and decision rule written in its "
                            "config before it ran): ",
                            ("Natural-collapse search: the grid's finished runs per group", "tab:searchgrid"),
                            (figures / "search_grid.png", "The natural-collapse search, grid: reward (top) and "
                             "in-training mismatch (bottom, log scale) per step, one column per learning rate; line: "
                             "mean over the four seeds, band: their range.", "fig:searchgrid"),
                            entropy_tracking(search_results, "grid"))
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
            parts += _stage_section(
                lever, f"The further lever, written in the config before any of it ran: "
                       f"{_settings_text(lever.get('envelope') or {})}; the grid's arms, seeds, warm starts and rules. ",
                ("Natural-collapse search: the lever stage per group", "tab:searchlever"),
                (figures / "search_lever.png", "The natural-collapse search, lever stage (4 optimizer updates per "
                 "generated batch): reward (top) and in-training mismatch (bottom, log scale) per logged step; line: "
                 "mean over the four seeds, band: their range.", "fig:searchlever"),
                entropy_tracking(search_results, "lever"))
        else:
            parts.append(escape("The further lever (the config's lever stage) has not run yet."))
        parts.append(_claims_text(grid, lever))
    write_text(path, "\n\n".join(parts) + "\n")
    return path


def _pilot_rule_text(rule: dict) -> str:
    """The paired pilot rule (``kind: paired``) in words, from the pilot summary's ``rule``."""
    return (f"a rung ({', '.join(rule['rung_axes'])}) is eligible when its {rule['control_arm']} run learns -- the mean "
            f"reward of the last {rule['learn_fraction']:g} of its logged steps exceeds that of the first by at least "
            f"{rule['min_gain']:g} -- and stays stable; the grid takes the eligible rung whose {rule['reference_arm']} "
            f"run has the largest step-1 mismatch")


def _questions_table(grid: dict, what: str = "The real-model grid's", label: str = "tab:realquestions") -> list[str]:
    """The grid's questions, each as its rule (written in the config before the grid ran) answers it."""
    qs = (grid.get("questions") or {}).get("questions") or {}
    if not qs:
        return []
    rows = []
    for name, q in qs.items():
        auc = q.get("reward_auc") or {}
        shift = auc.get("shift") or {}
        rows.append({"question": name, "a": q["a"], "a collapsed": "{}/{}".format(*q["a_collapsed"]),
                     "b": q["b"], "b collapsed": "{}/{}".format(*q["b_collapsed"]),
                     "Fisher p (one-sided)": q.get("fisher_p"), "reward AUC a - b": auc.get("mean_difference"),
                     "pairs tested": shift.get("pairs", auc.get("pairs", 0)), "signed-rank p": auc.get("signed_rank_p"),
                     "HL shift": shift.get("estimate"),
                     "exact interval": (f"{shift['low']:.3g} to {shift['high']:.3g} ({100 * shift['coverage']:.1f}%)"
                                        if shift else None),
                     "answer": q["answer"]})
    alpha = (grid.get("questions") or {}).get("alpha")
    caption = (f"{what} questions (collapse counts: finished runs; alpha {alpha}; the reward AUC difference paired by "
               f"seed beside the verdict, with an exact two-sided signed-rank test, and the Hodges-Lehmann shift with "
               f"the exact interval that inverts it; zero differences are dropped from the test and its interval alike)")
    return [_description({name: q["question"] for name, q in qs.items()}),
            booktabs(pd.DataFrame(rows), caption, label, placement="H")]


def _description(items: dict[str, str]) -> str:
    """Named items (a grid's questions, its effects) as a LaTeX description list, one line each."""
    return ("\\begin{description}" + "".join(f"\\item[{escape(k)}] {escape(v)}" for k, v in items.items())
            + "\\end{description}")


def arm_mismatch(grid: dict) -> dict[str, float]:
    """Each arm's mean in-training mismatch before any collapse, from a grid summary's groups (arms without one
    left out)."""
    return {g["arm"]: g["pre_collapse_mismatch"] for g in grid.get("groups") or []
            if g.get("pre_collapse_mismatch") is not None}


def arms_text(values: dict[str, float]) -> str:
    """Per-arm values as the paper quotes them: ``arm value, ...`` to 3 significant digits."""
    return ", ".join(f"{arm} {value:.3g}" for arm, value in values.items())


def contrast_text(contrast: dict[str, float]) -> str:
    """A contrast's weights as the paper writes them: ``+1 trainer-fp32 -1 fp32``."""
    return " ".join(f"{w:+g} {arm}" for arm, w in contrast.items())


def contrast_words(contrast: dict[str, float]) -> str:
    """A contrast as a difference in words: ``trainer-fp32 minus fp32``; arms of equal weight on one side are
    their mean (``none, all and self-sampled (mean) minus fp32``)."""
    plus = [arm for arm, w in contrast.items() if w > 0]
    minus = [arm for arm, w in contrast.items() if w < 0]
    side = lambda arms: arms[0] if len(arms) == 1 else ", ".join(arms[:-1]) + f" and {arms[-1]} (mean)"  # noqa: E731
    return f"{side(plus)} minus {side(minus)}" if plus and minus else contrast_text(contrast)


def unfinished_runs(grid: dict) -> int | None:
    """How many runs a grid with pre-registered effects still lacks before they are read; None when it is complete."""
    effects = grid.get("effects") or {}
    if grid["decision"].get("outcome") == "incomplete" or effects.get("unfinished"):
        return grid["decision"].get("unfinished", effects.get("unfinished"))
    return None


def post_hoc_text(grid: dict) -> str | None:
    """The grid's post-hoc comparisons (config ``post_hoc``, written after it ran) in one passage, each
    labelled post hoc, with what the arms' mismatch allows to conclude; None where there are none."""
    ph = grid.get("post_hoc") or {}
    if not ph.get("comparisons"):
        return None
    parts = []
    for name, c in ph["comparisons"].items():
        sh = c.get("shift") or {}
        what = "learning gain (reward AUC minus the run's own step-1 reward)" if c["outcome"] == "learning_gain" \
            else "reward AUC"
        if "a" in c:
            arms = " + ".join(c["a"]) + (" (mean per seed)" if len(c["a"]) > 1 else "") + f" - {c['b']}"
        else:
            arms = contrast_text(c["contrast"])
        if c.get("not_computed"):
            parts.append(f"{what}, {arms}: not computed ({c['not_computed']})")
            continue
        size = (f"shift {sh['estimate']:+.3f}, {100 * sh['coverage']:.1f}% interval {sh['low']:+.3f} to "
                f"{sh['high']:+.3f}" if sh else f"mean {c['mean_difference']:+.3f} (no interval with "
                f"{c['pairs']} pairs)")
        p = "" if c.get("signed_rank_p") is None else f", signed-rank p = {c['signed_rank_p']:.2g}"
        parts.append(f"{what}, {arms}: {size}, {c['a_lower']} of {c['pairs']} seeds lower{p}")
    arms = ph.get("arms") or {}
    own = arm_mismatch(grid)
    text = "Post hoc (not pre-registered; written after the grid ran): " + "; ".join(parts) + "."
    if arms:
        text += (" Step-1 training reward per arm (seed means): " + ", ".join(
            f"{arm} {a['step1_reward']:.3f}" for arm, a in arms.items()) + "; raw reward gain from the first "
            "logged step to the terminal reward: " + ", ".join(f"{arm} {a['reward_gain']:.3f}" for arm, a in arms.items())
            + ".")
    if own:
        text += (" Each arm's mean in-training mismatch: " + arms_text(own) + "; BF16 arms that carry the same mismatch "
            "confound BF16 arithmetic with the mismatch, so a gap between them and FP32 does not say which costs "
            "the learning.")
    return text


def _real_runs_table(csv: Path) -> list[str]:
    """Every finished run of the real-model grid: verdict, raw terminal reward, held-out accuracy, entropy,
    mismatch and phantom-clip rate (the issue's per-run report)."""
    if not csv.exists():
        return []
    runs = pd.read_csv(csv)
    done = runs[runs["state"] == "finished"]
    if done.empty:
        return []
    cols = [c for c in ("arm", "seed", "verdict", "terminal_reward", "first_eval_accuracy", "final_eval_accuracy",
                        "final_entropy", "step1_mismatch", "pre_collapse_mismatch", "max_pre_drop_phantom_clip",
                        "wall_s") if c in done]
    return [booktabs(readable(done[cols], {"terminal_reward": f"raw reward, last {TERMINAL_STEPS} steps",
                                           "final_entropy": _final_entropy_label(done),
                                           "first_eval_accuracy": "held-out acc. at start",
                                           "final_eval_accuracy": "held-out acc. at end",
                                           "step1_mismatch": "mean |dlogp| step 1",
                                           "pre_collapse_mismatch": "mean |dlogp| before any collapse",
                                           "max_pre_drop_phantom_clip": "max phantom clip before any drop"}),
                     "The real-model grid, every finished run (mismatch: each arm's own sampler against its "
                     "trainer's training forward on the sampled tokens; for self-sampled the trainer's KV-cached "
                     "decoding against its own recompute)", "tab:realruns", placement="H")]


def _decode_probes(decode: Path) -> dict[str, dict]:
    """The summaries of a search's decode probes (``rpa probe --decode-sequences``), by configuration;
    probes that did not decode are left out."""
    found = decode_probes(decode)
    return {name: s for name, s in found.items() if s.get("trainer_decode_variance") is not None}


def _decode_table(probes: dict[str, dict]) -> list[str]:
    """The trainer's own decode vs recompute, beside its padded batch and vLLM."""
    if not probes:
        return []
    rows = [{"configuration": name, "trainer vs vLLM": s["mean_abs_dlogp"],
             "trainer decode vs its recompute": s["trainer_decode_variance"]["decode_vs_single"]["mean_abs_dlogp"],
             "bitwise equal": s["trainer_decode_variance"]["decode_vs_single"]["frac_bitwise_equal"],
             "trainer padded batch vs its recompute":
                 ((s.get("trainer_batch_variance") or {}).get("batch_vs_single") or {}).get("mean_abs_dlogp"),
             "decoded tokens": s["trainer_decode_variance"]["tokens"]} for name, s in probes.items()]
    return [booktabs(pd.DataFrame(rows), "SmolLM2: the trainer disagrees with itself (mean |dlogp| on the same "
                     "sampled tokens: the trainer's one-forward recompute of each sequence against vLLM, against its "
                     "own KV-cached decoding, and against its padded training batch)", "tab:realdecode",
                     placement="H")]


def real_search_section(search_results: Path | None, out_dir: Path) -> Path | None:
    """``real_search_section.tex``: the real-model search (issue 31) -- the paired pilot and its choice,
    the grid's questions as its rules answer them (or how much of it has run), every finished run, and
    the trainer's own decode-vs-recompute gap that decides what the self-sampled control can show --
    from ``<search_results>/tables/search_*.{json,csv}`` and ``<search_results>/decode/*/summary.json``;
    nothing where no search ran."""
    path, appendix = out_dir / "real_search_section.tex", out_dir / "real_search_appendix.tex"
    appendix.unlink(missing_ok=True)  # written again below where the grid has finished runs
    pilot = _search_pilot(search_results, path)
    if pilot is None:
        return None
    tables, figures = search_results / "tables", search_results / "figures"
    table = pd.read_csv(tables / "search_pilot.csv")
    cols = [c for c in ("lr", "length", "updates", "control_gain", "control_stable", "reference_step1_mismatch",
                        "reference_step1_entropy", "eligible", "chosen") if c in table]
    parts = ["\\section{A real pretrained model: does stock BF16 collapse on SmolLM2?}\\label{sec:realsearch}",
             escape(f"The search on SmolLM2-135M-Instruct (2-digit sums after three solved ones; PPO's old "
                    f"log-probabilities from the sampler, IS off, a constant learning rate, vLLM compiled). The pilot's "
                    f"rule, written in its config before it ran: {_pilot_rule_text(pilot['rule'])}. "
                    f"{pilot['finished']} of {pilot['rungs']} rungs finished, {pilot['eligible']} eligible; chosen: "
                    f"{pilot.get('chosen') or 'none'}."),
             booktabs(readable(table[cols], {"reference_step1_mismatch": "none mean |dlogp| step 1",
                                             "reference_step1_entropy": "none entropy step 1",
                                             "control_gain": "fp32 reward gain", "control_stable": "fp32 stable"}),
                      "The real-model pilot: FP32's reward gain and stability, stock BF16's step-1 mismatch",
                      "tab:realpilot", placement="H")]
    parts += _copied_figure(figures / "search_pilot.png", out_dir, "real_", "The real-model pilot: stock BF16's step-1 "
                            "mismatch against FP32's reward gain, one point per rung (one seed each; red: eligible, "
                            "star: chosen).", "fig:realpilot")
    grid_json = tables / "search_grid.json"
    if not grid_json.exists():
        parts.append(escape("The grid has not run yet; the paper says nothing about it."))
    else:
        grid = json.loads(grid_json.read_text())
        parts.append(escape(f"The grid (arms and seeds at the chosen rung, its collapse windows, questions, tests "
                            f"and power written in its config before it ran): {grid['decision']['statement']}"))
        parts += _questions_table(grid)
        if post_hoc_text(grid):
            parts.append(escape(post_hoc_text(grid)))
        if grid["decision"].get("outcome") == "does not collapse naturally":
            parts.append(escape(_envelope_text(grid.get("envelope") or {})))
        parts += _stage_groups(grid, "The real-model grid's finished runs per arm", "tab:realgrid")
        every = _real_runs_table(tables / "search_grid.csv")
        if every:  # the per-run detail is the appendix's
            parts.append(escape("Every finished run, its verdict, rewards, held-out accuracy, entropy and mismatch: "
                                "Appendix ") + "\\ref{sec:realruns}.")
            write_text(appendix, "\n\n".join(["\\section{The real-model grid, every run}\\label{sec:realruns}",
                                               *every]) + "\n")
        parts += _copied_figure(figures / "search_grid.png", out_dir, "real_", "The real-model grid: reward (top) and "
                                "in-training mismatch (bottom, log scale) per logged step; line: mean over the finished "
                                "seeds, band: their range.", "fig:realgrid")
    probes = _decode_probes(search_results / "decode")
    if "none" in probes:
        stock = probes["none"]
        own, engines = stock["trainer_decode_variance"]["decode_vs_single"]["mean_abs_dlogp"], stock["mean_abs_dlogp"]
        parts.append(escape(f"What the self-sampled control can show: it was meant to be mismatch-free BF16 (the "
                            f"trainer sampling its own rollouts). With stock BF16 numerics the trainer's KV-cached "
                            f"decoding of a sequence differs from its own recompute of it by a mean |dlogp| of "
                            f"{own:.3g}, the trainer from vLLM by {engines:.3g} (ratio {own / engines:.2f}): "
                            f"`none` against `self-sampled` compares two arms with that much mismatch each."))
    parts += _decode_table(probes)
    write_text(path, "\n\n".join(parts) + "\n")
    return path


def _stage_section(stage: dict, intro: str, table: tuple[str, str], figure: tuple[Path, str, str],
                   tracking: dict[str, float] | None = None) -> list[str]:
    """A search stage's part of the section: ``intro`` and the stage's decision statement, its groups' table
    (caption, label), its notes (with the arms' entropy ``tracking``, :func:`entropy_tracking`) and its figure
    (path, caption, label)."""
    return [escape(f"{intro}{stage['decision']['statement']}"), *_stage_groups(stage, *table),
            *_stage_notes(stage, tracking), *_figure(*figure)]


def _figure(path: Path, caption: str, label: str) -> list[str]:
    """A committed figure of the search, placed where it is input (none where it is missing): the text's width, or
    less where that would make it taller than most of a page (a figure of several panel rows), so that it and its
    caption fit on one page."""
    if not path.exists():
        return []
    return ["\\begin{figure}[H]\\centering\\includegraphics[width=\\linewidth,height=0.75\\textheight,"
            "keepaspectratio]{" + path.name + "}"
            f"\\caption{{{escape(caption)}}}\\label{{{label}}}\\end{{figure}}"]


def _copied_figure(path: Path, out_dir: Path, prefix: str, caption: str, label: str) -> list[str]:
    """:func:`_figure` of a copy in ``out_dir`` named ``<prefix><name>``: two searches each have a
    ``search_pilot.png``, and LaTeX finds a bare name in the first folder that has one."""
    if not path.exists():
        return []
    copy = out_dir / f"{prefix}{path.name}"
    shutil.copyfile(path, copy)
    return _figure(copy, caption, label)


TRACKS = 0.5
"""Mismatch "tracks" the policy's entropy in an arm when the median over its runs of the per-run correlation of log
mismatch with log entropy (over the logged steps) is at least this; below it, comparing arms at matched entropy
controls for nothing in that arm."""


def entropy_tracking(results: Path, stage: str) -> dict[str, float]:
    """Per arm, the median over its runs of the per-run Pearson correlation of log mismatch (mean |dlogp|) with log
    entropy over the logged steps, from the runs' ``metrics.jsonl`` (runs with fewer than 3 usable steps left out)."""
    per: dict[str, list[float]] = {}
    for cell, run_dir in cells_by_folder(results, "search", stage):
        steps = [(m["mismatch/mean_abs_dlogp"], m["entropy"]) for m in read_jsonl(run_dir / "metrics.jsonl")
                 if (m.get("mismatch/mean_abs_dlogp") or 0) > 0 and (m.get("entropy") or 0) > 0]
        if len(steps) >= 3:
            x, y = np.log([e for _, e in steps]), np.log([d for d, _ in steps])
            if x.std() > 0 and y.std() > 0:
                per.setdefault(cell["labels"]["arm"], []).append(float(np.corrcoef(x, y)[0, 1]))
    return {arm: float(np.median(rs)) for arm, rs in per.items()}


def mismatch_course(results: Path, stage: str, arm: str) -> dict | None:
    """An arm's in-training mismatch over its logged steps, from its runs' ``metrics.jsonl``: the seed mean at each
    logged step, and per run the sign of the least-squares slope of log mismatch over the steps after the first
    (whether it keeps growing once the first weight sync is past)."""
    by_step: dict[int, list[float]] = {}
    rising, runs = 0, 0
    for cell, run_dir in cells_by_folder(results, "search", stage):
        if cell["labels"].get("arm") != arm:
            continue
        steps = [(m["step"], m["mismatch/mean_abs_dlogp"]) for m in read_jsonl(run_dir / "metrics.jsonl")
                 if (m.get("mismatch/mean_abs_dlogp") or 0) > 0]
        for step, value in steps:
            by_step.setdefault(int(step), []).append(value)
        later = steps[1:]
        if len(later) >= 2:
            runs += 1
            rising += np.polyfit([x for x, _ in later], np.log([v for _, v in later]), 1)[0] > 0
    if not by_step:
        return None
    means = {step: float(np.mean(v)) for step, v in sorted(by_step.items())}
    return {"means": means, "rising": int(rising), "runs": runs}


def _course_text(arm: str, course: dict | None) -> str:
    if course is None or len(course["means"]) < 3:
        return ""
    (s1, m1), (s2, m2), *rest = course["means"].items()
    later = [m2, *(m for _, m in rest)]
    return (f"Its in-training mismatch (seed means) goes from {m1:.3g} at logged step {s1} to {m2:.3g} at step {s2} "
            f"and then stays within {min(later):.3g}-{max(later):.3g} to step {rest[-1][0]}; the log slope after step "
            f"{s1} is positive in {course['rising']} of {course['runs']} runs of {arm}.")


def _stage_notes(stage: dict, tracking: dict[str, float] | None = None) -> list[str]:
    """What a stage's summary says beside its decision: runs ending in an absorbing state, and
    the aligned arm's mismatch relative to stock BF16's at step 1 and at matched entropy."""
    notes = []
    ended = stage.get("absorbing") or []
    if ended:
        notes.append(escape("Ending in an absorbing state (raw reward about 0 in groups without reward variance, "
                            "whatever the rule says): " + "; ".join(
                                f"{a['cell']} (verdict {a['verdict']}, raw reward {a['terminal_reward']:.2g} over the "
                                f"last {TERMINAL_STEPS} logged steps against a smoothed final reward of "
                                f"{a['final_reward']:.3g})" for a in ended) + "."))
    c = stage.get("comparison") or {}
    ratios = c.get("mismatch_ratio") or {}
    if ratios:
        def span(values):
            values = [v for v in values if v is not None]
            return "n/a" if not values else f"{min(values):.2f}-{max(values):.2f}"

        tracks = "mismatch tracks the policy's entropy, so"
        if tracking:
            loose = [arm for arm in (c["treatment_arm"], c["reference_arm"]) if tracking.get(arm, 1.0) < TRACKS]
            tracks = ("the per-run correlation of log mismatch with log entropy, median over seeds, is "
                      + ", ".join(f"{arm} {r:.2f}" for arm, r in tracking.items())
                      + ("" if not loose else f" (in {' and '.join(loose)} the mismatch does not follow the entropy, "
                                              f"so the matched-entropy ratio below controls for nothing there)")
                      + "; where it tracks,")
        notes.append(escape(
            f"Mismatch of {c['treatment_arm']} relative to {c['reference_arm']} (beside the rules): {tracks} "
            f"the means over the steps in the table compare how far each arm's policy moved as "
            f"much as its numerics; at step 1 (the same weights) and at matched entropy (equal-width bins of log "
            f"entropy) the ratio is " + "; ".join(
                f"{rung}: {span(list(r['step1'].values()))} per seed at step 1, "
                f"{'n/a' if r['entropy_matched'] is None else format(r['entropy_matched'], '.2f')} at matched entropy, "
                f"{r['mean_over_steps']:.2f} as a mean over the steps" for rung, r in ratios.items()) + "."))
    return notes


def _stage_groups(stage: dict, caption: str, label: str) -> list[str]:
    """A stage's finished groups as a table: collapsed with the group's own exact interval on the
    rate, the smoothed final reward beside the raw terminal one, absorbing ends, and means."""
    groups = pd.DataFrame(stage.get("groups") or [])
    if groups.empty or not (groups["finished"] > 0).any():
        return []
    shown = groups[groups["finished"] > 0].copy()
    shown["collapse_rate"] = [f"{lo:.2f}-{hi:.2f}" for lo, hi in
                              zip(shown["collapse_rate_low"], shown["collapse_rate_high"])]
    shown["collapsed"] = [f"{k}/{n}" for k, n in zip(shown["collapsed"], shown["finished"])]
    cols = [c for c in ("lr", "arm", "collapsed", "collapse_rate", "final_reward", "terminal_reward", "absorbing",
                        "reward_auc", "entropy", "pre_collapse_mismatch", "max_pre_drop_mismatch",
                        "max_pre_collapse_phantom_clip") if c in shown]
    confidence = stage["decision"]["rule"].get("confidence", 0.95)
    return [booktabs(readable(shown[cols], {"terminal_reward": f"raw reward, last {TERMINAL_STEPS} steps"}),
                     f"{caption} (collapsed / finished runs with the group's own exact {100 * confidence:.0f}% "
                     f"interval on the rate; final reward smoothed over the rule's window beside the raw reward of the "
                     f"last {TERMINAL_STEPS} logged steps; entropy and mean |dlogp| are means over the steps, the "
                     f"latter before any collapse; verdicts under collapse rule {RULE_VERSION})", label,
                     placement="H")]


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


def _final_entropy_label(rows: pd.DataFrame) -> str:
    """``final_entropy``'s header with its window (the runs' smoothing window), never a bare "final"."""
    steps = sorted({int(v) for v in rows.get("final_entropy_steps", pd.Series(dtype=float)).dropna()})
    return f"entropy, last {'/'.join(map(str, steps))} steps" if steps else "final entropy"


def _envelope_text(env: dict) -> str:
    """The envelope the stock-BF16 arm explored, from the stage summary's ``envelope``."""
    if not env.get("runs"):
        return "No stock BF16 run finished."
    return (f"The envelope explored by the {env['runs']} stock BF16 runs: {_settings_text(env)}; policy entropy "
            f"{_span(env.get('step1_entropy') or [])} nats/token at step 1 and "
            f"{_span(env.get('final_entropy') or [])} over each run's last "
            f"{_span(env.get('final_entropy_steps') or [])} logged steps (its smoothing window; mean over all steps "
            f"{_span([env.get('mean_entropy')])}); mean |dlogp| before any collapse up to "
            f"{_span([env.get('max_pre_collapse_mismatch')])} (largest step){_pre_drop(env)} and a phantom-clip rate up "
            f"to {_span([env.get('max_pre_collapse_phantom_clip')])}.")


def _pre_drop(env: dict) -> str:
    """The largest mismatch before any drop, where a drop that was no collapse comes first."""
    before, after = env.get("max_pre_drop_mismatch"), env.get("max_pre_collapse_mismatch")
    if before is None or after is None or before >= after:
        return ""
    return (f", {_span([before])} before any drop (the larger value is from after a run's raw reward fell below "
            f"the rule's level without staying there)")


def _top_rung_runs(csv: Path, decision: dict) -> str | None:
    """The runs of the grid's last (largest) rung, one row each."""
    if not csv.exists() or not decision.get("rungs"):
        return None
    runs = pd.read_csv(csv)
    rung_axis = decision["rule"]["rung_axis"]
    top = decision["rungs"][-1]["rung"]
    rows = runs[(runs[rung_axis] == top) & (runs["state"] == "finished")]
    cols = [c for c in (decision["rule"]["arm_axis"], "seed", "verdict", "collapse_step", "peak_reward", "final_reward",
                        "terminal_reward", "absorbing", "final_entropy", "max_pre_drop_mismatch",
                        "max_pre_collapse_phantom_clip") if c in rows]
    return booktabs(readable(rows[cols], {"terminal_reward": f"raw reward, last {TERMINAL_STEPS} steps",
                                          "final_entropy": _final_entropy_label(rows)}),
                    f"Natural-collapse search: every run of the top rung ({top}); final reward smoothed over the rule's "
                    f"window, raw reward the mean of the last {TERMINAL_STEPS} logged steps, absorbing: a raw reward about "
                    f"0 in groups without reward variance", "tab:searchtop", placement="H")


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
                        f"{c['reference_arm']} {c['reference'][0]}/{c['reference'][1]} (Fisher exact p = {_p(p)})")
            if p < 0.05:
                significant.append(name)
        for other, pair in (c.get("reward_auc_paired") or {}).items():
            if pair["pairs"] > pair.get("ties", 0):
                ties = f", {pair['ties']} tied" if pair.get("ties") else ""
                learning.append(f"{name}: {c['reference_arm']} below {other} in {pair['reference_lower']} of "
                                f"{pair['pairs'] - pair.get('ties', 0)} paired seeds{ties} (sign test p = "
                                f"{_p(pair['sign_test_p'])})")
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


def effect_reading(effect: dict, alpha: float) -> str:
    """An effect as the grid's written reading names it (:func:`analysis.collapse_stats.paired_reading`): ``below
    0``, ``above 0``, else ``not resolved`` at this power."""
    return paired_reading(effect, alpha)


def _p_range(ps: list[float] | None) -> str:
    if not ps:
        return "--"
    low, high = (f"{p:.2g}" for p in ps)
    return low if low == high else f"{low}-{high}"


def _effects_robustness(csv: Path, grid: dict, alpha: float) -> list[str]:
    """Beside each pre-registered effect (not part of its rule): the same contrast on the reward AUC, and how far
    its reading rests on one seed -- the contrast again with each seed left out (the range of its p, the seeds
    whose removal changes the reading)."""
    if not csv.exists():
        return []
    runs = pd.read_csv(csv)
    done = runs[runs["state"] == "finished"]
    rule = grid["decision"]["rule"]
    arm, confidence, rung = rule.get("arm_axis", "arm"), rule.get("confidence", 0.95), rule.get("rung_axis")
    rows = []
    for e in grid["effects"]["effects"].values():
        spec = {"contrast": e["contrast"], "outcome": e["outcome"]}
        auc = paired_contrast(done, pd.DataFrame(), {**spec, "outcome": "reward_auc"}, arm, confidence, rung)
        loo = leave_one_out(done, spec, arm, confidence, alpha, rung)
        sh = auc.get("shift") or {}
        changed = loo["changes_reading"]
        rows.append({"difference": contrast_words(e["contrast"]),
                     "reward AUC: HL shift (exact interval)": (f"{sh['estimate']:+.3f} [{sh['low']:+.3f}, "
                                                               f"{sh['high']:+.3f}]" if sh else "--"),
                     "reward AUC: signed-rank p": auc.get("signed_rank_p"),
                     "reward AUC: reading": paired_reading(auc, alpha),
                     "learning gain p, one seed left out": _p_range(loo["p_range"]),
                     "reading changes without seed": ", ".join(
                         f"{s} ({loo['without'][s]['reading']}, p = {loo['without'][s]['p']:.2g})" for s in changed)
                     or "none"})
    return [escape("Beside the rule (not part of it, computed when the paper is built): each effect on the reward "
                   "AUC, whose interval and p are those of the questions, and how far its reading on the learning "
                   "gain rests on one seed -- the effect again with each seed left out."),
            booktabs(pd.DataFrame(rows), f"The precision grid's effects beside the rule: the reward AUC, and the "
                     f"learning-gain effect with each seed left out in turn (exact signed-rank test at alpha "
                     f"{alpha}, one pair fewer)", "tab:precrobust", placement="H")]


def precision_section(results: Path | None, out_dir: Path) -> Path | None:
    """``precision_section.tex``: the precision x mismatch grid (issue 56) -- its decision statement, the collapse
    questions, the pre-registered effects on the learning gain with each one's reading by the rule written in the
    config (at the config's ``decision.alpha``, the one the effects were tested at), each arm's in-training
    mismatch, the groups and the figure; or how much of it has run; nothing where it did not run."""
    path = out_dir / "precision_section.tex"
    grid_json = None if results is None else results / "tables" / "search_grid.json"
    if grid_json is None or not grid_json.exists():
        path.unlink(missing_ok=True)
        return None
    grid = json.loads(grid_json.read_text())
    parts = ["\\section{Precision or mismatch? A grid on SmolLM2}\\label{sec:precision}",
             escape("The real-model grid's BF16 arms learned less than FP32 and all carried the same mismatch. This "
                    "grid crosses the two at its rung: FP32 on both sides (fp32), an FP32 trainer sampled by BF16 vLLM "
                    "(trainer-fp32) and stock BF16 (none), 8 seeds each, on one CPU type; its questions, effects and "
                    "what each outcome means were written in its config before it ran.")]
    left = unfinished_runs(grid)
    if left is not None:
        parts.append(escape(f"The grid has not finished ({left} runs left); nothing of it is read."))
        write_text(path, "\n\n".join(parts) + "\n")
        return path
    effects, alpha = grid["effects"], grid["questions"]["alpha"]
    parts.append(escape(grid["decision"]["statement"]))
    parts += _questions_table(grid, "The precision grid's", "tab:precquestions")
    parts.append(_description({contrast_words(e["contrast"]): e["question"] for e in effects["effects"].values()}))
    rows = [{"difference": contrast_words(e["contrast"]),
             "pairs": e["pairs"], "mean": f"{e['mean_difference']:+.3f}", "below 0": f"{e['a_lower']} of {e['pairs']}",
             "signed-rank p": e["signed_rank_p"], "HL shift": f"{e['shift']['estimate']:+.3f}",
             "exact interval": f"{e['shift']['low']:+.3f} to {e['shift']['high']:+.3f} "
                               f"({100 * e['shift']['coverage']:.1f}%)",
             "reading": effect_reading(e, alpha)} for name, e in effects["effects"].items()]
    parts.append(booktabs(pd.DataFrame(rows), f"The precision grid's pre-registered effects on the learning gain "
                          f"(reward AUC minus the run's own step-1 training reward), each contrast paired by seed: "
                          f"exact two-sided signed-rank test at alpha {alpha}, Hodges-Lehmann shift with the exact "
                          f"interval that inverts it; reading: below or above 0 where the interval excludes 0 at "
                          f"that alpha", "tab:preceffects", placement="H"))
    parts += _effects_robustness(results / "tables" / "search_grid.csv", grid, alpha)
    own = arm_mismatch(grid)
    treatment = grid["decision"]["rule"].get("treatment_arm", "trainer-fp32")
    if own:
        parts.append(escape("Each arm's mean in-training mismatch (mean |dlogp|): " + arms_text(own)
            + ". The FP32-trainer cell's mismatch is not stock BF16's kind: its trainer computes on the unrounded FP32 "
            "weights while its engine holds their BF16 rounding, so the two sides differ in their weights as well as "
            "in where they round; stock BF16's "
            "trainer computes on the same rounding as its engine, updates reaching both sides when they cross a "
            "rounding boundary, and its two sides differ only in where they round. An effect of that cell against fp32 is the cost of this kind and size "
            "of mismatch; whether stock BF16's own mismatch costs it learning needs a cell with BF16 arithmetic and no "
            "mismatch, which did not qualify on this CPU. "
            + _course_text(treatment, mismatch_course(results, "grid", treatment))))
    parts += _stage_notes(grid, entropy_tracking(results, "grid"))
    parts += _stage_groups(grid, "The precision grid's runs per arm", "tab:precgrid")
    parts += _copied_figure(results / "figures" / "search_grid.png", out_dir, "precision_", "The precision grid: "
                            "reward (top) and in-training mismatch (middle, log scale) per logged step, line: mean over "
                            "the seeds, band: their range; bottom: each run's learning gain (line: the arm's mean).",
                            "fig:precgrid")
    write_text(path, "\n\n".join(parts) + "\n")
    return path
