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
:data:`TOKEN_COLUMNS`; the stage's tables and figures. No checkpoints, no models.

Nothing is removed before everything is in hand: the export is built in a staging folder beside the reference
(``.<name>.exporting``), then swapped in by renames (a swap killed half-way is completed by the next export); a
results folder that is the reference or nested with it is refused, and so is an export that would leave a folder of
the reference with fewer finished results than it holds (``--allow-fewer`` does it and says so); one export into a
reference at a time. Each refusal is one line, exit 2, the reference untouched. An export
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
import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path

from analysis.refusal import Refused, run
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


PIPELINE_FOLDERS = ("parity", "probe", "probe-sampling", "diagnose", "attribution")
"""What a ``pipeline`` export replaces in the reference, each folder as a whole (no stale cell of an earlier export
stays beside the new ones)."""


def export_pipeline(results: Path, out: Path) -> int:
    """The probe pipeline's parity reports, probes and diagnoses (what its tables are made from), into ``out``
    (the export's staging folder: nothing of the reference is touched here)."""
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
        raise Refused(f"export: {out} would hold results of {len(recorded)} CPU types "
                         f"({'; '.join(str(c) for c in recorded.values())}); BF16 bits differ between them: "
                         "export each type into a reference of its own")


def write_machine(out: Path) -> dict:
    """``machine.json``: the CPU type the exported results were made on (:func:`rpa.core.provenance.cpu_info`,
    as each exported ``summary.json`` records it in its provenance), which :mod:`analysis.check_tables`
    compares a fresh run's CPU with. Where no exported result records a CPU (made before provenance did), the
    exporting machine's is written and ``source`` says so."""
    recorded, unrecorded = recorded_cpus(out)
    if len(recorded) > 1:
        raise Refused(f"export: {out} holds results of {len(recorded)} CPU types")
    if recorded:
        machine = {"cpu": next(iter(recorded.values())), "source": "the results' provenance",
                   "results_without_cpu": unrecorded}
    else:
        machine = {"cpu": cpu_info(), "source": "the exporting machine (no exported result records its CPU)",
                   "results_without_cpu": unrecorded}
    write_json(out / "machine.json", machine)
    return machine


def check_paths(results: Path, out: Path) -> None:
    """Refuse an export whose results folder is the reference or lies inside it, or the other way round: the
    export replaces folders of ``out`` by copies from ``results``, and one folder named twice loses both."""
    if not results.is_dir():
        raise Refused(f"export: --results {results} is not a folder of results")
    if out.exists() and not out.is_dir():
        raise Refused(f"export: --out {out} is a file, not a reference folder")
    src, dst = results.resolve(), out.resolve()
    if src == dst:
        raise Refused(f"export: --results and --out are one folder ({src}); export into another folder")
    if dst.is_relative_to(src) or src.is_relative_to(dst):
        inner, outer = (dst, src) if dst.is_relative_to(src) else (src, dst)
        raise Refused(f"export: --results and --out are nested ({inner} is inside {outer}); export into a folder "
                      f"beside the results")


def finished_results(folder: Path) -> int:
    """The finished results under ``folder`` (a run, probe or other cell each writes its ``summary.json`` last; a
    parity report is one file): what an export must not lose without being asked to."""
    if not folder.exists():
        return 0
    if folder.is_file():
        return 1
    return sum(1 for _ in folder.rglob("summary.json")) + sum(1 for _ in folder.glob("*.json")
                                                             if folder.name == "parity")


def check_not_fewer(out: Path, stage: Path, replaced: list[str], allow_fewer: bool) -> list[str]:
    """Refuse to replace a folder of the reference by one with fewer finished results (an export of a results folder
    holding 2 of a grid's 24 runs over the complete reference), unless ``allow_fewer``; the lines saying what such
    an export drops."""
    counted = [(rel, finished_results(out / rel), finished_results(stage / rel)) for rel in replaced]
    fewer = [(rel, had, has) for rel, had, has in counted if has < had]
    said = [f"export: {out / rel} had {had} finished results, now {has}" for rel, had, has in fewer]
    if fewer and not allow_fewer:
        rel, had, has = fewer[0]
        more = f" (and {len(fewer) - 1} more folders)" if len(fewer) > 1 else ""
        raise Refused(f"export: {out / rel} holds {had} finished results and the export brings {has}{more}; "
                      f"nothing was changed (--allow-fewer replaces them all the same)")
    return said


def stage_folder(out: Path) -> Path:
    """Where an export builds what it will put into ``out``: beside it, on its file system (the swap is renames)."""
    return out.parent / f".{out.name}.exporting"


SWAP_JOURNAL = "swap.json"
"""In the staging folder once everything is in hand: the paths (relative to the reference) the export puts into
place. A swap killed half-way is completed by the next export into the same reference, from this list."""


def swap_in(stage: Path, out: Path) -> list[str]:
    """Put each path the journal names from ``stage`` into ``out`` (what it replaces moved to ``stage/.old`` first),
    then remove ``stage``. Safe to run again after a kill: a path already placed is skipped."""
    replaced = json.loads((stage / SWAP_JOURNAL).read_text())
    for rel in replaced:
        new, dst, old = stage / rel, out / rel, stage / ".old" / rel
        if not new.exists() and not new.is_symlink():
            continue  # placed by an earlier, killed swap
        if dst.exists() or dst.is_symlink():
            old.parent.mkdir(parents=True, exist_ok=True)
            os.replace(dst, old)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(new, dst)
    shutil.rmtree(stage)
    return replaced


