"""The models of a pipeline config and the job files of its one-cell commands.

A ``models`` entry is one kind (:data:`MODEL_KINDS`) and loads from one place
(:func:`model_location`); the parity, probe, diagnosis and attribution cells each run ``rpa
<command> --config JOB``, their job file made here from the config (:func:`probe_job`, ...), and the
one-line jobs that build or convert a model get their flags here (:func:`tiny_flags`, ...).
"""

from __future__ import annotations

import shlex
from dataclasses import fields
from typing import Any

from rpa.core.numerics_config import NumericsConfig


MODEL_KINDS = ("tiny", "path", "gguf")
"""What a ``models`` entry is: built here (``tiny``: :class:`~rpa.sides.tiny.TinySpec` fields),
converted here from a GGUF file (``gguf``: :class:`~rpa.sides.convert.GgufSource` fields), or
loaded where it is (``path``: a local directory or hub id)."""


def model_kind(spec: dict[str, Any]) -> str:
    """``tiny``, ``gguf`` or ``path``: the one kind key of a ``models`` entry (the schema requires one)."""
    return next(k for k in MODEL_KINDS if k in spec)


def model_location(config: dict[str, Any], name: str) -> str:
    """Where a model of ``models`` is loaded from: built or converted here (``tiny``, ``gguf``), or
    its ``path``."""
    spec = config["models"][name]
    return spec["path"] if model_kind(spec) == "path" else f"{config['results']}/models/{name}"


def model_configs(config: dict[str, Any], model: str) -> list[str]:
    """The probe configurations ``model`` runs, in ``probe.configs`` order: its own
    ``models.<name>.probe.configs`` where given (the tiny models of the main job keep only the
    parity gate's and a few), else every one."""
    own = (config["models"][model].get("probe") or {}).get("configs")
    return [name for name in config["probe"]["configs"] if own is None or name in own]


