"""Collapse verdict on synthetic metric logs (healthy, collapsing, non-finite, spiking)."""

import math

import numpy as np
import pytest

from rpa.train.collapse import CollapseThresholds, collapse_verdict, run_verdict, smooth


def log(rewards, grads=None, losses=None):
    grads = grads or [1.0] * len(rewards)
    losses = losses or [0.1] * len(rewards)
    return [{"step": i + 1, "reward": r, "grad_norm": g, "loss": l}
            for i, (r, g, l) in enumerate(zip(rewards, grads, losses))]


def test_smooth_is_trailing_mean():
    assert smooth([1, 2, 3, 4], 2).tolist() == [1.0, 1.5, 2.5, 3.5]


def test_healthy_run_with_noise_is_not_collapsed():
    rng = np.random.default_rng(0)
    rewards = list(np.clip(np.linspace(0.1, 0.8, 60) + rng.normal(0, 0.05, 60), 0, 1))
    v = collapse_verdict(log(rewards))
    assert not v["collapsed"] and v["collapse_step"] is None
    assert v["peak_reward"] == pytest.approx(max(rewards)) and v["steps"] == 60
    assert v["reward_auc"] == pytest.approx(np.trapezoid(rewards) / 59)


def test_rise_then_permanent_drop_collapses_at_the_drop():
    rewards = [0.2] * 5 + [0.6] * 20 + [0.05] * 15
    v = collapse_verdict(log(rewards), CollapseThresholds(smoothing_window=3, drop_fraction=0.5))
    assert v["collapsed"] and "for 5 steps" in v["collapse_reason"]
    # smoothed over 3: step 27 is the first whose mean (0.6+0.05+0.05)/3=0.233 < 0.3
    assert v["collapse_step"] == 27
    assert v["final_reward"] == pytest.approx(0.05)


def test_drop_in_the_last_steps_is_unconfirmed_not_collapse():
    """The persistence window: a drop must hold for min_steps_after_drop logged steps."""
    rewards = [0.6] * 30 + [0.05] * 3
    t = CollapseThresholds(smoothing_window=1, min_steps_after_drop=5)
    v = collapse_verdict(log(rewards), t)
    assert not v["collapsed"] and v["verdict"] == "unconfirmed" and v["unconfirmed_drop_step"] == 31
    longer = collapse_verdict(log(rewards + [0.05] * 2), t)
    assert longer["collapsed"] and longer["verdict"] == "collapsed" and longer["collapse_step"] == 31
    assert collapse_verdict(log([0.6] * 33), t)["verdict"] == "stable"


def test_temporary_dip_that_recovers_is_not_collapse():
    rewards = [0.6] * 10 + [0.05] * 4 + [0.6] * 10
    assert not collapse_verdict(log(rewards), CollapseThresholds(smoothing_window=2))["collapsed"]


def test_never_learned_is_not_collapse():
    assert not collapse_verdict(log([0.0, 0.01, 0.0] * 10))["collapsed"]


def test_non_finite_loss_is_collapse_with_summary():
    losses = [0.1] * 7 + [math.nan] + [0.1] * 2
    v = collapse_verdict(log([0.5] * 10, losses=losses))
    assert v["collapsed"] and v["collapse_step"] == 8 and "non-finite loss" in v["collapse_reason"]


def test_grad_norm_spike_is_an_event_not_a_collapse():
    grads = [1.0, 1.2, 0.9, 1.1, 1.0, 1.05, 50.0, 1.0, 30.0]
    v = collapse_verdict(log([0.5] * 9, grads=grads), CollapseThresholds(spike_factor=10, spike_warmup_steps=5))
    assert not v["collapsed"] and v["verdict"] == "stable"
    assert (v["grad_spikes"], v["first_grad_spike_step"]) == (2, 7)
    assert v["max_grad_spike_factor"] == pytest.approx(50.0 / np.median(grads[:6]))
    # a spike with a reward collapse: the collapse is the reward's, the spike still an event
    rewards = [0.6] * 6 + [0.05] * 10
    grads = [1.0] * 6 + [40.0] + [1.0] * 9
    v = collapse_verdict(log(rewards, grads=grads), CollapseThresholds(smoothing_window=1))
    assert v["collapsed"] and "smoothed reward" in v["collapse_reason"] and v["collapse_step"] == 7
    assert v["grad_spikes"] == 1


