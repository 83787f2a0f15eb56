"""The Snakemake pipeline: config validation, dry run, and (slow) a real run of a small grid."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from rpa.workflow.jobs import numerics_options, tiny_flags
from rpa.workflow.pipeline import PipelineConfigError, check_config
from tests.conftest import REPO, assert_figure, tail

DEFAULT = yaml.safe_load((REPO / "experiments/config.yaml").read_text())


def snakemake(*args, cwd=REPO, timeout=1800):
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([sys.executable, "-m", "snakemake", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def write_config(tmp_path, config):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def test_default_config_is_valid_and_covers_the_grid():
    check_config(DEFAULT)
    regions = {c.get("regions") for c in DEFAULT["probe"]["configs"].values()}
    assert {"none", "rope", "swiglu", "rmsnorm", "rope,swiglu", "rope,rmsnorm", "swiglu,rmsnorm", "all"} <= regions
    kinds = [c for c in DEFAULT["probe"]["configs"].values()]
    assert any(c.get("precision") == "fp32" for c in kinds) and any(c.get("precision") == "fp16" for c in kinds)
    assert any(c.get("lm_head_fp32") for c in kinds) and any(c.get("trainer_mode") == "autocast" for c in kinds)


def test_check_config_names_every_bad_entry():
    bad = copy.deepcopy(DEFAULT)
    bad["probe"]["configs"]["oops"] = {"regions": "rope,atention"}
    bad["probe"]["configs"]["fp32-all"] = {"regions": "all", "precision": "fp32"}
    bad["diagnose"]["configs"] = ["none", "missing"]
    bad["models"]["tiny-qwen3"]["tiny"]["hidden_sise"] = 64
    with pytest.raises(PipelineConfigError) as err:
        check_config(bad)
    text = str(err.value)
    for needle in ("probe.configs.oops: unknown region(s) 'atention'", "probe.configs.fp32-all:",
                   "diagnose.configs: 'missing'", "models.tiny-qwen3.tiny: unknown TinySpec field(s) hidden_sise"):
        assert needle in text


def test_a_numerics_entry_becomes_the_clis_options_and_back(tmp_path):
    """probe.configs entry -> job file -> the NumericsConfig rpa probe builds: the identity."""
    from rpa.cli import _numerics, _with_job_config, build_parser
    from rpa.core.numerics_config import NumericsConfig

    for entry in ({"regions": "rope,swiglu", "lm_head_fp32": True}, {"regions": "none", "precision": "fp32"},
                  {"regions": "none", "sampler_perturbation": {"mantissa_bits": 3}},
                  {"regions": "all", "aligned_sides": "trainer", "trainer_positions": "stock"}):
        job = tmp_path / "job.yaml"
        job.write_text(yaml.safe_dump({"model": "m", **numerics_options(entry, "cpu")}))
        argv = ["probe", "--config", str(job), "--out", "o"]
        parser = build_parser()
        args = _with_job_config(parser, argv, parser.parse_args(argv))
        assert _numerics(args) == NumericsConfig.from_dict({**entry, "device": "cpu"}), entry
    assert tiny_flags({"arch": "qwen2", "tie_word_embeddings": False, "num_hidden_layers": 4}) == (
        "--arch qwen2 --no-tie-word-embeddings --num-hidden-layers 4")


def test_dry_run_plans_the_full_grid(tmp_path):
    cfg = write_config(tmp_path, {**DEFAULT, "results": str(tmp_path / "results")})
    proc = snakemake("-n", "--cores", "2", "--quiet", "rules", "--configfile", str(cfg))
    assert proc.returncode == 0, tail(proc)
    from rpa.workflow.jobs import model_configs

    n_models = len(DEFAULT["models"])
    counts = {line.split()[0]: int(line.split()[1]) for line in proc.stdout.splitlines()
              if len(line.split()) == 2 and line.split()[1].isdigit()}
    # each model its own configurations: the real model every one, the tiny parity gates none and all
    assert counts["probe"] + counts["probe_sampler"] == sum(len(model_configs(DEFAULT, m)) for m in DEFAULT["models"])
    assert len(model_configs(DEFAULT, "smollm2")) == len(DEFAULT["probe"]["configs"])
    assert counts["attribute"] == len(DEFAULT["attribution"]["models"]) * len(DEFAULT["attribution"]["configs"])
    assert counts["gguf_model"] == 1 and counts["task_prompts"] == 1
    assert counts["parity"] == n_models and counts["diagnose"] == n_models * len(DEFAULT["diagnose"]["configs"])
    sampling = DEFAULT["models"]["smollm2"]["probe"]["sampling"]  # the gap beyond rounding: each setting sampled anew
    assert counts["probe_sampling_sampler"] == len(sampling["settings"])
    assert counts["probe_sampling"] == len(sampling["settings"]) * (len(sampling["configs"]) - 1)
    assert counts["aggregate_sampling"] == 1


def test_a_sampling_cells_job_is_the_models_probe_at_its_settings_with_the_split():
    from rpa.workflow.jobs import probe_job, sampling_cells, sampling_probe_job

    cells = sampling_cells(DEFAULT)
    assert ("smollm2", "T0.7-p0.9", "all") in cells and ("smollm2", "T1-p1", "none") in cells and len(cells) == 8
    job = sampling_probe_job(DEFAULT, "models/smollm2", "all", "T0.7-p0.9", "c.jsonl", "cpu", name="smollm2")
    plain = probe_job(DEFAULT, "models/smollm2", "all", "c.jsonl", "cpu", name="smollm2")
    assert job == {**plain, "temperature": 0.7, "top_p": 0.9, "top_k": -1, "logprobs": "processed",
                   "split_sequences": 8}


@pytest.mark.parametrize("sampling, needle", [
    ({"settings": [{"top_p": 1.5}], "configs": ["none"], "split_sequences": 2},
     "models.smollm2.probe: sampling: settings[0]: top_p must be in (0, 1], got 1.5"),
    ({"settings": [{"top_p": 0.9}, {"top_p": 0.9, "top_k": -1}], "configs": ["none"], "split_sequences": 2},
     "models.smollm2.probe: sampling: settings: T1-p0.9 is given twice"),
    ({"settings": [{"top_p": 0.9}], "configs": ["all"], "split_sequences": 2},
     "models.smollm2.probe: sampling: configs: must include the sampler 'none'"),
    ({"settings": [{"top_p": 0.9}], "configs": ["none", "alll"], "split_sequences": 2},
     "models.smollm2.probe: sampling: configs: 'alll' is not a name in probe.configs"),
])
def test_bad_sampling_cells_are_refused_naming_the_entry(sampling, needle):
    bad = copy.deepcopy(DEFAULT)
    bad["models"]["smollm2"]["probe"]["sampling"] = sampling
    with pytest.raises(PipelineConfigError) as err:
        check_config(bad)
    assert needle in str(err.value)


@pytest.mark.cli
def test_one_file_jobs_write_exactly_the_job_in_snakemakes_own_process(tmp_path):
    """Job files and run configs are written by a shell job (a `run:` job would start a new
    Snakemake process for each): byte for byte the YAML the command reads, nothing else left."""
    from rpa.workflow.jobs import model_location, parity_job, probe_job
    from rpa.workflow.experiments import kind_cells

    results = tmp_path / "results"
    cfg = write_config(tmp_path, {**DEFAULT, "results": str(results)})
    probe = results / "jobs/probe/tiny-qwen3/rope.yaml"
    parity = results / "jobs/parity/tiny-qwen3.yaml"
    proc = snakemake(str(probe), str(parity), "--cores", "1", "--configfile", str(cfg), "--verbose")
    assert proc.returncode == 0, tail(proc)
    assert "spawned job" not in proc.stdout + proc.stderr
    config = {**DEFAULT, "results": str(results)}
    model = model_location(config, "tiny-qwen3")
    completions = str(results / "probe/tiny-qwen3/none/completions.jsonl")
    assert probe.read_text() == yaml.safe_dump(probe_job(config, model, "rope", completions, DEFAULT["device"]),
                                               sort_keys=False)
    assert parity.read_text() == yaml.safe_dump(parity_job(config, model, DEFAULT["device"]), sort_keys=False)
    study = yaml.safe_load((REPO / "experiments/study-cpu.yaml").read_text())
    cell = kind_cells({**study, "results": str(results)}, "study")[0]
    run = results / "study" / cell.name / "run.yaml"
    proc = snakemake(str(run), "--cores", "1", "--configfile", "experiments/study-cpu.yaml",
                     "--config", f"results={results}")
    assert proc.returncode == 0, tail(proc)
    from rpa.train.config import TrainConfig

    # a run file: the cell's validated config in full, as rpa train reads it back
    assert run.read_text() == yaml.safe_dump(TrainConfig.from_dict(dict(cell.config)).to_dict(), sort_keys=False)
    assert not list(results.glob("**/*.tmp"))


@pytest.mark.parametrize("mutate,needle", [
    (lambda c: c["probe"]["configs"].update({"bad-entry": {"regions": "rope,qk_norm"}}),
     "probe.configs.bad-entry: unknown region(s) 'qk_norm'"),
    (lambda c: c["probe"]["configs"].update({"bad-entry": {"precision": "int8"}}), "int8"),
])
def test_bad_grid_entry_stops_before_any_job(tmp_path, mutate, needle):
    config = copy.deepcopy(DEFAULT)
    config["results"] = str(tmp_path / "results")
    mutate(config)
    proc = snakemake("--cores", "1", "--configfile", str(write_config(tmp_path, config)))
    assert proc.returncode != 0
    assert needle in proc.stderr + proc.stdout, tail(proc)
    assert not (tmp_path / "results").exists()  # nothing ran


SMALL = {
    "models": {"tiny-qwen3": {"tiny": {"arch": "qwen3", "seed": 0}}},
    "probe": {"prompts": 4, "samples": 2, "max_tokens": 16, "seed": 0, "sampler": "none",
              "configs": {"none": {"regions": "none"}, "all": {"regions": "all"},
                          "fp32": {"regions": "none", "precision": "fp32"}}},
    "diagnose": {"sequences": 2, "configs": ["all"]},
    "attribution": {"models": [], "configs": []},
    "figures": {"format": "png", "dlogp_vs_prob_configs": ["none", "all"]},
}


@pytest.mark.engine
@pytest.mark.slow
def test_small_pipeline_runs_end_to_end_and_resumes(tmp_path):
    config = {**copy.deepcopy(DEFAULT), **SMALL, "results": str(tmp_path / "results")}
    cfg = write_config(tmp_path, config)
    proc = snakemake("--cores", "2", "--configfile", str(cfg))
    assert proc.returncode == 0, tail(proc, 6000)
    res = tmp_path / "results"
    table = pd.read_csv(res / "tables/probe.csv")
    assert list(table.config) == ["none", "all", "fp32"] and (table.tokens == table.tokens.iloc[0]).all()
    by = table.set_index("config")
    assert by.loc["fp32", "mean_abs_dlogp"] < 1e-5 < by.loc["none", "mean_abs_dlogp"]
    assert by.loc["none", "rel_mean_abs_dlogp_vs_none"] == 1.0 and by.parity_passed.all()
    assert "### tiny-qwen3" in (res / "tables/probe.md").read_text()
    layers = pd.read_csv(res / "tables/diagnose.csv")
    assert set(layers.boundary) >= {"attn_in", "attn_out", "swiglu_out", "layer_out", "final_norm"}
    for name in ("mismatch", "dlogp_vs_prob", "layers"):
        assert_figure(res / f"figures/{name}.png")
    again = snakemake("--cores", "2", "--configfile", str(cfg))
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr, tail(again)
    _fresh_run_equals_its_reference_cell_by_cell(res, tmp_path / "reference")
    # the Snakemake report of the main job: every table and figure, with its caption
    report = tmp_path / "report.html"
    made = snakemake("--report", str(report), "--configfile", str(cfg))
    assert made.returncode == 0 and report.stat().st_size > 10_000, tail(made)
    html = report.read_text()
    for name in ("probe.csv", "diagnose.csv", "mismatch.png", "dlogp_vs_prob.png", "layers.png",
                 "Per-layer divergence", "Probe table"):
        assert name in html, name
    assert "Undefined substitution" not in made.stderr


def _fresh_run_equals_its_reference_cell_by_cell(res, ref):
    """analysis.check_tables on the tiny gate models' real tables (issue 55): a run exported as a reference
    equals itself; one cell changed in the reference's probe table is named (exit 1); a reference made on
    another CPU type is refused (exit 2) unless --any-cpu."""
    import json

    from analysis import check_tables

    proc = subprocess.run([sys.executable, "-m", "analysis.export_reference", "--results", str(res), "--out",
                           str(ref), "--what", "pipeline"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    argv = ["--results", str(res), "--reference", str(ref)]
    assert check_tables.main(argv) == 0
    table = ref / "tables/probe.csv"
    lines = table.read_text().splitlines()
    header, row = lines[0].split(","), lines[2].split(",")  # the second row: tiny-qwen3/all
    col = header.index("mean_abs_dlogp")
    row[col] = repr(float(row[col]) * (1 + 1e-12))
    table.write_text("\n".join([*lines[:2], ",".join(row), *lines[3:]]) + "\n")
    diffs = check_tables.compare_table(table, res / "tables/probe.csv")
    assert diffs == [f"probe.csv: row {row[0]}/{row[1]} column mean_abs_dlogp: reference {row[col]}, "
                     f"fresh {lines[2].split(',')[col]}"], diffs
    assert check_tables.main(argv) == 1
    machine = json.loads((ref / "machine.json").read_text())
    machine["cpu"]["features"] = [f for f in machine["cpu"]["features"] if f != "avx2"] + ["other_isa"]
    (ref / "machine.json").write_text(json.dumps(machine))
    assert check_tables.main(argv) == 2 and check_tables.main([*argv, "--any-cpu"]) == 1


def test_lock_checker_finds_conflicts_and_missing_pins():
    """requirements/check_lock.py's judgement on hand-made metadata (the real run reads the index)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_lock", REPO / "requirements/check_lock.py")
    lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lock)
    pins = {"torch": "2.13.0", "triton": "3.9.0", "vllm": "0.32.0", "extra-dep": "1.0"}
    meta = {"torch": ['triton==3.7.1; platform_system == "Linux"', 'nvidia-nccl-cu13==2.29.7; sys_platform == "win32"'],
            "vllm": ["torch==2.13.0", "zentorch==2.13.0.1; extra == 'zen'", "x-lib>=1; platform_system == 'Linux'"],
            "triton": [], "extra-dep": []}
    problems = lock.check(pins, meta, "3.11")
    assert any(p.startswith("conflict: torch==2.13.0 requires 'triton==3.7.1") for p in problems)
    assert any(p.startswith("missing: vllm==0.32.0 requires") and "x-lib>=1" in p for p in problems)
    assert not any("nccl" in p or "zentorch" in p for p in problems)  # markers: windows-only, an extra
    assert len(problems) == 2
    assert lock._wheel_fits("hf_xet-1.8.0-cp37-abi3-manylinux_2_17_x86_64.whl", "3.11")
    assert not lock._wheel_fits("torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl", "3.11")


