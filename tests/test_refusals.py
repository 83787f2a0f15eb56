"""The bad-input battery: one case (or more) per kind of mistake, each refused in one line with
exit 2 before any model or engine loads, and nothing created (no output directory, no
``.lock``, no ``*.tmp``). In-process (``rpa.cli.main``): every refusal here happens before
anything heavy is imported, which is what the battery checks; ``tests/test_inputs.py`` runs the
CLI as a subprocess for the cases that need a fresh process.

Kinds: options checked only where they are used; checkpoints; input files; output paths;
run-file types and ranges; a rerun into a measuring command's directory with other options.
"""

import json
import shutil

import pytest
import yaml

from rpa.cli import main
from rpa.train.config import TrainConfig
from tests.conftest import refused, write_run_config


@pytest.fixture
def model(tiny_dirs, tmp_path):
    """A private copy of the tiny Qwen3 checkpoint, free to damage."""
    return shutil.copytree(tiny_dirs["qwen3"], tmp_path / "model")


def probe(model, out, *extra):
    return ["probe", "--model", model, "--regions", "all", "--out", out, *extra]


# ---------------------------------------------------------------- options checked up front

@pytest.mark.parametrize("extra,needle", [
    (["--prompts", "0"], "prompts must be >= 1, got 0"),
    (["--prompts", "-3"], "prompts must be >= 1, got -3"),
    (["--max-tokens", "0"], "max_tokens must be >= 1"),
    (["--samples", "-1"], "samples must be >= 1"),
    (["--ratio-band", "1.25", "0.8"], "ratio_band must satisfy 0 < lo < 1 < hi"),
])
def test_probe_options(capsys, model, tmp_path, extra, needle):
    refused(capsys, probe(model, tmp_path / "out", *extra), needle, absent=tmp_path / "out")


def test_diagnose_sequences(capsys, model, tmp_path):
    refused(capsys, ["diagnose", "--model", model, "--regions", "all", "--sequences", "0", "--out", tmp_path / "o"],
            "--sequences must be >= 1", absent=tmp_path / "o")


@pytest.mark.parametrize("extra,needle", [
    (["--head-dim", "48"], "head_dim must be a multiple of 32"),
    (["--num-key-value-heads", "3"], "must be a multiple of num_key_value_heads (3)"),
    (["--vocab-size", "100"], "vocab_size must be at least 300"),
    (["--hidden-size", "-128"], "sizes must be >= 1: hidden_size -128"),
    (["--num-hidden-layers", "0"], "sizes must be >= 1: num_hidden_layers 0"),
])
def test_tiny_specs(capsys, tmp_path, extra, needle):
    refused(capsys, ["tiny", "--out", tmp_path / "t", *extra], needle, absent=tmp_path / "t")


# ---------------------------------------------------------------- checkpoints

def test_checkpoint_without_weights(capsys, model, tmp_path):
    (model / "model.safetensors").unlink()
    refused(capsys, probe(model, tmp_path / "o"), "no weights", absent=tmp_path / "o")


def test_truncated_weights(capsys, model, tmp_path):
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    refused(capsys, probe(model, tmp_path / "o"), "model.safetensors", absent=tmp_path / "o")
    weights.write_bytes(data[:4])  # not even a header
    refused(capsys, probe(model, tmp_path / "o"), "unreadable safetensors header", absent=tmp_path / "o")


def test_checkpoint_without_tokenizer(capsys, model, tmp_path):
    (model / "tokenizer.json").unlink()
    refused(capsys, probe(model, tmp_path / "o"), "no tokenizer", absent=tmp_path / "o")


# ---------------------------------------------------------------- input files

@pytest.mark.parametrize("ids,needle", [
    ([5, 600], "token id 600 outside the model's vocabulary (0..511)"),
    ([5, -1], "token id -1 outside"),
    ([5, True], "must be non-empty lists of token ids"),  # JSON true is not token 1
])
def test_completion_token_ids(capsys, model, tmp_path, ids, needle):
    completions = tmp_path / "c.jsonl"
    completions.write_text(json.dumps({"seq": 0, "prompt_ids": [3, 4], "completion_ids": ids}) + "\n")
    refused(capsys, probe(model, tmp_path / "o", "--completions", completions), needle, absent=tmp_path / "o")


