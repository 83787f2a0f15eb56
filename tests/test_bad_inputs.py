"""The second bad-input pass (issue 33), kind by kind: each case refused in one line with exit 2
before any model or engine loads, nothing created. In-process (``rpa.cli.main``), as in
``tests/test_refusals.py``; the Snakemake cases run the workflow's own parse in a subprocess. The
last section is the third pass (issue 57): one test per case, each docstring naming the case and
what it did before."""

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import yaml

from rpa.cli import main
from tests.conftest import REPO, refused, write_run_config


@pytest.fixture
def model(tiny_dirs, tmp_path):
    return shutil.copytree(tiny_dirs["qwen3"], tmp_path / "model")


def probe(model, out, *extra):
    return ["probe", "--model", model, "--regions", "all", "--out", out, *extra]


def _edit_config(model, **changes):
    config = json.loads((model / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (model / "config.json").write_text(json.dumps(config))


def _write_header(path, header: bytes):
    path.write_bytes(struct.pack("<Q", len(header)) + header)


# ------------------------------------------------------- kind 1: bad checkpoints, from their files

def test_safetensors_headers_that_do_not_describe_tensors(capsys, model, tmp_path):
    weights = model / "model.safetensors"
    _write_header(weights, b"[1, 2, 3]")
    refused(capsys, probe(model, tmp_path / "o"), "safetensors header is a JSON list, not a mapping",
            absent=tmp_path / "o")
    _write_header(weights, json.dumps({"model.norm.weight": {"dtype": "BF16", "shape": [128]}}).encode())
    refused(capsys, probe(model, tmp_path / "o"), "header entry 'model.norm.weight' is not a tensor description")


def test_an_index_whose_entries_are_not_strings_and_a_bin_only_checkpoint(capsys, model, tmp_path):
    weights = model / "model.safetensors"
    weights.rename(model / "shard-1.safetensors")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": 1}}))
    refused(capsys, probe(model, tmp_path / "o"), "weight_map must map tensor names to shard file names")
    (model / "model.safetensors.index.json").unlink()
    (model / "shard-1.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"pickle")
    refused(capsys, probe(model, tmp_path / "o"), "pytorch_model.bin only")


def test_a_corrupt_tokenizer_and_a_token_past_the_embedding(capsys, model, tmp_path):
    tokenizer = model / "tokenizer.json"
    good = tokenizer.read_text()
    tokenizer.write_text(good[: len(good) // 2])
    refused(capsys, probe(model, tmp_path / "o"), "tokenizer.json: unreadable")
    tokenizer.write_text(good)
    _edit_config(model, vocab_size=300)
    refused(capsys, probe(model, tmp_path / "o"), "past the model's vocab_size 300")


@pytest.mark.parametrize("changes,needle", [
    ({"architectures": None}, "config.json names no architectures"),
    ({"architectures": ["Qwen3ForSequenceClassification"]}, "is not the causal LM 'Qwen3ForCausalLM'"),
    ({"num_hidden_layers": 3, "layer_types": ["full_attention"] * 3}, "the weights lack"),
    ({"head_dim": 64}, "in the weights"),
    ({"intermediate_size": 512}, "in the weights"),
])
def test_a_config_the_weights_do_not_fit(capsys, model, tmp_path, changes, needle):
    _edit_config(model, **changes)
    refused(capsys, probe(model, tmp_path / "o"), needle, absent=tmp_path / "o")


def test_qwen2_weights_under_a_qwen3_config(capsys, tiny_dirs, tmp_path):
    """Same sizes, another family: q/k/v biases the Qwen3 model has no place for, q/k norms it lacks."""
    model = shutil.copytree(tiny_dirs["qwen2"], tmp_path / "model")
    qwen3 = json.loads((tiny_dirs["qwen3"] / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**qwen3, "head_dim": 32, "hidden_size": 128}))
    refused(capsys, probe(model, tmp_path / "o"), "the weights lack")


def test_a_context_longer_than_the_models(capsys, model, tmp_path):
    refused(capsys, probe(model, tmp_path / "o", "--max-model-len", "4096"),
            "--max-model-len 4096 exceeds the model's max_position_embeddings (1024)")


# ------------------------------------------ kind 2: values only vLLM or torch checked, checked up front

run_config = write_run_config


@pytest.mark.parametrize("overrides,needle", [
    ({"temperature": float("inf")}, "temperature: must be a finite number"),
    ({"temperature": 0.005}, "vLLM raises a smaller one to 0.01"),  # issue 67: vLLM's own bounds, before it starts
    ({"temperature": 2.5}, "vLLM refuses a larger one"),
    ({"eval_temperature": 0.001}, "eval_temperature must be in [0.01, 2] (or 0: greedy), got 0.001"),
    ({"numerics": "all"}, "numerics must be a mapping"),
    ({"sync_check": {"probe_tokens": 400}, "max_prompt_length": 64, "max_completion_length": 32},
     "sync_check.probe_tokens 400 is longer than the engine's context (104 tokens)"),
    ({"report_to": ["tensorbord"]}, "unknown target(s) 'tensorbord' (did you mean tensorboard?)"),
    ({"report_to": ["wandb"]}, "wandb: the package 'wandb' is not installed"),
])
def test_run_values_vllm_or_transformers_would_have_refused_late(capsys, model, tmp_path, overrides, needle):
    cfg = run_config(tmp_path, model, **overrides)
    refused(capsys, ["train", "--config", cfg, "--out", tmp_path / "run"], needle, absent=tmp_path / "run")


def test_probe_values_only_vllm_checked(capsys, model, tmp_path):
    refused(capsys, probe(model, tmp_path / "o", "--seed", str(2 ** 32)), "seed must be in [0, 2**32)")
    refused(capsys, probe(model, tmp_path / "o", "--temperature", "0.005"), "vLLM raises a smaller one to 0.01")
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": str(model), "regions": "all", "ratio_band": 1.25}))
    refused(capsys, ["probe", "--config", job, "--out", tmp_path / "o"], "ratio_band: must be a list of 2 values")
    binary = tmp_path / "c.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    refused(capsys, probe(model, tmp_path / "o", "--completions", binary), "not a text file")
    binary.write_text(json.dumps({"seq": 0, "prompt_ids": 5, "completion_ids": [3]}) + "\n")
    refused(capsys, probe(model, tmp_path / "o", "--completions", binary), "must be non-empty lists of token ids")
    dangling = tmp_path / "link"
    os.symlink(tmp_path / "nowhere", dangling)
    refused(capsys, probe(model, dangling), "a symbolic link to")
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------- kind 3: what was accepted silently

@pytest.mark.parametrize("extra,needle", [
    (["--max-tokens", "1024"], "max_tokens 1024 leaves no room for a prompt in max_model_len 1024"),
    (["--regions", ""], "empty region set ''"),
    (["--full-kl-max-vocab", "-1"], "full_kl_max_vocab must be >= 0"),
    (["--ratio-band", "0.8", "inf"], "ratio_band: must be a finite number"),
])
def test_probe_values_that_were_taken_silently(capsys, model, tmp_path, extra, needle):
    argv = probe(model, tmp_path / "o", *extra)
    if extra[0] == "--regions":
        argv = ["probe", "--model", model, *extra, "--out", tmp_path / "o"]
    refused(capsys, argv, needle, absent=tmp_path / "o")


def test_a_bool_for_a_count_and_an_empty_out(capsys, model, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"model": str(model), "regions": "all", "prompts": True}))
    refused(capsys, ["probe", "--config", job, "--out", tmp_path / "o"], "prompts: must be an integer, got True")
    refused(capsys, probe(model, ""), "--out is empty")


@pytest.mark.parametrize("extra,needle", [
    (["--rope-theta", "inf"], "rope_theta: must be a finite number"),
    (["--initializer-range", "nan"], "initializer_range: must be a finite number"),
    (["--seed", "-1"], "seed must be in [0, 2**32)"),
    (["--max-position-embeddings", "8"], "max_position_embeddings 8 cannot hold a prompt"),
])
def test_tiny_values_that_were_taken_silently(capsys, tmp_path, extra, needle):
    refused(capsys, ["tiny", "--out", tmp_path / "t", *extra], needle, absent=tmp_path / "t")


@pytest.mark.parametrize("overrides,needle", [
    ({"learning_rate": float("inf")}, "learning_rate: must be a finite number"),
    ({"beta": float("nan")}, "beta: must be a finite number"),
    ({"numerics": {"regions": ""}}, "empty region set"),
    ({"collapse": {"drop_fraction": float("nan")}}, "collapse.drop_fraction: must be a finite number"),
    ({"collapse": {"min_best_reward": -0.5}}, "min_best_reward must be >= 0"),
])
def test_run_values_that_were_taken_silently(capsys, model, tmp_path, overrides, needle):
    cfg = run_config(tmp_path, model, **overrides)
    refused(capsys, ["train", "--config", cfg, "--out", tmp_path / "run"], needle, absent=tmp_path / "run")


def test_duplicate_yaml_keys_and_a_warm_start_of_no_steps(capsys, model, tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"model: {model}\nsteps: 2\nlearning_rate: 1.0e-4\nsteps: 3\n")
    refused(capsys, ["train", "--config", cfg, "--out", tmp_path / "run"], "run.yaml:4:1: duplicate key 'steps'")
    job = tmp_path / "job.yaml"
    job.write_text(f"model: {model}\nregions: all\nregions: none\n")
    refused(capsys, ["probe", "--config", job, "--out", tmp_path / "o"], "duplicate key 'regions'")
    ws = run_config(tmp_path, model, warm_start={"steps": 0})
    refused(capsys, ["warm-start", "--config", ws, "--out", tmp_path / "ws"], "a warm start of no steps",
            absent=tmp_path / "ws")


def test_merge_keys_are_read_and_a_duplicate_beside_one_is_still_refused():
    """``<<: *anchor`` (the schema shares its grid knobs so) gives its keys, which the mapping's own
    override; two of the mapping's own keys alike are still refused."""
    from rpa.core.yamlfiles import YamlError, parse_yaml

    text = "knobs: &k {a: 1, b: 2}\nsection:\n  <<: *k\n  b: 3\n"
    assert parse_yaml(text, "x.yaml")["section"] == {"a": 1, "b": 3}
    with pytest.raises(YamlError, match="x.yaml:5:3: duplicate key 'b'"):
        parse_yaml(text + "  b: 4\n", "x.yaml")


def test_a_directory_holding_another_commands_output_is_refused(capsys, model, tmp_path):
    """The one case that lost data: train into a finished probe's directory (and back) overwrote the
    other command's summary.json."""
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "options.json").write_text(json.dumps({"command": "probe", "options": {}}))
    (probe_dir / "summary.json").write_text("{}")
    cfg = run_config(tmp_path, model)
    refused(capsys, ["train", "--config", cfg, "--out", probe_dir], "holds the output of rpa probe")
    run_dir = tmp_path / "run"
    (run_dir / "init_model").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    refused(capsys, probe(model, run_dir), "holds the output of rpa train")
    refused(capsys, ["diagnose", "--model", model, "--regions", "all", "--out", run_dir],
            "holds the output of rpa train")
    assert (probe_dir / "summary.json").read_text() == "{}"


@pytest.mark.parametrize("record", ["{\"command\": \"probe\", \"opt", "[1, 2]", "\"probe\"", b"\xff\xfe",
                                    "{\"command\": \"probe\", \"options\": [1]}"])
def test_a_finished_directory_whose_record_cannot_be_read_is_refused_not_overwritten(capsys, model, tmp_path, record):
    """An unreadable options.json is an error, not an absence (issue 67): the directory may hold a finished run
    made with other options, and a probe into it took it as unrecorded and wrote over it."""
    out = tmp_path / "probe"
    out.mkdir()
    path = out / "options.json"
    path.write_bytes(record if isinstance(record, bytes) else record.encode())
    (out / "summary.json").write_text('{"mean_abs_dlogp": 0.5}')
    refused(capsys, probe(model, out), f"{path} is unreadable")
    assert (out / "summary.json").read_text() == '{"mean_abs_dlogp": 0.5}' and path.read_bytes() == (
        record if isinstance(record, bytes) else record.encode())


# ------------------------------------------------------------------ kind 4: one line, not a dump

def test_argparse_and_yaml_errors_are_one_line(capsys, model, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        main(["probe", "--model", str(model), "--regions", "all", "--out", str(tmp_path / "o"), "--prompts", "x"])
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and "argument --prompts: invalid int value: 'x'" in err[0], err
    job = tmp_path / "job.yaml"
    job.write_text("model: [a, b\nregions: all\n")
    refused(capsys, ["probe", "--config", job, "--out", tmp_path / "o"], "job.yaml:2:")
    refused(capsys, probe(model, tmp_path / "o", "--completions", tmp_path), "is a directory, not a completions file")


def _snakemake_parse(tmp_path, config, **env_vars):
    path = tmp_path / "config.yaml"
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', '')}",
           **env_vars}
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", str(path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.cli
def test_snakemake_configs_are_refused_at_parse_time_in_one_line(tmp_path):
    base = yaml.safe_load((REPO / "experiments/toys.yaml").read_text())
    base["results"] = str(tmp_path / "results")
    cases = [
        ({**base, "diagnosee": base["diagnose"]}, "unknown key(s) 'diagnosee' (did you mean 'diagnose'?)"),
        ({**base, "diagnose": {"sequencs": 2, "configs": []}}, "diagnose: unknown key(s) 'sequencs' (did you mean"),
        ({**base, "results": 5}, "results: 5 is not of type 'string'"),
        ({**base, "models": {"m": {"path": str(tmp_path / "missing")}}}, "no such directory, and not a hub id"),
    ]
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    (mistral / "config.json").write_text(json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}))
    cases.append(({**base, "models": {"m": {"path": str(mistral)}}}, "model_type='mistral'"))
    # issue 67: a key written twice (Snakemake's loader keeps the last one), at any depth
    text = yaml.safe_dump(base, sort_keys=False)
    cases.append((text + f"results: {tmp_path / 'other'}\n", "config.yaml:"))
    cases.append((text.replace("diagnose:\n", "diagnose:\n  sequences: 1\n", 1), "duplicate key 'sequences'"))
    for config, needle in cases:
        proc = _snakemake_parse(tmp_path, config)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode != 0 and any(needle in line for line in lines), proc.stderr[-2000:]
        assert sum(line.startswith("rpa config: error:") for line in lines) == 1 and len(lines) <= 3, lines
        assert not (tmp_path / "results").exists()


