"""The study and its grid machinery: expansion with overrides merged key by key, one run
directory per cell, resources scaled by size on SLURM and on a workstation, the positions
option, the GPU allocator, and the analysis on committed raw results."""

import os
import subprocess
import sys

import pytest
import yaml

from rpa.workflow.grid import deep_merge
from rpa.workflow.pipeline import check_config
from rpa.workflow.resources import study_resources
from rpa.workflow.experiments import grid_groups, kind_cells
from tests.conftest import REPO, assert_figure, run_py, tail
from tests.test_pipeline import DEFAULT, snakemake

STUDY = yaml.safe_load((REPO / "experiments/study.yaml").read_text())
STUDY_CPU = yaml.safe_load((REPO / "experiments/study-cpu.yaml").read_text())


def study_points(config):
    """The study's cells (rpa.workflow.experiments.kind_cells) as rows: cell, model, arm, seed, run config."""
    return [{"cell": c.name, "model": c.labels["model"], "arm": c.labels["arm"], "seed": c.seed, "config": c.config}
            for c in kind_cells(config, "study")]


def study_groups(config):
    """The study's process groups: name -> its cells' names."""
    return {g.name: [c.name for c in g.cells] for g in grid_groups(config, "study", kind_cells(config, "study"))}


def test_overrides_merge_key_by_key_numerics_included():
    assert deep_merge({"numerics": {"regions": "none", "precision": "bf16"}, "steps": 3},
                      {"numerics": {"precision": "fp16"}}) == {"numerics": {"regions": "none", "precision": "fp16"},
                                                               "steps": 3}
    config = {**DEFAULT, "train": {**DEFAULT["train"], "regions": ["none"], "seeds": [0],
                                   "settings": {"half": {"numerics": {"precision": "fp16"}, "steps": 7}}}}
    (cell,) = kind_cells(config, "train")
    assert cell.config["numerics"]["precision"] == "fp16"  # the old grid dropped it (came out bf16)
    assert cell.config["steps"] == 7 and cell.model == "tiny-qwen3"


@pytest.mark.parametrize("config", [STUDY, STUDY_CPU], ids=["gpu-study", "cpu-miniature"])
def test_study_cells_are_unique_and_name_model_arm_seed(config):
    points = study_points(config)
    study = config["study"]
    extra = sum(len(a or {}) for a in (study.get("size_arms") or {}).values())
    assert len(points) == (len(study["models"]) * len(study["arms"]) + extra) * len(study["seeds"]) >= 4 * 12 * 3
    assert len({p["cell"] for p in points}) == len(points)
    for p in points:
        assert p["cell"] == f"{p['model']}/{p['arm']}/seed{p['seed']}" and p["config"]["seed"] == p["seed"]
    by = {(p["model"], p["arm"], p["seed"]): p["config"] for p in points}
    m = study["models"][0]
    assert by[(m, "none", 0)]["numerics"]["trainer_positions"] == "mask"  # the study's default
    assert by[(m, "positions-stock", 0)]["numerics"]["trainer_positions"] == "stock"  # the shift alone
    assert by[(m, "positions-stock", 0)]["numerics"]["regions"] == "none"
    assert by[(m, "fp16", 0)]["numerics"]["precision"] == "fp16"
    assert by[(m, "all-sampler-only", 0)]["numerics"]["aligned_sides"] == "sampler"
    assert by[(m, "tis", 0)]["is_correction"] == "token_truncate"
    arms = set(study["arms"])
    assert {"none", "rope", "swiglu", "rmsnorm", "all", "fp16", "lm-head-fp32", "tis", "mis", "all-trainer-only",
            "all-sampler-only", "positions-stock"} <= arms and len(study["seeds"]) >= 3


def test_gpu_study_sizes_and_resources():
    steps = {m: p["config"]["steps"] for p in study_points(STUDY) for m in [p["model"]]}
    assert len(set(steps.values())) > 1  # per-size settings reach the cells
    small, large = study_resources(STUDY, "qwen3-0.6b"), study_resources(STUDY, "qwen3-8b")
    assert small["gpu"] == 1 and small["launch"] == "single"
    assert large["gpu"] > 1 and large["launch"] == "fsdp2" and large["mem_mb"] > small["mem_mb"]


def _with(config, **study):
    return {**config, "study": {**config["study"], **study}}


