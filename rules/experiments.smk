# Every experiment (rpa.workflow.experiments.KINDS: the GRPO grid `train`, the positive control `dose`, the
# study `study`, each stage of the collapse search `search`, each entry of `grids:`), each a set of grid
# entries in one shape, by the same rules: one writes any cell's run config (`<kind>/<cell>/run.yaml`), one
# runs any shared warm start, one runs any process group (`<kind>/<group>.json`, its record:
# rpa.workflow.runs), one writes any entry's manifest (`<kind>/[<entry>/]manifest.json`, docs/pipeline.md
# #manifests); per kind one aggregate rule (its analysis: tables and figures, each a report() output) and its
# target (train_all, dose_response, study, collapse_<stage>, grids), and per preset kind (dose, study) one more
# over the `grids:` entries of that kind (`kind: dose`: tables/grids/<entry>/dose.csv, ...). The cells come
# from the Snakefile's check_config as CELLS, their process groups as GRID_GROUPS (rules/common.smk).

# every cell by its directory under the results: `train/...`, `dose/...`, `study/...`, `search/...`,
# `grids/...`
GRID_CELLS = {f"{section}/{c.name}": c for section in GRID_SECTIONS for c in CELLS[section]}
# every shared warm start by its directory under the results, with the cells that start from it
GRID_WARM_STARTS = {}
for _cell in GRID_CELLS.values():
    if _cell.init is not None:
        GRID_WARM_STARTS.setdefault(_cell.init.dir.removeprefix(f"{R}/"), []).append(_cell)
# every entry's folder under the results (`train`, `search/pilot`, `grids/<name>`, ...) -> (kind, entry name)
GRID_ENTRIES = {"/".join([kind, *([name] if name else [])]): (kind, name)
                for kind in GRID_SECTIONS for name in entries(config, kind)}


def _one_of(names):
    return "|".join(map(re.escape, names)) or "(?!)"


def kind_outputs(kind, entry=None):
    """The tables and figures of an entry of section ``kind`` (its aggregate rule's outputs) by name."""
    return {name: f"{R}/{path}".replace("{format}", FIGURES["format"])
            for name, path in outputs_of_entry(config, kind, entry).items()}


def aggregate_command(kind, section, wildcards, output):
    """The analysis command of one aggregate job of ``kind`` over an entry of ``section`` (``Kind.analysis``
    with its placeholders filled; a `grids:` entry of a preset kind: pointed at the entry by ``Kind.entry_args``)."""
    from types import SimpleNamespace

    entry = getattr(wildcards, "entry", "") or ""
    log = f"{R}/logs/{KINDS[section].log}".replace("{entry}", entry)
    paths = entry_paths(R, entry) if kind != section else {"tables": f"{R}/tables"}
    scope = KINDS[kind].entry_args.format(**paths) if kind != section else ""
    params = SimpleNamespace(results=R, format=FIGURES["format"], tables=paths["tables"], scope=scope)
    return KINDS[kind].analysis.format(params=params, output=output, wildcards=wildcards, log=log)


def study_outputs(wildcards=None):
    return list(kind_outputs("study").values()) if CELLS["study"] else []


# ---------------------------------------------------------------- manifests, tables, figures, targets

# one-line jobs that write a file from the config: run by Snakemake itself, never submitted
localrules:
    manifest,


def manifest_text(entry):
    from rpa.workflow.manifest import dumps

    kind, name = GRID_ENTRIES[entry]
    return dumps(manifest(config, kind, name, CELLS[kind]))


rule manifest:
    output:
        f"{R}/{{entry,{_one_of(GRID_ENTRIES)}}}/manifest.json",
    params:
        text=lambda wc: manifest_text(wc.entry),
    shell:
        WRITE_TEXT


def aggregates():
    """Each aggregate rule: (its name, the kind whose analysis it runs, the section whose entries it tables,
    their names (None: the section's one entry), its outputs by name under the results): one per kind over
    its own section (a `grids:` section: its plain entries), one per preset kind over the `grids:` entries of
    that kind."""
    for kind in KINDS.values():
        names = None
        if kind.name in MULTI_GRID_SECTIONS:
            names = [n for n, e in written_entries(config, kind.name).items() if entry_kind(kind.name, e) == kind.name]
        yield f"{kind.name}_aggregate", kind, kind.name, names, kind.outputs
    for name in PRESETS:
        names = [n for n, e in written_entries(config, "grids").items() if entry_kind("grids", e) == name]
        yield f"grids_{name}_aggregate", KINDS[name], "grids", names, entry_outputs(name)


