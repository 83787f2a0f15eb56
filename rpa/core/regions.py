"""Region sets: which of the three rounding regions are aligned.

A region set is data: a ``frozenset`` of names from :data:`REGIONS`, held by
:attr:`rpa.core.numerics_config.NumericsConfig.regions` past the CLI / config boundary. Its forms
are all here, one function each:

* text (configs, CLI, job files, reports): ``none``, ``all`` or a comma-separated subset --
  :func:`parse_regions` reads it (the only parse), :func:`format_regions` writes it (the only format);
* the file-system label (directory and cache names, ``rope+swiglu``): :func:`region_label`, the text
  form with ``+`` for ``,``;
* the environment variable :data:`ENV_VAR` that carries the vLLM sampler's set into every vLLM
  process: :func:`to_env` writes it, :func:`from_env` reads it back.
"""

from __future__ import annotations

from collections.abc import Mapping

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


def check_regions(regions: frozenset[str]) -> frozenset[str]:
    """``regions`` when it is a region set (a ``frozenset`` of names of :data:`REGIONS`), else
    :class:`RegionError`: text (``"all"``) is read by :func:`parse_regions`, not taken as a set."""
    if not isinstance(regions, frozenset):
        raise RegionError(f"a region set is a frozenset of names of {', '.join(REGIONS)}, got {regions!r} "
                          f"({type(regions).__name__}); read text with parse_regions or NumericsConfig.from_dict")
    unknown = sorted(set(regions) - set(REGIONS))
    if unknown:
        raise RegionError(f"unknown region(s) {', '.join(map(repr, unknown))} in {set(regions)!r}; "
                          f"valid: {', '.join(REGIONS)}")
    return regions


def format_regions(regions: frozenset[str]) -> str:
    """The canonical text form of a region set (inverse of :func:`parse_regions`)."""
    check_regions(regions)
    if not regions:
        return "none"
    if set(regions) == set(REGIONS):
        return "all"
    return ",".join(r for r in REGIONS if r in regions)


def region_label(regions: frozenset[str]) -> str:
    """File-system form of a region set (``rope,swiglu`` -> ``rope+swiglu``): directory and cache names."""
    return format_regions(regions).replace(",", "+")


ENV_VAR = "RPA_REGIONS"
"""The environment variable that carries the sampler's region set into every vLLM process
(:mod:`rpa.sides.vllm_plugin` reads it, :func:`rpa.sides.engine.make_llm_env` writes it)."""


def to_env(regions: frozenset[str]) -> dict[str, str]:
    """The environment that carries ``regions``: ``{ENV_VAR: text form}``."""
    return {ENV_VAR: format_regions(regions)}


def from_env(environ: Mapping[str, str]) -> frozenset[str]:
    """The region set :func:`to_env` wrote into ``environ``; unset or empty means ``none`` (stock vLLM)."""
    value = environ.get(ENV_VAR)
    return parse_regions(value if value and value.strip() else None)
