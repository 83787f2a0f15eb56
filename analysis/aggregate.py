"""Collect probe, diagnose and parity results of a pipeline run into tables.

Reads ``RESULTS/probe/<model>/<config>/summary.json``, ``RESULTS/diagnose/<model>/<config>/
layers.csv`` and ``RESULTS/parity/<model>.json``; writes ``probe.csv`` (one row per model x
configuration, columns :data:`PROBE_COLUMNS`), ``probe.md`` (the same, readable, with each
configuration's mismatch relative to the model's stock ``none`` row) and ``diagnose.csv``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pandas as pd

METRICS = ("tokens", "mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp", "frac_bitwise_equal", "kl_k1", "kl_k3",
           "full_kl", "seq_log_ratio_mean_abs", "seq_log_ratio_max_abs", "frac_ratio_outside")
PROBE_COLUMNS = ("model", "config", "regions", "precision", "lm_head_fp32", "trainer_mode", *METRICS,
                 "batch_vs_single_mean_abs_dlogp", "batch_vs_sampler_mean_abs_dlogp", "rel_mean_abs_dlogp_vs_none",
                 "parity_passed")


def probe_table(results: Path, order: list[str] | None = None) -> pd.DataFrame:
    rows = []
    for path in sorted(results.glob("probe/*/*/summary.json")):
        s = json.loads(path.read_text())
        model, config = path.parts[-3], path.parts[-2]
        parity = results / "parity" / f"{model}.json"
        tv = s["trainer_batch_variance"]
        rows.append({"model": model, "config": config, **s["config"]["numerics"],
                     **{m: s[m] for m in METRICS},
                     "batch_vs_single_mean_abs_dlogp": tv["batch_vs_single"]["mean_abs_dlogp"],
                     "batch_vs_sampler_mean_abs_dlogp": tv["batch_vs_sampler"]["mean_abs_dlogp"],
                     "parity_passed": json.loads(parity.read_text())["passed"] if parity.exists() else None})
    if not rows:
        raise SystemExit(f"no probe summaries under {results}/probe")
    df = pd.DataFrame(rows)
    stock = df[(df.regions == "none") & (df.precision == "bf16") & ~df.lm_head_fp32 & (df.trainer_mode == "compute")]
    base = stock.groupby("model").mean_abs_dlogp.first()
    df["rel_mean_abs_dlogp_vs_none"] = df.mean_abs_dlogp / df.model.map(base)
    if order:
        rank = {name: i for i, name in enumerate(order)}
        df = df.sort_values(["model", "config"], key=lambda c: c.map(rank) if c.name == "config" else c,
                            kind="stable")
    return df[list(PROBE_COLUMNS)].reset_index(drop=True)


def diagnose_table(results: Path) -> pd.DataFrame:
    frames = []
    for path in sorted(results.glob("diagnose/*/*/layers.csv")):
        frame = pd.read_csv(path)
        frame.insert(0, "config", path.parts[-2])
        frame.insert(0, "model", path.parts[-3])
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def markdown(df: pd.DataFrame) -> str:
    cols = {"config": "config", "mean_abs_dlogp": "mean abs dlogp", "rel_mean_abs_dlogp_vs_none": "vs none",
            "p99_abs_dlogp": "p99", "max_abs_dlogp": "max", "frac_bitwise_equal": "bitwise eq",
            "kl_k3": "kl_k3", "full_kl": "full_kl", "seq_log_ratio_mean_abs": "mean abs seq log-ratio",
            "batch_vs_single_mean_abs_dlogp": "trainer batch vs batch-1"}
    parts = []
    for model, group in df.groupby("model", sort=False):
        table = group[list(cols)].rename(columns=cols)
        parts.append(f"### {model} ({int(group.tokens.iloc[0])} completion tokens, identical across configs)\n\n"
                     + table.to_markdown(index=False, floatfmt=".3g") + "\n")
        singles = group[group.config.isin(["rope", "swiglu", "rmsnorm"])]
        if len(singles):
            best = singles.loc[singles.mean_abs_dlogp.idxmin()]
            change = 100 * (best.rel_mean_abs_dlogp_vs_none - 1)
            parts.append(f"Single region with the lowest mean abs dlogp: **{best.config}** "
                         f"({change:+.1f}% vs `none`).\n")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path)
    parser.add_argument("--configs", nargs="*", help="configuration names in table order (default: sorted)")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    df = probe_table(args.results, args.configs)
    df.to_csv(args.out_dir / "probe.csv", index=False)
    (args.out_dir / "probe.md").write_text(markdown(df))
    diagnose_table(args.results).to_csv(args.out_dir / "diagnose.csv", index=False)
    print(f"aggregate: {len(df)} probe rows -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