for _rule, _kind, _section, _names, _outputs in aggregates():
    _multi = _names is not None
    _outputs = {name: f"{R}/{path}".replace("{format}", FIGURES["format"]) for name, path in _outputs.items()}
    if _multi:  # the entry's name a wildcard, constrained to the section's entries of this kind
        _first = next(iter(_outputs))
        _outputs[_first] = _outputs[_first].replace("{entry}", f"{{entry,{_one_of(_names)}}}", 1)
    _outputs = {name: report(path, caption=f"report/{_kind.name}.rst", category=_kind.category,
                             **({"subcategory": "{entry}"} if _multi else {}))
                if name in _kind.report else path for name, path in _outputs.items()}

    rule:
        name:
            _rule
        input:
            runs=lambda wc, section=_section: grid_records(section, getattr(wc, "entry", None)),
            # (none where the config has no such section: the committed cpu reference's GRPO and dose tables are
            # made under experiments/toys.yaml, from its committed runs)
            manifest=f"{R}/{_section}/{{entry}}/manifest.json" if _multi else
            [f"{R}/{_section}/manifest.json"] if CELLS[_section] else [],
            more=[f"{R}/{path}" for path in _kind.inputs],
        output:
            **_outputs,
        params:
            # the kind's command line, made per job: a directive that names the loop's `_kind` would read its last
            # value when the job runs (Snakemake evaluates `shell:` then, in this file's namespace)
            command=lambda wc, output, kind=_kind.name, section=_section: aggregate_command(kind, section, wc, output),
        log:
            f"{R}/logs/{KINDS[_section].log}",
        conda:
            ENV
        shell:
            "{params.command}"


# each kind's targets: all its tables and figures (a search stage's each: collapse_<stage>; `grids`: every entry's,
# a preset kind's included)
for _kind in KINDS.values():
    _names = list(written_entries(config, _kind.name)) if _kind.name in MULTI_GRID_SECTIONS else []
    if "{entry}" in _kind.target:
        for _name in _kind.target_entries:

            rule:
                name:
                    _kind.target.format(entry=_name)
                input:
                    list(kind_outputs(_kind.name, _name).values()) if _name in _names else [],

    else:

        rule:
            name:
                _kind.target
            input:
                [f for name in (_names if _kind.name in MULTI_GRID_SECTIONS else ([None] if CELLS[_kind.name] else []))
                 for f in kind_outputs(_kind.name, name).values()],


# ---------------------------------------------------------------- the runs


def grid_priority(cells):
    """A study cell's run config and its model's warm start: before the work they unlock (the model's
    STUDY_PRIORITY); 0 for the other grids."""
    return max((STUDY_PRIORITY.get(c.labels["model"], 0) for c in cells if c.grid == "study"), default=0)


# one-line jobs that write a file from the config: run by Snakemake itself, never submitted
localrules:
    grid_run_file,


rule grid_run_file:
    output:
        f"{R}/{{run,{_one_of(GRID_CELLS)}}}/run.yaml",
    params:
        # the validated run config in full (TrainConfig.to_dict: every option, its value or default),
        # the same TrainConfig rpa train reads back
        text=lambda wc: yaml_text(GRID_CELLS[wc.run].run.to_dict()),
    # a file written in milliseconds that a job waits for: before the jobs, or a job of many runs
    # would wait for its configs to be written a slot's turn at a time
    priority: lambda wc: grid_priority([GRID_CELLS[wc.run]])
    shell:
        WRITE_TEXT