def test_the_miniature_runs_arms_of_one_sampler_side_in_one_process_and_every_cell_once(tmp_path):
    from rpa.train.config import TrainConfig

    groups = study_groups(STUDY_CPU)
    points = {p["cell"]: p for p in study_points(STUDY_CPU)}
    cells = [c for group in groups.values() for c in group]
    assert sorted(cells) == sorted(points)
    seeds, arms_per = STUDY_CPU["study"]["seeds"], STUDY_CPU["study"]["arms_per_process"]
    for name, group in groups.items():  # one model, one sampler side, at most arms_per arms of all the seeds
        sides = {TrainConfig.from_dict(points[c]["config"]).numerics.sampler_process_key for c in group}
        arms = list(dict.fromkeys(points[c]["arm"] for c in group))
        assert len(sides) == 1 and len({points[c]["model"] for c in group}) == 1, name
        assert len(group) == len(arms) * len(seeds) and len(arms) <= arms_per, name
        assert name == f"{points[group[0]]['model']}/{'+'.join(arms)}/seed0+1+2"
    assert groups["mini-xs/none+positions-stock+fp16+lm-head-fp32/seed0+1+2"][:4] == [
        "mini-xs/none/seed0", "mini-xs/none/seed1", "mini-xs/none/seed2", "mini-xs/positions-stock/seed0"]
    assert groups["mini-xs/all+all-sampler-only/seed0+1+2"][3] == "mini-xs/all-sampler-only/seed0"
    assert groups["mini-xs/rope/seed0+1+2"] == ["mini-xs/rope/seed0", "mini-xs/rope/seed1", "mini-xs/rope/seed2"]
    one = study_groups(_with(STUDY_CPU, arms_per_process=1, runs_per_process=2))  # the seeds of one arm
    assert one["mini-l/fp16/seed0+1"] == ["mini-l/fp16/seed0", "mini-l/fp16/seed1"] and "mini-l/fp16/seed2" in one
    assert study_resources(STUDY_CPU, "mini-l", 3)["runtime"] == 3 * study_resources(STUDY_CPU, "mini-l")["runtime"]
    proc = snakemake("study", "-n", "--printshellcmds", "--configfile", "experiments/study-cpu.yaml",
                     "--config", f"results={tmp_path / 'r'}")
    assert proc.returncode == 0, tail(proc)
    out = proc.stdout + proc.stderr
    assert len(_jobs(out, "grid_run")) == len(groups)
    r = tmp_path / "r" / "study" / "mini-xs"
    runs = [f"{r}/{arm}/seed{s}" for arm in ("all", "all-sampler-only") for s in seeds]
    assert "rpa train " + " ".join(f"--config {d}/run.yaml --out {d}" for d in runs) + " " in out
    assert f"python -m rpa.workflow.runs --out {r}/all+all-sampler-only/seed0+1+2.json {' '.join(runs)}" in out
    # a run stopped by an OOM or a lost process fails its job (the schema's default, twice), so that it runs again
    assert f"{' '.join(runs)} --transient-retries 2 >> " in out


def test_the_longest_work_is_scheduled_first(tmp_path):
    """A study job's priority is its minutes of training; a model's warm start, its tiny-model
    build and its run configs (what a job waits for) outrank every job of that model they unlock;
    as Snakemake reads them (its dry run prints each job's priority)."""
    from rpa.workflow.resources import study_priorities

    groups = study_groups(STUDY_CPU)
    priority = study_priorities(STUDY_CPU, groups)
    for name, cells in groups.items():
        model = name.split("/")[0]
        assert priority[name] == study_resources(STUDY_CPU, model, len(cells))["runtime"]
        assert priority[model] > priority[name]
    assert priority["mini-l/none+positions-stock+fp16+lm-head-fp32/seed0+1+2"] > priority["mini-xs/rope/seed0+1+2"]
    assert priority["mini-l"] == sum(p for n, p in priority.items() if n.startswith("mini-l/"))
    proc = snakemake("study", "-n", "--configfile", "experiments/study-cpu.yaml", "--config", f"results={tmp_path}")
    assert proc.returncode == 0, tail(proc)
    out = proc.stdout + proc.stderr
    trains = _jobs(out, "grid_run")
    assert len(trains) == len(groups) and all(int(j["priority"]) == priority[j["wildcards"].removeprefix("record=study/")]
                                              for j in trains)
    # the model is the first part of a tiny model's name, the second of a warm start's and a run file's
    for rule, key, part in (("grid_warm_start", "init=study/", 0), ("tiny_model", "model=", 0),
                            ("grid_run_file", "run=study/", 0)):
        jobs = _jobs(out, rule)
        assert jobs and all(int(j["priority"]) == priority[j["wildcards"].removeprefix(key).split("/")[part]]
                            for j in jobs), rule
    # probes and parity fill in at the end; an FP16 probe (~8x a BF16 one on a CPU without FP16 arithmetic) first of them
    probes = _jobs(out, "probe") + _jobs(out, "parity")
    assert all(int(j.get("priority", 0)) == (1 if "fp16" in j.get("wildcards", "") else 0) for j in probes)


def test_process_groups_whose_names_collide_are_refused():
    """Arms ``a`` and ``b`` in one process would share a record with an arm named ``a+b``."""
    config = _with(STUDY_CPU, arms={"a": {}, "b": {}, "a+b": {}}, arms_per_process=2, size_arms={}, reference_arm="a")
    with pytest.raises(Exception, match=r"two process groups are named 'mini-xs/a\+b/seed0\+1\+2'"):
        check_config(config)


def test_several_runs_per_process_need_a_single_process_launch():
    config = {**STUDY, "study": {**STUDY["study"], "runs_per_process": 2}}
    with pytest.raises(Exception, match="study.runs_per_process: 2, but 'qwen3-8b' launches with 'fsdp2'"):
        check_config(config)