@contextmanager
def export_lock(out: Path):
    """One export into ``out`` at a time (an ``flock`` beside it that dies with its process)."""
    import fcntl

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.export.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Refused(f"export: another export into {out} is running; wait for it to finish") from None
        yield


def export(results: Path, out: Path, what: str, allow_fewer: bool = False) -> str:
    """Export ``what`` of ``results`` into the reference ``out``: everything it writes is first built in a staging
    folder beside ``out``; only then, if no folder would end with fewer finished results (unless ``allow_fewer``),
    are the replaced folders and files swapped in by renames. Nothing of ``out`` is removed before all of it is in
    hand; a killed export leaves ``out`` as it was (or, killed during the swap, is completed by the next one). The
    line said at the end."""
    check_paths(results, out)
    check_one_cpu_type(results, out)
    with export_lock(out):
        stage = stage_folder(out)
        if (stage / SWAP_JOURNAL).is_file():
            swap_in(stage, out)  # an earlier export had everything in hand and was killed while swapping
            print(f"export: completed the interrupted export into {out}", file=sys.stderr)
        shutil.rmtree(stage, ignore_errors=True)  # a killed build: only copies, nothing of out
        stage.mkdir(parents=True)
        try:
            replaced, said = build(results, stage, what)
            folders = [r for r in replaced if not r.startswith(("tables/", "figures/"))]
            for line in check_not_fewer(out, stage, folders, allow_fewer):
                print(line, file=sys.stderr)
            write_json(stage / SWAP_JOURNAL, replaced)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)  # refused or killed before the swap: out untouched
            raise
        swap_in(stage, out)
    write_machine(out)
    return said


def build(results: Path, stage: Path, what: str) -> tuple[list[str], str]:
    """Copy what an export of ``what`` writes into ``stage`` (laid out as the reference is): the paths (relative to
    the reference) it replaces, and the line to say. Refused where there is nothing to export."""
    if what == "pipeline":
        cells = export_pipeline(results, stage)
        if not cells:
            raise Refused(f"export: no parity, probe or diagnosis under {results}")
        replaced = list(PIPELINE_FOLDERS)
        said = f"export: {cells} parity reports, probes and diagnoses"
    else:
        tree = results / what
        runs = [tree / r for r in ended_runs(tree) if "init" not in r.parts]  # shared warm starts: no
        if not runs:
            raise Refused(f"export: no runs under {tree}")
        manifests = manifests_of(results, what)
        if what in ("search", "grids"):  # stages run in sittings from different results folders: replace those only
            replaced = [f"{what}/{m.parent.name}" for m in manifests]
            replaced += ["decode"] if (results / "decode").is_dir() else []
        else:
            replaced = ["study", "probe"] if what == "study" else [what]
        for one in runs:
            copy_run(one, stage / one.relative_to(results))
        records = copy_records(results, stage, what)
        for manifest in manifests:
            (stage / manifest.relative_to(results)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(manifest, stage / manifest.relative_to(results))
        if what == "search":
            for probe in sorted((results / "decode").glob("*/summary.json")):
                copy_probe(probe.parent, stage / probe.parent.relative_to(results), DECODE_TOKEN_COLUMNS)
        if what == "study":
            for probe in sorted((results / "probe").glob("*/*/tokens.csv")):
                copy_probe(probe.parent, stage / probe.parent.relative_to(results))
        said = f"export: {len(runs)} runs, {records} job records"
    for rel in replaced:  # a folder the export brings nothing to replaces the old one all the same (empty)
        (stage / rel).mkdir(parents=True, exist_ok=True)
    replaced += _copy_outputs(results, stage, what)
    return replaced, said


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, type=Path, help="the results folder a pipeline or grid wrote")
    parser.add_argument("--out", required=True, type=Path, help="the reference folder, results/reference/<name>")
    parser.add_argument("--what", choices=(*GRIDS, "pipeline"), required=True)
    parser.add_argument("--allow-fewer", action="store_true",
                        help="replace a folder of the reference even where the export brings fewer finished results "
                             "(each such folder is said)")
    args = parser.parse_args(argv)
    said = export(args.results, args.out, args.what, allow_fewer=args.allow_fewer)
    print(f"{said} -> {args.out}")
    return 0


def manifests_of(results: Path, what: str) -> list[Path]:
    """The manifests of the grids ``what`` names (rpa/workflow/manifest.py): ``<what>/manifest.json``, or for
    a section of several grids each entry's; refused where there is none (no table can be made of the runs)."""
    found = sorted((results / what).glob("*/manifest.json" if what in ("search", "grids") else "manifest.json"))
    if not found:
        raise Refused(f"export: no manifest under {results / what} (the workflow writes one per grid, from the "
                         f"config: rerun its manifest rule)")
    return found


def _copy_outputs(results: Path, stage: Path, what: str) -> list[str]:
    """The exported part's tables and figures (those that exist), into ``stage``: the paths they take in the
    reference (each replaced as a file; the tables of ``grids`` entries as the folder ``tables/grids``)."""
    placed = []
    if what == "grids" and (results / "tables" / "grids").is_dir():
        shutil.copytree(results / "tables" / "grids", stage / "tables" / "grids")
        placed.append("tables/grids")
    for folder, names, ext in (("tables", TABLES[what], ""), ("figures", FIGURES[what], ".png")):
        for name in names:
            if (results / folder / f"{name}{ext}").is_file():
                (stage / folder).mkdir(parents=True, exist_ok=True)
                shutil.copy2(results / folder / f"{name}{ext}", stage / folder / f"{name}{ext}")
                placed.append(f"{folder}/{name}{ext}")
    return placed


if __name__ == "__main__":
    raise SystemExit(run(main))
