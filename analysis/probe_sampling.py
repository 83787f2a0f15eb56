"""The gap beyond rounding: the probe cells at other sampling settings, as one table.

    python -m analysis.probe_sampling --results results/cpu --out-dir results/cpu/tables

Reads every ``RESULTS/probe-sampling/<model>/<setting>/<config>/`` (through :mod:`analysis.runs`:
the summary's ``sampling_split`` and ``split.csv``); writes ``probe_sampling.csv`` (one row per model x
setting x configuration, columns :data:`COLUMNS`) and ``probe_sampling.md`` (the same, readable, with
one sentence per setting naming the larger source).

Each part of the gap between the trainer's recompute and the logprob the sampler reports
(:func:`rpa.core.sampling.gap_split`; ``total`` = ``rounding`` + ``truncation`` for processed
logprobs, + ``temperature`` for raw) is the token mean of its absolute value over the split's
sequences, with a 95% percentile interval from a bootstrap over sequences
(:func:`analysis.paired.mean_interval`); a part the mode does not carry is empty. ``rounding_change``
is the rounding part's change vs the sampler's configuration at the same setting, on the same tokens,
with a paired bootstrap over sequences (:func:`analysis.paired.paired_change`), as the probe table's
change vs ``none``. Tokens outside the sampler's own kept set (``outside_kept``) have no processed
logprob and are left out of every part, as in the probe's summary.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.paired import fmt_change, mean_interval, paired_change
from analysis.refusal import Refused, run
from analysis.runs import sampling_probe_results
from rpa.core.jsonfiles import atomic_path, write_text
from rpa.core.sampling import REPORTED_PARTS

PARTS = ("total", "rounding", "truncation", "temperature")
COLUMNS = ("model", "setting", "temperature", "top_p", "top_k", "logprobs", "config", "sampler", "sequences", "tokens",
           "outside_kept", *(f"{p}_mean_abs_dlogp{s}" for p in PARTS for s in ("", "_low", "_high")),
           "rounding_change", "rounding_change_low", "rounding_change_high")
"""``probe_sampling.csv``: per model x setting x configuration, the setting, the split's sequences and tokens,
each part's token-mean |.| with its interval, and the rounding part's change vs the sampler's configuration."""


def _kept(split: pd.DataFrame) -> pd.DataFrame:
    """The split's tokens the sampler could have drawn (a finite processed logprob)."""
    return split[np.isfinite(split["logp_sampler_processed"].astype(float))]


def _rounding_pairs(split: pd.DataFrame) -> pd.DataFrame:
    """The split as the two columns whose difference is its rounding part, in the probe's token-table shape
    (what :func:`~analysis.paired.paired_change` pairs)."""
    return pd.DataFrame({"seq": split["seq"], "logp_trainer": split["logp_recompute"],
                         "logp_sampler": split["logp_sampler_scaled"]})


def sampling_table(results: Path) -> pd.DataFrame:
    cells = sampling_probe_results(results)
    if not cells:
        raise Refused(f"no probe cells at other sampling settings under {results}/probe-sampling")
    rows, splits = [], {}
    for cell in cells:
        summary = cell.summary["sampling_split"]
        settings, kept = summary["settings"], _kept(cell.split())
        splits[(cell.model, cell.setting, cell.config)] = kept
        row = {"model": cell.model, "setting": cell.setting, **{k: settings[k] for k in
                                                                ("temperature", "top_p", "top_k", "logprobs")},
               "config": cell.config, "sampler": cell.summary["config"]["completions"] == "sampled",  # it sampled itself
               "sequences": summary["sequences"], "tokens": summary["tokens"], "outside_kept": summary["outside_kept"]}
        per_seq = kept.assign(**{p: kept[p].abs() for p in PARTS}).groupby("seq")
        counts = per_seq.size().to_numpy()
        for part in PARTS:
            if part in REPORTED_PARTS[settings["logprobs"]]:
                m = mean_interval(per_seq[part].sum().to_numpy(), counts)
                m = (m["value"], m["low"], m["high"])
            else:
                m = (math.nan,) * 3
            row.update(zip((f"{part}_mean_abs_dlogp{s}" for s in ("", "_low", "_high")), m))
        rows.append(row)
    df = pd.DataFrame(rows)
    changes = []
    for row in df.itertuples():
        sampler = df[(df.model == row.model) & (df.setting == row.setting) & df.sampler]
        if row.sampler or sampler.empty:
            changes.append((math.nan, math.nan, math.nan))
            continue
        ref = splits[(row.model, row.setting, sampler.config.iloc[0])]
        c = paired_change(_rounding_pairs(splits[(row.model, row.setting, row.config)]),
                          _rounding_pairs(ref))["mean_abs_dlogp"]
        changes.append((c["change"], c["low"], c["high"]))
    df["rounding_change"], df["rounding_change_low"], df["rounding_change_high"] = zip(*changes)
    # the untransformed setting first: temperature and top-p falling, top-k off first, processed before raw
    df = df.assign(_k=df.top_k.astype(float).where(df.top_k > 0, np.inf)).sort_values(
        ["model", "temperature", "top_p", "_k", "logprobs", "sampler"],
        ascending=[True, False, False, False, True, False], kind="stable")
    return df[list(COLUMNS)].reset_index(drop=True)


def _with_interval(value: float, low: float, high: float) -> str:
    return "" if math.isnan(value) else f"{value:.3g} [{low:.3g}, {high:.3g}]"


def _sentence(group: pd.DataFrame) -> str:
    """Per setting, on the sampler's configuration: which part of the gap is the larger."""
    said = []
    for setting, rows in group.groupby("setting", sort=False):
        row = rows[rows.sampler].iloc[0] if rows.sampler.any() else rows.iloc[0]
        other = "truncation" if row.logprobs == "processed" else "temperature"
        part, rounding = row[f"{other}_mean_abs_dlogp"], row["rounding_mean_abs_dlogp"]
        if part == 0:
            said.append(f"{setting}: rounding alone ({rounding:.3g})")
        else:
            larger = other if part > rounding else "rounding"
            said.append(f"{setting}: {larger} the larger ({other} {part:.3g}, rounding {rounding:.3g})")
    return ("Per setting, on the sampler's configuration (`" + group[group.sampler].config.iloc[0] + "`), mean |part| "
            "in nats/token: " + "; ".join(said) + ".") if group.sampler.any() else ""


def markdown(df: pd.DataFrame) -> str:
    parts = []
    for model, group in df.groupby("model", sort=False):
        rows = pd.DataFrame({
            "setting": group.setting, "config": group.config, "tokens": group.tokens,
            **{f"{p} (95% CI)": [_with_interval(*v) for v in zip(*(group[f"{p}_mean_abs_dlogp{s}"]
                                                                   for s in ("", "_low", "_high")))] for p in PARTS},
            "rounding vs sampler's config": ["" if math.isnan(c) else fmt_change(c, lo, hi) for c, lo, hi in
                                             zip(group.rounding_change, group.rounding_change_low,
                                                 group.rounding_change_high)],
            "outside kept": group.outside_kept})
        parts.append(f"### {model}: the gap beyond rounding ({int(group.sequences.iloc[0])} sequences split per "
                     f"setting, identical tokens across configs)\n\n" + rows.to_markdown(index=False) + "\n")
        sentence = _sentence(group)
        if sentence:
            parts.append(sentence + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    df = sampling_table(args.results)
    with atomic_path(args.out_dir / "probe_sampling.csv") as tmp:
        df.to_csv(tmp, index=False)
    write_text(args.out_dir / "probe_sampling.md", markdown(df))
    print(f"probe_sampling: {len(df)} rows -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