def test_an_arm_whose_vllm_weights_cannot_fit_its_gpu_share_is_refused_in_one_line():
    """The fp32 arm at 8B: 32.8 GB of FP32 weights against vLLM's 0.3 x 80 GB = 24 GB (the BF16 arms' share);
    the study sizes it (0.5: 40 GB), and a config without the GPU's memory is not checked."""
    from rpa.workflow.pipeline import PipelineConfigError

    check_config(STUDY)  # as shipped: every arm fits
    arms = {**STUDY["study"]["arms"], "fp32": {"numerics": {"precision": "fp32"}}}
    config = {**STUDY, "study": {**STUDY["study"], "arms": arms}}
    with pytest.raises(PipelineConfigError) as err:
        check_config(config)
    problems = str(err.value).splitlines()[1:]
    assert [p.strip() for p in problems] == [
        "study.arms.fp32 (qwen3-8b): vLLM's fp32 weights, 32.8 GB (8.19e+09 parameters x 4 bytes), do not fit its "
        "share of one 80 GB GPU (vllm_gpu_memory_utilization 0.3: 24.0 GB); raise the arm's "
        "vllm_gpu_memory_utilization or run it on smaller sizes only (study.size_arms)"]
    check_config({**config, "study": {**config["study"], "gpu_memory_gb": None}})  # no GPU size: nothing checked
    on_141 = {**config, "study": {**config["study"], "gpu_memory_gb": 141}}  # an H200: 0.3 x 141 = 42.3 GB
    check_config(on_141)
    tp = deep_merge(STUDY["study"]["sizes"], {"qwen3-8b": {"vllm_tensor_parallel_size": 2, "eval_every": 0}})
    check_config({**config, "study": {**config["study"], "sizes": tp}})  # 16.4 GB a rank


def test_a_job_record_needs_every_run_summary(tmp_path):
    from rpa.workflow.runs import main

    runs = [tmp_path / "seed0", tmp_path / "seed1"]
    for d in runs:
        d.mkdir()
    (runs[0] / "summary.json").write_text('{"status": "ok", "steps": 20, "wall_s": 3.5, "engine_taken_over": false}')
    record = tmp_path / "seed0+1.json"
    assert main(["--out", str(record), *map(str, runs)]) == 1 and not record.exists()
    (runs[1] / "summary.json").write_text('{"status": "error", "steps": 4, "wall_s": 1.0, "engine_taken_over": true}')
    assert main(["--out", str(record), *map(str, runs)]) == 0
    import json

    got = json.loads(record.read_text())
    assert got["schema"] == "rpa.grid-job/1" and [r["status"] for r in got["runs"]] == ["ok", "error"]
    assert [r["engine_taken_over"] for r in got["runs"]] == [False, True]


def _jobs(dry_run_output: str, rule: str) -> list[dict[str, str]]:
    """(wildcards, resources, priority) of each job of ``rule`` in a dry run's log."""
    jobs, current = [], None
    for line in dry_run_output.splitlines():
        line = line.strip()
        if line.startswith("rule ") or line.startswith("localrule "):
            current = {"rule": line.split()[1].rstrip(":")}
            jobs.append(current)
        elif current is not None and line.startswith(("wildcards:", "resources:", "priority:")):
            key, _, value = line.partition(": ")
            current[key] = value
    return [j for j in jobs if j["rule"] == rule]


def test_slurm_dry_run_lists_every_cell_once_with_gpu_resources(tmp_path):
    proc = snakemake("study", "-n", "--workflow-profile", "experiments/profiles/slurm",
                     "--configfile", "experiments/study.yaml", "--config", f"results={tmp_path / 'r'}")
    assert proc.returncode == 0, tail(proc)
    jobs = _jobs(proc.stdout + proc.stderr, "grid_run")
    cells = [j["wildcards"].removeprefix("record=study/") for j in jobs]  # the GPU study: one run per job
    assert sorted(cells) == sorted(p["cell"] for p in study_points(STUDY))  # every cell, exactly once
    for j in jobs:
        res = dict(kv.split("=", 1) for kv in j["resources"].split(", "))
        model = j["wildcards"].removeprefix("record=study/").split("/")[0]
        want = study_resources(STUDY, model)
        assert int(res["gpu"]) == want["gpu"] > 0 and "slurm_extra" not in res  # the plugin makes --gpus from gpu
        assert int(res["mem_mb"]) == want["mem_mb"] and int(res["runtime"]) == want["runtime"]
        assert int(res["cpus_per_task"]) == want["cpus_per_task"]
    probes = _jobs(proc.stdout + proc.stderr, "probe")
    assert probes and all("gpu=1" in j["resources"] for j in probes)


