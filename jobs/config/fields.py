"""Typed config fields: the error every bad value raises, value coercion and range checks.

Contract: :class:`ConfigError` is the only exception a bad configuration value raises; its
``str()`` is one line, ``"<field_path>: <message>"``, and it pickles across actor
boundaries. ``_coerce`` turns a value into a field's annotation (strings from the command
line are parsed; values from a file or Python must already have the right type, an int
standing for a float and a list for a tuple). ``_Section`` is the mixin of the frozen
section dataclasses (``config_sections.py``): it coerces every field on construction, runs
the section's ``_validate``, and converts to and from plain dicts. Pure: no I/O.
"""

from __future__ import annotations

import math
import types
from collections.abc import Mapping
from dataclasses import fields
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})
_NONE = frozenset({"none", "null", ""})


class ConfigError(ValueError):
    """A bad configuration value; ``str()`` is ``"<field_path>: <message>"`` on one line.

    Pickles cleanly, so it can cross an actor boundary.
    """

    def __init__(self, field_path: str, message: str) -> None:
        self.field_path = field_path
        self.message = " ".join(str(message).split())  # one line, whatever the cause said
        super().__init__(f"{field_path}: {self.message}")

    def __reduce__(self):
        return (type(self), (self.field_path, self.message))


# --------------------------------------------------------------------------- type coercion


def _describe(tp: Any) -> str:
    """Human name of an annotation, for 'must be ...' messages."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return f"{_describe(inner[0])} or none"
    if origin is tuple:
        item = args[0] if args else str
        return {int: "a list of integers", float: "a list of numbers"}.get(item, "a list of strings")
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
    }.get(tp, str(tp))


def _coerce(path: str, value: Any, tp: Any, *, from_string: bool) -> Any:
    """Convert ``value`` to annotation ``tp`` or raise :class:`ConfigError`.

    ``from_string`` values come from the command line and are parsed
    (``"0.1"`` -> 0.1, ``"none"`` -> None, ``"a,b"`` -> ("a", "b")); other
    values come from a file or Python and must already have the right type,
    except that an int is accepted for a float and a list for a tuple.
    """

    def bad() -> ConfigError:
        return ConfigError(path, f"must be {_describe(tp)}, got {value!r}")

    origin, args = get_origin(tp), get_args(tp)
    if origin is Literal:
        if isinstance(value, str) and value in args:
            return value
        raise bad()
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if value is None or (from_string and value.strip().lower() in _NONE):
            return None
        try:
            return _coerce(path, value, inner[0], from_string=from_string)
        except ConfigError:
            raise bad() from None
    if origin is tuple:
        if from_string:
            items = [part.strip() for part in value.split(",") if part.strip()]
        elif isinstance(value, (list, tuple)):
            items = list(value)
        else:
            raise bad()
        item_tp = args[0] if args else str  # tuple[X, ...]
        if item_tp is str:
            if not all(isinstance(item, str) for item in items):
                raise bad()
            return tuple(items)
        try:
            return tuple(_coerce(path, item, item_tp, from_string=from_string) for item in items)
        except ConfigError:
            raise bad() from None
    if tp is bool:
        if from_string and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        if isinstance(value, bool):
            return value
        raise bad()
    if tp is int:
        if from_string:
            try:
                return int(value.strip())
            except ValueError:
                raise bad() from None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad()
    if tp is float:
        if from_string:
            try:
                return float(value.strip())
            except ValueError:
                raise bad() from None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise bad()
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    raise TypeError(f"{path}: unsupported annotation {tp!r}")  # a bug in this module


# --------------------------------------------------------------------------- checks


def _check(ok: bool, path: str, message: str, value: Any) -> None:
    if not ok:
        raise ConfigError(path, f"{message}, got {value!r}")


def _positive(path: str, value: int | float) -> None:
    _check(math.isfinite(value) and value > 0, path, "must be a positive number", value)


def _non_negative(path: str, value: int | float) -> None:
    _check(math.isfinite(value) and value >= 0, path, "must be a non-negative number", value)


def _positive_int(path: str, value: int) -> None:
    _check(value > 0, path, "must be a positive integer", value)


def _fraction(path: str, value: float) -> None:
    _check(0.0 <= value < 1.0, path, "must be a number in [0, 1)", value)


def _non_empty(path: str, value: str | None) -> None:
    if value is not None:
        _check(bool(value.strip()), path, "must be a non-empty string", value)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in fields(cls)]  # type: ignore[arg-type]


class _Section:
    """Mixin for the frozen section dataclasses.

    ``__post_init__`` coerces every field to its annotation (so ints become
    floats, lists become tuples, a string where a number belongs is a
    :class:`ConfigError`) and then runs the section's ``_validate``.
    """

    _section = ""  # dotted prefix used in error messages; set by each subclass

    def __post_init__(self) -> None:
        hints = get_type_hints(type(self))
        for f in fields(self):  # type: ignore[arg-type]
            path = f"{self._section}.{f.name}"
            value = _coerce(path, getattr(self, f.name), hints[f.name], from_string=False)
            object.__setattr__(self, f.name, value)  # frozen: normalise in place once
        self._validate()

    def _validate(self) -> None:
        """Range and cross-field checks; raise :class:`ConfigError`."""

    def _path(self, name: str) -> str:
        return f"{self._section}.{name}"

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """Build from a mapping of field name -> value (file semantics); unknown keys raise."""
        names = _field_names(cls)
        for key in data:
            if key not in names:
                raise ConfigError(
                    f"{cls._section}.{key}",
                    "unknown key; valid keys: " + ", ".join(f"{cls._section}.{n}" for n in names),
                )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (tuples become lists)."""
        out: dict[str, Any] = {}
        for name in _field_names(type(self)):
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out