def test_a_study_naming_an_unknown_reference_arm():
    from rpa.workflow.pipeline import PipelineConfigError, check_config

    config = yaml.safe_load((REPO / "experiments/study-cpu.yaml").read_text())
    config["study"]["reference_arm"] = "nnone"
    with pytest.raises(PipelineConfigError, match="study.reference_arm: 'nnone' is not an arm of study.arms "
                                                  r"\(did you mean 'none'\?\)"):
        check_config(config)


# ------------------------------------------- the last bad inputs (issue 57), one test per case

@pytest.mark.parametrize("seed", [-1, 2 ** 64])
def test_a_run_seed_numpy_cannot_take(capsys, model, tmp_path, seed):
    """Case 6: numpy's "Seed must be between 0 and 2**32 - 1" (or "Overflow when unpacking long
    long") from inside transformers' set_seed, after the engines started."""
    cfg = run_config(tmp_path, model, seed=seed)
    refused(capsys, ["train", "--config", cfg, "--out", tmp_path / "run"], f"seed: must be in [0, 2**32), got {seed}",
            absent=tmp_path / "run")


@pytest.mark.parametrize("regions,write", [("ROPE", "rope"), ("rope, swiglu", "rope,swiglu")])
def test_a_region_set_spelled_otherwise_is_refused_with_the_one_spelling(capsys, model, tmp_path, regions, write):
    """Case 8: ``ROPE`` and ``rope, swiglu`` were read as ``rope`` / ``rope,swiglu`` though the
    commands document one spelling (docs/commands.md): refused, naming the spelling to write."""
    refused(capsys, ["probe", "--model", model, "--regions", regions, "--out", tmp_path / "o"],
            f"region set {regions!r} is not spelled as region sets are (lower case, comma-separated without spaces): "
            f"write {write!r}", absent=tmp_path / "o")


