"""The kernel-swap attribution (``rpa attribute``) as a table and a figure.

Reads ``RESULTS/attribution/<model>/<config>/{summary.json,tokens.csv}`` (:func:`analysis.runs.attribution_results`); writes
``attribution.csv`` (the rungs, columns :data:`COLUMNS`), ``attribution_ops.csv`` (each op on
vLLM's own inputs, columns :data:`OP_COLUMNS`), ``attribution.md`` (both) and the figure
``attribution.<format>``. Every rung's change of the token-mean |dlogp| vs the ``trainer``
rung (nothing swapped) is paired -- the same tokens, the same sequences -- with a 95% paired
bootstrap interval over sequences (:func:`analysis.paired.paired_change`). A change of -100%
would mean the swapped kernels carry the whole gap; what is left after the last rung is what
the trainer computes differently from vLLM outside the swapped ops (with ``all``: attention).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd

from analysis.paired import fmt_change, paired_change
from analysis.refusal import Refused, run
from analysis.runs import attribution_results, read_tokens
from rpa.core.jsonfiles import atomic_path, write_text

COLUMNS = ("model", "config", "rung", "swapped", "tokens", "mean_abs_dlogp", "frac_bitwise_equal", "kl_k3",
           "change", "low", "high")
REFERENCE = "trainer"


def attribution_table(results: Path) -> pd.DataFrame:
    rows = []
    for result in attribution_results(results):
        model, config, summary = result.model, result.config, result.summary
        tokens = read_tokens(result.dir / "tokens.csv")

        def as_probe(rung: str) -> pd.DataFrame:
            return pd.DataFrame({"seq": tokens.seq, "logp_trainer": tokens[f"logp_{rung}"],
                                 "logp_sampler": tokens.logp_sampler})

        ref = as_probe(REFERENCE)
        for rung, r in summary["rungs"].items():
            change = {"change": None, "low": None, "high": None} if rung == REFERENCE else \
                {k: v for k, v in paired_change(as_probe(rung), ref)["mean_abs_dlogp"].items() if k != "value"}
            rows.append({"model": model, "config": config, "rung": rung, "swapped": "+".join(r["swapped"]) or "-",
                         "tokens": summary["tokens"], "mean_abs_dlogp": r["mean_abs_dlogp"],
                         "frac_bitwise_equal": r["frac_bitwise_equal"], "kl_k3": r["kl_k3"], **change})
    if not rows:
        raise Refused(f"no attribution summaries under {results}/attribution")
    return pd.DataFrame(rows, columns=list(COLUMNS))


OP_COLUMNS = ("model", "config", "op", "layers", "layers_differing", "elements", "frac_bitwise_equal",
              "rel_mean_abs_diff", "max_abs_diff")


def ops_table(results: Path) -> pd.DataFrame:
    """Per model, configuration and op (over every layer): the trainer's op fed vLLM's very inputs vs
    vLLM's output (``summary.json`` ``local_ops``, from ``ops.csv``)."""
    rows = []
    for result in attribution_results(results):
        for op, r in result.summary.get("local_ops", {}).items():
            rows.append({"model": result.model, "config": result.config, "op": op, **{k: r[k] for k in OP_COLUMNS[3:]}})
    return pd.DataFrame(rows, columns=list(OP_COLUMNS))


def ops_markdown(ops: pd.DataFrame) -> str:
    """Per model: one row per op, one column per configuration: the share of output elements that
    differ given identical inputs, and in how many layers."""
    parts = []
    for model, group in ops.groupby("model", sort=False):
        configs = list(dict.fromkeys(group.config))
        table = {}
        for r in group.itertuples():
            differ = 1 - r.frac_bitwise_equal
            cell = "bitwise equal" if r.layers_differing == 0 else \
                f"{100 * differ:.3g}% differ ({r.layers_differing}/{r.layers} layers, rel {r.rel_mean_abs_diff:.2g})"
            table.setdefault(r.op, {"op": r.op})[f"`{r.config}`"] = cell
        frame = pd.DataFrame(list(table.values()), columns=["op", *(f"`{c}`" for c in configs)])
        parts.append(f"### {model}: each op on vLLM's own inputs, trainer vs vLLM\n\n"
                     + frame.to_markdown(index=False) + "\n")
    return "\n".join(parts)


