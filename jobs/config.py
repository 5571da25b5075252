"""One typed, validated training configuration, resolved once at start-up.

Sources, lowest precedence first: field defaults < config file (TOML or JSON,
one table per section) < ``--set section.key=value`` < convenience flags
(``--local-nodes 3``...). The result is a frozen :class:`TrainConfig`; nothing
downstream reads environment variables or re-parses strings.

Every problem is a :class:`ConfigError` whose ``str()`` is one line naming
the field, e.g. ``training.lr: must be a positive number, got -1.0``.

Example file (TOML)::

    [training]
    mode = "local_sgd"
    lr = 1e-3

    [cluster]
    local_nodes = 3
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

try:  # Python 3.11+
    import tomllib as _toml
except ImportError:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml  # type: ignore[no-redef]
    except ImportError:
        _toml = None  # TOML files are refused with a clear message; JSON still works

if TYPE_CHECKING:
    from moshray.actors.model import ModelConfig

__all__ = [
    "CheckpointSection",
    "ClusterSection",
    "ConfigError",
    "DataSection",
    "MetricsSection",
    "ModelSection",
    "TrainConfig",
    "TrainingSection",
    "add_config_arguments",
    "config_from_args",
    "exit_on_config_error",
    "load_config",
    "parse_set",
    "valid_keys",
]

Mode = Literal["collaborative", "local_sgd"]
OuterOptimizer = Literal["none", "nesterov"]
Compression = Literal["auto", "none", "fp16", "uint8", "blockwise8"]
Overlap = Literal["auto", "on", "off"]
NoticeSourceName = Literal["auto", "aws", "gcp", "none"]

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


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelSection(_Section):
    """Mirror of :class:`moshray.actors.model.ModelConfig` (same fields and defaults)."""

    _section = "model"

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 1024
    dropout: float = 0.0
    # Decentralized Mixture-of-Experts: blocks listed here get a DMoE layer served by
    # ExpertActors (grid moe_grid, top moe_k experts); empty = a dense model. ``--moe`` fills
    # it with every other block when it is empty.
    moe_layers: tuple[int, ...] = ()
    moe_grid: tuple[int, ...] = (4, 4)
    moe_k: int = 4
    moe_aux_weight: float = 0.01

    def _validate(self) -> None:
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff"):
            _positive_int(self._path(name), getattr(self, name))
        if self.d_model % self.n_heads:
            raise ConfigError(
                self._path("d_model"),
                f"must be divisible by model.n_heads ({self.n_heads}), got {self.d_model}",
            )
        _fraction(self._path("dropout"), self.dropout)
        layers = self.moe_layers
        _check(len(set(layers)) == len(layers) and all(0 <= i < self.n_layers for i in layers),
               self._path("moe_layers"),
               f"must be distinct block indices in [0, model.n_layers={self.n_layers})", layers)
        _check(bool(self.moe_grid) and all(m >= 1 for m in self.moe_grid),
               self._path("moe_grid"), "must be one or more positive integers", self.moe_grid)
        experts = math.prod(self.moe_grid)
        _check(1 <= self.moe_k <= experts, self._path("moe_k"),
               f"must be an integer in [1, {experts}] (the experts of model.moe_grid)",
               self.moe_k)
        _non_negative(self._path("moe_aux_weight"), self.moe_aux_weight)

    @property
    def moe(self) -> bool:
        """True when the model has DMoE layers (and so needs expert actors)."""
        return bool(self.moe_layers)

    def with_default_moe(self) -> "ModelSection":
        """This section with DMoE on every other block (1, 3, ...; block 0 for one block),
        unless ``moe_layers`` already names the blocks."""
        if self.moe_layers:
            return self
        layers = tuple(range(1, self.n_layers, 2)) or (0,)
        return replace(self, moe_layers=layers)

    def to_model_config(self) -> ModelConfig:
        """The equivalent :class:`ModelConfig` (imports torch, hence lazily)."""
        from moshray.actors.model import ModelConfig

        return ModelConfig(**asdict(self))


@dataclass(frozen=True)
class TrainingSection(_Section):
    """Optimisation and averaging protocol.

    ``mode``: ``collaborative`` accumulates ``target_batch_size`` samples
    across replicas per optimizer step; ``local_sgd`` takes ``local_steps``
    local steps between averaging rounds, optionally followed by an outer
    Nesterov step (``outer_optimizer``). ``grad_clip = 0`` disables clipping.
    ``max_steps`` / ``max_seconds`` of ``None`` mean unbounded. ``compression`` is the
    wire codec of the averaging: ``auto`` sends fp16 gradients in collaborative mode
    (within the bound documented in ``cluster/compression.py``) and full precision when
    local SGD averages parameters. ``max_group``: largest Moshpit group (a swarm of more
    peers averages over a multi-round grid). ``step_grace_s``: how long a full batch waits
    for a replica still applying the previous step before the step is planned without it.
    ``overlap`` (collaborative mode): average step k's gradients while the replica
    accumulates step k+1's (one step of delay); ``auto`` turns it on for replicas that
    train on a GPU (where compute and the averaging's CPU work do not compete) and off on
    CPUs (see ``overlaps``).
    """

    _section = "training"

    mode: Mode = "collaborative"
    target_batch_size: int = 256  # global samples per collaborative step
    batch_size: int = 16  # per-replica micro-batch
    lr: float = 3e-4
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    local_steps: int = 8
    outer_optimizer: OuterOptimizer = "none"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    round_timeout_s: float = 10.0
    max_steps: int | None = None
    max_seconds: float | None = None
    seed: int = 0
    compression: Compression = "auto"
    max_group: int = 8
    step_grace_s: float = 2.0
    overlap: Overlap = "auto"

    def overlaps(self, cuda: bool) -> bool:
        """Whether a collaborative replica (on CUDA if ``cuda``) overlaps its averaging."""
        if self.mode != "collaborative" or self.overlap == "off":
            return False
        return self.overlap == "on" or cuda

    @property
    def wire_codec(self) -> str:
        """The codec ``compression`` resolves to for this mode."""
        if self.compression != "auto":
            return self.compression
        return "fp16" if self.mode == "collaborative" else "none"

    def _validate(self) -> None:
        _check(isinstance(self.max_group, int) and self.max_group >= 2, self._path("max_group"),
               "must be an integer >= 2", self.max_group)
        _non_negative(self._path("step_grace_s"), self.step_grace_s)
        _check(not (self.overlap == "on" and self.mode == "local_sgd"), self._path("overlap"),
               "overlaps collaborative steps only: set training.mode = \"collaborative\" or "
               "overlap = \"off\"", self.overlap)
        for name in ("target_batch_size", "batch_size", "local_steps"):
            _positive_int(self._path(name), getattr(self, name))
        for name in ("lr", "outer_lr", "round_timeout_s"):
            _positive(self._path(name), getattr(self, name))
        for name in ("weight_decay", "grad_clip"):
            _non_negative(self._path(name), getattr(self, name))
        _fraction(self._path("outer_momentum"), self.outer_momentum)
        if self.max_steps is not None:
            _positive_int(self._path("max_steps"), self.max_steps)
        if self.max_seconds is not None:
            _positive(self._path("max_seconds"), self.max_seconds)
        _check(self.seed >= 0, self._path("seed"), "must be a non-negative integer", self.seed)


@dataclass(frozen=True)
class DataSection(_Section):
    """Where training bytes come from; empty ``paths`` means the stdlib corpus."""

    _section = "data"

    paths: tuple[str, ...] = ()  # local paths, directories, s3:// or gs:// URIs
    cache_dir: str = "~/.cache/moshray/corpus"  # default-corpus cache (~ expanded by the reader)

    def _validate(self) -> None:
        for i, p in enumerate(self.paths):
            _non_empty(f"{self._path('paths')}[{i}]", p)
        _non_empty(self._path("cache_dir"), self.cache_dir)


@dataclass(frozen=True)
class ClusterSection(_Section):
    """Which Ray cluster to use, or how to simulate one.

    ``address`` of ``None`` starts a local cluster of ``local_nodes`` nodes (each with
    ``local_gpus`` declared GPUs, for placement tests on CPU machines); ``trace`` replays a
    spot-availability trace at ``time_scale`` trace seconds per wall second. The job wants
    between ``min_nodes`` and ``max_nodes`` spot nodes: it asks Ray's autoscaler for
    ``max_nodes``, trains on at most ``max_nodes`` of them, and with fewer than
    ``min_nodes`` waits, at most ``wait_for_nodes_s`` seconds, before it fails.
    ``replicas_per_node``: replicas on each node; 0 means one per GPU on a GPU node and
    one on a CPU node. A trace's removal comes with a spot notice ``notice_s`` trace
    seconds ahead (AWS gives 120, GCP 30; scaled by ``time_scale`` like the trace),
    delivered through the node's metadata service. ``notice_source`` is how each node's
    watcher hears notices: ``aws`` / ``gcp`` (the cloud's metadata service), ``none``, or
    ``auto`` (the metadata service the node names in ``AWS_EC2_METADATA_SERVICE_ENDPOINT``
    or ``GCE_METADATA_HOST``, as the embedded cluster does; else none).
    """

    _section = "cluster"

    address: str | None = None
    local_nodes: int = 2
    local_gpus: int = 0
    trace: str | None = None
    time_scale: float = 60.0  # trace seconds per wall second
    min_nodes: int = 1
    max_nodes: int = 4
    replicas_per_node: int = 0  # 0: one per GPU (GPU node) or one (CPU node)
    wait_for_nodes_s: float = 600.0
    notice_s: float = 120.0  # trace seconds between a spot notice and the node's removal
    notice_source: NoticeSourceName = "auto"

    def _validate(self) -> None:
        _non_empty(self._path("address"), self.address)
        _non_empty(self._path("trace"), self.trace)
        for name in ("local_nodes", "max_nodes", "min_nodes"):
            _positive_int(self._path(name), getattr(self, name))
        for name in ("replicas_per_node", "local_gpus"):
            _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 0,
                   self._path(name), "must be an integer >= 0", getattr(self, name))
        _check(self.min_nodes <= self.max_nodes, self._path("min_nodes"),
               f"must be <= cluster.max_nodes ({self.max_nodes})", self.min_nodes)
        _positive(self._path("time_scale"), self.time_scale)
        _positive(self._path("wait_for_nodes_s"), self.wait_for_nodes_s)
        _non_negative(self._path("notice_s"), self.notice_s)

    @property
    def wall_notice_s(self) -> float:
        """The notice in wall seconds on a replayed trace."""
        return self.notice_s / self.time_scale


@dataclass(frozen=True)
class CheckpointSection(_Section):
    """Checkpoint location (local dir, s3:// or gs://); ``None`` disables checkpoints on one
    machine. On a cluster of several machines checkpoints are on by default: without ``uri``
    the job uses the cluster's ``MOSHRAY_CHECKPOINT_URI`` (set where the head runs ``ray
    start``) and refuses to start without either, unless ``optional`` is true (then a lost
    head node loses the run)."""

    _section = "checkpoint"

    uri: str | None = None
    every_steps: int = 50
    optional: bool = False

    def _validate(self) -> None:
        _non_empty(self._path("uri"), self.uri)
        _positive_int(self._path("every_steps"), self.every_steps)


@dataclass(frozen=True)
class MetricsSection(_Section):
    """Prometheus exporter; ``port = 0`` lets the OS choose a free port. The cost metrics
    (per hour, per sample) multiply the worker nodes the controller sees on each market by
    ``spot_price_per_hour`` / ``on_demand_price_per_hour`` (US$ per node-hour; defaults:
    an AWS g4dn.xlarge in us-east-1, set your instance type's; the NodeProviders export
    the cloud's live spot prices as ``moshray_provider_spot_price_dollars``)."""

    _section = "metrics"

    port: int = 9450
    spot_price_per_hour: float = 0.16
    on_demand_price_per_hour: float = 0.526

    def _validate(self) -> None:
        _check(0 <= self.port <= 65535, self._path("port"), "must be in [0, 65535]", self.port)
        for name in ("spot_price_per_hour", "on_demand_price_per_hour"):
            _non_negative(self._path(name), getattr(self, name))


_SECTIONS: dict[str, type[_Section]] = {
    "model": ModelSection,
    "training": TrainingSection,
    "data": DataSection,
    "cluster": ClusterSection,
    "checkpoint": CheckpointSection,
    "metrics": MetricsSection,
}
_TOP_LEVEL: dict[str, Any] = {"run_dir": str, "json": bool}  # scalar keys outside any section


@dataclass(frozen=True)
class TrainConfig:
    """The whole run configuration: one frozen, validated object.

    Build it with :func:`load_config`, :func:`config_from_args` or
    :meth:`from_dict`; ship it with :meth:`to_dict`. Construction raises
    :class:`ConfigError` on any invalid field.
    """

    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    data: DataSection = field(default_factory=DataSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    run_dir: str = "runs/latest"
    json: bool = False  # machine-readable (JSON lines) output instead of text

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ConfigError(name, f"must be a {cls.__name__}, got {type(value).__name__}")
        for name, tp in _TOP_LEVEL.items():
            value = _coerce(name, getattr(self, name), tp, from_string=False)
            object.__setattr__(self, name, value)
        _non_empty("run_dir", self.run_dir)

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dict (JSON-able); ``from_dict(to_dict())`` gives an equal config."""
        out: dict[str, Any] = {name: getattr(self, name).to_dict() for name in _SECTIONS}
        out.update({name: getattr(self, name) for name in _TOP_LEVEL})
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainConfig:
        """Build from a nested mapping (file semantics); missing keys take defaults.

        Raises :class:`ConfigError` for unknown keys (listing valid ones), a
        section that is not a table, and any invalid value.
        """
        if not isinstance(data, Mapping):
            raise ConfigError("config", f"top level must be a table, got {type(data).__name__}")
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in _SECTIONS:
                if not isinstance(value, Mapping):
                    raise ConfigError(key, f"must be a table of settings, got {value!r}")
                kwargs[key] = _SECTIONS[key].from_dict(value)
            elif key in _TOP_LEVEL:
                kwargs[key] = value
            else:
                raise ConfigError(key, "unknown key; valid keys: " + ", ".join(_top_level_keys()))
        return cls(**kwargs)


def _top_level_keys() -> list[str]:
    return [*_SECTIONS, *_TOP_LEVEL]


def valid_keys() -> list[str]:
    """Every dotted key accepted by ``--set`` / ``load_config`` overrides."""
    keys = [f"{s}.{name}" for s, cls in _SECTIONS.items() for name in _field_names(cls)]
    return [*keys, *_TOP_LEVEL]


# --------------------------------------------------------------------------- loading


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


# --------------------------------------------------------------------------- command line

# argparse dest -> dotted config key for the convenience flags.
_FLAG_KEYS = {
    "local_nodes": "cluster.local_nodes",
    "trace": "cluster.trace",
    "time_scale": "cluster.time_scale",
    "max_nodes": "cluster.max_nodes",
    "max_steps": "training.max_steps",
    "max_seconds": "training.max_seconds",
    "data": "data.paths",
    "checkpoint": "checkpoint.uri",
    "metrics_port": "metrics.port",
    "mode": "training.mode",
    "json": "json",
}


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--config``, repeatable ``--set KEY=VALUE`` and the convenience flags.

    Flag values stay strings here and are parsed by :func:`config_from_args`,
    so a bad value is reported as a :class:`ConfigError` naming the field
    (not as an argparse usage error).
    """
    group = parser.add_argument_group("configuration (file < --set < flags)")
    group.add_argument("--config", metavar="FILE", help="TOML or JSON config file")
    group.add_argument(
        "--set",
        metavar="KEY=VALUE",
        action="append",
        default=None,
        help="override one setting, e.g. --set training.lr=1e-3 (repeatable)",
    )
    group.add_argument("--local-nodes", metavar="N", help="cluster.local_nodes")
    group.add_argument(
        "--trace", metavar="FILE", help="cluster.trace: spot-availability trace to replay"
    )
    group.add_argument(
        "--time-scale", metavar="X", help="cluster.time_scale: trace seconds per wall second"
    )
    group.add_argument("--max-nodes", metavar="N", help="cluster.max_nodes")
    group.add_argument("--max-steps", metavar="N", help="training.max_steps")
    group.add_argument("--max-seconds", metavar="S", help="training.max_seconds")
    group.add_argument(
        "--data", metavar="URI", action="append", default=None,
        help="data.paths: file, directory, s3:// or gs:// URI (repeatable)",
    )
    group.add_argument(
        "--checkpoint", metavar="URI", help="checkpoint.uri: local dir, s3:// or gs://"
    )
    group.add_argument("--metrics-port", metavar="PORT", help="metrics.port")
    group.add_argument("--mode", metavar="MODE", help="training.mode: collaborative or local_sgd")
    group.add_argument("--json", action="store_true", default=None, help="JSON-lines output")
    group.add_argument(
        "--moe", action="store_true", default=None,
        help="Decentralized Mixture-of-Experts layers (model.moe_layers, default every other "
             "block; model.moe_grid, model.moe_k) served by expert actors on the spot nodes",
    )


def parse_set(items: Sequence[str] | None) -> dict[str, str]:
    """``--set KEY=VALUE`` items as ``{key: value}`` (later wins), ready for
    :func:`load_config`; ``ConfigError`` for an item without ``=``."""
    out: dict[str, str] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError("--set", f"expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value
    return out


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Resolve the :class:`TrainConfig` from arguments added by :func:`add_config_arguments`.

    Precedence: file (``--config``) < ``--set`` (in order, later wins) <
    convenience flags. Raises :class:`ConfigError` like :func:`load_config`,
    plus for a ``--set`` without ``=``.
    """
    overrides: list[tuple[str, Any, bool]] = [
        (key, value, True) for key, value in parse_set(getattr(args, "set", None)).items()]
    for dest, key in _FLAG_KEYS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest == "data":
            overrides.append((key, tuple(value), False))  # already a list: no comma splitting
        elif dest == "json":
            overrides.append((key, bool(value), False))
        else:
            overrides.append((key, value, True))
    config = _build(getattr(args, "config", None), overrides)
    if getattr(args, "moe", None):
        config = replace(config, model=config.model.with_default_moe())
    return config


F = TypeVar("F", bound=Callable[..., Any])


def exit_on_config_error(fn: F) -> F:
    """Decorate a CLI entry point: a :class:`ConfigError` prints
    ``moshray: config error: <one line>`` to stderr and exits with status 2; so does a
    ``UserError`` (the training code or data is at fault), with its own prefix.
    Other exceptions pass through unchanged.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ConfigError as exc:
            print(f"moshray: config error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        except ValueError as exc:
            from moshray.actors.errors import UserError

            if not isinstance(exc, UserError):
                raise
            print(f"moshray: error in the training code or data: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    return wrapper  # type: ignore[return-value]
