"""A dose-response at fixed trainer arithmetic (issue 68): what the trainer-sampler mismatch itself costs a grid's
outcome, from a decision's ``dose_response`` (written in the config before the grid runs).

The doses are arms that differ only in the sampler's perturbation (``numerics.sampler_perturbation``), so the
trainer's arithmetic is the same in every one; the first dose is the unperturbed arm (stock BF16). Each run's dose is
its measured in-training mismatch (``pre_collapse_mismatch``: mean |dlogp| before any collapse), not the nominal
perturbation. Per seed (the seeds are paired across arms) the outcome is fitted on the dose by least squares; over
the seeds:

- ``slope``: the per-seed slopes' Hodges-Lehmann shift with the exact interval of the signed-rank test and its p;
- ``explained``: per seed the outcome predicted at zero mismatch minus the unperturbed arm's own -- what the
  mismatch of stock BF16 costs it, by its own dose-response;
- ``deficit``: per seed the floor arm's outcome (FP32 on both sides) minus the unperturbed arm's -- all of stock
  BF16's deficit;
- ``share``: the share of the deficit the mismatch explains, ``explained = share x deficit``: the value at which the
  signed-rank test of ``explained - share x deficit`` is least decided (point), and the exact confidence set of the
  values it does not reject at the decision's confidence (by test inversion, on a grid of :data:`SHARE_GRID` values;
  unbounded where the set reaches the grid's end);
- ``lowest_collapsing``: the first dose, in the order written, with a collapsed run (None where none collapsed).

Nothing is read while a run is unfinished or runs of several CPU types are mixed.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from analysis.collapse_stats import signed_rank_interval, signed_rank_p

SHARE_GRID = np.round(np.arange(-3.0, 3.0 + 1e-9, 0.001), 3)
"""The shares the confidence set of ``share`` is searched over (a share outside [-3, 3] reads as unbounded)."""


def _outcome(runs: pd.DataFrame, outcome: str) -> pd.Series:
    return runs["reward_auc"] - runs["step1_reward"] if outcome == "learning_gain" else runs["reward_auc"]


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float] | None:
    """Least-squares (intercept, slope) of y on x; None without two distinct doses."""
    if len(x) < 2 or np.ptp(x) == 0:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    return float(intercept), float(slope)


def _summary(values: list[float], confidence: float) -> dict:
    return {"values": values, "mean": float(np.mean(values)) if values else None,
            "signed_rank_p": signed_rank_p(values), "shift": signed_rank_interval(values, confidence)}


def share_set(explained: list[float], deficit: list[float], confidence: float) -> dict:
    """The share s with ``explained = s x deficit``: the exact confidence set (test inversion of the signed-rank
    test of ``explained - s x deficit`` over :data:`SHARE_GRID`) and its point (the s of the largest p)."""
    e, d = np.asarray(explained), np.asarray(deficit)
    ps = np.array([signed_rank_p(list(e - s * d)) or 0.0 for s in SHARE_GRID])
    kept = SHARE_GRID[ps > 1 - confidence]
    if not len(kept):
        return {"estimate": None, "low": None, "high": None, "confidence": confidence, "bounded": False}
    best = SHARE_GRID[ps == ps.max()]
    return {"estimate": float(np.median(best)), "low": float(kept.min()), "high": float(kept.max()),
            "confidence": confidence, "contiguous": bool(len(kept) == round((kept.max() - kept.min()) / 0.001) + 1),
            "bounded": bool(kept.min() > SHARE_GRID[0] and kept.max() < SHARE_GRID[-1])}


def dose_response(runs: pd.DataFrame, spec: dict, rule: dict) -> dict:
    """The registered dose-response estimands of a grid's runs (module docstring); ``spec``: the decision's
    ``dose_response`` (``doses``: arms, unperturbed first; ``floor_arm``), ``rule``: the decision (arm axis,
    outcome, confidence, control arm)."""
    arm, confidence = rule.get("arm_axis", "arm"), rule.get("confidence", 0.95)
    outcome = rule.get("outcome", "learning_gain")
    doses, floor = list(spec["doses"]), spec.get("floor_arm") or rule.get("control_arm", "fp32")
    out: dict = {"doses": doses, "floor_arm": floor, "outcome": outcome}
    mine = runs[runs[arm].isin([*doses, floor])]
    unfinished = int((mine["state"] != "finished").sum())
    if unfinished or mine.empty:
        out["unfinished"] = unfinished or len(doses) + 1
        return out
    types = sorted(mine["cpu_type"].dropna().unique()) if "cpu_type" in mine else []
    if len(types) > 1:
        out["refused"] = f"the runs were made on {len(types)} CPU types ({'; '.join(types)}); compare within one"
        return out
    done = mine.assign(_y=_outcome(mine, outcome))
    out["arms"] = {a: {"runs": int((g := done[done[arm] == a]).shape[0]),
                       "collapsed": int(g["collapsed"].astype(bool).sum()),
                       "mismatch": float(g["pre_collapse_mismatch"].mean()), "outcome": float(g["_y"].mean())}
                   for a in [*doses, floor] if (done[arm] == a).any()}
    slopes, explained, deficit = [], [], []
    for _, seed in done.groupby("seed"):
        curve = seed[seed[arm].isin(doses)].dropna(subset=["pre_collapse_mismatch", "_y"])
        fit = _fit(curve["pre_collapse_mismatch"].to_numpy(float), curve["_y"].to_numpy(float))
        zero = seed[seed[arm] == doses[0]]["_y"]
        base = seed[seed[arm] == floor]["_y"]
        if fit is None or zero.empty or base.empty:
            continue
        slopes.append(fit[1])
        explained.append(fit[0] - float(zero.iloc[0]))
        deficit.append(float(base.iloc[0]) - float(zero.iloc[0]))
    out["seeds"] = len(slopes)
    out["slope"] = _summary(slopes, confidence)
    out["explained"] = _summary(explained, confidence)
    out["deficit"] = _summary(deficit, confidence)
    out["share"] = share_set(explained, deficit, confidence) if slopes else None
    collapsing = [a for a in doses if out["arms"].get(a, {}).get("collapsed")]
    out["lowest_collapsing"] = ({"arm": collapsing[0], "mismatch": out["arms"][collapsing[0]]["mismatch"]}
                                if collapsing else None)
    return out


def choose_doses(probe: pd.DataFrame, rule: dict) -> list[str]:
    """The pilot's choice of a dose grid's arms (config ``dose_pilot``, written before the pilot runs), from the
    probe table of the pilot (``tables/probe.csv``: each candidate's mean |dlogp| on identical tokens): with ``r``
    each candidate's mismatch over the ``reference``'s, the highest dose is the candidate of least ``r`` at or above
    ``high``; the lowest, the candidate nearest ``low`` (on a log scale) among those above 1 and below the highest;
    the ``doses - 2`` others, each the remaining candidate nearest its point of the geometric series between the
    two. Returned lowest first, the reference not included. ValueError, saying what to add, where the candidates
    cannot make such a series."""
    rows = probe[probe["model"] == rule["model"]].set_index("config")["mean_abs_dlogp"]
    missing = [c for c in [rule["reference"], *rule["candidates"]] if c not in rows.index]
    if missing:
        raise ValueError(f"dose_pilot: the pilot's probe has no {', '.join(missing)} for {rule['model']}")
    ratio = {c: float(rows[c] / rows[rule["reference"]]) for c in rule["candidates"]}
    above = [c for c in ratio if ratio[c] >= rule["high"]]
    if not above:
        raise ValueError(f"dose_pilot: no candidate reaches {rule['high']}x the reference's mismatch (largest "
                         f"{max(ratio.values()):.2f}x); add stronger perturbations (fewer mantissa bits)")
    top = min(above, key=ratio.get)
    below = [c for c in ratio if 1 < ratio[c] < ratio[top]]
    need = rule["doses"] - 1
    if len(below) < need:
        raise ValueError(f"dose_pilot: {len(below)} candidates lie between the reference and {top} "
                         f"({ratio[top]:.2f}x); {need} are needed: add perturbations between them")
    low = min(below, key=lambda c: abs(np.log(ratio[c] / rule["low"])))
    chosen = [low, top]
    points = np.geomspace(ratio[low], ratio[top], rule["doses"])[1:-1]
    for point in points:
        free = [c for c in below if c not in chosen]
        chosen.append(min(free, key=lambda c: abs(np.log(ratio[c] / point))))
    return sorted(chosen, key=ratio.get)


def main(argv: list[str] | None = None) -> int:
    """``python -m analysis.dose.response --probe P --configfile C``: the doses the config's ``dose_pilot`` rule
    chooses from the pilot's probe table, printed as the grid entry's arm labels and dose list."""
    import argparse
    from pathlib import Path

    from analysis.refusal import Refused
    from rpa.core.yamlfiles import load_yaml

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--probe", required=True, type=Path, help="the pilot's tables/probe.csv")
    parser.add_argument("--configfile", required=True, type=Path, help="the config whose dose_pilot rule applies")
    args = parser.parse_args(argv)
    rule = (load_yaml(args.configfile) or {}).get("dose_pilot")
    if not rule:
        raise Refused(f"{args.configfile}: no dose_pilot rule")
    schema = load_yaml(Path(__file__).resolve().parents[2] / "experiments/schema/config.schema.yaml")
    defaults = {k: v["default"] for k, v in schema["properties"]["dose_pilot"]["properties"].items() if "default" in v}
    if not args.probe.is_file():
        raise Refused(f"--probe {args.probe}: no such file (run the pilot first)")
    try:
        chosen = choose_doses(pd.read_csv(args.probe), {**defaults, **rule})
    except ValueError as err:
        raise Refused(str(err)) from None
    configs = (load_yaml(args.configfile).get("probe") or {}).get("configs") or {}
    print("doses (lowest first):", ", ".join(chosen))
    for c in chosen:
        dose = configs.get(c, {}).get("sampler_perturbation") or {}
        written = "{" + ", ".join(f"{k}: {v}" for k, v in dose.items()) + "}"
        print(f"  {c}: {{numerics: {{sampler_perturbation: {written}}}}}")
    print(f"dose_response: {{doses: [{rule['reference']}, {', '.join(chosen)}], floor_arm: fp32}}")
    return 0


if __name__ == "__main__":
    from analysis.refusal import run

    raise SystemExit(run(main))