rule grid_warm_start:
    input:
        lambda wc: model_files(GRID_WARM_STARTS[wc.init][0].model),
    output:
        f"{R}/{{init,{_one_of(GRID_WARM_STARTS)}}}/config.json",
    params:
        out=lambda wc: f"{R}/{wc.init}",
        cfg=lambda wc: f"{R}/{wc.init}.yaml",
        text=lambda wc: yaml_text(dict(GRID_WARM_STARTS[wc.init][0].init.config)),
    log:
        f"{R}/logs/{{init}}.log",
    priority: lambda wc: grid_priority(GRID_WARM_STARTS[wc.init])
    conda:
        ENV
    resources:
        mem_mb=4000,
        runtime=60,
    shell:
        WARM_START


# ---------------------------------------------------------------- the runs, one process per group

def group_resources(record):
    """A group's resources (rpa.workflow.resources.group_resources): its first run's, the runtime the sum
    of its runs'."""
    section, group = GRID_GROUPS[record]
    return resources_of_group(config, section, entry_of(config, section, group.cells[0]), group.cells)


def group_dirs(record):
    section, group = GRID_GROUPS[record]
    return [f"{R}/{section}/{c.name}" for c in group.cells]


def group_start(wildcards):
    """The checkpoints a group's runs start from: their shared warm starts, else their models."""
    section, group = GRID_GROUPS[wildcards.record]
    files = sorted({f"{c.init.dir}/config.json" for c in group.cells if c.init}
                   | {f for c in group.cells if not c.init for f in model_files(c.model)})
    # a digest-named warm start (or a model) is the same checkpoint when rebuilt: ancient, so that committed
    # runs restored into place are not made stale by it (rpa.workflow.experiments.ancient_start)
    return [ancient(f) for f in files] if ancient_start(config, section, group.cells[0]) else files


def group_command(wildcards, input):
    """``rpa train`` on the group's GPUs for its runs: one process, or (one run) accelerate with its
    multi-GPU config."""
    res = group_resources(wildcards.record)
    runs = " ".join(f"--config {d}/run.yaml --out {d}" for d in group_dirs(wildcards.record))
    if res["launch"] == "single":
        cmd = f"rpa train {runs}"
    else:
        cmd = (f"accelerate launch --config_file experiments/accelerate/{res['launch']}.yaml "
               f"--num_processes {res['gpu']} -m rpa.cli train {runs}")
    return gpu_launch(res["gpu"]) + cmd


def group_retries(record):
    section, group = GRID_GROUPS[record]
    return entry_of(config, section, group.cells[0])["transient_retries"]


def group_priority(record):
    """The study's by STUDY_PRIORITY; every other group its minutes of training (the longest first)."""
    section, group = GRID_GROUPS[record]
    if section == "study":
        return STUDY_PRIORITY[group.name]
    return group_resources(record)["runtime"]


rule grid_run:
    input:
        cfgs=lambda wc: [f"{d}/run.yaml" for d in group_dirs(wc.record)],
        start=group_start,
    output:
        # the job's record, written once every run has its summary.json (each run writes one for every
        # end: ok, collapsed, error -- a failed run is a result the tables show as failed, except one
        # stopped for a reason worth retrying (out of memory, a lost process), which fails the job up to
        # transient_retries times so that it runs again and resumes); the summaries are not the job's
        # outputs, so a job stopped half-way keeps its finished runs and its rerun does only the rest
        # (a killed run resumes from its checkpoint, a finished one does nothing)
        f"{R}/{{record,{_one_of(GRID_GROUPS)}}}.json",
    params:
        command=group_command,
        dirs=lambda wc: " ".join(group_dirs(wc.record)),
        retries=lambda wc: group_retries(wc.record),
    log:
        f"{R}/logs/{{record}}.log",
    priority: lambda wc: group_priority(wc.record)
    conda:
        ENV
    resources:
        gpu=lambda wc: group_resources(wc.record)["gpu"],
        mem_mb=lambda wc: group_resources(wc.record)["mem_mb"],
        runtime=lambda wc: group_resources(wc.record)["runtime"],
        cpus_per_task=lambda wc: group_resources(wc.record)["cpus_per_task"],
    shell:
        # `;`: the record decides, from the runs' summaries, whether the job failed
        "{params.command} > {log} 2>&1; python -m rpa.workflow.runs --out {output} {params.dirs} "
        "--transient-retries {params.retries} >> {log} 2>&1"
