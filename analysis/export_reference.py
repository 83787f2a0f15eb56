"""Copy the small raw results of a pipeline run into ``results/reference/<name>/``.

    python -m analysis.export_reference --results results/cpu --out results/reference/cpu --what dose
    python -m analysis.export_reference --results results/cpu --out results/reference/cpu --what train
    python -m analysis.export_reference --results results/study-cpu --out results/reference/study-cpu --what study
    python -m analysis.export_reference --results results/collapse-cpu --out results/reference/collapse-cpu --what search
    python -m analysis.export_reference --results results/cpu --out results/reference/main --what pipeline
    python -m analysis.export_reference --results results/toys --out results/reference/cpu --what pipeline

``pipeline`` is the probe pipeline of ``make main``: each parity report, each probe's
``summary.json`` and ``tokens.csv`` (restricted as below), each probe cell at another sampling setting's
``summary.json`` and ``split.csv`` (``probe-sampling/``), each diagnosis' ``summary.json`` and
``layers.csv``, each attribution's ``summary.json``, ``tokens.csv`` and ``ops.csv``, and its
tables and figures.

Per run directory: ``run.yaml``, ``config.json``, ``summary.json``, ``eval.jsonl`` and ``metrics.jsonl``
restricted to :data:`METRIC_KEYS` (what the analyses and the collapse verdict read; the full
logs stay in ``results/``), and the job records of the exported runs (:func:`copy_records`); per
probe: ``summary.json`` and ``tokens.csv`` restricted to
:data:`TOKEN_COLUMNS`; the stage's tables and figures. No checkpoints, no models. An export
replaces what it exports: the whole ``dose``/``study`` folder, or, for ``search``, each stage
the results folder has a manifest of (the other stages' committed runs stay), and its decode probes
(``decode/<config>/``: ``summary.json``, ``tokens.csv`` with the trainer's own decode,
:data:`DECODE_TOKEN_COLUMNS`). Every grid's manifest goes with its runs (``<what>/manifest.json``; a search
stage's or a ``grids:`` entry's ``<what>/<entry>/manifest.json``): the tables are read from it
(:func:`analysis.runs.runs_table`).
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from pathlib import Path

from analysis.runs import ended_runs
from rpa.core.jsonfiles import read_jsonl, write_json, write_text
from rpa.core.provenance import cpu_info, recorded_cpus

METRIC_KEYS = ("step", "reward", "reward_std", "loss", "grad_norm", "entropy", "completions/mean_length",
               "clip_ratio/region_mean", "mismatch/tokens", "mismatch/mean_abs_dlogp", "mismatch/kl_k3",
               "mismatch/seq_log_ratio_mean_abs", "mismatch/frac_ratio_outside", "mismatch/phantom_clip_rate",
               "mismatch/nonfinite_sampler_logprobs", "sync/mean_abs_dlogp", "sync/over_tolerance",
               "fp16/loss_scale", "fp16/skipped_step")
TOKEN_COLUMNS = ("seq", "position", "token_id", "logp_trainer", "logp_sampler", "p_sampler", "logp_trainer_batch",
                 "entropy_trainer")
DECODE_TOKEN_COLUMNS = (*TOKEN_COLUMNS, "logp_trainer_decode")
"""A search's decode probes (``rpa probe --decode-sequences``, ``<results>/decode/<config>/``): the probe's
columns and the trainer's own KV-cached decode."""
TABLES = {"train": ("train.csv", "train.md"),
          "dose": ("dose.csv", "dose.md", "dose_runs.csv", "dose_sensitivity.csv"),
          "study": ("study_collapse.csv", "study_collapse.md", "study_collapse.tex", "study_mismatch.csv",
                    "study_mismatch.md", "study_mismatch.tex", "study_sensitivity.csv", "study_sensitivity.md",
                    "study_sensitivity.tex", "probe.csv", "probe.md"),
          "search": tuple(f"search_{stage}.{ext}" for stage in ("pilot", "grid", "ablation", "lever")
                          for ext in ("csv", "md", "json")),
          "pipeline": ("probe.csv", "probe.md", "probe_sampling.csv", "probe_sampling.md", "diagnose.csv",
                       "attribution.csv", "attribution.md",
                       "attribution_ops.csv")}
