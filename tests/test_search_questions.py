"""The real-model search's pre-registered machinery (issue 31): the paired pilot rule, the grid's
questions with their tests, and the power the seed count buys."""

import math

import pandas as pd
import pytest

from analysis.collapse_search import (fisher_one_sided, fisher_power, paired_pilot, questions, signed_rank_interval,
                                      signed_rank_null, signed_rank_p, smallest_detectable_effect,
                                      smallest_detectable_rate)

RULE = {"kind": "paired", "arm_axis": "arm", "reference_arm": "none", "control_arm": "fp32",
        "rung_axes": ["lr", "length"], "learn_fraction": 0.25, "min_gain": 0.05}


def _pilot_runs(rewards: dict, mismatch: dict, status=None):
    runs, curves = [], []
    for (lr, length, arm), series in rewards.items():
        cell = f"pilot/{lr}/{length}/{arm}/seed0"
        runs.append({"lr": lr, "length": length, "arm": arm, "seed": 0, "cell": cell, "state": "finished",
                     "status": (status or {}).get(cell, "ok"), "wall_s": 10.0, "collapsed": False,
                     "step1_mismatch": mismatch[(lr, length, arm)], "step1_entropy": 1.0,
                     "initial_reward": series[0]})
        curves += [{"cell": cell, "step": i + 1, "reward": r} for i, r in enumerate(series)]
    return pd.DataFrame(runs), pd.DataFrame(curves)


def test_the_paired_pilot_takes_the_rung_where_fp32_learns_with_the_largest_bf16_mismatch():
    learns, flat = [0.1, 0.1, 0.2, 0.3, 0.4, 0.4, 0.5, 0.5], [0.3] * 8
    rewards = {("lr1", "c8", "fp32"): learns, ("lr1", "c8", "none"): learns,
               ("lr1", "c32", "fp32"): learns, ("lr1", "c32", "none"): learns,
               ("lr2", "c8", "fp32"): flat, ("lr2", "c8", "none"): learns}
    mismatch = {("lr1", "c8", "none"): 0.02, ("lr1", "c32", "none"): 0.04, ("lr2", "c8", "none"): 0.09,
                ("lr1", "c8", "fp32"): 1e-6, ("lr1", "c32", "fp32"): 1e-6, ("lr2", "c8", "fp32"): 1e-6}
    runs, curves = _pilot_runs(rewards, mismatch)
    table, choice = paired_pilot(runs, RULE, curves)
    assert choice["chosen"] == "lr1/c32"  # lr2/c8 has the largest mismatch, but FP32 does not learn there
    assert table.set_index(["lr", "length"]).loc[("lr2", "c8"), "eligible"] == False  # noqa: E712
    assert table.set_index(["lr", "length"]).loc[("lr1", "c32"), "control_gain"] == pytest.approx(0.5 - 0.1)
    # an FP32 run that did not finish cleanly is not stable: its rung is out
    runs, curves = _pilot_runs(rewards, mismatch, status={"pilot/lr1/c32/fp32/seed0": "error"})
    assert paired_pilot(runs, RULE, curves)[1]["chosen"] == "lr1/c8"
    # the rule is over the whole pilot: no choice while a run is missing
    runs.loc[0, "state"] = "missing"
    assert paired_pilot(runs, RULE, curves)[1]["chosen"] is None


def test_rungs_tied_at_step_1_are_named_and_the_first_in_axis_order_is_taken():
    """Step 1 samples the same weights with the same seed at every learning rate: equal mismatch."""
    learns = [0.1, 0.1, 0.2, 0.3, 0.4, 0.4, 0.5, 0.5]
    rewards = {(lr, "c8", arm): learns for lr in ("lr1", "lr2") for arm in ("none", "fp32")}
    mismatch = {(lr, "c8", arm): 0.03 if arm == "none" else 1e-6 for lr in ("lr1", "lr2") for arm in ("none", "fp32")}
    runs, curves = _pilot_runs(rewards, mismatch)
    choice = paired_pilot(runs, RULE, curves)[1]
    assert choice["chosen"] == "lr1/c8" and choice["tied_with"] == ["lr2/c8"]
    mismatch[("lr2", "c8", "none")] = 0.031
    runs, curves = _pilot_runs(rewards, mismatch)
    choice = paired_pilot(runs, RULE, curves)[1]
    assert choice["chosen"] == "lr2/c8" and choice["tied_with"] == []


