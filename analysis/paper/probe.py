"""The paper's real-model probe section (``probe_section.tex``): where the mismatch lives on SmolLM2 -- every
numerics configuration the main job probes, scored on identical tokens, one column pair per CPU type (a main-job
reference each: ``results/reference/main``, ``results/reference/main-xeon-amx``), from their ``tables/probe.csv``.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from analysis.latex import booktabs, escape
from analysis.paired import fmt_change
from analysis.paper.front import MOST, cpu_words, real_model_probe
from rpa.core.jsonfiles import write_text


def probe_section(probe_results: list[Path], out_dir: Path) -> Path | None:
    """The section, or None (and no file left over) where no main-job reference was given."""
    path = out_dir / "probe_section.tex"
    tables = {}
    for results in probe_results:
        tables[cpu_words(results)] = real_model_probe(results)
    tables = {cpu: t for cpu, t in tables.items() if len(t)}
    if not tables:
        path.unlink(missing_ok=True)
        return None
    configs = [c for c in next(iter(tables.values())).index if all(c in t.index for t in tables.values())]
    rows = []
    for config in configs:
        row = {"configuration": config}
        for cpu, t in tables.items():
            r = t.loc[config]
            row[f"{cpu}: mean |dlogp|"] = float(r["mean_abs_dlogp"])
            row[f"{cpu}: change vs none (95% CI)"] = ("reference" if config == "none" else
                                                      fmt_change(r["mean_abs_dlogp_change"], r["mean_abs_dlogp_low"],
                                                                 r["mean_abs_dlogp_high"]))
        rows.append(row)
    tokens = ", ".join(f"{int(t.loc['none', 'tokens']):,} on the {cpu}" for cpu, t in tables.items() if "none" in t.index)
    parts = ["\\section{Where the mismatch lives on SmolLM2}\\label{sec:probe}",
             escape("The main job's probe (make main): vLLM samples completions of 2-digit addition prompts from "
                    "SmolLM2-135M-Instruct, and every numerics configuration scores these identical tokens on both "
                    f"sides, one sequence at a time ({tokens} completion tokens). Mismatch is the mean |dlogp| of vLLM "
                    "against the trainer; its change against stock BF16 (none) has a paired bootstrap 95% interval "
                    "over sequences. A configuration names what is computed in FP32 and rounded once (regions: rope, "
                    "swiglu, rmsnorm, all three; attention-fp32: the trainer's attention in FP32; lm-head-fp32: the "
                    "LM head in FP32; fp16, fp32: the whole model in that precision). Each CPU type is its own "
                    "reference: their BF16 bits differ."),
             booktabs(pd.DataFrame(rows), "SmolLM2: trainer-vs-sampler mismatch per numerics configuration on "
                      "identical tokens, per CPU type (main-job references)", "tab:probe", placement="H"),
             escape(_reading(tables))]
    write_text(path, "\n\n".join(parts) + "\n")
    return path


def _reading(tables: dict[str, pd.DataFrame]) -> str:
    """What the table shows, per CPU type: how much aligning the three regions removes, and whether the trainer's
    attention in FP32 as well removes most of the rest (the whole interval below -MOST)."""
    said = []
    for cpu, t in tables.items():
        if not {"all", "all+attention-fp32"} <= set(t.index):
            continue
        a, b = t.loc["all"], t.loc["all+attention-fp32"]
        most = "removes most of the rest" if b["mean_abs_dlogp_high"] < -MOST else "does not remove most of the rest"
        said.append(f"on the {cpu}, aligning the three regions changes the mismatch by "
                    f"{fmt_change(a['mean_abs_dlogp_change'], a['mean_abs_dlogp_low'], a['mean_abs_dlogp_high'])}, and "
                    f"the trainer's attention in FP32 as well {most} "
                    f"({fmt_change(b['mean_abs_dlogp_change'], b['mean_abs_dlogp_low'], b['mean_abs_dlogp_high'])})")
    text = "; ".join(said)
    return f"{text[:1].upper()}{text[1:]}." if text else ""
