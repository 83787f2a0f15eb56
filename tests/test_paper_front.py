"""The paper's front (issue 71): an abstract of at most 250 words and 25 numbers, each number formatted here again
from the committed tables (not from the front's own reading of them); the claims table's verdicts by the rule its
sections state; a number is what a reader meets as one (names such as BF16 or SmolLM2-135M are not)."""

import json

import pandas as pd
import pytest

from tests.conftest import REPO

R = REPO / "results/reference"


def _committed_front():
    from analysis.paper.front import gather
    from analysis.runs import MANIFEST, read_manifest

    manifest = read_manifest(R / "study-cpu/study" / MANIFEST)
    return gather(R / "study-cpu", manifest, {"dose": [R / "cpu"], "search": [R / "collapse-cpu"],
                                               "real-search": [R / "collapse-smollm2"],
                                               "precision": [R / "precision-smollm2"],
                                               "probe": [R / "main", R / "main-xeon-amx"]})


def test_numbers_are_what_a_reader_meets_as_numbers():
    from analysis.paper.front import numbers, words

    text = "SmolLM2-135M-Instruct in BF16 and Qwen3: -3.7% [-6.9, -0.1], 25x stock, 0 of 44 runs; 1,024 tokens."
    assert numbers(text) == ["-3.7%", "-6.9", "-0.1", "25x", "0", "44", "1,024"]
    assert words("a  b\nc") == 3


def test_the_abstract_is_short_and_quotes_the_committed_tables():
    """<= 250 words, <= 25 numbers, and every number in it formatted here from the committed tables: the SmolLM2
    probe's changes (AMD reference), the stock BF16 collapse counts summed over every experiment, the post-hoc and
    pre-registered learning-gain shifts with their exact intervals, the positive control's ratio."""
    from analysis.dose.stats import anchor_positions, thresholds
    from analysis.paper.front import ABSTRACT_NUMBERS, ABSTRACT_WORDS, abstract, numbers, words

    text = abstract(_committed_front())
    assert words(text) <= ABSTRACT_WORDS == 250 and len(numbers(text)) <= ABSTRACT_NUMBERS == 25, (words(text),
                                                                                                  numbers(text))
    probe = pd.read_csv(R / "main/tables/probe.csv").query("model == 'smollm2'").set_index("config")
    expect = set()
    for config in ("all", "all+attention-fp32"):
        r = probe.loc[config]
        expect |= {f"{100 * r['mean_abs_dlogp_change']:+.1f}%", f"{100 * r['mean_abs_dlogp_low']:+.1f}",
                   f"{100 * r['mean_abs_dlogp_high']:+.1f}"}
    assert f"by {100 * probe.loc['all', 'mean_abs_dlogp_change']:+.1f}%" in text
    runs = [tuple(map(int, c.split("/"))) for c in pd.read_csv(R / "study-cpu/tables/study_collapse.csv")
            .query("arm == 'none'")["collapsed"]]
    for path in (R / "collapse-cpu/tables/search_grid.json", R / "collapse-cpu/tables/search_lever.json",
                 R / "collapse-smollm2/tables/search_grid.json", R / "precision-smollm2/tables/search_grid.json"):
        d = json.loads(path.read_text())["decision"]
        runs.append((d["reference_collapsed"], d["reference_runs"]))
    k, n = sum(a for a, _ in runs), sum(b for _, b in runs)
    assert f"collapsed in {k} of {n} GRPO runs" in text
    expect |= {str(k), str(n), "1", "2"}  # and on 1 of 2 CPU types
    shifts = [c["shift"] for c in json.loads((R / "collapse-smollm2/tables/search_grid.json").read_text())
              ["post_hoc"]["comparisons"].values() if c["outcome"] == "learning_gain"]
    effects = json.loads((R / "precision-smollm2/tables/search_grid.json").read_text())["effects"]["effects"]
    shifts += [effects[name]["shift"] for name in ("mismatch_at_fp32", "bf16_vs_fp32")]
    for s in shifts:
        quoted = [f"{s[key]:+.3f}" for key in ("estimate", "low", "high")]
        assert "{} [{}, {}]".format(*quoted) in text
        expect |= set(quoted)
    dose = pd.read_csv(R / "cpu/tables/dose_runs.csv")
    fit = thresholds(dose, boot=0).query("kind == 'logistic' and is_correction == 'off'").iloc[0]
    stock = anchor_positions(dose).query("arm == 'bf16-none' and is_correction == 'off' and old_logprobs == "
                                         f"'{fit['old_logprobs']}'")["mean_abs_dlogp"].iloc[0]
    expect.add(f"{fit['estimate'] / stock:.0f}x")
    unexplained = [x for x in numbers(text) if x not in expect]
    assert not unexplained, unexplained