def test_the_grid_questions_use_the_tests_named_in_advance():
    rows = []
    for seed in range(8):
        rows.append({"arm": "none", "seed": seed, "state": "finished", "collapsed": seed < 5, "reward_auc": 0.2})
        rows.append({"arm": "fp32", "seed": seed, "state": "finished", "collapsed": False, "reward_auc": 0.5 + seed / 100})
    rule = {"arm_axis": "arm", "alpha": 0.05, "questions": {"Q1": {"question": "collapses?", "a": "none", "b": "fp32"}}}
    q = questions(pd.DataFrame(rows), rule)["questions"]["Q1"]
    assert q["a_collapsed"] == [5, 8] and q["b_collapsed"] == [0, 8]
    assert q["fisher_p"] == pytest.approx(fisher_one_sided(5, 8, 0, 8)) and q["fisher_p"] < 0.05 and q["answer"] == "yes"
    assert q["reward_auc"]["a_lower"] == 8 and q["reward_auc"]["signed_rank_p"] == pytest.approx(2 / 256)
    shift = q["reward_auc"]["shift"]  # differences -0.30 .. -0.37: the interval is below zero, as p < 0.05 says
    assert shift["high"] < 0 and shift["low"] >= -0.37 - 1e-12 and shift["coverage"] == pytest.approx(1 - 10 / 256)
    rows[0]["state"] = "missing"
    assert questions(pd.DataFrame(rows), rule)["questions"]["Q1"]["answer"] == "grid incomplete"


def test_exact_tests_and_power():
    # Fisher one-sided: 3 of 4 vs 0 of 4 is p = C(4,3)C(4,0)/C(8,3) + C(4,4)C(4,-1)... = 4/56 + 0 = 1/14
    assert fisher_one_sided(3, 4, 0, 4) == pytest.approx(1 / 14)
    assert fisher_one_sided(0, 8, 0, 8) == 1.0
    assert signed_rank_p([1.0] * 8) == pytest.approx(2 / 256) and signed_rank_p([]) is None
    assert signed_rank_p([1.0, -1.0]) == 1.0
    # power grows with the rate and the seeds; "3 of 4" level facts of the tiny search for scale
    assert fisher_power(8, 8, 0.9, 0.0, 0.05) > fisher_power(8, 8, 0.5, 0.0, 0.05) > fisher_power(4, 4, 0.5, 0.0, 0.05)
    assert smallest_detectable_rate(8, 0.05) == pytest.approx(0.59)
    assert smallest_detectable_rate(10, 0.05) < smallest_detectable_rate(8, 0.05) < smallest_detectable_rate(6, 0.05)
    effect = smallest_detectable_effect(8, 0.05)
    assert 1.0 <= effect <= 1.6 and not math.isnan(effect)


def test_the_shift_interval_inverts_the_signed_rank_test_with_the_coverage_it_states():
    """The Hodges-Lehmann interval is the set of shifts the exact two-sided signed-rank test does not
    reject: a shift just inside either end is kept, one just outside is rejected; its stated coverage is
    the exact one (8 pairs: k = 4, 1 - 10/256); with 5 pairs no 95% interval exists, as no p < 0.05 does."""
    import numpy as np

    assert sum(signed_rank_null(8)) == 256 and signed_rank_null(3) == [1, 1, 1, 2, 1, 1, 1]
    rng = np.random.default_rng(3)
    for n in (6, 8, 10):
        d = list(rng.normal(0.05, 0.03, n))
        ci = signed_rank_interval(d, 0.95)
        alpha = 1 - ci["coverage"]
        assert ci["coverage"] >= 0.95 and ci["low"] < ci["estimate"] < ci["high"]
        walsh = sorted((d[i] + d[j]) / 2 for i in range(n) for j in range(i, n))
        assert ci["estimate"] == pytest.approx(float(np.median(walsh)))
        eps = 1e-9
        for end, inside in ((ci["low"], ci["low"] + eps), (ci["high"], ci["high"] - eps)):
            outside = 2 * end - inside
            assert signed_rank_p([x - inside for x in d]) > 0.05
            assert signed_rank_p([x - outside for x in d]) <= alpha + 1e-12
    assert signed_rank_interval([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8], 0.95)["coverage"] == pytest.approx(1 - 10 / 256)
    assert signed_rank_interval([0.1, 0.2, 0.3, 0.4, 0.5], 0.95) is None and signed_rank_interval([]) is None