def test_a_completions_record_whose_seq_is_not_an_integer(capsys, model, tmp_path):
    """Case 9: ``"seq": "a"`` was taken (and written into tokens.csv as it was)."""
    completions = tmp_path / "c.jsonl"
    completions.write_text(json.dumps({"seq": "a", "prompt_ids": [3, 4], "completion_ids": [5]}) + "\n")
    refused(capsys, probe(model, tmp_path / "o", "--completions", completions),
            "c.jsonl:1: seq must be an integer (the record's index), got 'a'", absent=tmp_path / "o")


def test_completions_longer_than_the_engines_context(capsys, model, tmp_path):
    """Case 2: vLLM's "The decoder prompt (length N) is longer than the maximum model length" from
    inside the engine; also where the model's own context is the shorter one."""
    completions = tmp_path / "c.jsonl"
    completions.write_text(json.dumps({"seq": 0, "prompt_ids": [3, 4], "completion_ids": [5] * 1100}) + "\n")
    refused(capsys, probe(model, tmp_path / "o", "--completions", completions),
            "record seq 0 (prompt + completion) has 1102 tokens; the engine's context (max_model_len 1024) holds at "
            "most 1023 before the token vLLM samples; raise --max-model-len (up to the model's "
            "max_position_embeddings, 1024)", absent=tmp_path / "o")
    _edit_config(model, max_position_embeddings=96)
    completions.write_text(json.dumps({"seq": 0, "prompt_ids": [3, 4], "completion_ids": [5] * 100}) + "\n")
    refused(capsys, probe(model, tmp_path / "o", "--completions", completions, "--max-model-len", "96",
                          "--max-tokens", "8"),
            "has 102 tokens; the engine's context (max_model_len 96) holds at most 95", absent=tmp_path / "o")


