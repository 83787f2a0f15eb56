"""Collect probe, diagnose and parity results of a pipeline run into tables.

Reads ``RESULTS/probe/<model>/<config>/summary.json``, ``RESULTS/diagnose/<model>/<config>/
layers.csv`` and ``RESULTS/parity/<model>.json`` (through :mod:`analysis.runs`); writes ``probe.csv`` (one row per model x
configuration, columns :data:`PROBE_COLUMNS`), ``probe.md`` (the same, readable, with each
configuration's mismatch relative to the model's stock ``none`` row) and ``diagnose.csv``.

The change of ``mean_abs_dlogp`` vs the model's ``none`` row (``mean_abs_dlogp_change``,
``_low``, ``_high``) is paired: both configurations scored the same sampled tokens
(``probe/<model>/<config>/tokens.csv``), and the 95% interval is a paired bootstrap over
sequences (:func:`analysis.paired.paired_change`). ``change_note`` says why a row has none:
``reference`` (the ``none`` row itself), ``n/a (unpadded probe)`` (a configuration that differs
from ``none`` only in ``trainer_positions``: the probe scores each sequence unpadded, so the
position shift it would change never happens), or ``no tokens.csv`` (left out, e.g. of the
committed reference results for size; ``rel_mean_abs_dlogp_vs_none`` is still there, without
an interval). ``probe.md`` names the single region (rope / swiglu / rmsnorm) with the lowest
mean abs dlogp only where its interval lies below zero, and otherwise says that no single
region's change is distinguishable from zero.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from analysis.paired import fmt_change, paired_change, positions_only
from analysis.refusal import Refused, run
from analysis.runs import diagnose_layers, parity_passed, probe_folder, probe_results, read_tokens
from rpa.core.jsonfiles import atomic_path, write_text

METRICS = ("tokens", "mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp", "frac_bitwise_equal", "kl_k1", "kl_k3",
           "full_kl", "seq_log_ratio_mean_abs", "seq_log_ratio_max_abs", "frac_ratio_outside")
PROBE_COLUMNS = ("model", "config", "regions", "precision", "lm_head_fp32", "trainer_mode", "trainer_attention",
                 *METRICS, "entropy",
                 "batch_vs_single_mean_abs_dlogp", "batch_vs_sampler_mean_abs_dlogp", "rel_mean_abs_dlogp_vs_none",
                 "mean_abs_dlogp_change", "mean_abs_dlogp_low", "mean_abs_dlogp_high", "change_note", "parity_passed")
SINGLE_REGIONS = ("rope", "swiglu", "rmsnorm")
NO_TOKENS = "no tokens.csv"


def paired_changes(results: Path, df: pd.DataFrame, numerics: dict[tuple[str, str], dict],
                   stock: dict[str, str]) -> pd.DataFrame:
    """``mean_abs_dlogp_change/_low/_high`` and ``change_note`` per row of ``df``, vs the
    model's ``none`` row (the stock BF16 row where no configuration is named ``none``)."""
    out = []
    for model, config in zip(df.model, df.config):
        ref = "none" if ((df.model == model) & (df.config == "none")).any() else stock.get(model)
        row = {"mean_abs_dlogp_change": None, "mean_abs_dlogp_low": None, "mean_abs_dlogp_high": None,
               "change_note": None}
        arm_path, ref_path = (probe_folder(results, model, c) / "tokens.csv" for c in (config, ref))
        if ref is None:
            row["change_note"] = "no none row"
        elif config == ref:
            row["change_note"] = "reference"
        elif positions_only(numerics.get((model, config)), numerics.get((model, ref))):
            row["change_note"] = "n/a (unpadded probe)"
        elif not (arm_path.exists() and ref_path.exists()):
            row["change_note"] = NO_TOKENS
        else:
            c = paired_change(read_tokens(arm_path), read_tokens(ref_path))["mean_abs_dlogp"]
            row.update(mean_abs_dlogp_change=c["change"], mean_abs_dlogp_low=c["low"], mean_abs_dlogp_high=c["high"])
        out.append(row)
    return pd.DataFrame(out, index=df.index)