def test_probe_options_have_one_owner_from_config_to_job_file_and_back(tmp_path):
    """The probe: section, the job file the rule writes and the options rpa probe reads are one
    dataclass (rpa.measure.probe.ProbeOptions): config -> job file -> parsed options is the identity,
    and a bad range is reported by the dataclass for the config as for the command line."""
    from rpa.cli import _probe_options, _with_job_config, build_parser
    from rpa.workflow.jobs import probe_job, probe_options

    config = copy.deepcopy(DEFAULT)
    config["probe"].update(prompts=7, ratio_band=[0.5, 2.0], compiled=True)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(probe_job(config, "m", "rope", "c.jsonl", "cpu")))
    argv = ["probe", "--config", str(job), "--out", "o"]
    parser = build_parser()
    args = _with_job_config(parser, argv, parser.parse_args(argv))
    assert _probe_options(args) == probe_options(config)
    assert (args.model, args.regions, args.completions, args.device) == ("m", "rope", "c.jsonl", "cpu")
    config["probe"]["ratio_band"] = [1.25, 0.8]
    with pytest.raises(PipelineConfigError, match="probe: ratio_band must satisfy 0 < lo < 1 < hi"):
        check_config(config)


def test_parity_options_have_one_owner_from_config_to_job_file_and_back(tmp_path):
    """The parity: section, the gate's job file and what rpa parity reads are one dataclass
    (rpa.measure.parity.ParityOptions)."""
    from rpa.cli import _parity_numerics, _parity_options, _with_job_config, build_parser
    from rpa.measure.parity import ParityOptions
    from rpa.workflow.jobs import parity_job, parity_options

    config = copy.deepcopy(DEFAULT)
    config["parity"].update(regions="rope,swiglu", compiled=True)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(parity_job(config, "m", "cpu")))
    argv = ["parity", "--config", str(job), "--out", "r.json"]
    parser = build_parser()
    args = _with_job_config(parser, argv, parser.parse_args(argv))
    assert _parity_options(args) == parity_options(config) == ParityOptions(compiled=True)
    assert _parity_numerics(args).regions == frozenset({"rope", "swiglu"}) and args.model == "m"


