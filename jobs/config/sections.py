"""The configuration's sections and the frozen :class:`TrainConfig` that holds them.

Contract: one frozen dataclass per section (``model``, ``training``, ``data``, ``cluster``,
``checkpoint``, ``metrics``), each coercing and validating its fields on construction
(:class:`ConfigError` naming the field otherwise), plus :class:`TrainConfig`, the whole run
configuration: the sections and the top-level keys (``run_dir``, ``json``).
``TrainConfig.from_dict(config.to_dict())`` gives an equal config; :func:`valid_keys` lists
every dotted key. ``_SECTIONS`` and ``_TOP_LEVEL`` name what a file or an override may set
(``config_load.py``). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from moshray.jobs.config.fields import (
    ConfigError,
    _check,
    _coerce,
    _field_names,
    _fraction,
    _non_empty,
    _non_negative,
    _positive,
    _positive_int,
    _Section,
)

if TYPE_CHECKING:
    from moshray.jobs.examples.lm.model import ModelConfig

Mode = Literal["collaborative", "local_sgd"]
OuterOptimizer = Literal["none", "nesterov"]
Compression = Literal["auto", "none", "fp16", "uint8", "blockwise8"]
Overlap = Literal["auto", "on", "off"]
LrScaling = Literal["sqrt", "none"]
NoticeSourceName = Literal["auto", "aws", "gcp", "none"]
HostsMode = Literal["loopback", "netns"]


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelSection(_Section):
    """Mirror of :class:`moshray.jobs.examples.lm.model.ModelConfig` (same fields and defaults)."""

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
        from moshray.jobs.examples.lm.model import ModelConfig

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
    (within the bound documented in ``cluster/collective/codecs.py``) and full precision when
    local SGD averages parameters. ``max_group``: largest Moshpit group (a swarm of more
    peers averages over a multi-round grid). ``step_grace_s``: how long a full batch waits
    for a replica still applying the previous step before the step is planned without it.
    ``overlap`` (collaborative mode): average step k's gradients while the replica
    accumulates step k+1's (one step of delay); ``auto`` turns it on for replicas that
    train on a GPU (where compute and the averaging's CPU work do not compete) and off on
    CPUs (see ``overlaps``). ``min_part``: fewest values a part owner of an averaging group
    gets (``RoundPlan.min_part``; default 262144: a small model's tensor has one owner, fewer
    transfers per round; owners take turns step by step, see ``partition.owner_shares``);
    1: every member owns a part. ``lr_scaling`` (collaborative mode): ``lr`` is the rate for
    a step of ``target_batch_size`` samples; a step that averaged more (replicas keep
    computing while its plan forms) or fewer scales it by ``sqrt(samples / target)``,
    within [1/4, 2] (``sqrt``, the square-root rule for Adam-type optimizers), or not at
    all (``none``); see ``actors/strategies.lr_scale``.
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
    min_part: int = 262144  # partition.MIN_PART
    lr_scaling: LrScaling = "sqrt"

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
        _positive_int(self._path("min_part"), self.min_part)
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
    or ``GCE_METADATA_HOST``, as the embedded cluster does; else the cloud its DMI vendor
    strings name; else a short probe of 169.254.169.254; else none, with a warning; see
    ``autoscaler/clouds/detect.py``). ``hosts`` is how the local cluster lays out its nodes:
    ``loopback`` (every raylet on 127.0.0.1, no root needed) or ``netns`` (each spot node a
    separate host: a network namespace with its own address and its metadata service at
    169.254.169.254; needs root; see ``jobs/local/cluster.py``).
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
    hosts: HostsMode = "loopback"

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
    (per hour, per sample) sum the price of each worker node the controller sees: the
    cloud's live spot price (EC2), else the shipped table (autoscaler/price_table.json),
    else ``spot_price_per_hour`` / ``on_demand_price_per_hour`` (US$ per node-hour, the
    fallback; defaults: an AWS g4dn.xlarge in us-east-1, an assumed spot price and the
    on-demand list price). ``moshray_node_price_dollars_per_hour{source}`` says which."""

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