# ---------------------------------------------------------------- output paths

def test_out_is_a_file(capsys, model, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    refused(capsys, probe(model, f), "is a file, not a directory")
    refused(capsys, ["tiny", "--out", f], "is a file, not a directory")
    refused(capsys, probe(model, f / "sub"), "is a file, so nothing can be written under it")


def test_parity_report_path(capsys, model, tmp_path):
    """An existing directory as the report path used to run the whole check, then crash."""
    refused(capsys, ["parity", "--model", model, "--regions", "all", "--out", tmp_path], "is a directory")
    f = tmp_path / "file"
    f.write_text("x")
    refused(capsys, ["parity", "--model", model, "--regions", "all", "--out", f / "r.json"], "is a file")


def test_out_inside_the_model(capsys, model, tmp_path):
    refused(capsys, probe(model, model / "probe"), "is (or is inside) the input")


run_config = write_run_config


def test_warm_start_and_train_outputs(capsys, model, tmp_path):
    cfg = run_config(tmp_path, model, warm_start={"steps": 2})
    f = tmp_path / "file"
    f.write_text("x")
    refused(capsys, ["warm-start", "--config", cfg, "--out", f], "is a file")
    refused(capsys, ["warm-start", "--config", cfg, "--out", model], "is (or is inside) the input")
    refused(capsys, ["train", "--config", cfg, "--out", f], "is a file")
    assert not list(tmp_path.glob("*.tmp")) and not list(model.glob("*.tmp"))


def test_readonly_parent(capsys, model, tmp_path, monkeypatch):
    """A read-only parent folder is refused before anything loads. Root writes anywhere whatever the mode (and CI
    runs as root), so the check is given the answer an ordinary user gets: no write access to a 0o500 folder."""
    import os

    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    real = os.access

    def user_access(path, mode, *args, **kwargs):  # the kernel's answer for a non-owner without root's override
        if os.stat(path).st_mode & 0o222 == 0 and mode & os.W_OK:
            return False
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr("rpa.measure.inputs.os.access", user_access)
    try:
        refused(capsys, probe(model, parent / "o"), "is not writable")
        assert not (parent / "o").exists()
    finally:
        parent.chmod(0o700)


# ---------------------------------------------------------------- run-file types and ranges

@pytest.mark.parametrize("overrides,needle", [
    ({"numerics": {"regions": 1}}, "numerics: regions: must be a string"),
    ({"numerics": {"regions": ["rope", "swiglu"]}}, "numerics: regions: must be a string"),
    ({"steps": "40"}, "steps: must be an integer, got '40' (str)"),
    ({"seed": "0"}, "seed: must be an integer"),
    ({"max_completion_length": 100000}, "exceeds the model's max_position_embeddings (1024)"),
    ({"sync_check": {"probe_tokens": 0}}, "probe_tokens >= 2"),
    ({"warm_start": {"steps": 5, "learning_rate": -1}}, "warm_start: steps must be >= 0, learning_rate > 0"),
    ({"warm_start": {"steps": 5, "batch_size": 0}}, "batch_size >= 1"),
    ({"task": {"name": "synthetic-add", "num_prompts": 3}}, "the run would train nothing"),
])
def test_run_config_values(capsys, model, tmp_path, overrides, needle):
    cfg = run_config(tmp_path, model, **overrides)
    refused(capsys, ["train", "--config", cfg, "--out", tmp_path / "run"], needle, absent=tmp_path / "run")


def test_run_config_spellings_users_write_are_accepted(model, tmp_path):
    cfg = TrainConfig.from_yaml(run_config(tmp_path, model, learning_rate="1e-4", report_to="none"))
    assert cfg.learning_rate == 1e-4 and cfg.report_to == ("none",)  # one name where a list belongs
    # YAML 1.1 itself reads 1e-4 as a string: the file as a user writes it
    (tmp_path / "plain.yaml").write_text(f"model: {model}\nlearning_rate: 1e-4\nreport_to: none\n")
    assert TrainConfig.from_yaml(tmp_path / "plain.yaml").learning_rate == 1e-4


# ---------------------------------------------------------------- reruns into a measuring command's directory

def test_probe_rerun_with_other_options_is_refused(capsys, model, tmp_path):
    from rpa.core.numerics_config import NumericsConfig
    from rpa.core.outdir import claim
    from rpa.measure.probe import ProbeOptions, recorded_options
    from rpa.core.regions import parse_regions

    out = tmp_path / "o"
    numerics = NumericsConfig(regions=parse_regions("all"))
    claim(out, "probe", recorded_options(str(model), numerics, ProbeOptions(seed=0), None))
    line = refused(capsys, probe(model, out, "--seed", "1"), "made with other options (seed: 0 -> 1)")
    assert "use another directory" in line
    assert sorted(p.name for p in out.iterdir()) == [".lock", "options.json"]  # nothing else written
    # the same options again are accepted (a rerun restarts cleanly): the check passes up front
    from rpa.core.outdir import check_options

    check_options(out, "probe", recorded_options(str(model), numerics, ProbeOptions(seed=0), None))


def test_a_finished_probe_started_again_does_nothing(model, tmp_path):
    """Same options + a summary (written last): the run returns that summary without starting
    an engine; without the options record (``--replace`` removes it) it would run."""
    from rpa.core.numerics_config import NumericsConfig
    from rpa.core.outdir import claim, finished
    from rpa.core.regions import parse_regions
    from rpa.measure.probe import ProbeOptions, recorded_options, run_probe

    out = tmp_path / "o"
    numerics = NumericsConfig(regions=parse_regions("all"))
    options = recorded_options(str(model), numerics, ProbeOptions(seed=0), None)
    assert claim(out, "probe", options) == (out, None)  # a new directory: run it
    (out / "summary.json").write_text(json.dumps({"schema": "rpa.probe/1", "mark": 7}))
    assert run_probe(str(model), numerics, out, ProbeOptions(seed=0)) == {"schema": "rpa.probe/1", "mark": 7}
    assert finished(out, "probe", {**options, "seed": 1}) is None  # other options: not this run's result
    (out / "options.json").unlink()
    assert finished(out, "probe", options) is None


def test_replace_makes_a_directorys_earlier_run_give_way(model, tmp_path):
    """``--replace`` (what the workflow's rules pass once Snakemake decided a job reruns): the input
    check lets a directory made with other options through, and the claim removes its summary and
    record under the lock, so the command runs again -- without it the same directory is refused."""
    from rpa.cli import _check_inputs, build_parser
    from rpa.core.numerics_config import NumericsConfig
    from rpa.core.outdir import OutputDirectoryTaken, claim
    from rpa.core.regions import parse_regions
    from rpa.measure.probe import ProbeOptions, recorded_options

    out = tmp_path / "o"
    numerics = NumericsConfig(regions=parse_regions("all"))
    old = recorded_options(str(model), numerics, ProbeOptions(seed=0), None)
    claim(out, "probe", old)
    (out / "summary.json").write_text(json.dumps({"schema": "rpa.probe/1", "mark": 7}))
    parser = build_parser()
    with pytest.raises(OutputDirectoryTaken):
        _check_inputs(parser.parse_args(probe(str(model), str(out), "--seed", "1")))
    _check_inputs(parser.parse_args(probe(str(model), str(out), "--seed", "1", "--replace")))  # no refusal
    new = recorded_options(str(model), numerics, ProbeOptions(seed=1), None)
    with pytest.raises(OutputDirectoryTaken):
        claim(out, "probe", new)
    assert claim(out, "probe", new, replace=True) == (out, None)  # runs again
    assert not (out / "summary.json").exists()
    assert json.loads((out / "options.json").read_text())["options"]["seed"] == 1
    # a finished run with the same options: kept without --replace, run again with it
    (out / "summary.json").write_text(json.dumps({"schema": "rpa.probe/1", "mark": 8}))
    assert claim(out, "probe", new)[1] == {"schema": "rpa.probe/1", "mark": 8}
    assert claim(out, "probe", new, replace=True) == (out, None)


def test_the_measuring_rules_rerun_through_replace_not_by_deleting_the_record():
    """One owner of rerun behaviour: the rules pass ``--replace``; none deletes ``options.json``."""
    import re
    from pathlib import Path

    rules = Path(__file__).resolve().parent.parent / "rules"
    for name, command in (("probe", "probe"), ("diagnose", "diagnose"), ("attribution", "attribute")):
        text = (rules / f"{name}.smk").read_text()
        assert "options.json" not in text
        assert re.search(rf"rpa {command} --config \{{input\.job\}} --out \{{params\.out\}} --replace", text)


def test_a_directory_another_process_runs_is_refused(tmp_path):
    import fcntl

    from rpa.core.outdir import DirectoryBusy, lock_dir

    out = tmp_path / "o"
    out.mkdir()
    other = open(out / ".lock", "a+")  # another holder: a second open file description, as a process has
    fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    other.write("pid 4242")
    other.flush()
    with pytest.raises(DirectoryBusy, match="in use by a running rpa probe \\(pid 4242\\)"):
        lock_dir(out, "probe")
    other.close()  # the holder ends: its lock dies with it
    lock_dir(out, "probe")
    lock_dir(out, "probe")  # this process holds it: taking it again is a no-op


def test_a_misspelt_arm_key_is_reported_once_with_a_suggestion():
    """One line per distinct error, not one per (model, seed) cell that repeats it."""
    from rpa.workflow.pipeline import PipelineConfigError, check_config
    from tests.conftest import REPO, refused, write_run_config

    config = yaml.safe_load((REPO / "experiments/study-cpu.yaml").read_text())
    arm = list(config["study"]["arms"])[1]
    config["study"]["arms"][arm] = {**config["study"]["arms"][arm], "lerning_rate": 1e-3}
    with pytest.raises(PipelineConfigError) as err:
        check_config(config)
    lines = [line for line in str(err.value).splitlines() if "lerning_rate" in line]
    assert len(lines) == 1 and "(did you mean learning_rate?)" in lines[0] and " more: " in lines[0], err.value


def test_a_hub_id_the_hub_cannot_serve_is_refused_at_once(capsys, tmp_path, monkeypatch):
    """A path that does not exist but looks like a hub id: the hub is asked once (here an
    endpoint nothing listens on), not retried for half a minute."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    refused(capsys, probe("models/q3", tmp_path / "o"), "cannot be reached", absent=tmp_path / "o")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    refused(capsys, probe("models/q3", tmp_path / "o"), "HF_HUB_OFFLINE is set", absent=tmp_path / "o")


def test_a_checkpoint_with_a_torn_trainer_state_is_not_resumed_from(tmp_path):
    """A kill while a checkpoint's trainer_state.json was written: resume from the one before."""
    from rpa.train.rundir import latest_checkpoint

    for step, state in ((2, '{"global_step": 2}'), (4, '{"global_st')):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    (tmp_path / "checkpoint-6").mkdir()  # killed before its state was written at all
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"


# ---------------------------------------------------------------- one job, one file

def test_a_job_config_file_gives_the_options_and_flags_override_it(tmp_path):
    from rpa.cli import _numerics, _probe_options, _with_job_config, build_parser

    job = tmp_path / "probe.yaml"
    job.write_text(yaml.safe_dump({"model": "m", "regions": "rope", "out": "o", "prompts": 5,
                                   "ratio_band": [0.5, 2.0], "precision": "bf16", "compiled": True}))
    argv = ["probe", "--config", str(job), "--prompts", "9"]
    parser = build_parser()
    args = _with_job_config(parser, argv, parser.parse_args(argv))
    options = _probe_options(args)
    assert (args.model, args.out, options.prompts, options.ratio_band, options.compiled) == ("m", "o", 9, (0.5, 2.0),
                                                                                              True)
    assert _numerics(args).regions == frozenset({"rope"})


@pytest.mark.parametrize("content,needle", [
    ({"model": "m", "regions": "all", "out": "o", "promts": 5}, "unknown option(s) promts"),
    ({"regions": "all", "out": "o"}, "--model required (as flags or in --config)"),
    (["not", "a", "mapping"], "expected a mapping of options"),
])
def test_bad_job_config_files(capsys, tmp_path, content, needle):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(content))
    refused(capsys, ["probe", "--config", job], needle)


