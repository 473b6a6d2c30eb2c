"""Dataclass field values checked against their annotations, for configs read from JSON.

A hand-edited or foreign config.json can put a string, a boolean, a float or a null anywhere; unchecked, `"false"`
reads as a true flag, `true` as the integer 1, and `"512"` fails later deep inside NumPy. `type_error` names the
first field whose value does not have its annotated type. Rules: a bool is not an int, an int is a float,
`tuple[X, ...]` is a tuple of X, `X | None` also allows None.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any

_WORDS = {int: ("an integer", "integers"), float: ("a number", "numbers"), bool: ("true or false", "booleans"),
          str: ("a string", "strings"), type(None): ("null", "nulls")}


def type_error(instance: Any) -> str | None:
    """"<field> must be <type>, got <value>" for the first field of a dataclass instance whose value does not have
    its annotated type, or None when every field has."""
    for name, hint in _field_hints(type(instance)).items():
        value = getattr(instance, name)
        if not _matches(value, hint):
            shown = list(value) if isinstance(value, tuple) else value  # as the JSON list it came from
            return f"{name} must be {_describe(hint)}, got {shown!r}"
    return None


@functools.cache
def _field_hints(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return any(_matches(value, option) for option in typing.get_args(hint))
    if origin is tuple:  # tuple[X, ...]
        return isinstance(value, tuple) and all(_matches(item, typing.get_args(hint)[0]) for item in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any, plural: bool = False) -> str:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        return " or ".join(_describe(option, plural) for option in typing.get_args(hint))
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(hint)[0], plural=True)}"
    return _WORDS[hint][plural] if hint in _WORDS else f"a {hint.__name__}"
