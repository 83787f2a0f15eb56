"""Region sets: which of the three rounding regions are aligned.

A region set is data. Its text form is ``none``, ``all`` or a comma-separated subset of
:data:`REGIONS`; :func:`parse_regions` is the only place that reads it.
"""

from __future__ import annotations

from rpa.core.errors import UserError

REGIONS: tuple[str, ...] = ("rope", "swiglu", "rmsnorm")
"""The alignable regions, in the order they are reported."""


class RegionError(UserError):
    """A region set that names something other than a known region."""


def parse_regions(spec: str | None) -> frozenset[str]:
    """Parse ``none`` / ``all`` / ``rope,swiglu,...`` into a frozenset of region names.

    ``None`` (not given) means ``none``; an empty string is an error (an empty list written where
    a region set belongs is not silently "no region": write ``none``). Unknown names, duplicates
    and mixing ``all``/``none`` with names are errors that list the valid names. One spelling:
    lower case, names separated by commas alone (``rope,swiglu``); ``ROPE`` or ``rope, swiglu`` is
    refused with the spelling to write, not read as it. The names may come in any order (a set).
    """
    if spec is None:
        return frozenset()
    text = spec.strip().lower()
    valid = f"valid: 'none', 'all', or a comma-separated subset of {', '.join(REGIONS)}"
    if text == "":
        raise RegionError(f"empty region set {spec!r}; write 'none' for no aligned region ({valid})")
    spelled = ",".join(part.strip() for part in text.split(","))
    if spec != spelled:
        raise RegionError(f"region set {spec!r} is not spelled as region sets are (lower case, comma-separated "
                          f"without spaces): write {spelled!r} ({valid})")
    if text == "none":
        return frozenset()
    if text == "all":
        return frozenset(REGIONS)
    names = [part.strip() for part in text.split(",")]
    if any(not n for n in names):
        raise RegionError(f"empty region name in {spec!r}; {valid}")
    unknown = [n for n in names if n not in REGIONS]
    if unknown:
        raise RegionError(f"unknown region(s) {', '.join(map(repr, unknown))} in {spec!r}; {valid}")
    if len(set(names)) != len(names):
        raise RegionError(f"duplicate region in {spec!r}; {valid}")
    return frozenset(names)


def format_regions(regions: frozenset[str] | set[str]) -> str:
    """The canonical text form of a region set (inverse of :func:`parse_regions`)."""
    if not regions:
        return "none"
    if set(regions) == set(REGIONS):
        return "all"
    return ",".join(r for r in REGIONS if r in regions)


def region_label(regions: str | frozenset[str] | set[str]) -> str:
    """File-system form of a region set (``rope,swiglu`` -> ``rope+swiglu``): directory and cache names."""
    text = format_regions(parse_regions(regions) if isinstance(regions, str) else regions)
    return text.replace(",", "+")