def test_the_real_model_search_config_states_its_grid_and_questions():
    """experiments/collapse-smollm2.yaml: valid; the grid is the four arms at one rung x 8 seeds with the
    rule's windows inside its logged steps, and every question names two of its arms."""
    import yaml

    from rpa.workflow.pipeline import check_config
    from rpa.workflow.experiments import kind_cells
    from tests.conftest import REPO

    config = yaml.safe_load((REPO / "experiments/collapse-smollm2.yaml").read_text())
    check_config(config)
    grid = kind_cells(config, "search", "grid")
    assert len(grid) == 4 * 8 and {c.labels["arm"] for c in grid} == {"fp32", "none", "all", "self-sampled"}
    run = grid[0].run
    logged = run.steps // run.updates_per_generation  # TRL logs once per generated batch
    assert run.collapse.smoothing_window + run.collapse.min_steps_after_drop < logged
    assert not run.keep_checkpoints and run.checkpoint_every % run.updates_per_generation == 0
    rule = config["search"]["decision"]
    assert set(rule["questions"]) == {"Q1", "Q2", "Q3", "Q4"}
    assert all(q[side] in {c.labels["arm"] for c in grid} for q in rule["questions"].values() for side in "ab")
    assert smallest_detectable_rate(8, rule["alpha"]) == pytest.approx(0.59)  # what the config's comment says


@pytest.mark.cli  # the checker runs the grid's analysis in a process of its own
def test_the_committed_real_model_decision_is_the_one_its_raw_runs_give_and_the_readme_states(capsys):
    """The real-model grid's decision, recomputed from the committed raw runs (metric logs, configs), is
    the committed table byte for byte; and the reference README's decision table states each question's
    counts, answer and shift interval as that table has them (not numbers typed in once)."""
    import json

    from analysis import check_reference
    from tests.conftest import REPO

    ref = REPO / "results/reference/collapse-smollm2"
    assert check_reference.main(["--only", "collapse-smollm2"]) == 0
    assert "0 differ" in capsys.readouterr().out
    grid = json.loads((ref / "tables/search_grid.json").read_text())
    # the grid is complete: a missing or partial committed grid is a failure, not a skip
    assert grid["decision"]["outcome"] != "incomplete" and not grid["questions"]["unfinished"], grid["decision"]
    assert all(n == 8 for q in grid["questions"]["questions"].values() for _, n in (q["a_collapsed"], q["b_collapsed"]))
    readme = (ref / "README.md").read_text().split("## Decision")[1]
    for name, q in grid["questions"]["questions"].items():
        row = next(line for line in readme.splitlines() if line.startswith(f"| {name} "))
        (ka, na), (kb, nb) = q["a_collapsed"], q["b_collapsed"]
        assert f"| `{q['a']}` vs `{q['b']}` | {ka}/{na} vs {kb}/{nb} | {q['fisher_p']:.2g} | **{q['answer']}** |" in row
        shift = q["reward_auc"]["shift"]
        assert (f"{_fmt(shift['estimate'])} [{_fmt(shift['low'])}, {_fmt(shift['high'])}] "
                f"({100 * shift['coverage']:.1f}%; {shift['pairs']}") in row, row


def _fmt(value: float, digits: int = 3) -> str:
    return f"{value:+.{digits}f}".replace("+0.000", "0.000")


def _prose(path) -> str:
    """A document's text with its line wraps joined and its typographic minus and dashes as '-'."""
    import re

    return re.sub(r"\s+", " ", path.read_text()).replace("\u2212", "-").replace("\u2013", "-")


