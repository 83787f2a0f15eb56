"""Config values checked against the types of the dataclass fields they fill, before anything loads.

A YAML value of the wrong type would otherwise reach the code that uses it and fail there with
a message that does not name the key (``'<' not supported between instances of 'str' and
'int'``), or be taken silently (``report_to: wandb`` split into letters). :func:`typed` checks
each given value against its field's annotation and returns the values to build the dataclass
from; the error names the key, the value and what is allowed. Two spellings users write are
accepted: a float written as YAML 1.1 reads it (``1e-4`` is a string there) and one string
where a list of strings is expected.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from rpa.errors import UserError


class FieldTypeError(UserError):
    """A config value of the wrong type (the message names the key)."""


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
        except ValueError:
            return None
    return None


def coerce(key: str, value: Any, hint: Any) -> Any:
    """``value`` for a field annotated ``hint``, or :class:`FieldTypeError` naming ``key``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        others = [a for a in args if a is not type(None)]
        if len(others) == 1:
            return coerce(key, value, others[0])
        return value  # a union of several types: its own check decides
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise FieldTypeError(f"{key}: must be true or false, got {_shown(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise FieldTypeError(f"{key}: must be an integer, got {_shown(value)}")
    if hint is float:
        number = _as_float(value)
        if number is None:
            raise FieldTypeError(f"{key}: must be a number, got {_shown(value)}")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        raise FieldTypeError(f"{key}: must be a string, got {_shown(value)}")
    if origin is tuple and args[-1:] == (Ellipsis,) and args[0] is str:
        if isinstance(value, str):
            return (value,)  # one name where a list is expected
        if value is None:
            return ()
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise FieldTypeError(f"{key}: must be a list of strings, got {_shown(value)}")
    return value  # nested dataclasses, frozensets, Any: built and checked by their owners


def typed(cls: type, data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``data`` (keys of the dataclass ``cls``) with every value checked against its field's
    type; keys are reported as ``prefix + key``. Unknown keys are left for the caller."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: coerce(prefix + k, v, hints[k]) if k in names else v for k, v in data.items()}