def test_workstation_dry_run_caps_gpus_and_gives_jobs_their_own(tmp_path):
    proc = snakemake("study", "-n", "--workflow-profile", "experiments/profiles/workstation", "--resources", "gpu=8",
                     "--configfile", "experiments/study.yaml", "--config", f"results={tmp_path / 'r'}",
                     "--printshellcmds")
    assert proc.returncode == 0, tail(proc)
    out = proc.stdout + proc.stderr
    assert "python -m rpa.workflow.gpus --count 1 -- rpa train" in out
    assert "python -m rpa.workflow.gpus --count 8 -- accelerate launch --config_file experiments/accelerate/fsdp2.yaml" in out


def test_a_workstation_with_fewer_gpus_than_a_job_needs_is_refused_at_parse_time(tmp_path):
    from rpa.workflow.resources import gpu_shortfall

    assert gpu_shortfall(STUDY, None) is None and gpu_shortfall(STUDY, 8) is None  # SLURM: no limit; 8 GPUs
    assert gpu_shortfall(STUDY_CPU, 0) is None  # the CPU miniature takes none
    line = gpu_shortfall(STUDY, 2)
    assert "study.resources.qwen3-4b.gpu 4, study.resources.qwen3-8b.gpu 8;" in line and "qwen3-1.7b" not in line
    proc = snakemake("study", "-n", "--workflow-profile", "experiments/profiles/workstation", "--resources", "gpu=2",
                     "--configfile", "experiments/study.yaml", "--config", f"results={tmp_path / 'r'}")
    assert proc.returncode != 0 and line in proc.stdout + proc.stderr, tail(proc)
    assert "grid_run" not in proc.stdout  # refused before any job is listed


def test_gpu_allocator_gives_concurrent_jobs_distinct_gpus(tmp_path):
    """Three one-GPU jobs on two lent GPUs: two run at once on different GPUs (each waits until
    both have started), the third waits for a free one."""
    env = {**os.environ, "RPA_GPUS": "3,7", "RPA_GPU_LOCK_DIR": str(tmp_path / "locks")}
    env.pop("SLURM_JOB_ID", None)
    started = tmp_path / "started"
    started.mkdir()
    job = ("import os, time, pathlib; d = pathlib.Path(%r); gpu = os.environ['CUDA_VISIBLE_DEVICES']; "
           "(d / f'{gpu}-{os.getpid()}').touch(); t = time.time()\n"
           "while len(list(d.iterdir())) < 2 and time.time() - t < 60: time.sleep(0.1)\n"
           "print(gpu, len(list(d.iterdir())))" % str(started))
    cmd = [sys.executable, "-m", "rpa.workflow.gpus", "--count", "1", "--", sys.executable, "-c", job]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=REPO) for _ in range(3)]
    outs = [p.communicate(timeout=180)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    gpus = sorted(o[0] for o in outs)
    assert set(gpus) == {"3", "7"} and len(list(started.iterdir())) == 3
    passthrough = subprocess.run([sys.executable, "-m", "rpa.workflow.gpus", "--count", "0", "--", "true"], env=env, cwd=REPO)
    assert passthrough.returncode == 0


def test_positions_are_an_independent_option(tiny_dirs):
    """trainer_positions: mask removes TRL's left-padding shift without aligning RoPE rounding;
    stock keeps the shift even with RoPE aligned."""
    import torch
    from transformers import AutoModelForCausalLM

    from rpa.core.numerics_config import NumericsConfig
    from rpa.sides.trainer import align_model
    from rpa.measure.scoring import trainer_batch_logprobs, trainer_logprobs

    g = torch.Generator().manual_seed(1)
    comps = [{"prompt_ids": torch.randint(3, 500, (p,), generator=g).tolist(),
              "completion_ids": torch.randint(3, 500, (c,), generator=g).tolist()} for p, c in ((5, 9), (11, 3))]
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["qwen3"], dtype=torch.bfloat16, attn_implementation="eager")
    same = {}
    for name, numerics in {"none-mask": {"regions": "none", "trainer_positions": "mask"},
                           "none-stock": {"regions": "none", "trainer_positions": "stock"},
                           "rope-stock": {"regions": "rope", "trainer_positions": "stock"},
                           "rope-auto": {"regions": "rope"}}.items():
        with align_model(model, NumericsConfig.from_dict(numerics)):
            single = [trainer_logprobs(model, c["prompt_ids"], c["completion_ids"]) for c in comps]
            same[name] = single == trainer_batch_logprobs(model, comps, pad_id=0)
    assert same == {"none-mask": True, "none-stock": False, "rope-stock": False, "rope-auto": True}


REFERENCE = REPO / "results/reference/study-cpu"


def test_study_analysis_regenerates_from_committed_raw_results(tmp_path):
    import shutil

    assert (REFERENCE / "study/manifest.json").exists(), "committed reference data missing (part of the contract)"

    res = tmp_path / "r"
    shutil.copytree(REFERENCE, res)
    committed = {name: (REFERENCE / f"tables/{name}").read_text()
                 for name in ("study_collapse.csv", "study_sensitivity.csv")}
    for table in (res / "tables").glob("study_*"):
        table.unlink()
    proc = run_py(["-m", "analysis.study", "--results", str(res)])
    assert proc.returncode == 0, tail(proc)
    for name, text in committed.items():
        assert (res / f"tables/{name}").read_text() == text
    for name in ("rewards", "mismatch_curves", "heatmap"):
        assert_figure(res / f"figures/study_{name}.png")
    tex = (res / "tables/study_mismatch.tex").read_text()
    assert "\\toprule" in tex and "\\bottomrule" in tex