def test_spike_only_runs_of_the_committed_dose_grid_are_not_collapsed():
    """The two spike-only collapses of the dose grid (perturb-mantissa1, MIS, old logprobs from
    the sampler, seeds 0 and 2): their spikes are events now; seed 0's smoothed reward never
    fell below its level."""
    import json
    from pathlib import Path
    cell = Path(__file__).resolve().parents[1] / "results/reference/cpu/dose/perturb-mantissa1/sequence_mask-sampler"
    assert cell.exists(), "committed dose grid missing (part of the contract)"
    run = cell / "seed0"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    t = CollapseThresholds(**json.loads((run / "config.json").read_text())["collapse"])
    v = collapse_verdict(records, t)
    assert v["grad_spikes"] >= 1 and not v["collapsed"]


def test_recovery_does_not_undo_a_collapse():
    """A drop that held for the persistence window is a collapse even if the reward comes back;
    the return is reported as recovered_step. A shorter dip is not a collapse."""
    t = CollapseThresholds(smoothing_window=1, min_steps_after_drop=5)
    v = collapse_verdict(log([0.6] * 10 + [0.05] * 6 + [0.6] * 10), t)
    assert v["collapsed"] and v["collapse_step"] == 11 and v["recovered_step"] == 17
    short = collapse_verdict(log([0.6] * 10 + [0.05] * 4 + [0.6] * 10), t)
    assert short["verdict"] == "stable" and short["recovered_step"] is None


def test_rule_text_is_written_from_the_thresholds():
    from rpa.train.collapse import rule_text
    text = rule_text(CollapseThresholds(smoothing_window=10, drop_fraction=0.4, min_steps_after_drop=20))
    assert "smoothed over 10 steps" in text and "0.4 times" in text and "20 consecutive" in text
    assert "half" in rule_text(CollapseThresholds()) and "5 consecutive" in rule_text(CollapseThresholds())
    assert "five" not in text


def test_sensitivity_reports_each_variation():
    from rpa.train.collapse import sensitivity
    # smoothed (window 1) reward falls to 0.27 of the best: collapsed at 0.4 / 0.5 / 0.6
    # for 6 steps: collapsed at persistence 2 and 5, only unconfirmed at 10
    rewards = [1.0] * 10 + [0.27] * 6
    s = sensitivity(log(rewards), CollapseThresholds(smoothing_window=1, min_steps_after_drop=5))
    assert s == {"drop 0.4": "collapsed", "drop 0.5": "collapsed", "drop 0.6": "collapsed",
                 "persist /2": "collapsed", "persist x2": "unconfirmed"}
    s = sensitivity(log([1.0] * 10 + [0.45] * 8), CollapseThresholds(smoothing_window=1))
    assert (s["drop 0.4"], s["drop 0.5"], s["drop 0.6"]) == ("stable", "collapsed", "collapsed")


def test_earliest_cause_wins_and_thresholds_are_reported():
    rewards = [0.6] * 10 + [0.0] * 10
    grads = [1.0] * 15 + [math.inf] + [1.0] * 4
    v = collapse_verdict(log(rewards, grads=grads), CollapseThresholds(smoothing_window=1))
    assert v["collapse_step"] == 11 and v["thresholds"]["smoothing_window"] == 1
    early = [1.0] * 3 + [math.inf] + [1.0] * 16
    v = collapse_verdict(log(rewards, grads=early), CollapseThresholds(smoothing_window=1))
    assert v["collapse_step"] == 4 and "non-finite grad_norm" in v["collapse_reason"]


def test_bad_logs_and_thresholds_are_refused():
    with pytest.raises(ValueError, match="strictly increasing"):
        collapse_verdict([{"step": 1, "reward": 0.1}, {"step": 1, "reward": 0.2}])
    with pytest.raises(ValueError):
        collapse_verdict([])
    with pytest.raises(ValueError):
        CollapseThresholds(drop_fraction=1.5)


def test_a_lucky_first_batch_is_not_a_level_to_fall_from():
    # one batch at 0.25, then a run that never learned (~0.1): the partial-window "peak" of step 1
    # would make it a collapse at step ~5; only full windows set the best, so it is stable
    rewards = [0.25] + [0.1, 0.08, 0.12, 0.1] * 5
    v = collapse_verdict(log(rewards), CollapseThresholds(smoothing_window=5, drop_fraction=0.5))
    assert v["verdict"] == "stable" and not v["collapsed"]
    assert v["peak_smoothed_reward"] == pytest.approx(max(smooth(rewards, 5)[4:]))
    # shorter than the window: no reward verdict at all
    short = collapse_verdict(log([0.5, 0.0, 0.0]), CollapseThresholds(smoothing_window=5, min_steps_after_drop=1))
    assert short["verdict"] == "stable" and short["peak_smoothed_reward"] is None