FIGURES = {"train": ("train_curves",), "dose": ("dose_response",), "study": ("study_rewards", "study_accuracy", "study_mismatch_curves",
                                                 "study_heatmap", "mismatch"),
           "search": tuple(f"search_{stage}" for stage in ("pilot", "grid", "ablation", "lever")),
           "pipeline": ("mismatch", "dlogp_vs_prob", "layers", "attribution"), "grids": ()}
GRIDS = ("train", "dose", "study", "search", "grids")
"""What a grid export can be: each kind of grid, under its own folder of the results."""


def copy_run(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("run.yaml", "config.json", "summary.json", "eval.jsonl"):  # run.yaml: what Snakemake wrote
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)
    if (src / "metrics.jsonl").exists():
        lines = read_jsonl(src / "metrics.jsonl")
        write_text(dst / "metrics.jsonl", "".join(json.dumps({k: r[k] for k in METRIC_KEYS if k in r}) + "\n"
                                                   for r in lines))


def copy_records(results: Path, out: Path, what: str) -> int:
    """Copy the job records (:mod:`rpa.workflow.runs`, ``<group>.json`` beside its run directories)
    of the groups whose every run was exported: with them a complete committed grid copied into
    place has nothing to do (a record is its job's output). The number copied."""
    copied = 0
    for record in sorted(p for p in (results / what).glob("**/seed*.json") if p.is_file()):
        try:
            dirs = [Path(r["dir"]).relative_to(results) for r in json.loads(record.read_text())["runs"]]
        except (ValueError, KeyError):  # a record of another results folder's runs
            continue
        if all((out / d / "summary.json").exists() for d in dirs):
            shutil.copy2(record, out / record.relative_to(results))
            copied += 1
    return copied


def copy_probe(src: Path, dst: Path, columns: tuple[str, ...] = TOKEN_COLUMNS) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src / "summary.json", dst / "summary.json")
    with open(src / "tokens.csv") as f_in, open(dst / "tokens.csv", "w", newline="") as f_out:
        writer = csv.DictWriter(f_out, fieldnames=list(columns))
        writer.writeheader()
        for row in csv.DictReader(f_in):
            writer.writerow({k: row.get(k, "") for k in columns})  # older probes: no entropy column


def export_pipeline(results: Path, out: Path) -> int:
    """The probe pipeline's parity reports, probes and diagnoses (what its tables are made from)."""
    for folder in ("parity", "probe", "probe-sampling", "diagnose", "attribution"):
        shutil.rmtree(out / folder, ignore_errors=True)  # no stale cells from an earlier export
    reports = sorted((results / "parity").glob("*.json"))
    for report in reports:
        (out / "parity").mkdir(parents=True, exist_ok=True)
        shutil.copy2(report, out / "parity" / report.name)
    probes = sorted(p.parent for p in (results / "probe").glob("*/*/summary.json"))
    for probe in probes:
        copy_probe(probe, out / probe.relative_to(results))
    diagnoses = sorted(p.parent for p in (results / "diagnose").glob("*/*/summary.json"))
    for diagnosis in diagnoses:
        dst = out / diagnosis.relative_to(results)
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "layers.csv"):
            shutil.copy2(diagnosis / name, dst / name)
    attributions = sorted(p.parent for p in (results / "attribution").glob("*/*/summary.json"))
    for attribution in attributions:
        dst = out / attribution.relative_to(results)
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "tokens.csv", "ops.csv"):
            shutil.copy2(attribution / name, dst / name)
    sampled = sorted(p.parent for p in (results / "probe-sampling").glob("*/*/*/summary.json"))
    for cell in sampled:  # the gap beyond rounding: what its table reads
        dst = out / cell.relative_to(results)
        dst.mkdir(parents=True, exist_ok=True)
        for name in ("summary.json", "split.csv"):
            shutil.copy2(cell / name, dst / name)
    return len(reports) + len(probes) + len(sampled) + len(diagnoses) + len(attributions)


def check_one_cpu_type(results: Path, out: Path) -> None:
    """Refuse, before anything is copied, an export that would put results of two CPU types into one
    reference (what ``out`` holds already and what ``results`` brings)."""
    recorded = {**recorded_cpus(out)[0], **recorded_cpus(results)[0]} if out.exists() else recorded_cpus(results)[0]
    if len(recorded) > 1:
        raise SystemExit(f"export: {out} would hold results of {len(recorded)} CPU types "
                         f"({'; '.join(str(c) for c in recorded.values())}); BF16 bits differ between them: "
                         "export each type into a reference of its own")