def test_export_replaces_the_stage_never_merges_stale_runs(tmp_path):
    """Exporting again into a reference folder keeps its README but not runs the new results lack (an export with
    fewer finished runs than the reference holds is refused unless asked for: issue 67)."""
    def run(root, cell):
        d = root / "study" / cell
        d.mkdir(parents=True)
        (d / "summary.json").write_text("{}")
        (d / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5, "extra": 1}\n')
        return d

    first, second, out = tmp_path / "first", tmp_path / "second", tmp_path / "out"
    for root, cells in ((first, ("m/none/seed0", "m/none/seed9")), (second, ("m/none/seed0",))):
        for cell in cells:
            run(root, cell)
        (root / "study/manifest.json").write_text("{}")
    out.mkdir()
    (out / "README.md").write_text("kept")
    export = ["-m", "analysis.export_reference", "--out", str(out), "--what", "study"]
    proc = run_py([*export, "--results", str(first)])
    assert proc.returncode == 0, tail(proc)
    proc = run_py([*export, "--results", str(second)])  # 1 run over 2: refused, nothing changed
    assert proc.returncode == 2 and "holds 2 finished results and the export brings 1" in proc.stderr, tail(proc)
    assert sorted(p.parent.name for p in (out / "study").glob("*/*/*/summary.json")) == ["seed0", "seed9"]
    proc = run_py([*export, "--results", str(second), "--allow-fewer"])
    assert proc.returncode == 0 and "had 2 finished results, now 1" in proc.stderr, tail(proc)
    assert sorted(p.parent.name for p in (out / "study").glob("*/*/*/summary.json")) == ["seed0"]
    assert (out / "README.md").read_text() == "kept"
    assert (out / "study/m/none/seed0/metrics.jsonl").read_text() == '{"step": 1, "reward": 0.5}\n'


def test_paper_builds_from_committed_results_or_says_what_is_missing(tmp_path):
    import shutil

    assert (REFERENCE / "study/manifest.json").exists(), "committed reference data missing (part of the contract)"

    res = tmp_path / "r"
    shutil.copytree(REFERENCE, res)
    dose = REPO / "results/reference/cpu"  # the committed positive control, another results directory
    proc = run_py(["-m", "analysis.paper", "--results", str(res), "--out-dir", str(res / "paper"),
                   "--section", f"dose={dose}"], timeout=600)
    claims = (res / "paper/claims.tex").read_text()
    front = (res / "paper/front.tex").read_text()
    assert "\\newcommand{\\claimstable}" in front and "RoPE alone suffices" in front and "RoPE alone" in claims
    assert "half of the runs collapse at mismatch" in claims and (res / "paper/dose_table.tex").exists()
    if shutil.which("latexmk") and shutil.which("pdflatex"):
        assert proc.returncode == 0, tail(proc)
        assert (res / "paper/main.pdf").stat().st_size > 20_000
    else:
        from tests.conftest import skip_unless_present

        assert proc.returncode == 1 and "no TeX engine" in proc.stderr and "apt-get install latexmk" in proc.stderr
        skip_unless_present("tex", "no latexmk/pdflatex: the PDF was not built")  # fails where TeX is required


def test_every_arm_has_its_own_colour():
    from analysis.study.figures import arm_colors

    arms = list(STUDY["study"]["arms"])
    colours = arm_colors(arms)
    assert len(arms) == 13 and len(set(colours.values())) == len(arms)


# --------------------------------------------------------------------------- study tables (synthetic runs)

THRESHOLDS = {"smoothing_window": 5, "drop_fraction": 0.5, "min_best_reward": 0.05, "spike_factor": 10.0,
              "spike_warmup_steps": 5, "min_steps_after_drop": 5}
REWARDS = {"stable": [0.8] * 30, "collapsed": [0.8] * 15 + [0.0] * 15, "unconfirmed": [0.8] * 25 + [0.0] * 5}


def _study_run(results, cell: str, rewards: list[float], dlogp: list[float], numerics: dict | None = None,
               spike_at: int | None = None, steps: list[int] | None = None) -> None:
    import json

    d = results / "study" / cell
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"collapse": THRESHOLDS, "numerics": numerics or {"regions": "none"}}))
    (d / "summary.json").write_text(json.dumps({"status": "finished"}))
    steps = steps or list(range(1, len(rewards) + 1))
    lines = [{"step": s, "reward": r, "loss": 0.01, "grad_norm": 50.0 if i == spike_at else 1.0,
              "mismatch/mean_abs_dlogp": m, "mismatch/kl_k3": m * m}
             for i, (s, r, m) in enumerate(zip(steps, rewards, dlogp))]
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


