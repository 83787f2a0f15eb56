"""A booktabs table from a DataFrame, for the paper (no LaTeX engine needed to write it).

Every table fits the text width whatever its column count: the font shrinks with the number
of columns, long headers wrap onto several lines (at spaces and after underscores), and a
tabular still wider than ``\\linewidth`` is scaled down to it (``\\resizebox`` of graphicx,
measured in a box first, so that a table that fits is never scaled). The paper's tables name
their columns in words (:func:`readable`: :data:`HEADERS`, never a raw identifier such as
``max_pre_collapse_phantom_clip``) and are placed where they are input (``placement="H"`` of
the ``float`` package), so that no float splits a sentence across pages.
"""

from __future__ import annotations

import math
import re

import pandas as pd

_ESCAPE = {"&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_", "{": r"\{", "}": r"\}",
           "~": r"\textasciitilde{}", "^": r"\textasciicircum{}", "\\": r"\textbackslash{}"}

# a box for measuring the tabular; allocated once however many tables a document inputs
_MEASURE = r"\ifdefined\rpatablebox\else\newsavebox{\rpatablebox}\fi"
_FIT = (r"\ifdim\wd\rpatablebox>\linewidth\resizebox{\linewidth}{!}{\usebox{\rpatablebox}}"
        r"\else\usebox{\rpatablebox}\fi")


HEADERS = {
    "lr": "learning rate", "arm": "arm", "model": "model", "seed": "seed", "temperature": "temperature",
    "warmup": "warm start", "finished": "finished", "runs": "runs", "collapsed": "collapsed",
    "collapse_rate": "collapse rate (exact 95%)", "collapse_rate_high": "collapse rate, 95% upper bound",
    "final_reward": "final reward (smoothed)", "terminal_reward": "raw reward, last steps",
    "absorbing": "absorbing end", "reward_auc": "reward AUC", "entropy": "entropy (mean)",
    "pre_collapse_mismatch": "mean |dlogp| before collapse", "max_pre_collapse_mismatch": "max |dlogp| before collapse",
    "max_pre_drop_mismatch": "max |dlogp| before any drop", "pre_collapse_phantom_clip": "phantom clip before collapse",
    "max_pre_collapse_phantom_clip": "max phantom clip before collapse", "verdict": "verdict",
    "collapse_step": "collapse step", "peak_reward": "peak reward", "final_entropy": "final entropy",
    "initial_reward": "initial reward", "step1_entropy": "step-1 entropy", "step1_mismatch": "step-1 mean |dlogp|",
    "eligible": "eligible", "chosen": "chosen", "is_correction": "IS correction", "old_logprobs": "old logprobs",
    "invalid": "invalid", "unconfirmed": "unconfirmed", "grad_spike_runs": "runs with grad spikes",
    "mean_abs_dlogp": "mean |dlogp|", "phantom_clip_rate": "phantom-clip rate", "rule_version": "rule",
}
"""Column identifier -> the header the paper prints (:func:`readable`)."""


def readable(df: pd.DataFrame, headers: dict[str, str] | None = None) -> pd.DataFrame:
    """``df`` with its columns named in words (:data:`HEADERS`, then ``headers``); a column not
    named there keeps its name with underscores as spaces."""
    names = {**HEADERS, **(headers or {})}
    return df.rename(columns={c: names.get(c, str(c).replace("_", " ")) for c in df.columns})


def escape(text: str) -> str:
    return "".join(_ESCAPE.get(ch, ch) for ch in str(text))


def cell(value) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "--"
    if isinstance(value, float):
        return f"{value:.3g}"
    return escape(value)


def _plain(value) -> str:
    """The text a cell shows (for measuring column widths)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "--"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def wrap_header(name: str, width: int) -> list[str]:
    """``name`` in lines of at most ``width`` characters where it can break (after a space or
    an underscore); a piece longer than ``width`` stays whole."""
    pieces = [p for p in re.split(r"(?<=[ _])", str(name)) if p]
    lines: list[str] = []
    for piece in pieces:
        if lines and len(lines[-1]) + len(piece.rstrip()) <= width:
            lines[-1] += piece
        else:
            lines.append(piece)
    return [line.strip() for line in lines if line.strip()] or [""]


def header(name: str, width: int) -> str:
    lines = wrap_header(name, width)
    if len(lines) == 1:
        return escape(lines[0])
    return r"\begin{tabular}[b]{@{}l@{}}" + r"\\".join(escape(line) for line in lines) + r"\end{tabular}"


def font_for(columns: int) -> str:
    return r"\small" if columns <= 7 else r"\footnotesize" if columns <= 10 else r"\scriptsize"


def booktabs(df: pd.DataFrame, caption: str, label: str, align: str | None = None, placement: str = "tbp") -> str:
    """``df`` as a ``table`` environment with ``\\toprule``/``\\midrule``/``\\bottomrule``,
    no wider than the text (see the module's docstring); ``placement`` "H" (the ``float``
    package) puts it where it is input."""
    align = align or "l" * df.shape[1]
    widths = [max([len(_plain(v)) for v in df[c]] + [6]) for c in df.columns]
    heads = [header(c, w) for c, w in zip(df.columns, widths)]
    lines = [f"\\begin{{table}}[{placement}]", r"\centering", font_for(df.shape[1]), f"\\caption{{{escape(caption)}}}",
             f"\\label{{{label}}}", _MEASURE, r"\sbox{\rpatablebox}{%", f"\\begin{{tabular}}{{{align}}}",
             r"\toprule", " & ".join(heads) + r" \\", r"\midrule"]
    lines += [" & ".join(cell(v) for v in row) + r" \\" for row in df.itertuples(index=False)]
    lines += [r"\bottomrule", r"\end{tabular}}%", _FIT, r"\end{table}"]
    return "\n".join(lines) + "\n"