def test_the_schemas_probe_and_diagnose_defaults_are_the_dataclasses():
    import dataclasses

    from rpa.measure.probe import ProbeOptions

    schema = yaml.safe_load((REPO / "experiments/schema/config.schema.yaml").read_text())
    props = schema["properties"]["probe"]["properties"]
    for f in dataclasses.fields(ProbeOptions):
        if f.name in props:
            default = props[f.name]["default"]
            assert (tuple(default) if isinstance(default, list) else default) == f.default, f.name
    assert {"prompts", "samples", "max_tokens", "seed", "compiled", "full_kl_max_vocab", "ratio_band"} <= set(props)
    from rpa.measure.diagnose import DiagnoseOptions

    assert schema["properties"]["diagnose"]["properties"]["sequences"]["default"] == DiagnoseOptions().sequences
    from rpa.measure.parity import ParityOptions

    assert schema["properties"]["parity"]["properties"]["compiled"]["default"] is ParityOptions().compiled is False


def test_the_schemas_numerics_enums_and_dose_range_are_numerics_configs():
    """Each enum and range of a numerics configuration is written once in rpa.core.numerics_config;
    the schema (checked before anything loads) must say the same."""
    from rpa.core import numerics_config as nc

    schema = yaml.safe_load((REPO / "experiments/schema/config.schema.yaml").read_text())
    numerics = schema["properties"]["probe"]["properties"]["configs"]["additionalProperties"]["properties"]
    assert numerics["precision"]["enum"] == list(nc.PRECISIONS)
    assert numerics["trainer_mode"]["enum"] == list(nc.TRAINER_MODES)
    assert numerics["trainer_positions"]["enum"] == list(nc.TRAINER_POSITIONS)
    assert numerics["aligned_sides"]["enum"] == list(nc.ALIGNED_SIDES)
    assert numerics["trainer_attention"]["enum"] == list(nc.TRAINER_ATTENTION)
    assert numerics["trainer_precision"]["enum"] == list(nc.TRAINER_PRECISIONS)
    perturbation = numerics["sampler_perturbation"]
    assert perturbation["required"] == list(nc.PERTURBATION_KEYS)
    bits = perturbation["properties"]["mantissa_bits"]
    dose = schema["properties"]["dose"]["properties"]["doses"]["items"]["anyOf"][0]
    for spec in (bits, dose):
        assert (spec["minimum"], spec["maximum"]) == nc.MANTISSA_BITS
    assert set(numerics) <= set(nc.KEYS)


