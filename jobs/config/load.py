"""Loading a configuration: a TOML or JSON file, then dotted-key overrides.

Contract: :func:`load_config` reads a file (or none, for the defaults), applies ``section.key``
overrides in order, each coerced to its field's type (strings parsed as on the command line,
or values already typed), and returns a validated :class:`TrainConfig`. Every problem (an
unreadable or invalid file, an unknown key, a bad value) is a :class:`ConfigError`.
``_build`` is the one path from file + overrides to a config; ``config_cli.py`` uses it too.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, get_type_hints

from moshray.jobs.config.fields import ConfigError, _coerce, _field_names
from moshray.jobs.config.sections import _SECTIONS, _TOP_LEVEL, TrainConfig, _top_level_keys

try:  # Python 3.11+
    import tomllib as _toml
except ImportError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ImportError:
        _toml = None  # TOML files are refused with a clear message; JSON still works


def _read_file(path: str) -> dict[str, Any]:
    """Parse a ``.toml`` or ``.json`` config file into a dict; errors are ConfigErrors."""
    file = Path(path).expanduser()
    suffix = file.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(
            "config", f"unsupported file type {suffix!r} for {path}; use .toml or .json"
        )
    if suffix == ".toml" and _toml is None:
        raise ConfigError(
            "config", f"cannot read {path}: TOML needs Python 3.11+ or tomli; use JSON"
        )
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        if suffix == ".json":
            data = json.loads(raw)
        else:
            data = _toml.loads(raw.decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, TOMLDecodeError
        raise ConfigError("config", f"invalid {suffix[1:].upper()} in {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(
            "config", f"top level of {path} must be a table, got {type(data).__name__}"
        )
    return data


def _apply_override(tree: dict[str, Any], key: str, value: Any, *, from_string: bool) -> None:
    """Set dotted ``key`` in the nested ``tree`` after coercing ``value`` to its field type."""
    section, _, name = key.partition(".")
    if not name:
        if key in _SECTIONS:
            example = f"{key}.{_field_names(_SECTIONS[key])[0]}"
            raise ConfigError(key, f"is a section; set one of its keys, e.g. {example}")
        if key not in _TOP_LEVEL:
            raise ConfigError(key, "unknown key; valid keys: " + ", ".join(_top_level_keys()))
        tree[key] = _coerce(key, value, _TOP_LEVEL[key], from_string=from_string)
        return
    if section not in _SECTIONS:
        raise ConfigError(key, "unknown key; valid sections: " + ", ".join(_SECTIONS))
    cls = _SECTIONS[section]
    hints = get_type_hints(cls)
    names = _field_names(cls)
    if name not in names:
        valid = ", ".join(f"{section}.{n}" for n in names)
        raise ConfigError(key, f"unknown key; valid keys: {valid}")
    table = tree.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(section, f"must be a table of settings, got {table!r}")
    table[name] = _coerce(key, value, hints[name], from_string=from_string)


def _build(path: str | None, overrides: list[tuple[str, Any, bool]]) -> TrainConfig:
    tree = copy.deepcopy(_read_file(path)) if path else {}
    for key, value, from_string in overrides:
        _apply_override(tree, key.strip(), value, from_string=from_string)
    return TrainConfig.from_dict(tree)


def load_config(path: str | None, overrides: Mapping[str, str] | None = None) -> TrainConfig:
    """Load ``path`` (TOML or JSON, or ``None`` for defaults) and apply string overrides.

    ``overrides`` maps dotted keys to strings, e.g. ``{"training.lr": "1e-3",
    "training.max_steps": "none", "data.paths": "a.txt,b.parquet"}``; each is
    parsed to the field's type and wins over the file. Raises
    :class:`ConfigError` for an unreadable/invalid file, an unknown key (the
    message lists the valid ones), an unparsable value (the message says what
    is allowed) or a value out of range.
    """
    return _build(path, [(k, v, True) for k, v in (overrides or {}).items()])