def _manifest(results, model: str, arms: list[str], seeds: list[int]) -> dict:
    import json

    manifest = {"models": [model], "arms": arms, "seeds": seeds, "reference_arm": arms[0], "label": "synthetic",
                "probe_configs": arms, "cells": [{"cell": f"{model}/{a}/seed{s}", "model": model, "arm": a, "seed": s}
                                                 for a in arms for s in seeds]}
    (results / "study").mkdir(parents=True, exist_ok=True)
    (results / "study/manifest.json").write_text(json.dumps(manifest))
    return manifest


def test_collapse_table_shows_unconfirmed_spikes_and_every_sensitivity_variation(tmp_path):
    from analysis.study.command import readable_sensitivity
    from analysis.study.stats import collapse_table, sensitivity_table, study_rows
    from rpa.train.collapse import CollapseThresholds, sensitivity_settings

    manifest = _manifest(tmp_path, "m", ["none"], [0, 1, 2])
    for seed, kind in enumerate(("stable", "collapsed", "unconfirmed")):
        _study_run(tmp_path, f"m/none/seed{seed}", REWARDS[kind], [0.01] * 30, spike_at=12 if seed == 0 else None)
    runs, _, _ = study_rows(tmp_path, manifest)
    row = collapse_table(runs, manifest).iloc[0]
    assert row["collapsed"] == "1/3" and row["unconfirmed"] == 1 and row["grad_spikes"] == 1
    sens = sensitivity_table(runs, manifest)
    labels = [label for label, _ in sensitivity_settings(CollapseThresholds(**THRESHOLDS))]
    assert len(labels) == 5
    for label in labels:
        assert f"{label} collapsed" in sens and f"{label} unconfirmed" in sens
    s = sens.iloc[0]
    # the drop at the end lasts 3 steps: unconfirmed at a window of 5, collapsed at half of it (2)
    assert s["drop 0.5 collapsed"] == 1 and s["drop 0.5 unconfirmed"] == 1
    assert s["persist /2 collapsed"] == 2 and s["persist /2 unconfirmed"] == 0
    readable = readable_sensitivity(sens)
    assert list(readable.columns) == ["model", "arm", *labels]
    assert readable.iloc[0]["drop 0.5"] == "1/3 (1 unconf.)" and readable.iloc[0]["persist /2"] == "2/3"


def test_train_mismatch_change_is_paired_by_seed_and_step_with_a_t_interval(tmp_path):
    import math

    from analysis.study.command import readable_mismatch
    from analysis.study.stats import mismatch_table, study_rows

    manifest = _manifest(tmp_path, "m", ["none", "rope"], [0, 1, 2])
    log_ratio = {0: 0.1, 1: 0.2, 2: 0.3}  # per seed; the steps' ratios scatter around it
    for seed, lr in log_ratio.items():
        ref = [0.001 * (1 + seed) * (1 + 0.5 * math.sin(i)) for i in range(20)]
        arm = [r * math.exp(lr + (0.05 if i % 2 else -0.05)) for i, r in enumerate(ref)]
        _study_run(tmp_path, f"m/none/seed{seed}", [0.8] * 20, ref)
        if seed == 0:  # the arm logged steps 1-18 and a wild step 40 that the reference never logged
            _study_run(tmp_path, f"m/rope/seed{seed}", [0.8] * 19, arm[:18] + [1.0], steps=list(range(1, 19)) + [40])
        else:
            _study_run(tmp_path, f"m/rope/seed{seed}", [0.8] * 20, arm)
    runs, curves, _ = study_rows(tmp_path, manifest)
    table = mismatch_table(tmp_path, runs, manifest, curves).set_index("arm")
    half = 4.303 * 0.1 / math.sqrt(3)  # t(0.975, df=2) x sd / sqrt(seeds)
    rope = table.loc["rope"]
    assert rope["train_mean_abs_dlogp_change"] == pytest.approx(math.expm1(0.2))
    assert rope["train_mean_abs_dlogp_low"] == pytest.approx(math.expm1(0.2 - half))
    assert rope["train_mean_abs_dlogp_high"] == pytest.approx(math.expm1(0.2 + half))
    assert rope["train_mean_abs_dlogp_low"] < math.expm1(0.2) < rope["train_mean_abs_dlogp_high"]
    assert rope["train_paired_seeds"] == 3 and pd_isna(table.loc["none", "train_mean_abs_dlogp_change"])
    readable = readable_mismatch(table.reset_index(), "none").set_index("arm")
    assert readable.loc["rope", "train mean_abs_dlogp change (95% CI)"] == \
        f"+22.1% [{100 * math.expm1(0.2 - half):+.1f}, {100 * math.expm1(0.2 + half):+.1f}]"
    assert readable.loc["none", "train mean_abs_dlogp change (95% CI)"] == "reference"


def pd_isna(value) -> bool:
    import pandas as pd

    return bool(pd.isna(value))