def test_every_number_quoted_for_the_real_model_grid_is_the_committed_tables():
    """The numbers the README's long findings (docs/findings.md), docs/searches.md, docs/design.md and the reference
    README quote for the real-model grid are formatted from the committed decision table (issue 55): each
    question's Hodges-Lehmann shift with its own interval, the post-hoc comparisons labelled post hoc, the
    step-1 rewards and reward gains, the greedy evaluation as one measurement per arm, the entropy of
    `none`, and the arms' in-training mismatch at one rounding; the statements the data do not support are
    gone."""
    import json

    from tests.conftest import REPO

    grid = json.loads((REPO / "results/reference/collapse-smollm2/tables/search_grid.json").read_text())
    qs, ph = grid["questions"]["questions"], grid["post_hoc"]
    own = {g["arm"]: g["pre_collapse_mismatch"] for g in grid["groups"]}
    shifts = {n: q["reward_auc"]["shift"] for n, q in qs.items()}
    interval = {n: f"{_fmt(s['estimate'])} [{_fmt(s['low'])}, {_fmt(s['high'])}]" for n, s in shifts.items()}
    arms, bf16 = ph["arms"], ("none", "all", "self-sampled")
    span = lambda values, d=3: (f"{min(values):.{d}f}-{max(values):.{d}f}")  # noqa: E731
    post = {n: c for n, c in ph["comparisons"].items()}
    gain = post["bf16-vs-fp32-learning-gain"]
    common = [f"{post['all-vs-fp32']['signed_rank_p']:.2g}", f"p = {gain['signed_rank_p']:.2g}",
              f"{_fmt(gain['shift']['low'])}, {_fmt(gain['shift']['high'])}".replace("+", ""),
              f"{arms['fp32']['step1_reward']:.3f} vs {span([arms[a]['step1_reward'] for a in bf16])}",
              "post hoc"]
    bf16_mismatch = span([own[a] for a in bf16], 4)
    expect = {
        "docs/findings.md": [interval["Q1"], interval["Q2"], interval["Q4"],
                      f"{own['self-sampled']:.3g}", bf16_mismatch,
                      f"{arms['fp32']['reward_gain']:.3f} vs {span([arms[a]['reward_gain'] for a in bf16])}",
                      "{}/{} vs {}/{}".format(arms["fp32"]["first_eval_solved"][0], arms["fp32"]["eval_prompts"],
                                              span([arms[a]["first_eval_solved"][0] for a in bf16], 0),
                                              arms["none"]["eval_prompts"]), *common],
        "docs/searches.md": [*(interval[n] for n in qs), f"{100 * shifts['Q2']['coverage']:.1f}%",
                             f"{shifts['Q2']['pairs']} pairs", bf16_mismatch, *common],
        "docs/design.md": [interval["Q1"], f"{own['self-sampled']:.3g}",
                           f"{arms['fp32']['step1_reward']:.3f} vs {span([arms[a]['step1_reward'] for a in bf16])}"],
        "results/reference/collapse-smollm2/README.md": [
            *(interval[n] for n in qs), f"{own['self-sampled']:.3g}", bf16_mismatch,
            f"seed mean {arms['none']['step1_entropy']:.2f} at the first logged step, {arms['none']['last_entropy']:.2f} "
            f"at the last; lower in {arms['none']['entropy_fell']} of 8",
            "last step {:.2f}-{:.2f}".format(*arms["none"]["last_entropy_range"]),
            f"FP32 gains {arms['fp32']['reward_gain']:.3f} and the BF16 arms "
            f"{span([arms[a]['reward_gain'] for a in bf16])}",
            ", ".join(f"{v:+.3f}" for v in gain["reward_gap_by_step"].values()).replace("+", ""),
            *common]}
    unsupported = ["points at BF16 arithmetic", "What separates the arms here is BF16 arithmetic", "did not fall over",
                   "at step 0 (greedy accuracy", "starting lower already at step 0", "exact 96% interval",
                   "-0.052 against FP32", "+0.009 [-0.015, +0.052]", "residual 0.033 ", "by 0.033,"]
    for doc, numbers in expect.items():
        text = _prose(REPO / doc)
        missing = [n for n in numbers if n not in text]
        assert not missing, f"{doc} does not quote {missing}"
        said = [u for u in unsupported if u in text]
        assert not said, f"{doc} still says {said}"