def test_run_verdict_adds_a_blow_up_the_log_cannot_show():
    """The analyses' verdict: the log's, except that a run stopped by non-finite weights (summary
    status ``collapsed``) is collapsed at the summary's step; a collapse in the log is kept."""
    stable = log([0.5] * 12)
    blown = {"status": "collapsed", "collapse_step": 12, "collapse_reason": "non-finite weights"}
    v = run_verdict(stable, CollapseThresholds(), blown)
    assert (v["collapsed"], v["verdict"], v["collapse_step"], v["collapse_reason"]) == \
        (True, "collapsed", 12, "non-finite weights")
    assert run_verdict(stable, CollapseThresholds(), {"status": "ok"}) == collapse_verdict(stable)
    dropped = log([0.8] * 10 + [0.1] * 10)
    late = {**blown, "collapse_step": 20}
    assert run_verdict(dropped, CollapseThresholds(), late)["collapse_step"] == collapse_verdict(dropped)["collapse_step"] < 20
    assert run_verdict([], CollapseThresholds(), {"status": "ok"}) == {"steps": 0}
    assert run_verdict([], CollapseThresholds(), blown)["collapsed"]


def test_the_readme_states_the_rule_as_coded():
    """The README quotes rule_text for the default thresholds word for word (one source)."""
    import re
    from pathlib import Path

    from rpa.train.collapse import rule_text
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    quoted = " ".join(line.strip()[2:] for line in readme.splitlines() if line.strip().startswith("> "))
    assert re.sub(r"\s+", " ", rule_text(CollapseThresholds())) in re.sub(r"\s+", " ", quoted)


def test_a_step_fp16_loss_scaling_skipped_is_not_a_blow_up():
    records = log([0.5] * 10, grads=[1.0] * 5 + [math.inf] + [1.0] * 4)
    assert collapse_verdict(records)["collapsed"]  # an infinite grad norm is a blow-up...
    records[5]["fp16/skipped_step"] = 1.0
    assert not collapse_verdict(records)["collapsed"]  # ...unless loss scaling skipped that step by design
    records[5]["loss"] = math.nan
    assert collapse_verdict(records)["collapse_step"] == 6  # a non-finite loss still is


# ------------------------------------------------------------------ terminal state, rule version

REFERENCE = __import__("pathlib").Path(__file__).resolve().parents[1] / "results/reference"
TERMINAL_RUN = REFERENCE / "collapse-cpu/search/grid/lr8e-4/all/seed0"


def _committed_log(run):
    import json

    assert (run / "metrics.jsonl").exists(), f"committed reference data missing: {run}"
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return records, CollapseThresholds(**json.loads((run / "config.json").read_text())["collapse"])


def test_terminal_collapse_hidden_by_smoothing_is_reported_as_an_absorbing_end():
    """Search grid lr 8e-4 `all` seed 0: after a grad-norm spike at step 116 the raw reward is
    0.001 / 0.005 / 0.003 / 0.000 at steps 117-120 with (nearly) no reward variance in the groups;
    the smoothed final reward says 0.43. The raw terminal reward and the absorbing end say what
    happened, whatever the persistence window says."""
    from rpa.train.collapse import TERMINAL_STEPS, terminal_state

    records, t = _committed_log(TERMINAL_RUN)
    assert TERMINAL_STEPS == 4 and [r["step"] for r in records[-4:]] == [117, 118, 119, 120]
    assert [round(r["reward"], 3) for r in records[-4:]] == [0.001, 0.005, 0.003, 0.0]
    end = terminal_state(records)
    assert end["terminal_reward"] == pytest.approx((0.0013020833721384406 + 0.005208333022892475
                                                    + 0.0026041667442768812 + 0.0) / 4)
    assert end["absorbing"] and end["terminal_zero_grad_steps"] == 2 and end["terminal_reward_std"] < 0.01
    v = run_verdict(records, t)
    # the smoothed number the tables showed alone: the trailing mean of the last window's raw rewards, from the log
    window = t.smoothing_window
    assert v["final_reward"] == pytest.approx(sum(r["reward"] for r in records[-window:]) / window, abs=1e-12)
    assert v["final_reward"] == pytest.approx(0.4288, abs=1e-4)  # as the committed tables print it
    assert v["terminal_reward"] == end["terminal_reward"] and v["absorbing"]
    # a healthy end, and one without the groups' spread logged, are not absorbing
    assert not terminal_state(log([0.8] * 10))["absorbing"]
    assert not terminal_state(log([0.0] * 10))["absorbing"]  # no reward_std: no evidence of zero variance
    flat = [dict(r, reward_std=0.0) for r in log([0.6] * 6 + [0.0] * 4)]
    assert terminal_state(flat)["absorbing"] and not collapse_verdict(flat)["collapsed"]  # too short for the rule


