"""The presets: config sections that write grid entries (:func:`rpa.workflow.experiments.grid_of`).

The ``train:``, ``dose:`` and ``study:`` sections and the search stages are shorthand for grid entries of one
shape each; a ``grids:`` entry of ``kind: dose | study`` takes the keys of its section and goes through the same
builder. Each builder is a pure function of the keys as written (and the base run YAMLs it reads, once:
:func:`read_base`); what a kind adds beyond its entries (checks, manifest, analysis) is
:data:`rpa.workflow.experiments.KINDS`.
"""

from __future__ import annotations

from typing import Any

from rpa.core.numerics_config import perturbation_label
from rpa.core.regions import parse_regions, region_label
from rpa.core.yamlfiles import load_yaml
from rpa.workflow.grid import BASE


def read_base(path: str, bases: dict[str, Any]) -> dict[str, Any]:
    """The run YAML ``path``, read once: ``bases`` keeps what was read, by path."""
    if path not in bases:
        bases[path] = load_yaml(path)
    return bases[path]


def train_spec(config: dict[str, Any]) -> dict[str, Any]:
    """The ``train:`` section as a grid entry (:func:`grid_of`): settings x region sets x seeds,
    ``<model>/<setting>/<regions>/seed<N>``."""
    train = config["train"]
    return {"base": train["base"], "overrides": {"model": train["model"]}, "seeds": train["seeds"],
            "axes": {"setting": train["settings"],
                     "regions": {region_label(parse_regions(r)): {"numerics": {"regions": r}} for r in train["regions"]}},
            "path": f"{train['model']}/{{setting}}/{{regions}}"}


def dose_label(dose) -> str:
    """Directory / table name of a dose: ``bf16-none`` (no dose) or ``perturb-mantissa<K>``."""
    return "bf16-none" if dose in (None, "none") else perturbation_label(int(dose))


def dose_spec(dose: dict[str, Any], bases: dict[str, Any] | None = None, folder: str = "dose") -> dict[str, Any]:
    """A positive control as a grid entry (:func:`grid_of`) from its keys as written (the ``dose:``
    section, or a ``grids:`` entry of ``kind: dose``): arms (the sampler-only doses on the base's
    numerics, then the x-axis anchors, each a numerics configuration in full) x IS correction x
    old-logprob source x seeds, ``<arm>/<is_correction>-<old_logprobs>/seed<N>``, every cell from one
    shared warm start (``<folder>/init``, ``folder`` the entry's folder under the results: ``dose``,
    ``grids/<entry>``). Left out: an IS correction with the sampler's old logprobs (the correction would be
    applied twice: TrainConfig refuses it), and the anchors with a correction (an anchor runs uncorrected)."""
    base = read_base(dose["base"], {} if bases is None else bases)
    doses = {dose_label(d): {"numerics": {
        **(base.get("numerics") or {}), "regions": "none", "precision": "bf16",
        **({} if d in (None, "none") else {"sampler_perturbation": {"mantissa_bits": int(d)}})}}
        for d in dose["doses"]}
    anchors = {name: {"numerics": numerics} for name, numerics in (dose.get("anchors") or {}).items()}
    corrections = list(dict.fromkeys([*dose["is_corrections"], "off"]))
    applied = [c for c in corrections if c != "off"]
    exclude = [{"is_correction": applied, "old_logprobs": ["sampler"]}, {"arm": list(anchors), "is_correction": applied}]
    if "off" not in dose["is_corrections"]:  # listed for the anchors only
        exclude.append({"arm": list(doses), "is_correction": ["off"]})
    exclude = [rule for rule in exclude if all(rule.values()) and  # what the grid has: nothing to leave out else
               ("sampler" in dose["old_logprobs"] or "old_logprobs" not in rule)]
    return {"base": dose["base"], "overrides": {"model": dose["model"]}, "seeds": dose["seeds"],
            "axes": {"arm": {**doses, **anchors},
                     "is_correction": {c: {"is_correction": c} for c in corrections},
                     "old_logprobs": {o: {"old_logprobs": o} for o in dose["old_logprobs"]}},
            "exclude": exclude, "path": "{arm}/{is_correction}-{old_logprobs}", "replace": ["numerics"],
            "shared_warm_start": {"level": BASE, "directory": f"{folder}/init", "only_with_steps": False}}


def study_arms(study: dict[str, Any], model: str) -> dict[str, Any]:
    """The arms ``model`` runs: every arm of ``study.arms``, then its own ``study.size_arms``
    (e.g. the sampler-perturbation positive control on the smallest size only)."""
    return {**study["arms"], **((study.get("size_arms") or {}).get(model) or {})}


def study_arm_names(study: dict[str, Any]) -> list[str]:
    """Every arm of the study in table order: the common arms, then the per-size ones."""
    names = list(study["arms"])
    for arms in (study.get("size_arms") or {}).values():
        names += [a for a in (arms or {}) if a not in names]
    return names


def study_spec(study: dict[str, Any], bases: dict[str, Any] | None = None, folder: str = "study") -> dict[str, Any]:
    """A study as a grid entry (:func:`grid_of`) from its keys as written (the ``study:`` section, or a
    ``grids:`` entry of ``kind: study``): models (the base with each size's settings) x arms x seeds,
    ``<model>/<arm>/seed<N>``; a model's own arms (``size_arms``) only on that model. Models with a shared
    warm start (``warm_start.steps`` > 0) start from ``<folder>/<model>/init`` (``folder`` the entry's
    folder under the results: ``study``, ``grids/<entry>``)."""
    sizes, own = study.get("sizes") or {}, study.get("size_arms") or {}
    arms = {name: {} for name in study_arm_names(study)}
    for model in study["models"]:
        arms.update(study_arms(study, model))
    owners = {arm: {m for m in study["models"] if arm in (own.get(m) or {})}
              for arm in arms if arm not in study["arms"]}
    return {"base": study["base"], "seeds": study["seeds"],
            "axes": {"model": {m: {**(sizes.get(m) or {}), "model": m} for m in study["models"]},
                     "arm": {arm: overrides or {} for arm, overrides in arms.items()}},
            "exclude": [{"model": [m for m in study["models"] if m not in models], "arm": [arm]}
                        for arm, models in owners.items()],
            "shared_warm_start": {"level": "model", "directory": f"{folder}/{{model}}/init"}}


SEARCH_STAGES = ("pilot", "grid", "ablation", "lever")
"""Stages of ``search`` (each optional): the pilot picks a setting, the grid tests it under
the decision rule written in the config, then the ablation (if it collapsed) or a further
lever (if it did not)."""


def search_entries(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each stage of the natural-collapse search (``search.stages``) as a grid entry: the search's ``base``
    under the stage as written; cells ``search/<stage>/<label>/.../seed<N>``. With ``shared_warm_start``,
    every arm of a seed that changes none of what a warm start reads starts from one ``rpa warm-start``
    (``search/init/<model>-ws<steps>-seed<N>-<digest>``), as it would from its own identical warm start."""
    search = config["search"]
    return {name: {"base": search["base"], **stage} for name, stage in (search.get("stages") or {}).items()}
