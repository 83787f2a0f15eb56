"""YAML files as every rpa command reads them: safe loading, a duplicate key refused (YAML's own
rule, which PyYAML does not enforce: the later key would silently win), merge keys (``<<``) as
PyYAML reads them, and any error one line naming the file, line and column."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rpa.core.errors import InputError


class YamlError(InputError):
    """A YAML file that cannot be read as written (syntax, a duplicate key, not a file)."""


MERGE_TAG = "tag:yaml.org,2002:merge"
"""A merge key (``<<``), which PyYAML's safe loader resolves (the schema shares its grid knobs so)."""


class _StrictLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping with the same key twice."""


def _mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == MERGE_TAG:  # `<<: *anchor`: its keys are defaults the mapping's own may override
            continue
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            mark = key_node.start_mark
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r} (first at line "
                                                    f"{seen[key].line + 1})", mark)
        seen[key] = key_node.start_mark
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def parse_yaml(text: str, source: str) -> Any:
    """The data of YAML ``text`` (from ``source``, for messages), or :class:`YamlError` in one line."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark is not None else source
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise YamlError(f"{where}: {problem}") from None


def load_yaml(path: str | Path) -> Any:
    """The data of the YAML file ``path`` (see :func:`parse_yaml`)."""
    p = Path(path)
    if p.is_dir():
        raise YamlError(f"{path}: is a directory, not a YAML file")
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise YamlError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise YamlError(f"{path}: cannot be read ({type(err).__name__})") from None
    return parse_yaml(text, str(path))