def test_every_number_quoted_for_the_precision_grid_is_the_committed_tables(capsys):
    """The precision grid (issue 56): its decision and effects, recomputed from the committed raw runs, are the
    committed table byte for byte; the grid is complete (24 of 24, every effect over 8 seeds); and the numbers the
    README, docs/searches.md, docs/design.md and the reference README quote for its pre-registered effects -- each
    Hodges-Lehmann shift with its own interval and p, each arm's in-training mismatch -- are formatted from that
    table, not typed in once."""
    import json

    from analysis import check_reference
    from tests.conftest import REPO

    assert check_reference.main(["--only", "precision-smollm2"]) == 0
    assert "0 differ" in capsys.readouterr().out
    ref = REPO / "results/reference/precision-smollm2"
    grid = json.loads((ref / "tables/search_grid.json").read_text())
    effects = grid["effects"]
    assert grid["decision"]["outcome"] != "incomplete" and effects["unfinished"] == 0, grid["decision"]
    assert sorted(g["finished"] for g in grid["groups"]) == [8, 8, 8]
    assert all(e["pairs"] == 8 for e in effects["effects"].values())
    interval = {n: "{} [{}, {}]".format(*(_fmt(e["shift"][k]) for k in ("estimate", "low", "high")))
                for n, e in effects["effects"].items()}
    p = {n: f"p = {e['signed_rank_p']:.2g}" for n, e in effects["effects"].items()}
    own = {g["arm"]: f"{g['pre_collapse_mismatch']:.3g}" for g in grid["groups"]}
    every = [*interval.values(), *p.values()]
    expect = {"docs/findings.md": every,
              "docs/searches.md": [*every, *own.values(), f"{100 * effects['effects']['bf16_vs_fp32']['shift']['coverage']:.1f}%"],
              "docs/design.md": [interval["mismatch_at_fp32"], interval["bf16_vs_fp32"]],
              "results/reference/precision-smollm2/README.md": [*interval.values(), *own.values()]}
    for doc, numbers in expect.items():
        text = _prose(REPO / doc)
        missing = [n for n in numbers if n not in text]
        assert not missing, f"{doc} does not quote {missing}"
    rows = (ref / "README.md").read_text().split("## The grid (24 of 24")[1]
    for name, e in effects["effects"].items():
        row = next(line for line in rows.splitlines() if line.startswith(f"| {name} "))
        assert f"| {e['a_lower']} of {e['pairs']} | {e['signed_rank_p']:.2g} | {interval[name]} |" in row, row


def test_a_zero_difference_is_dropped_from_the_test_and_its_interval_alike():
    """Q2's convention (issue 55): seed 6's two AUCs were equal; the signed-rank p drops that zero
    difference (Wilcoxon), and the Hodges-Lehmann interval is computed from the same nonzero pairs, so the
    interval is the one that inverts the p it is shown beside."""
    d = [0.03, -0.01, 0.05, 0.02, 0.0, 0.04, 0.06, -0.02]
    with_zero, without = signed_rank_interval(d), signed_rank_interval([x for x in d if x != 0])
    assert {k: v for k, v in with_zero.items() if k != "zeros"} == {k: v for k, v in without.items() if k != "zeros"}
    assert with_zero["pairs"] == 7 and with_zero["zeros"] == 1 and without["zeros"] == 0
    assert signed_rank_p(d) == signed_rank_p([x for x in d if x != 0])
    assert signed_rank_interval([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])["zeros"] == 0