def markdown(df: pd.DataFrame, ops: pd.DataFrame | None = None) -> str:
    parts = [] if ops is None or ops.empty else [ops_markdown(ops)]
    for (model, config), group in df.groupby(["model", "config"], sort=False):
        shown = group.assign(change=[("reference" if r.rung == REFERENCE else fmt_change(r.change, r.low, r.high))
                                     for r in group.itertuples()])
        cols = {"rung": "trainer scores with", "swapped": "vLLM's own kernels swapped in",
                "mean_abs_dlogp": "mean abs dlogp", "change": "change vs trainer (95% CI)",
                "frac_bitwise_equal": "bitwise eq"}
        parts.append(f"### {model}, regions `{config}` ({int(group.tokens.iloc[0])} tokens)\n\n"
                     + shown[list(cols)].rename(columns=cols).to_markdown(index=False, floatfmt=".3g") + "\n")
        last = group.iloc[-1]
        parts.append(f"With {last.swapped} from vLLM the trainer's gap is {last.mean_abs_dlogp:.3g} "
                     f"({fmt_change(last.change, last.low, last.high)}): what is left is computed differently "
                     f"outside the swapped ops (attention and anything else unaligned).\n")
    return "\n".join(parts)


def figure(df: pd.DataFrame, ops: pd.DataFrame, path: Path) -> None:
    """Left: per op, the share of output elements that differ when the trainer's op gets vLLM's own
    inputs (log scale; bitwise equal drawn at the floor), one bar per configuration. Right: the
    rungs' mean |dlogp| with their paired intervals."""
    import numpy as np

    from analysis.plots import plt, save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), gridspec_kw={"width_ratios": [1.4, 1]})
    floor = 1e-7
    if not ops.empty:
        names = list(dict.fromkeys(ops.op))
        cells = list(dict.fromkeys(zip(ops.model, ops.config)))
        width = 0.8 / len(cells)
        for i, (model, config) in enumerate(cells):
            part = ops[(ops.model == model) & (ops.config == config)].set_index("op")
            share = [max(1 - part.frac_bitwise_equal.get(op, 1.0), floor) for op in names]
            left.bar(np.arange(len(names)) + i * width, share, width, label=f"{model} {config}")
        left.set_yscale("log")
        left.set_ylim(floor / 2, 1)
        left.set_xticks(np.arange(len(names)) + 0.4 - width / 2, names, rotation=55, ha="right", fontsize=7)
        left.set_ylabel(f"share of elements differing ({floor:g} = none)")
        left.set_title("each op on vLLM's own inputs: trainer vs vLLM", fontsize=9)
        left.legend(fontsize=7)
    labels, values, errs = [], [], [[], []]
    for r in df.itertuples():
        base = df[(df.model == r.model) & (df.config == r.config) & (df.rung == REFERENCE)].mean_abs_dlogp.iloc[0]
        lo = base * (1 + r.low) if pd.notna(r.low) else r.mean_abs_dlogp
        hi = base * (1 + r.high) if pd.notna(r.high) else r.mean_abs_dlogp
        labels.append(f"{r.config}: {r.rung}")
        values.append(r.mean_abs_dlogp)
        errs[0].append(max(r.mean_abs_dlogp - lo, 0))
        errs[1].append(max(hi - r.mean_abs_dlogp, 0))
    right.barh(range(len(values)), values, xerr=errs, capsize=2, color="tab:blue")
    right.set_yticks(range(len(values)), labels, fontsize=6)
    right.invert_yaxis()
    right.set_xlabel("mean |dlogp| vs vLLM (95% paired interval)")
    right.set_title("trainer rescored with vLLM's own GEMM / LM-head kernels", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=150, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--results", required=True, type=Path)
    parser.add_argument("--out-dir", required=True, type=Path, help="tables go here")
    parser.add_argument("--figure", required=True, type=Path, help="the figure's path")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    df = attribution_table(args.results)
    with atomic_path(args.out_dir / "attribution.csv") as tmp:
        df.to_csv(tmp, index=False)
    ops = ops_table(args.results)
    with atomic_path(args.out_dir / "attribution_ops.csv") as tmp:
        ops.to_csv(tmp, index=False)
    write_text(args.out_dir / "attribution.md", markdown(df, ops))
    args.figure.parent.mkdir(parents=True, exist_ok=True)
    figure(df, ops, args.figure)
    print(f"attribution: {len(df)} rows -> {args.out_dir}, {args.figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run(main))
