"""The paper's sections beyond the study itself (config ``paper.sections``): a list of kinds of result, each with
the results directory it is read from. One place for what each kind is, which files its section reads (the paper
rule's inputs) and what the list may hold; ``analysis.paper`` asks each kind for its section.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SectionKind:
    """A kind of section the paper can take from a results directory."""

    name: str
    reads: tuple[str, ...]
    """Files under the results directory the section reads (the paper rule's inputs)."""
    what: str
    """What the results are, in words (the paper's provenance list names each part by it)."""
    repeatable: bool = False
    """Whether several directories of this kind may be listed (one per CPU type, say)."""


SECTION_KINDS: dict[str, SectionKind] = {k.name: k for k in (
    SectionKind("probe", ("tables/probe.csv",), "main-job probe", repeatable=True),
    SectionKind("search", ("tables/search_pilot.json",), "search"),
    SectionKind("real-search", ("tables/search_pilot.json",), "real-model search"),
    SectionKind("precision", ("tables/search_grid.json",), "precision grid"),
    SectionKind("dose", ("tables/dose_runs.csv", "figures/dose_response.png"), "positive control"),
)}
"""Every section kind, by name (the schema's ``paper.sections[].kind`` enum is these names: a test holds them
equal)."""

REPLACED_KEYS = {"dose_results": "dose", "search_results": "search", "real_search_results": "real-search",
                 "precision_results": "precision", "probe_results": "probe"}
"""Top-level config keys of earlier versions, each replaced by a ``paper.sections`` entry of this kind."""


def parse_section(text: str) -> tuple[str, Path]:
    """``KIND=DIR`` (the paper command's ``--section``) as (kind, directory); ValueError naming the kinds."""
    kind, sep, folder = text.partition("=")
    if not sep or not folder or kind not in SECTION_KINDS:
        raise ValueError(f"--section {text!r}: expected KIND=DIR with KIND one of {', '.join(SECTION_KINDS)}")
    return kind, Path(folder)


def sections_problem(sections: list[tuple[str, Path]]) -> str | None:
    """What is wrong with a list of sections, in one line: a kind that is not repeatable listed twice, a directory
    listed twice; None where nothing is."""
    seen: dict[str, int] = {}
    for kind, folder in sections:
        seen[kind] = seen.get(kind, 0) + 1
        if seen[kind] > 1 and not SECTION_KINDS[kind].repeatable:
            return f"paper.sections: {kind!r} is listed more than once (one {SECTION_KINDS[kind].what} a paper)"
    folders = [str(folder) for _, folder in sections]
    twice = sorted({f for f in folders if folders.count(f) > 1})
    if twice:
        return f"paper.sections: {twice[0]} is listed more than once"
    return None


def by_kind(sections: list[tuple[str, Path]]) -> dict[str, list[Path]]:
    """The directories of each kind, in the order listed (every kind present, empty where none)."""
    out: dict[str, list[Path]] = {name: [] for name in SECTION_KINDS}
    for kind, folder in sections:
        out[kind].append(Path(folder))
    return out


def config_sections(config: dict) -> list[tuple[str, Path]]:
    """A pipeline config's ``paper.sections`` as (kind, directory) pairs."""
    return [(s["kind"], Path(s["results"])) for s in (config.get("paper") or {}).get("sections") or []]


def section_inputs(sections: list[tuple[str, Path]]) -> list[str]:
    """The files the paper rule needs from the listed directories."""
    return [str(folder / name) for kind, folder in sections for name in SECTION_KINDS[kind].reads]


def first(sections: dict[str, list[Path]], kind: str) -> Path | None:
    """The one directory of a kind that is not repeatable (None where the list has none)."""
    folders = sections.get(kind) or []
    return folders[0] if folders else None