def test_more_samples_than_vllm_gives_one_prompt(capsys, model, tmp_path):
    """Case 1: vLLM's ``VLLMValidationError: n must be at most 16384`` after the engine started; the
    bound is vLLM's own (``vllm.envs.VLLM_MAX_N_SEQUENCES``)."""
    import vllm.envs

    bound = vllm.envs.VLLM_MAX_N_SEQUENCES
    refused(capsys, probe(model, tmp_path / "o", "--samples", "1000000000"),
            f"probe option samples 1000000000: vLLM samples at most {bound} completions per prompt "
            f"(its VLLM_MAX_N_SEQUENCES)", absent=tmp_path / "o")


def test_more_built_in_prompts_than_there_are(capsys, model, tmp_path):
    """Case 7: ``--prompts 100000000000`` ran until memory was gone, drawing built-in prompts."""
    from rpa.measure.prompts import DEFAULT_PROMPTS_DISTINCT, default_prompts

    assert len(set(default_prompts(50 * DEFAULT_PROMPTS_DISTINCT, 0))) == DEFAULT_PROMPTS_DISTINCT  # the bound
    refused(capsys, probe(model, tmp_path / "o", "--prompts", "100000000000"),
            f"probe option prompts 100000000000: the built-in prompts are {DEFAULT_PROMPTS_DISTINCT} distinct ones, "
            f"more would repeat them", absent=tmp_path / "o")