def test_a_parity_job_with_a_bad_trainer_dtype(capsys, model, tmp_path):
    """argparse checks --trainer-dtype's choices only on the command line; from a job file the
    dataclass refuses it."""
    job = tmp_path / "parity.yaml"
    job.write_text(yaml.safe_dump({"model": str(model), "regions": "all", "trainer_dtype": "float16"}))
    refused(capsys, ["parity", "--config", job, "--out", tmp_path / "r.json"], "trainer_dtype: 'float16' is not one of",
            absent=tmp_path / "r.json")
    # spelled as every precision of the suite is (bf16 / fp32), not with torch's names
    job.write_text(yaml.safe_dump({"model": str(model), "regions": "all", "trainer_dtype": "float32"}))
    refused(capsys, ["parity", "--config", job, "--out", tmp_path / "r.json"],
            "trainer_dtype: 'float32' is not one of bf16, fp32", absent=tmp_path / "r.json")


def test_a_job_needs_its_model_regions_and_out(capsys, tmp_path):
    refused(capsys, ["probe", "--regions", "all", "--out", tmp_path / "o"], "--model required", absent=tmp_path / "o")


def test_diagnose_rerun_with_other_options_is_refused(capsys, model, tmp_path):
    """The in-process path rpa diagnose takes before its engine starts: its sequences are read
    (here from a completions file) and the output directory's recorded options compared."""
    from rpa.measure.diagnose import recorded_options
    from rpa.core.numerics_config import NumericsConfig
    from rpa.core.outdir import claim
    from rpa.core.regions import parse_regions

    completions = tmp_path / "c.jsonl"
    completions.write_text("".join(json.dumps({"seq": i, "prompt_ids": [3, 4], "completion_ids": [5 + i]}) + "\n"
                                   for i in range(3)))
    out = tmp_path / "diag"
    claim(out, "diagnose", recorded_options(str(model), NumericsConfig(regions=parse_regions("all")),
                                            [[3, 4, 5], [3, 4, 6]], 0))
    refused(capsys, ["diagnose", "--model", model, "--regions", "all", "--out", out, "--completions", completions,
                     "--sequences", "3"], "made with other options (sequences: 2 -> 3")


def test_the_input_check_hands_the_command_what_it_validated(model, tmp_path):
    """Parse once and pass the object down: the check returns the validated numerics, options and
    run configs (:class:`rpa.cli.Checked`), the objects the command then runs with."""
    from rpa.cli import _check_inputs, build_parser
    from rpa.measure.probe import ProbeOptions
    from rpa.train.config import TrainConfig

    parser = build_parser()
    checked = _check_inputs(parser.parse_args(probe(str(model), str(tmp_path / "o"), "--seed", "3")))
    assert checked.options == ProbeOptions(seed=3) and checked.numerics.regions == {"rope", "swiglu", "rmsnorm"}
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": str(model), "steps": 3, "numerics": {"regions": "all"}}))
    checked = _check_inputs(parser.parse_args(["train", "--config", str(run), "--out", str(tmp_path / "r")]))
    assert checked.configs == [TrainConfig.from_yaml(run)] and checked.configs[0].steps == 3