def test_positions_stock_probe_change_is_not_a_measurement(tmp_path):
    import numpy as np

    from analysis.study.command import latex_mismatch, readable_mismatch
    from analysis.study.stats import mismatch_table, study_rows
    from tests.test_aggregate import write_probe

    arms = ["none", "positions-stock", "rope"]
    manifest = _manifest(tmp_path, "m", arms, [0])
    base = np.linspace(0.005, 0.02, 10)
    write_probe(tmp_path, "m", "none", {}, base)
    write_probe(tmp_path, "m", "positions-stock", {"trainer_positions": "stock"}, base)
    write_probe(tmp_path, "m", "rope", {"regions": "rope"}, base * 0.8)
    for arm in arms:
        _study_run(tmp_path, f"m/{arm}/seed0", [0.8] * 10, [0.001] * 10)
    runs, curves, _ = study_rows(tmp_path, manifest)
    table = mismatch_table(tmp_path, runs, manifest, curves)
    by = table.set_index("arm")
    assert by.loc["positions-stock", "probe_note"] == "n/a (unpadded probe)"
    assert by.loc[["positions-stock"], [c for c in table if c.startswith("probe_") and c != "probe_note"]].isna().all(
        axis=None)
    assert by.loc["rope", "probe_mean_abs_dlogp_change"] == pytest.approx(-0.2)
    for frame, column in ((readable_mismatch(table, "none"), "mean_abs_dlogp change (95% CI)"),
                          (latex_mismatch(table, "none"), "probe change (95% CI)")):
        cells = frame.set_index("arm")[column]
        assert cells["positions-stock"] == "n/a (unpadded probe)" and cells["none"] == "reference"
        assert cells["rope"].startswith("-20.0% [")


def test_latex_tables_keep_few_columns():
    import pandas as pd

    from analysis.study.command import latex_collapse

    table = pd.DataFrame({"model": ["m"], "arm": ["none"], "runs": [3], "finished": [3], "failed": [0], "missing": [0],
                          "collapsed": ["1/3"], "unconfirmed": pd.array([1], dtype="Int64"),
                          "grad_spikes": pd.array([2], dtype="Int64"), "median_collapse_step": [12.0],
                          "peak_reward": ["1 ± 0"], "final_reward": ["0.5 ± 0.1"],
                          "final_eval_accuracy": ["0.2 ± 0"]})
    tex = latex_collapse(table)
    assert "peak_reward" not in tex and "eval accuracy" in tex and tex.shape[1] <= 8
    assert tex.iloc[0].tolist() == ["m", "none", "1/3", 1, 2, "12", "0.5 ± 0.1", "0.2 ± 0"]


def test_readme_gpu_budget_is_the_one_computed_from_the_config():
    """The study page's budget block (docs/study.md) is what analysis.gpu_budget computes."""
    from analysis.gpu_budget import budget, markdown

    readme = (REPO / "docs" / "study.md").read_text()
    block = readme.split("<!-- gpu-budget:begin -->\n")[1].split("<!-- gpu-budget:end -->")[0]
    rows = budget(STUDY)
    assert block == markdown(rows)
    for r in rows:  # every run fits its job's wall time (a longer one would rely on retries)
        assert r["wall_h_per_run"] <= r["runtime_h"] <= 24, r


def test_the_disk_budget_counts_the_kept_checkpoints_of_every_run():
    """8B: 300 steps, a checkpoint every 25 (12 written), 2 kept: 8.19e9 x (2 x 12 B + 2 B) a run, 39 runs."""
    from analysis.gpu_budget import budget, markdown

    rows = {r["model"]: r for r in budget(STUDY)}
    assert rows["qwen3-8b"]["disk_gb_per_run"] == pytest.approx(8.19e9 * 26 / 1e9)
    assert rows["qwen3-8b"]["disk_tb"] == pytest.approx(8.19e9 * 26 * 39 / 1e12)
    assert rows["qwen3-8b"]["disk_tb_every_checkpoint"] == pytest.approx(8.19e9 * (12 * 12 + 2) * 39 / 1e12)
    every = deep_merge(STUDY["study"], {"sizes": {"qwen3-8b": {"save_total_limit": None}}})
    unbounded = rows["qwen3-8b"]["disk_tb_every_checkpoint"]
    assert budget({**STUDY, "study": every})[-1]["disk_tb"] == pytest.approx(unbounded)
    unknown = budget({**STUDY, "study": {**STUDY["study"], "parameters": {}}})
    text = markdown(unknown)
    assert all(r["disk_tb"] is None for r in unknown) and "| ? | ? |" in text and "Assumed:" in text