def test_diagnose_on_a_model_whose_context_the_sequences_do_not_fit(capsys, model, tmp_path):
    """Case 5: pydantic's ``ValidationError`` for ModelConfig (vLLM's max_model_len 1024 past the
    model's max_position_embeddings 8) from inside the engine's start. Diagnose's engine now gets the
    model's context where it is the shorter (the built-in prompts, at most 7 tokens on the tiny
    tokenizer, run on it); a sequence that does not fit it is refused up front."""
    _edit_config(model, max_position_embeddings=8)
    completions = tmp_path / "c.jsonl"
    completions.write_text(json.dumps({"seq": 0, "prompt_ids": [3, 4, 5, 6], "completion_ids": [7, 8, 9, 10]}) + "\n")
    refused(capsys, ["diagnose", "--model", model, "--regions", "all", "--out", tmp_path / "o", "--completions",
                     completions, "--sequences", "1"],
            f"completions {completions}: sequence 0 has 8 tokens; the engine's context (max_model_len 8) holds at most "
            f"7 before the token vLLM samples (the model's max_position_embeddings)", absent=tmp_path / "o")


def test_diagnose_asking_for_more_sequences_than_the_file_holds(capsys, model, tmp_path):
    """Case 10: ``--sequences 1000000`` on a 64-sequence file ran on the 64 without a word."""
    completions = tmp_path / "c.jsonl"
    completions.write_text("".join(json.dumps({"seq": i, "prompt_ids": [3, 4], "completion_ids": [5 + i]}) + "\n"
                                   for i in range(64)))
    refused(capsys, ["diagnose", "--model", model, "--regions", "all", "--out", tmp_path / "o", "--completions",
                     completions, "--sequences", "1000000"],
            f"--sequences 1000000: {completions} holds 64 sequences", absent=tmp_path / "o")


