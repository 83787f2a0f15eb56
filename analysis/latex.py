"""A booktabs table from a DataFrame, for the paper (no LaTeX engine needed to write it)."""

from __future__ import annotations

import math

import pandas as pd

_ESCAPE = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
           "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}"}


def escape(text: str) -> str:
    return "".join(_ESCAPE.get(ch, ch) for ch in str(text))


def cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "--"
    if isinstance(value, float):
        return f"{value:.3g}"
    return escape(value)


def booktabs(df: pd.DataFrame, caption: str, label: str, align: str | None = None) -> str:
    """``df`` as a ``table`` environment with ``\\toprule``/``\\midrule``/``\\bottomrule``."""
    align = align or "l" * df.shape[1]
    lines = [r"\begin{table}[t]", r"\centering", r"\small", f"\\caption{{{escape(caption)}}}",
             f"\\label{{{label}}}", f"\\begin{{tabular}}{{{align}}}", r"\toprule",
             " & ".join(escape(c) for c in df.columns) + r" \\", r"\midrule"]
    lines += [" & ".join(cell(v) for v in row) + r" \\" for row in df.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}", r"\end{table}"]
    return "\n".join(lines) + "\n"
