"""The paper takes a list of sections (issue 69, item 4): ``paper.sections`` in the config, ``--section KIND=DIR`` on
the command; one registry of kinds (rpa.workflow.paper.SECTION_KINDS) that the schema, the rule's inputs and the
command share; a bad list refused in one line before anything is written; the keys it replaced named with the new
way to write them."""

import yaml

from tests.conftest import REPO, run_py
from tests.test_pipeline import snakemake

R = REPO / "results/reference"


def test_the_schema_names_exactly_the_registered_kinds():
    from rpa.workflow.paper import SECTION_KINDS

    schema = yaml.safe_load((REPO / "experiments/schema/config.schema.yaml").read_text())
    kinds = schema["properties"]["paper"]["properties"]["sections"]["items"]["properties"]["kind"]["enum"]
    assert kinds == list(SECTION_KINDS)
    for key in ("dose_results", "search_results", "real_search_results", "precision_results", "probe_results"):
        assert key not in schema["properties"]


def test_a_section_list_is_parsed_checked_and_read_by_kind(tmp_path):
    from rpa.workflow.paper import by_kind, first, parse_section, section_inputs, sections_problem

    listed = [parse_section(f"probe={R / 'main'}"), parse_section(f"probe={R / 'main-xeon-amx'}"),
              parse_section(f"dose={R / 'cpu'}")]
    assert sections_problem(listed) is None
    kinds = by_kind(listed)
    assert kinds["probe"] == [R / "main", R / "main-xeon-amx"] and first(kinds, "dose") == R / "cpu"
    assert first(kinds, "search") is None and kinds["precision"] == []
    assert section_inputs(listed) == [str(R / "main/tables/probe.csv"), str(R / "main-xeon-amx/tables/probe.csv"),
                                      str(R / "cpu/tables/dose_runs.csv"), str(R / "cpu/figures/dose_response.png")]
    assert "listed more than once" in sections_problem([("dose", R / "cpu"), ("dose", R / "x")])
    assert "listed more than once" in sections_problem([("probe", R / "main"), ("probe", R / "main")])
    for bad in ("dose", "nope=x", "dose="):
        try:
            parse_section(bad)
        except ValueError as err:
            assert "KIND one of probe, search, real-search, precision, dose" in str(err)
        else:
            raise AssertionError(bad)


def _refused(proc, needle):
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr[-2000:]


def test_the_command_refuses_a_bad_list_in_one_line_before_writing(tmp_path):
    out = tmp_path / "paper"
    base = ["-m", "analysis.paper", "--results", str(R / "study-cpu"), "--out-dir", str(out)]
    proc = run_py([*base, "--section", "nope=x"])
    assert proc.returncode == 2 and "KIND one of probe" in proc.stderr
    _refused(run_py([*base, "--section", f"dose={R / 'cpu'}", "--section", f"dose={R / 'collapse-cpu'}"]),
            "'dose' is listed more than once")
    _refused(run_py([*base, "--section", f"precision={tmp_path / 'missing'}"]),
            f"--section: {tmp_path / 'missing'}/tables/search_grid.json does not exist")
    assert not out.exists()  # nothing written


def test_a_replaced_key_is_refused_with_the_new_way_to_write_it(tmp_path):
    config = yaml.safe_load((REPO / "experiments/study-cpu.yaml").read_text())
    config.pop("paper")
    config["precision_results"] = "results/reference/precision-smollm2"
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = snakemake("-n", "paper", "--configfile", str(path))
    assert proc.returncode != 0
    assert "'precision_results' was replaced by paper.sections" in proc.stdout + proc.stderr
    assert "{kind: precision, results: <its directory>}" in proc.stdout + proc.stderr


def test_the_paper_rule_passes_every_listed_section(tmp_path):
    """The study-cpu config's paper job (a dry run) hands the command each listed section in order and needs each
    section's files as inputs."""
    proc = snakemake("-n", "-p", "paper", "--configfile", "experiments/study-cpu.yaml", "--config",
                     f"results={tmp_path}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    sections = yaml.safe_load((REPO / "experiments/study-cpu.yaml").read_text())["paper"]["sections"]
    expected = " ".join(f"--section {s['kind']}={s['results']}" for s in sections)
    assert expected in out, out[-3000:]