def test_a_tiny_vocabulary_past_any_real_models(capsys, tmp_path):
    """Case 3: ``--vocab-size 100000000000`` aborted the process in tokenizers' BPE trainer (Rust's
    "memory allocation of ... bytes failed", SIGABRT) after creating the directory."""
    from rpa.sides.tiny import MAX_VOCAB

    refused(capsys, ["tiny", "--out", tmp_path / "t", "--vocab-size", "100000000000"],
            f"vocab_size must be at most {MAX_VOCAB} (the largest vocabulary of a released LM; the tokenizer has ~800 "
            f"tokens), got 100000000000", absent=tmp_path / "t")


def test_tiny_into_a_directory_of_someone_elses_files(capsys, tmp_path):
    """Case 12: ``rpa tiny --out DIR`` wrote a model among DIR's other files."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    refused(capsys, ["tiny", "--out", other], f"--out {other}: a non-empty directory that is not a tiny model "
                                              f"(notes.txt); rpa tiny writes into a new or empty directory")
    assert [p.name for p in other.iterdir()] == ["notes.txt"]


def test_non_finite_weights_and_config_values_are_named(capsys, model, tmp_path):
    """Case 4: NaN bytes under an intact safetensors header, and ``rms_norm_eps: NaN``, ran both
    engines to numpy's "zero-size array to reduction operation maximum" (no token sampled)."""
    weights = model / "model.safetensors"
    data = bytearray(weights.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    begin, end = header["model.norm.weight"]["data_offsets"]
    good = bytes(data)
    data[8 + length + begin:8 + length + end] = b"\xff" * (end - begin)  # 0xffff: a BF16 NaN
    weights.write_bytes(bytes(data))
    refused(capsys, probe(model, tmp_path / "o"), "tensor model.norm.weight in model.safetensors holds NaN or infinite "
                                                  "values (damaged weights)", absent=tmp_path / "o")
    weights.write_bytes(good)
    _edit_config(model, rms_norm_eps=float("nan"))
    refused(capsys, probe(model, tmp_path / "o"), "config.json's rms_norm_eps is not a finite number",
            absent=tmp_path / "o")


def test_an_eos_token_outside_the_vocabulary(capsys, model, tmp_path):
    """Case 11: a model whose eos_token_id lies outside its vocabulary was probed without a word."""
    _edit_config(model, eos_token_id=600)
    refused(capsys, probe(model, tmp_path / "o"), "config.json's eos_token_id 600 is outside the vocabulary (0..511): no "
                                                  "engine can sample it, so generation would never stop on it",
            absent=tmp_path / "o")



def _refused_at_parse(proc, needle, tmp_path):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode != 0 and any(needle in line for line in lines), proc.stderr[-2000:]
    assert sum(line.startswith("rpa config: error:") for line in lines) == 1 and len(lines) <= 3, lines
    assert not (tmp_path / "results").exists()


@pytest.mark.cli
def test_a_main_config_whose_results_is_not_a_path(tmp_path):
    """Case 13: ``results: 5`` in a config of experiments/config.yaml's shape is refused when
    Snakemake parses it (a dry run stops), in one line."""
    config = yaml.safe_load((REPO / "experiments/config.yaml").read_text())
    config["results"] = 5
    _refused_at_parse(_snakemake_parse(tmp_path, config), "rpa config: error: results: 5 is not of type 'string'",
                      tmp_path)


@pytest.mark.cli
def test_a_missing_model_path_that_reads_as_a_hub_id_is_refused_at_parse_time(tmp_path):
    """Case 14: ``path: models/mine`` that is not there read as a hub id, which was left to the job
    that loads it. A relative path whose first part is a local directory (``results/`` of the
    repository) is a local path; one that is not is asked of the cache and, offline, refused when
    Snakemake parses the config."""
    assert (REPO / "results").is_dir() and not (REPO / "models").exists()
    config = yaml.safe_load((REPO / "experiments/config.yaml").read_text())
    config["results"] = str(tmp_path / "results")
    config["models"]["smollm2"] = {"path": "results/missing-model"}
    _refused_at_parse(_snakemake_parse(tmp_path, config),
                      "models.smollm2.path: results/missing-model: no such directory, and not a hub id of the form "
                      "'org/name' whose org is not a local directory", tmp_path)
    config["models"]["smollm2"] = {"path": "models/missing-model"}
    _refused_at_parse(_snakemake_parse(tmp_path, config, HF_HUB_OFFLINE="1"),
                      "models.smollm2.path: models/missing-model: no such local directory, and not in the Hugging Face "
                      "cache (HF_HUB_OFFLINE is set)", tmp_path)


@pytest.mark.parametrize("command", ["probe", "diagnose", "attribute"])
def test_completions_naming_a_directory_is_one_line(capsys, model, tmp_path, command):
    """Case 15: ``--completions DIR`` is one line (no argparse usage block) in every command that
    reads completions."""
    refused(capsys, [command, "--model", model, "--regions", "all", "--out", tmp_path / "o", "--completions", tmp_path],
            f"{tmp_path}: is a directory, not a completions file", absent=tmp_path / "o")


@pytest.mark.parametrize("change, needle", [
    ({"arm_axis": "armm"}, "decision.arm_axis: 'armm' is not an axis of the grid (arm, rung)"),
    ({"rung_axis": "lr"}, "decision.rung_axis: 'lr' is not an axis of the grid"),
    ({"treatment_arm": "nothing"}, "decision.treatment_arm: 'nothing' is not a label of the grid's 'arm' axis"),
    ({"questions": {"Q1": {"question": "?", "a": "none", "b": "none"}}}, "decision.questions.Q1: compares 'none' with itself"),
    ({"effects": {"e": {"contrast": {"none": float("nan"), "fp32": 1}}}}, "weights must be finite numbers"),
    ({"effects": {"e": {"contrast": {"none": float("inf"), "fp32": float("-inf")}}}}, "weights must be finite numbers"),
    ({"effects": {"e": {"contrast": {"none": 0, "fp32": 0}}}}, "decision.effects.e: every weight is 0"),
    ({"min_reference_collapsed": 9}, "min_reference_collapsed: 9 is more than any arm's runs (8)"),
])
def test_a_decision_naming_nothing_or_unreachable_is_refused_in_one_line(change, needle):
    """Issue 67: decisions that passed the dry run but meant nothing -- an axis or arm that is not there (an unknown
    arm axis was 14 lines blaming every arm), an arm compared with itself, NaN / infinite / all-zero weights (a NaN
    sum passed the sum check), a collapse count above the seeds."""
    from rpa.workflow.pipeline import PipelineConfigError, check_config

    config = yaml.safe_load((REPO / "experiments/precision-smollm2.yaml").read_text())
    config["search"]["decision"].update(change)
    with pytest.raises(PipelineConfigError) as err:
        check_config(config)
    lines = [line for line in str(err.value).splitlines() if line.strip() and "invalid pipeline config" not in line]
    assert len(lines) == 1 and needle in lines[0], lines


@pytest.mark.parametrize("change, needle", [
    ({"path": "../{arm}/{rung}"}, "path '../fp32/lr1e-5-c48-u4' leaves the results folder"),
    ({"path": "/tmp/{arm}"}, "path '/tmp/fp32' leaves the results folder"),
    ({"shared_warm_start": {"directory": "../init/{seed}", "only_with_steps": False}},
     "shared_warm_start.directory 'results/precision-smollm2/../init/0' leaves the results folder"),
])
def test_a_grid_directory_outside_the_results_folder_is_refused(change, needle):
    """Issue 67: '../' in a grid's path or its shared warm start's directory put runs outside the results folder."""
    from rpa.workflow.pipeline import PipelineConfigError, check_config

    config = yaml.safe_load((REPO / "experiments/precision-smollm2.yaml").read_text())
    config["search"]["stages"]["grid"].update(change)
    with pytest.raises(PipelineConfigError, match=None) as err:
        check_config(config)
    assert needle in str(err.value)


# ------------------------------------------- damaged result files (issue 67): the file named, one line, exit 2

DAMAGED = {"cut": b'{"mean_abs_dlogp": 0.01, "tok', "a list": b"[1, 2]", "binary": b"\xff\xfe\x00\x81garbage",
           "empty": b""}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_damaged_result_file_is_named_in_one_line(damage, tmp_path):
    """A probe's summary.json, a reference's machine.json and a run's summary.json / config.json, cut, list-valued,
    binary or empty (and a folder where the file must be): each reader says which file and what is wrong."""
    from analysis import check_tables
    from analysis.refusal import run as run_analysis
    from rpa.core.jsonfiles import DamagedFile, read_record
    from rpa.train.rundir import finished_summary
    from tests.conftest import run_py

    results = tmp_path / "results"
    probe_dir = results / "probe" / "m" / "none"
    probe_dir.mkdir(parents=True)
    (probe_dir / "summary.json").write_bytes(DAMAGED[damage])
    proc = run_py(["-m", "analysis.aggregate", "--results", str(results), "--out-dir", str(tmp_path / "out")])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and str(probe_dir / "summary.json") in lines[0], proc.stderr
    reference = tmp_path / "reference"
    for folder in (results / "tables", reference / "tables"):
        folder.mkdir(parents=True)
    (reference / "machine.json").write_bytes(DAMAGED[damage])
    code = run_analysis(lambda: check_tables.main(["--results", str(results), "--reference", str(reference)]))
    assert code == 2
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_bytes(DAMAGED[damage])
    with pytest.raises(DamagedFile, match=f"{run_dir / 'summary.json'}: "):
        finished_summary(run_dir, object())
    (run_dir / "folder.json").mkdir()
    with pytest.raises(DamagedFile, match="a folder where a JSON file must be"):
        read_record(run_dir / "folder.json")


def test_a_run_directory_whose_config_was_cut_is_refused_before_anything_loads(capsys, model, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text('{"model": "x", "steps"')
    cfg = run_config(tmp_path, model)
    refused(capsys, ["train", "--config", cfg, "--out", out], f"{out / 'config.json'}: not valid JSON")


def test_a_damaged_csv_table_is_named_in_one_line(tmp_path):
    from analysis.refusal import Refused
    from analysis.runs import read_table

    path = tmp_path / "tokens.csv"
    path.write_bytes(b"\xff\xfe\x00\x81" * 100)
    with pytest.raises(Refused, match=f"{path}: not text"):
        read_table(path)
    path.write_text('seq,position\n1,2\n"3,4\n')
    with pytest.raises(Refused, match=f"{path}: not a readable CSV table"):
        read_table(path)
    with pytest.raises(Refused, match="a folder where a CSV table must be"):
        read_table(tmp_path)


def test_sampling_values_that_change_nothing_or_exceed_the_probe_are_refused(capsys, model, tmp_path):
    """Issue 67: a top_k keeping the whole vocabulary (it truncates nothing; vLLM refuses a larger one after start-up)
    and a --split-sequences (or decode / batch) above the probe's sequences were accepted."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    refused(capsys, probe(model, tmp_path / "o", "--top-k", str(vocab)), f"keeps the model's whole vocabulary ({vocab}")
    refused(capsys, probe(model, tmp_path / "o", "--prompts", "2", "--samples", "2", "--split-sequences", "5"),
            "--split-sequences 5: the probe has 4 sequences", absent=tmp_path / "o")
    refused(capsys, probe(model, tmp_path / "o", "--prompts", "2", "--samples", "2", "--batch-sequences", "6"),
            "--batch-sequences 6: the probe has 4 sequences", absent=tmp_path / "o")
    cfg = run_config(tmp_path, model, top_k=vocab + 5)
    refused(capsys, ["train", "--config", cfg, "--out", tmp_path / "run"], "truncates nothing", absent=tmp_path / "run")