def test_pre_registered_effects_are_contrasts_of_arms_paired_by_seed():
    """A 2x2's effects (``decision.effects``, issue 56): per seed the weighted sum of the arms' outcomes
    (learning gain: reward AUC minus the run's own step-1 reward), tested as the questions' AUCs are; the
    interaction is the difference of the two simple effects; nothing is read while a run is unfinished."""
    from analysis.collapse_search import effects

    rows = []
    for seed in range(8):
        gains = {"fp32": 0.3, "trainer-fp32": 0.3 - 0.05 - seed / 1000, "none": 0.2 - seed / 1000,
                 "aligned-full": 0.25}
        for arm, gain in gains.items():
            rows.append({"arm": arm, "seed": seed, "state": "finished", "reward_auc": gain + 0.1, "step1_reward": 0.1})
    rule = {"arm_axis": "arm", "outcome": "learning_gain", "effects": {
        "mismatch_at_fp32": {"question": "q1", "contrast": {"trainer-fp32": 1, "fp32": -1}},
        "arithmetic_at_mismatch": {"contrast": {"none": 1, "trainer-fp32": -1}},
        "interaction": {"contrast": {"none": 1, "aligned-full": -1, "trainer-fp32": -1, "fp32": 1}}}}
    out = effects(pd.DataFrame(rows), pd.DataFrame(), rule)
    e = out["effects"]
    assert e["mismatch_at_fp32"]["mean_difference"] == pytest.approx(-0.05 - 0.0035)
    assert e["mismatch_at_fp32"]["a_lower"] == 8 and e["mismatch_at_fp32"]["signed_rank_p"] == pytest.approx(2 / 256)
    assert e["arithmetic_at_mismatch"]["mean_difference"] == pytest.approx(-0.05)
    # (none - aligned-full) - (trainer-fp32 - fp32) = (-0.05 - s) - (-0.05 - s) = 0 for every seed
    assert e["interaction"]["mean_difference"] == pytest.approx(0.0, abs=1e-12)
    assert e["mismatch_at_fp32"]["question"] == "q1"
    from analysis.collapse_search import _effects_markdown

    table = _effects_markdown(out)
    assert "| mismatch_at_fp32: q1 | `trainer-fp32` - `fp32` | 8 | -0.054 | 8 of 8 | 0.0078 |" in table, table
    # the interaction cancels exactly but for float error: every difference is a tie, no test, no interval
    assert e["interaction"]["signed_rank_p"] is None and e["interaction"]["shift"] is None
    assert e["interaction"]["a_lower"] == 0
    mixed = [{**r, "cpu_type": "GenuineIntel avx512_bf16+amx_bf16" if r["seed"] else "AuthenticAMD avx512_bf16"}
             for r in rows]
    refused = effects(pd.DataFrame(mixed), pd.DataFrame(), rule)
    assert refused["effects"] == {} and "2 CPU types" in refused["refused"]
    rows[0]["state"] = "running"
    assert effects(pd.DataFrame(rows), pd.DataFrame(), rule)["effects"] == {}


def test_a_contrast_whose_weights_do_not_sum_to_zero_or_name_no_arm_is_refused():
    from rpa.workflow.pipeline import check_config
    import yaml

    from tests.conftest import REPO

    config = yaml.safe_load((REPO / "experiments/collapse-smollm2.yaml").read_text())
    config["search"]["decision"]["effects"] = {"bad": {"contrast": {"none": 1, "fp32": -2}},
                                               "ghost": {"contrast": {"none": 1, "nope": -1}}}
    with pytest.raises(Exception) as err:
        check_config(config)
    assert "weights sum to -1" in str(err.value) and "'nope' is not a label" in str(err.value)


def test_a_contrast_pairs_within_a_rung_and_says_when_it_cannot_be_computed():
    """Review findings (issue 56): with several rungs a pair is (rung, seed), not the seed's first rung; an
    arm repeated in a comparison adds its weights; an arm with no finished run is named, not dropped."""
    from analysis.collapse_search import contrast_weights, paired_contrast

    rows = []
    for rung, shift in (("lr1", 0.1), ("lr2", -0.2)):
        for seed in range(6):
            rows.append({"lr": rung, "arm": "a", "seed": seed, "state": "finished", "reward_auc": 0.5 + shift})
            rows.append({"lr": rung, "arm": "b", "seed": seed, "state": "finished", "reward_auc": 0.5 + seed / 1000})
    done = pd.DataFrame(rows)
    c = paired_contrast(done, pd.DataFrame(), {"a": "a", "b": "b"}, "arm", 0.95, "lr")
    assert c["pairs"] == 12 and c["a_lower"] == 6  # lr2's six pairs lower, lr1's six higher
    assert contrast_weights({"a": ["x", "y"], "b": "y"}) == {"x": 0.5, "y": -0.5}
    gone = paired_contrast(done, pd.DataFrame(), {"a": "a", "b": "nobody"}, "arm", 0.95, "lr")
    assert gone["pairs"] == 0 and "nobody" in gone["not_computed"]
