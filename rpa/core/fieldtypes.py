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
import math
import types
import typing
from typing import Any

from rpa.core.errors import UserError


class FieldTypeError(UserError):
    """A config value of the wrong type (the message names the key)."""


SEED_LIMIT = 2 ** 32
"""Every seed of rpa is in ``[0, SEED_LIMIT)``: numpy's legacy generator (``np.random.seed``, which
transformers' ``set_seed`` and vLLM's seeding call) takes no other (``Seed must be between 0 and
2**32 - 1``; past 2**64 ``Overflow when unpacking long long``)."""


def seed_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a seed (``"must be in [0, 2**32), got ..."``), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        return f"must be in [0, 2**32), got {value!r}"
    return None


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
    if origin is typing.Literal:  # an enumerated option: its values are the field's type
        if isinstance(value, str) and value in args:
            return value
        raise FieldTypeError(f"{key}: {value!r} is not one of {', '.join(map(str, args))}")
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
        if not math.isfinite(number):  # .inf / .nan are YAML numbers; no option of rpa means them
            raise FieldTypeError(f"{key}: must be a finite number, got {_shown(value)}")
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


def choices(hint: Any) -> tuple[str, ...]:
    """The values of an enumerated option (``Literal[...]``): its CLI choices and the one list every
    check and message takes them from."""
    return tuple(typing.get_args(hint))


def check_choices(obj: Any, error: type[Exception] | None = None) -> None:
    """Every ``Literal`` field of the dataclass instance ``obj`` holds one of its values (a
    dataclass built in code, not through :func:`typed`, is held to its enumerations too)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if typing.get_origin(hints[f.name]) is typing.Literal:
            try:
                coerce(f.name, getattr(obj, f.name), hints[f.name])
            except FieldTypeError as err:
                raise (error or FieldTypeError)(str(err)) from None


def typed(cls: type, data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``data`` (keys of the dataclass ``cls``) with every value checked against its field's
    type; keys are reported as ``prefix + key``. Unknown keys are left for the caller."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: coerce(prefix + k, v, hints[k]) if k in names else v for k, v in data.items()}


# ------------------------------------------------------------------ command-line flags from fields


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser, cls: type, names: tuple[str, ...] | None = None) -> None:
    """One ``--flag`` per field of the dataclass ``cls``, its default and help taken from the
    field (``metadata={"help": ...}``, and ``"choices"`` / ``"metavar"`` where given): a bool is a
    ``--name``/``--no-name`` pair; a fixed-length tuple takes that many values. Values are
    checked when the dataclass is built from them."""
    import argparse

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if names is not None and f.name not in names:
            continue
        hint, help_text = hints[f.name], f.metadata.get("help", "")
        shown = f"{help_text} (default: {f.default})" if help_text else f"default: {f.default}"
        if hint is bool:  # --name / --no-name
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text or None)
        elif typing.get_origin(hint) is tuple:
            args = typing.get_args(hint)
            parser.add_argument(_flag(f.name), type=args[0], nargs=len(args), default=f.default, help=shown,
                                metavar=f.metadata.get("metavar"))
        elif typing.get_origin(hint) is typing.Literal:  # an enumerated option: its values are the choices
            parser.add_argument(_flag(f.name), type=str, default=f.default, help=shown, choices=choices(hint))
        else:
            if typing.get_origin(hint) in (typing.Union, types.UnionType):  # ``X | None``: a flag of type X
                hint = next(a for a in typing.get_args(hint) if a is not type(None))
            parser.add_argument(_flag(f.name), type=hint, default=f.default, help=shown,
                                choices=f.metadata.get("choices"))


def _finite(key: str, value: Any) -> None:
    numbers = value if isinstance(value, (tuple, list)) else (value,)
    if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
        raise FieldTypeError(f"{key}: must be a finite number, got {value!r}")


def build(cls: type, values: dict[str, Any]) -> Any:
    """The dataclass ``cls`` from ``values`` (some or all of its fields; the dataclass fills in
    and checks the rest); a list for a tuple field (argparse's ``nargs``, YAML) becomes the tuple.
    A non-finite number (``inf``, ``nan``: argparse's ``float`` and YAML read both) is refused."""
    hints = typing.get_type_hints(cls)
    for k, v in values.items():
        _finite(k, v)
        if typing.get_origin(hints[k]) is tuple and not isinstance(v, (list, tuple)):
            raise FieldTypeError(f"{k}: must be a list of {len(typing.get_args(hints[k]))} values, got {_shown(v)}")
    values = typed(cls, {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()})  # a count is no bool
    return cls(**{k: tuple(v) if typing.get_origin(hints[k]) is tuple else v for k, v in values.items()})


def from_args(cls: type, args) -> Any:
    """The dataclass ``cls`` built from the flags :func:`add_arguments` added."""
    return build(cls, {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def to_flags(obj: Any, names: tuple[str, ...] | None = None) -> str:
    """The flags that give the dataclass instance ``obj`` (its fields ``names``, default all)
    on the command line: what :func:`add_arguments` reads back."""
    parts = []
    for f in dataclasses.fields(obj):
        if names is not None and f.name not in names:
            continue
        value = getattr(obj, f.name)
        if isinstance(value, bool):
            parts += [_flag(f.name)] if value else []
        elif isinstance(value, tuple):
            parts.append(f"{_flag(f.name)} {' '.join(map(str, value))}")
        else:
            parts.append(f"{_flag(f.name)} {value}")
    return " ".join(parts)