@pytest.mark.cli  # the checker runs each analysis in a process of its own
def test_the_committed_probe_pipeline_regenerates_and_its_export_round_trips(tmp_path, capsys):
    """results/reference/cpu holds what its probe and diagnosis tables are made from: they
    regenerate byte for byte, and exporting that folder again gives the same files."""
    import filecmp

    from analysis import check_reference

    assert check_reference.main(["--only", "cpu"]) == 0
    assert "cpu: 9 tables identical, 0 differ" in capsys.readouterr().out
    ref = REPO / "results/reference/cpu"
    proc = subprocess.run([sys.executable, "-m", "analysis.export_reference", "--results", str(ref), "--out",
                           str(tmp_path), "--what", "pipeline"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for folder in ("parity", "probe", "diagnose"):
        files = sorted(p.relative_to(ref) for p in (ref / folder).rglob("*") if p.is_file())
        assert files and files == sorted(p.relative_to(tmp_path) for p in (tmp_path / folder).rglob("*") if p.is_file())
        _, mismatch, errors = filecmp.cmpfiles(ref, tmp_path, [str(f) for f in files], shallow=False)
        assert not mismatch and not errors, (mismatch, errors)


@pytest.mark.parametrize("name", ["main", "main-xeon-amx"])
def test_each_main_reference_names_its_cpu_type_and_quotes_its_own_probe(name):
    """A main-job reference is one CPU type's (issue 55): ``machine.json`` names it, and the numbers its
    README and docs/findings.md quote for it are its own probe table's (the AMD and the Xeon references'
    BF16 numbers differ)."""
    import json
    import re

    import pandas as pd

    ref = REPO / "results/reference" / name
    cpu = json.loads((ref / "machine.json").read_text())["cpu"]
    assert cpu["vendor"] in ("AuthenticAMD", "GenuineIntel") and "avx512_bf16" in cpu["features"]
    probe = pd.read_csv(ref / "tables/probe.csv")
    smol = probe[probe.model == "smollm2"].set_index("config")
    prose = lambda path: re.sub(r"\s+", " ", path.read_text()).replace("\u2212", "-")  # noqa: E731
    readme, top = prose(ref / "README.md"), prose(REPO / "docs/findings.md")  # the README's findings in full
    change = lambda c: "{:+.1f}% [{:+.1f}, {:+.1f}]".format(  # noqa: E731
        *(100 * smol.loc[c, k] for k in ("mean_abs_dlogp_change", "mean_abs_dlogp_low", "mean_abs_dlogp_high")))
    for config in ("all", "all+attention-fp32"):
        assert change(config).replace("+", "") in readme.replace("+", ""), (name, config, change(config))
        assert change(config).replace("+", "") in top.replace("+", ""), (name, config, change(config))
    assert f"{smol.loc['none', 'mean_abs_dlogp']:.3g}" in readme