def probe_table(results: Path, order: list[str] | None = None) -> pd.DataFrame:
    rows, numerics = [], {}
    for probe in probe_results(results):
        s, model, config = probe.summary, probe.model, probe.config
        tv = s["trainer_batch_variance"]
        numerics[(model, config)] = s["config"]["numerics"]
        rows.append({"model": model, "config": config, **s["config"]["numerics"],
                     **{m: s[m] for m in METRICS}, "entropy": s.get("entropy"),
                     "batch_vs_single_mean_abs_dlogp": tv["batch_vs_single"]["mean_abs_dlogp"],
                     "batch_vs_sampler_mean_abs_dlogp": tv["batch_vs_sampler"]["mean_abs_dlogp"],
                     "parity_passed": parity_passed(results, model)})
    if not rows:
        raise Refused(f"no probe summaries under {results}/probe")
    df = pd.DataFrame(rows)
    # summaries older than the option computed the stock attention
    df["trainer_attention"] = df["trainer_attention"].fillna("stock") if "trainer_attention" in df else "stock"
    attention = df["trainer_attention"]
    # an FP32 trainer beside a BF16 engine is not the stock row (summaries older than the option: same)
    same = df["trainer_precision"].fillna("same") == "same" if "trainer_precision" in df else True
    stock = df[(df.regions == "none") & (df.precision == "bf16") & ~df.lm_head_fp32 & (df.trainer_mode == "compute")
               & (attention == "stock") & same]
    stock = stock.assign(_named=stock.config != "none").sort_values(["model", "_named"], kind="stable")
    base = stock.groupby("model").mean_abs_dlogp.first()  # the row named none where there is one
    df["rel_mean_abs_dlogp_vs_none"] = df.mean_abs_dlogp / df.model.map(base)
    df = pd.concat([df, paired_changes(results, df, numerics, stock.groupby("model").config.first().to_dict())],
                   axis=1)
    if order:
        rank = {name: i for i, name in enumerate(order)}
        df = df.sort_values(["model", "config"], key=lambda c: c.map(rank) if c.name == "config" else c,
                            kind="stable")
    return df[list(PROBE_COLUMNS)].reset_index(drop=True)


def diagnose_table(results: Path) -> pd.DataFrame:
    return diagnose_layers(results)


def _region_sentence(group: pd.DataFrame) -> str | None:
    """Which single region lowers the mean abs dlogp -- named only where its interval lies
    below zero."""
    singles = group[group.config.isin(SINGLE_REGIONS)]
    if singles.empty:
        return None
    if singles.mean_abs_dlogp_change.isna().all():
        best = singles.loc[singles.mean_abs_dlogp.idxmin()]
        why = ("tokens.csv missing" if (singles.change_note == NO_TOKENS).all()
               else "; ".join(sorted(set(singles.change_note.dropna()))) or "no paired change")
        return (f"Single region with the lowest mean abs dlogp: **{best.config}** "
                f"({100 * (best.rel_mean_abs_dlogp_vs_none - 1):+.1f}% vs `none`); no interval ({why}), so "
                f"whether it differs from `none` beyond sampling noise is not known.")
    measured = singles[singles.mean_abs_dlogp_change.notna()]
    listed = ", ".join(f"{r.config} {fmt_change(r.mean_abs_dlogp_change, r.mean_abs_dlogp_low, r.mean_abs_dlogp_high)}"
                       for r in measured.itertuples())
    below = measured[measured.mean_abs_dlogp_high < 0]
    above = measured[measured.mean_abs_dlogp_low > 0]
    method = "paired bootstrap 95% interval over sequences vs `none`"
    if len(below):
        best = below.loc[below.mean_abs_dlogp_change.idxmin()]
        others = [c for c in below.config if c != best.config]
        return (f"Single region with the lowest mean abs dlogp, interval below zero: **{best.config}** "
                f"({fmt_change(best.mean_abs_dlogp_change, best.mean_abs_dlogp_low, best.mean_abs_dlogp_high)}, "
                f"{method})" + (f"; also below zero: {', '.join(others)}" if others else "") +
                f". All single regions: {listed}.")
    if len(above):
        return (f"No single region lowers the mean abs dlogp distinguishably from zero; "
                f"{', '.join(above.config)} raise{'s' if len(above) == 1 else ''} it ({method}: {listed}).")
    return f"No single region's change of the mean abs dlogp is distinguishable from zero ({method}: {listed})."


def markdown(df: pd.DataFrame) -> str:
    cols = {"config": "config", "mean_abs_dlogp": "mean abs dlogp", "rel_mean_abs_dlogp_vs_none": "vs none",
            "change": "change vs none (95% CI)", "p99_abs_dlogp": "p99", "max_abs_dlogp": "max",
            "frac_bitwise_equal": "bitwise eq", "kl_k3": "kl_k3", "full_kl": "full_kl", "entropy": "entropy (nats)",
            "seq_log_ratio_mean_abs": "mean abs seq log-ratio",
            "batch_vs_single_mean_abs_dlogp": "trainer batch vs batch-1"}
    parts = []
    for model, group in df.groupby("model", sort=False):
        change = [note if isinstance(note, str) else fmt_change(c, lo, hi)
                  for note, c, lo, hi in zip(group.change_note, group.mean_abs_dlogp_change, group.mean_abs_dlogp_low,
                                             group.mean_abs_dlogp_high)]
        table = group.assign(change=change)[list(cols)].rename(columns=cols)
        parts.append(f"### {model} ({int(group.tokens.iloc[0])} completion tokens, identical across configs)\n\n"
                     + table.to_markdown(index=False, floatfmt=".3g") + "\n")
        sentence = _region_sentence(group)
        if sentence:
            parts.append(sentence + "\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--configs", nargs="*", help="configuration names in table order (default: sorted)")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    df = probe_table(args.results, args.configs)
    with atomic_path(args.out_dir / "probe.csv") as tmp:
        df.to_csv(tmp, index=False)
    write_text(args.out_dir / "probe.md", markdown(df))
    with atomic_path(args.out_dir / "diagnose.csv") as tmp:
        diagnose_table(args.results).to_csv(tmp, index=False)
    print(f"aggregate: {len(df)} probe rows -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