def model_probe(config: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The ``probe:`` section with the model's own ``models.<name>.probe`` options on top (a
    real model samples longer completions from a task's prompts than the tiny ones)."""
    own = dict(((config["models"].get(model) or {}).get("probe") or {}) if model else {})
    own.pop("task", None)  # its prompts reach the probe as a prompts file (:func:`prompts_task`)
    own.pop("configs", None)  # which configurations, not an option of each (:func:`model_configs`)
    own.pop("sampling", None)  # other cells, with their own settings (:func:`sampling_settings`)
    return {**config["probe"], **own}


def sampling_settings(config: dict[str, Any], model: str) -> dict[str, Any]:
    """``model``'s probe cells at other sampling settings (``models.<name>.probe.sampling``): label ->
    :class:`~rpa.core.sampling.SamplingSettings`, in the order written; empty where it has none."""
    from rpa.core.sampling import SamplingSettings

    sampling = (config["models"][model].get("probe") or {}).get("sampling") or {}
    settings = [SamplingSettings(**s) for s in sampling.get("settings") or ()]
    return {s.label: s for s in settings}


def sampling_cells(config: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(model, setting label, configuration) of every probe cell at another sampling setting."""
    return [(m, label, c) for m in config["models"] for label in sampling_settings(config, m)
            for c in config["models"][m]["probe"]["sampling"]["configs"]]


def sampling_probe_job(config: dict[str, Any], model: str, numerics: str, setting: str, completions: str | None,
                       device: str, name: str, prompts_file: str | None = None) -> dict:
    """The ``rpa probe --config`` file of one cell at sampling setting ``setting`` (a label of
    :func:`sampling_settings`): the model's probe cell with the setting's fields and the split."""
    import dataclasses

    settings = sampling_settings(config, name)[setting]
    job = probe_job(config, model, numerics, completions, device, name=name, prompts_file=prompts_file)
    split = config["models"][name]["probe"]["sampling"]["split_sequences"]
    return {**job, **dataclasses.asdict(settings), "split_sequences": split}


def prompts_task(config: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The task (TaskSpec fields) whose prompts ``model``'s probe samples from, or None (the
    built-in prompts); ``num_prompts`` and ``seed`` default to the probe's ``prompts`` and ``seed``."""
    task = ((config["models"][model].get("probe") or {}).get("task"))
    if task is None:
        return None
    probe = model_probe(config, model)
    return {"num_prompts": probe.get("prompts", 16), "seed": probe.get("seed", 0), **task}


def tiny_flags(spec: dict[str, Any]) -> str:
    """``rpa tiny`` flags for a ``models.<name>.tiny`` mapping."""
    flags: list[str] = []
    for key, value in spec.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return shlex.join(flags)


def prompts_flags(task: dict[str, Any]) -> str:
    """``rpa prompts`` flags for a task mapping (TaskSpec fields, ``name`` as ``--task``)."""
    return tiny_flags({("task" if k == "name" else k): v for k, v in task.items()})


def gguf_flags(spec: dict[str, Any]) -> str:
    """``rpa convert`` flags for a ``models.<name>.gguf`` mapping (``file`` as ``--gguf``)."""
    return tiny_flags({("gguf" if k == "file" else k): v for k, v in spec.items()})


def _options(cls: type, section: dict[str, Any]):
    """The dataclass ``cls`` of the options a config section names."""
    from rpa.core.fieldtypes import build

    return build(cls, {f.name: section[f.name] for f in fields(cls) if f.name in section})


def probe_options(config: dict[str, Any], model: str | None = None):
    """The :class:`~rpa.measure.probe.ProbeOptions` of the config's ``probe:`` section, with
    ``model``'s own options on top (:func:`model_probe`)."""
    from rpa.measure.probe import ProbeOptions

    return _options(ProbeOptions, model_probe(config, model))


def parity_options(config: dict[str, Any]):
    """The :class:`~rpa.measure.parity.ParityOptions` of the config's ``parity:`` section."""
    from rpa.measure.parity import ParityOptions

    return _options(ParityOptions, config["parity"])


def _job(options: dict[str, Any]) -> dict[str, Any]:
    """A job file's mapping: tuples as YAML lists (``yaml.safe_dump`` writes no tuples)."""
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()}


def numerics_options(numerics: dict[str, Any], device: str) -> dict[str, Any]:
    """One ``probe.configs`` entry as ``rpa probe``/``rpa diagnose`` options (their ``--config`` keys:
    the flags' names), checked by :class:`NumericsConfig` and read back by the CLI into the same one."""
    n = NumericsConfig.from_dict({**numerics, "device": device}).to_dict()
    bits = (n.pop("sampler_perturbation") or {}).get("mantissa_bits")
    return {**n, "sampler_mantissa_bits": bits}


def probe_job(config: dict[str, Any], model: str, numerics: str, completions: str | None, device: str,
              name: str | None = None, prompts_file: str | None = None) -> dict:
    """The ``rpa probe --config`` file of one probe cell: model (``model`` is where it loads from,
    ``name`` its entry in ``models``), numerics, every probe option (the model's own on top) and
    the prompts file its task's prompts were written to."""
    import dataclasses

    options = dataclasses.asdict(probe_options(config, name))
    if prompts_file is not None:
        options["prompts_file"] = prompts_file
    return _job({"model": model, **numerics_options(config["probe"]["configs"][numerics], device),
                 **options, "completions": completions})


def diagnose_job(config: dict[str, Any], model: str, numerics: str, completions: str, device: str) -> dict:
    """The ``rpa diagnose --config`` file of one diagnosis cell."""
    return _job({"model": model, **numerics_options(config["probe"]["configs"][numerics], device),
                 "sequences": config["diagnose"]["sequences"], "completions": completions})


def attribution_job(config: dict[str, Any], model: str, numerics: str, completions: str, device: str) -> dict:
    """The ``rpa attribute --config`` file of one attribution cell."""
    return _job({"model": model, **numerics_options(config["probe"]["configs"][numerics], device),
                 "sequences": config["attribution"]["sequences"], "completions": completions})


def parity_job(config: dict[str, Any], model: str, device: str) -> dict:
    """The ``rpa parity --config`` file of one model's gate: the options the ``parity:`` section
    can set (the schema's), from :class:`~rpa.measure.parity.ParityOptions`."""
    return _job({"model": model, "regions": config["parity"]["regions"],
                 "compiled": parity_options(config).compiled, "device": device})