def test_the_pilot_dry_runs_as_cells_of_the_study_with_its_own_budget(tmp_path):
    """experiments/study-pilot.yaml: 0.6B, arms none / all / fp16 / fp32, 2 seeds -- each run the study's
    own cell (same run config, so the same collapse rule), and a budget table of its own."""
    from analysis.gpu_budget import budget, markdown

    pilot = yaml.safe_load((REPO / "experiments/study-pilot.yaml").read_text())
    check_config(pilot)
    points = study_points(pilot)
    assert sorted({p["arm"] for p in points}) == ["all", "fp16", "fp32", "none"] and pilot["study"]["seeds"] == [0, 1]
    study = {p["cell"]: p["config"] for p in study_points(STUDY)}
    assert all(p["config"] == study[p["cell"]] for p in points)  # the study's cells, collapse rule included
    rows = budget(pilot)
    assert [r["runs"] for r in rows] == [8] and 40 < rows[0]["gpu_h"] < 120
    assert "| **total** | | | | | | 8 |" in markdown(rows)
    proc = snakemake("study", "-n", "--configfile", "experiments/study-pilot.yaml", "--config",
                     f"results={tmp_path / 'r'}")
    assert proc.returncode == 0, tail(proc)
    out = proc.stdout + proc.stderr
    trains = _jobs(out, "grid_run")
    assert sorted(j["wildcards"] for j in trains) == sorted(f"record=study/qwen3-0.6b/{a}/seed{s}"
                                                             for a in ("none", "all", "fp16", "fp32") for s in (0, 1))


def test_gpu_study_settings_can_show_a_collapse():
    """Constant lr, several updates per rollout batch, long completions, an FP32 control, and the
    positive control on the smallest size only."""
    points = study_points(STUDY)
    run = points[0]["config"]
    assert run["lr_scheduler_type"] == "constant" and run["updates_per_generation"] > 1
    assert run["max_completion_length"] >= 4096 and run["task"]["name"] == "math"
    arms = {(p["model"], p["arm"]) for p in points}
    smallest = STUDY["study"]["models"][0]
    assert (smallest, "perturb-mantissa4") in arms and ("qwen3-8b", "perturb-mantissa4") not in arms
    assert all((m, "fp32") in arms for m in STUDY["study"]["models"])


# --------------------------------------------------------- stable bootstrap bounds, compact tables

def test_a_reported_probe_bound_is_the_same_for_two_bootstrap_seeds():
    """mini-m rmsnorm (16 sequences): with 2000 resamples its lower bound was +1.9 with one seed
    and -1.3 with another. With analysis.paired.BOOTSTRAP resamples, each bound shown to the
    precision its Monte Carlo error supports, two seeds give the same rounded interval."""
    import pandas as pd

    from analysis.paired import BOOTSTRAP, bound_step, fmt_change, paired_change

    probe = REFERENCE / "probe/mini-m"
    assert (probe / "rmsnorm/tokens.csv").exists(), "committed reference data missing (part of the contract)"
    arm, ref = pd.read_csv(probe / "rmsnorm/tokens.csv"), pd.read_csv(probe / "none/tokens.csv")
    shown = []
    for seed in (0, 1):
        c = paired_change(arm, ref, seed=seed)["mean_abs_dlogp"]
        shown.append(fmt_change(c["change"], c["low"], c["high"]))
        assert bound_step(c["low"], c["high"]) == 1.0  # a 110-point-wide interval: bounds to whole percent
    assert BOOTSTRAP >= 1_000_000 and shown[0] == shown[1] == "+50.9% [-1, +109]"
    # the committed table is the seed-0 one
    table = pd.read_csv(REFERENCE / "tables/study_mismatch.csv").set_index(["model", "arm"])
    row = table.loc[("mini-m", "rmsnorm")]
    assert fmt_change(row["probe_mean_abs_dlogp_change"], row["probe_mean_abs_dlogp_low"],
                      row["probe_mean_abs_dlogp_high"]) == shown[0]
    assert fmt_change(-0.5, -0.6, -0.4) == "-50.0% [-60.0, -40.0]" and fmt_change(0.1, -0.2, 0.4, resamples=0) == \
        "+10.0% [-20.0, +40.0]"


def test_committed_collapse_table_has_the_raw_terminal_reward_and_the_paper_the_compact_sensitivity():
    import pandas as pd

    from rpa.train.collapse import RULE_VERSION

    collapse = pd.read_csv(REFERENCE / "tables/study_collapse.csv")
    assert {"terminal_reward", "absorbing", "rule_version"} <= set(collapse)
    assert set(collapse["rule_version"]) == {RULE_VERSION} and collapse["absorbing"].sum() == 0
    tex = (REFERENCE / "tables/study_sensitivity.tex").read_text()
    assert tex.count("\\\\\n") == 2  # the header and the one row with a collapse (mini-l mis)
    assert "mini-l & mis" in tex and "The other 47 of 48 model x arm rows: 0/3 collapsed" in tex
    header = (REFERENCE / "tables/study_collapse.tex").read_text().split("\\midrule")[0]
    assert "raw" in header and "last 4" in header and "absorbing" in header  # (wrapped over lines)


def test_figures_facet_the_arms_by_family():
    from analysis.study.figures import arm_families

    arms = list(STUDY["study"]["arms"])
    families = arm_families(arms)
    assert sorted(a for _, members in families for a in members) == sorted(arms)  # each arm once
    assert all(len(members) <= 4 for _, members in families)
    assert arm_families(["none", "perturb-mantissa4", "odd"])[1:] == [("positive control", ["perturb-mantissa4"]),
                                                                       ("other arms", ["odd"])]