def write_machine(out: Path) -> dict:
    """``machine.json``: the CPU type the exported results were made on (:func:`rpa.core.provenance.cpu_info`,
    as each exported ``summary.json`` records it in its provenance), which :mod:`analysis.check_tables`
    compares a fresh run's CPU with. Where no exported result records a CPU (made before provenance did), the
    exporting machine's is written and ``source`` says so."""
    recorded, unrecorded = recorded_cpus(out)
    if len(recorded) > 1:
        raise SystemExit(f"export: {out} holds results of {len(recorded)} CPU types")
    if recorded:
        machine = {"cpu": next(iter(recorded.values())), "source": "the results' provenance",
                   "results_without_cpu": unrecorded}
    else:
        machine = {"cpu": cpu_info(), "source": "the exporting machine (no exported result records its CPU)",
                   "results_without_cpu": unrecorded}
    write_json(out / "machine.json", machine)
    return machine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--what", choices=(*GRIDS, "pipeline"), required=True)
    args = parser.parse_args()
    check_one_cpu_type(args.results, args.out)
    if args.what == "pipeline":
        cells = export_pipeline(args.results, args.out)
        if not cells:
            raise SystemExit(f"export: no parity, probe or diagnosis under {args.results}")
        _copy_outputs(args)
        write_machine(args.out)
        print(f"export: {cells} parity reports, probes and diagnoses -> {args.out}")
        return
    tree = args.results / args.what
    runs = [tree / run for run in ended_runs(tree) if "init" not in run.parts]  # shared warm starts: no
    if not runs:
        raise SystemExit(f"export: no runs under {tree}")
    manifests = manifests_of(args.results, args.what)
    if args.what in ("search", "grids"):  # stages run in sittings from different results folders: replace the exported ones only
        stale = [args.out / args.what / m.parent.name for m in manifests]
        stale += [args.out / "decode"] if (args.results / "decode").is_dir() else []
    else:
        stale = [args.out / folder for folder in ((args.what, "probe") if args.what == "study" else (args.what,))]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)  # no stale runs from an earlier export
    for run in runs:
        copy_run(run, args.out / run.relative_to(args.results))
    records = copy_records(args.results, args.out, args.what)
    for manifest in manifests:
        shutil.copy2(manifest, args.out / manifest.relative_to(args.results))
    if args.what == "search":
        for probe in sorted((args.results / "decode").glob("*/summary.json")):
            copy_probe(probe.parent, args.out / probe.parent.relative_to(args.results), DECODE_TOKEN_COLUMNS)
    if args.what == "study":
        for probe in sorted((args.results / "probe").glob("*/*/tokens.csv")):
            copy_probe(probe.parent, args.out / probe.parent.relative_to(args.results))
    _copy_outputs(args)
    write_machine(args.out)
    print(f"export: {len(runs)} runs, {records} job records -> {args.out}")


def manifests_of(results: Path, what: str) -> list[Path]:
    """The manifests of the grids ``what`` names (rpa/workflow/manifest.py): ``<what>/manifest.json``, or for
    a section of several grids each entry's; refused where there is none (no table can be made of the runs)."""
    found = sorted((results / what).glob("*/manifest.json" if what in ("search", "grids") else "manifest.json"))
    if not found:
        raise SystemExit(f"export: no manifest under {results / what} (the workflow writes one per grid, from the "
                         f"config: rerun its manifest rule)")
    return found


def _copy_outputs(args: argparse.Namespace) -> None:
    """The exported part's tables and figures (those that exist)."""
    if args.what == "grids":
        for table in sorted((args.results / "tables" / "grids").glob("*")):
            (args.out / "tables" / "grids").mkdir(parents=True, exist_ok=True)
            shutil.copy2(table, args.out / "tables" / "grids" / table.name)
    for folder, names, ext in (("tables", TABLES[args.what], ""), ("figures", FIGURES[args.what], ".png")):
        (args.out / folder).mkdir(parents=True, exist_ok=True)
        for name in names:
            if (args.results / folder / f"{name}{ext}").exists():
                shutil.copy2(args.results / folder / f"{name}{ext}", args.out / folder / f"{name}{ext}")


if __name__ == "__main__":
    main()