def test_first_dip_is_the_start_of_any_drop():
    """Search grid lr 8e-4 `none` seed 3: its raw reward fell from 0.96 to 0.37 at step 93 and
    never stayed below half its best (stable by the rule); its largest mismatch (9.2e-3, step 108)
    is after that drop, the largest of the 12 `none` runs before any drop 8.7e-3."""
    from rpa.train.collapse import first_dip_step

    records, t = _committed_log(REFERENCE / "collapse-cpu/search/grid/lr8e-4/none/seed3")
    assert not collapse_verdict(records, t)["collapsed"] and first_dip_step(records, t) == 93
    assert first_dip_step(log([0.6] * 20), CollapseThresholds()) is None


def test_every_verdict_names_its_rule_version_and_the_rule_text_is_pinned_to_it():
    """A change of the rule's text without a new RULE_VERSION fails here: bump both."""
    import hashlib

    from rpa.train.collapse import RULE_VERSION, rule_text

    assert RULE_VERSION == "v4"
    digest = hashlib.sha256(rule_text(CollapseThresholds()).encode()).hexdigest()[:16]
    assert digest == RULE_TEXT_SHA256[RULE_VERSION], digest
    assert collapse_verdict(log([0.5] * 10))["rule_version"] == RULE_VERSION
    blown = {"status": "collapsed", "collapse_step": 3, "collapse_reason": "non-finite weights"}
    assert run_verdict([], CollapseThresholds(), blown)["rule_version"] == RULE_VERSION


RULE_TEXT_SHA256 = {"v4": "9f5180199ee24462"}  # sha256(rule_text(default thresholds))[:16] per version


def test_every_committed_table_with_a_verdict_names_the_rule_that_produced_it():
    """No reader sees two verdicts for one run: every committed table that shows a verdict says
    which rule version produced it, and marks the runs whose summary.json holds an earlier rule's
    different verdict (15 dose runs, 3 of the small GRPO grid, none elsewhere)."""
    import pandas as pd

    from rpa.train.collapse import RULE_VERSION

    tables = {"collapse-cpu/tables/search_grid.csv": 0, "collapse-cpu/tables/search_lever.csv": 0,
              "collapse-cpu/tables/search_pilot.csv": 0, "cpu/tables/dose_runs.csv": 15, "cpu/tables/train.csv": 3,
              "cpu/tables/dose.csv": None, "study-cpu/tables/study_collapse.csv": None}
    for name, superseded in tables.items():
        path = REFERENCE / name
        assert path.exists(), f"committed reference data missing: {path}"
        table = pd.read_csv(path)
        assert set(table["rule_version"].dropna()) == {RULE_VERSION}, name
        if superseded is not None:
            assert int(table["summary_superseded"].astype(bool).sum()) == superseded, name
    for name in ("collapse-cpu/tables/search_grid.md", "cpu/tables/dose.md", "cpu/tables/train.md",
                 "study-cpu/tables/study_collapse.md"):
        assert f"rule {RULE_VERSION}" in (REFERENCE / name).read_text(), name


def test_summary_superseded_compares_the_summarys_verdict_with_the_current_one():
    from rpa.train.collapse import summary_superseded

    v = collapse_verdict(log([0.6] * 10 + [0.05] * 6), CollapseThresholds(smoothing_window=1))
    assert v["collapsed"] and v["collapse_step"] == 11
    assert not summary_superseded({"collapsed": True, "verdict": "collapsed", "collapse_step": 11}, v)
    assert summary_superseded({"collapsed": True, "verdict": "collapsed", "collapse_step": 9}, v)
    assert summary_superseded({"collapsed": False, "collapse_step": None}, v)  # no verdict field: an old summary
    assert not summary_superseded({}, v) and not summary_superseded(None, v)