def test_the_claims_table_judges_each_claim_by_its_sections_rule():
    """Collapse claims are untestable without a collapsing baseline; a probe change holds only with its interval
    below zero; an effect is answered by its written reading; the unrun dose-response is said not run; a verdict
    outside the vocabulary is refused."""
    from analysis.paper.front import ClaimRow, Front, Interval, claims_rows, claims_table

    rows = {r.claim: r for r in claims_rows(_committed_front())}
    collapse = rows["Aligning RoPE, SwiGLU and add+RMSNorm prevents BF16 collapse"]
    assert collapse.verdict == "untestable here" and collapse.number.startswith("stock BF16 collapsed 0/44")
    assert rows["The mismatch itself costs learning at fixed trainer arithmetic"].verdict == "not run"
    probes = [r for r in rows.values() if r.section == "sec:probe"]
    assert len(probes) == 2  # one CPU type's rows per claim (the dict keeps the last); the table has both
    table = claims_table(claims_rows(_committed_front()))
    assert table.count("Intel Xeon with AMX") == 2 and table.count("AMD EPYC with AVX-512 BF16") == 2
    collapsing = Front(stock=[("grid", 3, 8)], probe={"cpu": {"tokens": 10, "none": 0.03,
                                                              "all": Interval(-0.1, -0.2, 0.01),
                                                              "all+attention-fp32": Interval(-0.8, -0.9, -0.6)}})
    got = {r.claim: r.verdict for r in claims_rows(collapsing)}
    assert got["Aligning RoPE, SwiGLU and add+RMSNorm prevents BF16 collapse"] == "not resolved"
    assert got["Aligning the three regions lowers the trainer-vs-sampler mismatch"] == "not resolved"
    assert got["The rest lives in attention (aligning its arithmetic too removes most of it)"] == "holds"
    with pytest.raises(ValueError, match="not one of"):
        ClaimRow("c", "s", "r", "probably", "1", "sec:x")


def test_the_readme_findings_fit_one_screen_and_quote_the_committed_tables():
    """The README's first screen (issue 71): at most 40 lines from the top to the end of its findings, 5-8 findings
    of a line each, and each finding's number the one the paper's front reads from the committed tables."""
    import re

    from analysis.paper.front import abstract, claims_rows

    readme = (REPO / "README.md").read_text()
    head, _, rest = readme.partition("## Findings\n")
    block = rest.split("\n## ")[0].rstrip("\n")
    assert len((head + "## Findings\n" + block).splitlines()) <= 40
    findings = [line for line in block.splitlines() if line.startswith("- **")]
    assert 5 <= len(findings) <= 8 and len(findings) == len([line for line in block.splitlines() if line.strip()
                                                             and not line.startswith(("On CPU", "claims table"))])
    text = block.replace("\u2212", "-").replace("\u00d7", "x")
    front = _committed_front()
    quoted = abstract(front) + " ".join(r.number for r in claims_rows(front))
    for number in re.findall(r"[-+]?\d+(?:\.\d+)?%? \[[^\]]+\]|\d+ of \d+|\d+x", text):
        plain = number.replace("x", "") if number.endswith("x") else number
        assert plain in quoted.replace("x stock", " stock"), number
    assert "0 of 44 GRPO runs" in text and "25x stock BF16" in text
