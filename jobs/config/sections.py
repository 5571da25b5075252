"""The configuration's sections and the frozen :class:`TrainConfig` that holds them.

Contract: one frozen dataclass per section (``model``, ``training``, ``data``, ``cluster``,
``checkpoint``, ``metrics``), each coercing and validating its fields on construction
(:class:`ConfigError` naming the field otherwise), plus :class:`TrainConfig`, the whole run
configuration: the sections and the top-level keys (``name``, ``run_dir``, ``json``).
``TrainConfig.from_dict(config.to_dict())`` gives an equal config; :func:`valid_keys` lists
every dotted key. ``_SECTIONS`` and ``_TOP_LEVEL`` name what a file or an override may set
(``jobs/config/load.py``). Every field has a docstring, the string right under it: its line
in the settings table of docs/settings.md (``moshray config table``,
``jobs/config/table.py``; a field without one fails ``tests/test_readme.py``). Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from moshray.cluster.collective.codecs import codec_names
from moshray.actors.replica.strategies import strategy_class, strategy_names
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

# The step strategies registered in actors/replica/strategies.py (``@register``), by name,
# and ``auto`` (the job picks one at start-up: actors/replica/mode_choice.py).
Mode = Literal[(*strategy_names(), "auto")]  # type: ignore[valid-type]
OuterOptimizer = Literal["none", "nesterov"]
# "auto" or a codec name registered in cluster/collective/codecs.py (checked in _validate
# against the registry, so a plug-in codec is accepted once its module is imported)
Compression = str
Overlap = Literal["auto", "on", "off"]
LrScaling = Literal["sqrt", "none"]
# "auto", a cloud registered in autoscaler/clouds (aws, gcp, ...) or "none" (checked in
# _validate against the registry, so a plug-in cloud is accepted once its module is imported)
NoticeSourceName = str
HostsMode = Literal["loopback", "netns"]
ReplicaUnit = Literal["gpu", "node"]


# --------------------------------------------------------------------------- sections


@dataclass(frozen=True)
class ModelSection(_Section):
    """Mirror of :class:`moshray.jobs.examples.lm.model.ModelConfig` (same fields and defaults)."""

    _section = "model"

    vocab_size: int = 256
    """Built-in LM: tokens in the vocabulary (256: bytes)."""
    seq_len: int = 128
    """Built-in LM: tokens per training window."""
    d_model: int = 256
    """Built-in LM: width of the residual stream (and of each DMoE expert's input)."""
    n_layers: int = 4
    """Built-in LM: transformer blocks."""
    n_heads: int = 4
    """Built-in LM: attention heads per block; must divide d_model."""
    d_ff: int = 1024
    """Built-in LM: hidden width of a block's feed-forward layer and of each DMoE expert."""
    dropout: float = 0.0
    """Built-in LM: dropout probability."""
    # Decentralized Mixture-of-Experts: blocks listed here get a DMoE layer served by
    # ExpertActors (grid moe_grid, top moe_k experts); empty = a dense model. ``--moe`` fills
    # it with every other block when it is empty.
    moe_layers: tuple[int, ...] = ()
    """Blocks with a DMoE layer served by expert actors on the spot nodes; empty: a dense
    model (``--moe`` fills every other block)."""
    moe_grid: tuple[int, ...] = (4, 4)
    """DMoE expert grid; its product is the number of experts per layer."""
    moe_k: int = 4
    """DMoE: experts each token is routed to (beam search over the grid)."""
    moe_aux_weight: float = 0.01
    """DMoE: weight of the load-balancing loss."""

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
    Nesterov step (``outer_optimizer``). ``grad_clip = 0`` (default) clips nothing.
    ``max_steps`` / ``max_seconds`` / ``max_epochs`` of ``None`` mean unbounded.
    ``compression`` is the wire codec of the averaging: ``auto`` sends fp16 gradients in
    collaborative mode (within the bound documented in ``cluster/collective/codecs.py``) and
    full precision when local SGD averages parameters. ``max_group``: largest Moshpit group
    (a swarm of more peers averages over a multi-round grid). ``step_grace_s``: how long a
    full batch waits for a replica still applying the previous step before the step is
    planned without it. ``overlap`` (collaborative mode): average step k's gradients while
    the replica accumulates step k+1's (one step of delay); ``auto`` turns it on for
    replicas that train on a GPU (where compute and the averaging's CPU work do not compete)
    and off on CPUs (see ``overlaps``). ``overlap = "on"`` with ``local_sgd`` and
    ``outer_optimizer = "nesterov"``: Streaming DiLoCo's overlapped outer step (round k's
    outer gradient travels while round k+1's inner steps run; see ``LocalSGD`` in
    ``actors/replica/strategies.py``); without the outer step it is refused, and ``auto``
    leaves it off. ``min_part``: fewest values a part owner of an
    averaging group gets (``RoundPlan.min_part``; default 262144: a small model's tensor has
    one owner, fewer transfers per round; owners take turns step by step, see
    ``partition.owner_shares``); 1: every member owns a part. ``lr_scaling`` (collaborative
    mode): ``lr`` is the rate for a step of ``target_batch_size`` samples; a step that
    averaged more (replicas keep computing while its plan forms) or fewer scales it by
    ``sqrt(samples / target)``, within [1/4, 2] (``sqrt``, the square-root rule for
    Adam-type optimizers), or not at all (``none``, the default); see
    ``actors/replica/strategies.lr_scale``. ``max_failures``: replicas whose loop raised
    (anything but a ``UserError``, which stops the job at once) are replaced this many times
    across the job; one more ends it with that error (the same error from two nodes ends it
    at once). ``max_checkpoint_failures``: checkpoint saves failing in a row before the job
    ends (see ``jobs/controller/reconcile.py``, rule 6).
    """

    _section = "training"

    mode: Mode = "collaborative"
    """``collaborative`` (DeDLOC): gradients accumulate across replicas until the swarm has
    target_batch_size samples, then one averaged step; ``local_sgd`` (Moshpit SGD): local
    steps, parameters averaged every local_steps; ``auto``: the job measures the spot
    nodes' links and the model's step at start-up and picks collaborative where averaging
    is cheap, else local_sgd with DiLoCo's outer Nesterov step (it prints one line saying
    which and why; see actors/replica/mode_choice.py)."""
    target_batch_size: int = 256
    """Global samples per collaborative step (a minimum: replicas keep computing while the
    step's plan forms)."""
    batch_size: int = 16
    """Samples per replica micro-batch."""
    lr: float = 3e-4
    """Learning rate of a step of target_batch_size samples (see lr_scaling)."""
    weight_decay: float = 0.0
    """Built-in LM: AdamW weight decay."""
    grad_clip: float = 0.0
    """Gradient-norm clip of each optimizer step moshray takes; 0 (default): none, the loop
    clips if it wants (between loss.backward() and opt.step()). Off because clipping is a
    choice of the model's recipe, not of the averaging: torch, DDP, hivemind.Optimizer and
    torchft clip nothing unless asked, and a hidden clip at 1.0 changed users' training."""
    local_steps: int = 8
    """``local_sgd``: local steps between averaging rounds."""
    outer_optimizer: OuterOptimizer = "none"
    """``local_sgd``: ``nesterov`` applies DiLoCo's outer Nesterov step to each average."""
    outer_lr: float = 0.7
    """Learning rate of the outer Nesterov step."""
    outer_momentum: float = 0.9
    """Momentum of the outer Nesterov step."""
    round_timeout_s: float = 10.0
    """Deadline of one averaging round: a late or dead member drops out of that part's
    average. With adaptive_deadline it is the cap of the adaptive deadline."""
    adaptive_deadline: bool = True
    """Each round waits deadline_margin x the deadline_quantile of this peer's recent round
    times (at least deadline_floor_s, at most round_timeout_s) instead of round_timeout_s,
    once 5 rounds were seen: a dead peer costs seconds, a slow link is still waited for."""
    deadline_quantile: float = 0.9
    """Quantile of the recent round times the adaptive deadline starts from."""
    deadline_margin: float = 3.0
    """Factor over that quantile (>= 1): a round slower than usual is still waited for."""
    deadline_floor_s: float = 5.0
    """Shortest adaptive deadline: a shorter one would drop a peer merely descheduled."""
    max_steps: int | None = None
    """Stop after this many global steps; none: no bound."""
    max_seconds: float | None = None
    """Stop after this many seconds; none: no bound."""
    max_epochs: int | None = None
    """Stop once every shard of this many passes over the data source has been handed out
    (the driver checks the Coordinator's data position against max_epochs x num_shards at
    every poll, twice a second; replicas stop at their next micro-batch, so the last shards
    may be read in part, and shards read in well under a second overshoot by what the
    replicas read meanwhile); none: no bound. moshray.fit defaults to 1 when no other bound
    is given."""
    seed: int = 0
    """Seed of the initial parameters and the data order."""
    compression: Compression = "auto"
    """Wire codec of the averaging; ``auto``: fp16 gradients in collaborative mode, full
    precision when local SGD averages parameters (error bounds:
    ``cluster/collective/codecs.py``)."""
    max_group: int = 8
    """Largest Moshpit group; a larger swarm averages over a grid of several rounds."""
    step_grace_s: float = 2.0
    """How long a full batch waits for a replica still applying the previous step before
    the step is planned without it."""
    overlap: Overlap = "auto"
    """Collaborative mode: average step k while accumulating step k+1 (one step of delay);
    ``auto``: on for replicas on a GPU, off on CPUs. ``local_sgd`` with the outer step:
    ``on`` overlaps each outer average with the next inner steps (streaming DiLoCo)."""
    zone_aware: bool = True
    """Peers in one zone (their node's ``ray.io/availability-zone`` label) average inside
    it first, so only one reduced tensor per zone crosses the slow, billed link between
    zones (``cluster/collective/grid.py``); false: the plain Moshpit grid."""
    min_part: int = 262144  # partition.MIN_PART
    """Fewest values a part owner of an averaging group gets; 1: every member owns a
    part."""
    lr_scaling: LrScaling = "none"
    """Collaborative mode: ``none`` (default) keeps the optimizer's lr for every step;
    ``sqrt`` scales it by sqrt(samples / target_batch_size) for a step that averaged more
    or fewer samples, within [1/4, 2]. Off because no one rule fits every optimizer: the
    square-root rule is derived for Adam-type optimizers (Malladi et al. 2022, "On the SDEs
    and Scaling Rules for Adaptive Gradient Algorithms"), SGD wants the linear rule (Goyal
    et al. 2017), and hivemind.Optimizer and torchft leave the rate to the user's
    scheduler."""
    max_failures: int = 3
    """Replicas whose loop raised that are replaced across the job; one more failure ends
    it (a ``UserError``, or the same error on two nodes, ends it at once)."""
    max_checkpoint_failures: int = 3
    """Checkpoint saves that may fail in a row before the job ends."""

    def overlaps(self, cuda: bool) -> bool:
        """Whether a replica (on CUDA if ``cuda``) overlaps its averaging: only a strategy
        that can (``Strategy.can_overlap``) with these settings (``overlap_refusal``);
        ``auto`` only where the strategy says so (``Strategy.overlap_auto``: collaborative
        steps, not local_sgd's outer step, whose overlap changes the optimisation)."""
        cls = strategy_class(self.mode)
        if not cls.can_overlap or self.overlap == "off" or cls.overlap_refusal(self):
            return False
        return self.overlap == "on" or (cuda and cls.overlap_auto)

    @property
    def averaging_local_steps(self) -> int | None:
        """The Coordinator's step trigger: ``local_steps`` in ``local_sgd`` mode (a global
        step after that many local steps per replica on average), None for collaborative
        steps of ``target_batch_size`` samples (``mode`` "auto" is resolved before)."""
        return self.local_steps if self.mode == "local_sgd" else None

    @property
    def wire_codec(self) -> str:
        """The codec ``compression`` resolves to for this mode."""
        if self.compression != "auto":
            return self.compression
        return strategy_class(self.mode).default_codec  # fp16 gradients, full-precision params

    def _validate(self) -> None:
        _check(isinstance(self.max_group, int) and self.max_group >= 2, self._path("max_group"),
               "must be an integer >= 2", self.max_group)
        _non_negative(self._path("step_grace_s"), self.step_grace_s)
        _positive_int(self._path("min_part"), self.min_part)
        _check(isinstance(self.zone_aware, bool), self._path("zone_aware"),
               "must be true or false", self.zone_aware)
        codecs = codec_names()
        _check(self.compression == "auto" or self.compression in codecs,
               self._path("compression"),
               "must be one of " + ", ".join(repr(c) for c in ("auto", *codecs)),
               self.compression)
        overlapping = [n for n in strategy_names() if strategy_class(n).can_overlap]
        _check(not (self.overlap == "on" and self.mode not in overlapping),
               self._path("overlap"), f"overlaps {' or '.join(overlapping)} steps only: set "
               f"training.mode = \"{overlapping[0]}\" or overlap = \"off\"", self.overlap)
        if self.overlap == "on" and self.mode in overlapping:
            refusal = strategy_class(self.mode).overlap_refusal(self)
            _check(refusal is None, self._path("overlap"), str(refusal), self.overlap)
        for name in ("target_batch_size", "batch_size", "local_steps"):
            _positive_int(self._path(name), getattr(self, name))
        for name in ("lr", "outer_lr", "round_timeout_s", "deadline_floor_s"):
            _positive(self._path(name), getattr(self, name))
        _check(0 < self.deadline_quantile <= 1, self._path("deadline_quantile"),
               "must be in (0, 1]", self.deadline_quantile)
        _check(self.deadline_margin >= 1, self._path("deadline_margin"), "must be >= 1",
               self.deadline_margin)
        for name in ("weight_decay", "grad_clip"):
            _non_negative(self._path(name), getattr(self, name))
        _fraction(self._path("outer_momentum"), self.outer_momentum)
        if self.max_steps is not None:
            _positive_int(self._path("max_steps"), self.max_steps)
        if self.max_seconds is not None:
            _positive(self._path("max_seconds"), self.max_seconds)
        if self.max_epochs is not None:
            _positive_int(self._path("max_epochs"), self.max_epochs)
        _check(isinstance(self.max_failures, int) and self.max_failures >= 0,
               self._path("max_failures"), "must be an integer >= 0", self.max_failures)
        _positive_int(self._path("max_checkpoint_failures"), self.max_checkpoint_failures)
        _check(self.seed >= 0, self._path("seed"), "must be a non-negative integer", self.seed)

    def deadline_policy(self):
        """The averager's ``DeadlinePolicy`` from these settings; None with
        ``adaptive_deadline`` off (every round waits ``round_timeout_s``)."""
        from moshray.cluster.collective.deadline import DeadlinePolicy

        if not self.adaptive_deadline:
            return None
        return DeadlinePolicy(quantile=self.deadline_quantile, margin=self.deadline_margin,
                              floor_s=self.deadline_floor_s)


@dataclass(frozen=True)
class DataSection(_Section):
    """Where training bytes come from; empty ``paths`` means the stdlib corpus."""

    _section = "data"

    paths: tuple[str, ...] = ()  # local paths, directories, s3:// or gs:// URIs
    """Built-in LM's training files: local paths, directories, ``s3://`` or ``gs://`` URIs;
    empty: a corpus built from the Python standard library's sources."""
    cache_dir: str = "~/.cache/moshray/corpus"  # default-corpus cache (~ expanded by the reader)
    """Where the built-in corpus is cached."""

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
    169.254.169.254; needs root; see ``jobs/local/cluster.py``). ``driver_lease_s``: the
    replicas and the Coordinator outlive the driver (a resubmitted job with the same config
    adopts them) for at most this long after its last renewal, then stop by themselves,
    with a final checkpoint (``jobs/controller/lease.py``); a live driver is never reaped. ``replica``: what one replica
    is: ``gpu`` (a replica per GPU, ``replicas_per_node`` on a node) or ``node`` (a replica
    group per node: one Ray actor per GPU, ``group_ranks`` of them, joined in a
    ``torch.distributed`` process group, the model sharded inside by FSDP2;
    ``jobs/controller/groups.py``).
    """

    _section = "cluster"

    address: str | None = None
    """Ray cluster to join; none: ``RAY_ADDRESS`` if set, else the embedded local cluster."""
    local_nodes: int = 2
    """Embedded cluster: spot nodes when no trace is replayed."""
    local_gpus: int = 0
    """Embedded cluster: GPUs declared on each node (GPU placement on a CPU machine)."""
    trace: str | None = None
    """Embedded cluster: spot trace to replay (a file or a shipped trace's name); ``moshray
    train`` replays the shipped AWS trace unless it is ``off``; ``moshray.fit`` replays none
    unless one is named."""
    time_scale: float = 60.0  # trace seconds per wall second
    """Trace seconds per wall second."""
    min_nodes: int = 1
    """Fewest spot nodes to train on; with fewer the job waits (see wait_for_nodes_s)."""
    max_nodes: int = 4
    """Spot nodes the job asks Ray's autoscaler for and trains on at most."""
    replicas_per_node: int = 0  # 0: one per GPU (GPU node) or one (CPU node)
    """Replicas on each node; 0: one per GPU on a GPU node, one on a CPU node."""
    wait_for_nodes_s: float = 600.0
    """How long the job waits for min_nodes before it exits 3."""
    notice_s: float = 120.0  # trace seconds between a spot notice and the node's removal
    """Trace seconds between a replayed spot notice and the node's removal (AWS: 120, GCP:
    30)."""
    notice_source: NoticeSourceName = "auto"
    """How each node's watcher hears spot notices; ``auto``: the metadata service the
    environment names, else the cloud the DMI vendor strings name, else a short probe."""
    hosts: HostsMode = "loopback"
    """Embedded cluster: ``loopback`` (every raylet on 127.0.0.1) or ``netns`` (each spot
    node a network namespace of its own; root)."""
    driver_lease_s: float = 120.0
    """Seconds the replicas and the Coordinator outlive a lost driver (a resubmitted job
    adopts them); then they stop by themselves, with a final checkpoint. A driver that lives
    is never reaped: a thread of its own renews the lease every quarter of this (at most
    5 s), through any save or drain."""
    dashboard: bool = False
    """Embedded cluster: start Ray's dashboard on 127.0.0.1 and print its URL."""
    replica: ReplicaUnit = "gpu"
    """What one replica is: ``gpu`` (one per GPU) or ``node`` (a replica group of one rank
    per GPU of a node, the model sharded over them; the data must be
    ``moshray.data.by_step``)."""
    group_ranks: int = 0
    """replica = node: ranks per group; 0: the GPUs of a node (2 on CPU nodes)."""

    def _validate(self) -> None:
        _non_empty(self._path("address"), self.address)
        _non_empty(self._path("trace"), self.trace)
        for name in ("local_nodes", "max_nodes", "min_nodes"):
            _positive_int(self._path(name), getattr(self, name))
        for name in ("replicas_per_node", "local_gpus", "group_ranks"):
            _check(isinstance(getattr(self, name), int) and getattr(self, name) >= 0,
                   self._path(name), "must be an integer >= 0", getattr(self, name))
        _check(self.min_nodes <= self.max_nodes, self._path("min_nodes"),
               f"must be <= cluster.max_nodes ({self.max_nodes})", self.min_nodes)
        _positive(self._path("time_scale"), self.time_scale)
        _positive(self._path("wait_for_nodes_s"), self.wait_for_nodes_s)
        _non_negative(self._path("notice_s"), self.notice_s)
        from moshray.autoscaler.notices.sources import source_names

        sources = source_names(simulated=False, sigterm=False)
        _check(self.notice_source in sources, self._path("notice_source"),
               "must be one of " + ", ".join(repr(s) for s in sources), self.notice_source)
        _positive(self._path("driver_lease_s"), self.driver_lease_s)

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
    """Checkpoint location (local dir, ``s3://``, ``gs://``); none: off on one machine, the
    cluster's ``MOSHRAY_CHECKPOINT_URI`` on several."""
    every_steps: int = 50
    """Global steps between checkpoints (and one at the end)."""
    optional: bool = False
    """On several machines, run without a durable checkpoint location."""
    run_id: str | None = None
    """This run's directory under ``uri`` (a resubmitted job resumes from it; another run's
    checkpoints are never read); none: the job's ``name``."""
    resume_from: str | None = None
    """Start from another run's newest checkpoint when this run has none: its run id under
    ``uri``, or its directory as ``<uri>/<run_id>``."""

    def _validate(self) -> None:
        from moshray.actors.replica.checkpoint import check_run_id

        _non_empty(self._path("uri"), self.uri)
        _positive_int(self._path("every_steps"), self.every_steps)
        for name in ("run_id", "resume_from"):
            value = getattr(self, name)
            if value is None:
                continue
            if name == "resume_from":  # a run id, or <uri>/<run_id>
                value = value.rstrip("/").rsplit("/", 1)[-1]
            try:
                check_run_id(value)
            except ValueError as exc:
                raise ConfigError(self._path(name), str(exc)) from None


@dataclass(frozen=True)
class MetricsSection(_Section):
    """Prometheus exporter; ``port = 0`` lets the OS choose a free port. The cost metrics
    (per hour, per sample) sum the price of each worker node the controller sees: the
    cloud's live spot price (EC2), else the shipped table (autoscaler/price_table.json),
    else ``spot_price_per_hour`` / ``on_demand_price_per_hour`` (US$ per node-hour, the
    fallback; defaults: an AWS g4dn.xlarge in us-east-1, an assumed spot price and the
    on-demand list price). ``moshray_node_price_dollars_per_hour{source}`` says which."""

    _section = "metrics"

    port: int = 0
    """Port of the job's Prometheus metrics on the head; 0: a free one (each job has its
    own; Prometheus finds them in the files the Coordinators write,
    ``/tmp/moshray/prometheus/<job>.json``)."""
    spot_price_per_hour: float = 0.16
    """US$ per spot node-hour when neither the cloud nor the price table has one."""
    on_demand_price_per_hour: float = 0.526
    """US$ per on-demand node-hour when neither the cloud nor the price table has one."""

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
_TOP_LEVEL: dict[str, Any] = {"name": str, "run_dir": str, "json": bool,
                               "save_model": bool}  # outside sections
_UNSET_UNTIL_NAMED = ("name", "run_dir")  # None until ``TrainConfig.named``


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
    name: str | None = None
    """The job's name on its cluster: its own Coordinator, lease, capacity request, metrics
    (``job`` label) and checkpoint run; resubmitting a name resumes (or adopts) that job;
    none: a unique one (``job-<UTC time>-<hex>``)."""
    run_dir: str | None = None
    """Where the run writes ``summary.json`` and ``training.png``; none: ``runs/<name>``."""
    json: bool = False  # machine-readable (JSON lines) output instead of text
    """Machine-readable output (JSON lines) instead of text."""
    save_model: bool = False
    """At the end, write the trained model's ``state_dict`` (a staying replica's, at the
    last step) to ``<run_dir>/model.pt`` (``torch.load`` it into your model)."""

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise ConfigError(name, f"must be a {cls.__name__}, got {type(value).__name__}")
        for name, tp in _TOP_LEVEL.items():
            if getattr(self, name) is None and name in _UNSET_UNTIL_NAMED:
                continue
            value = _coerce(name, getattr(self, name), tp, from_string=False)
            object.__setattr__(self, name, value)
        if self.name is not None:
            from moshray.actors.replica.checkpoint import check_run_id

            try:
                check_run_id(self.name)
            except ValueError as exc:
                raise ConfigError("name", str(exc).replace("run id", "a job's name")) from None
        if self.run_dir is not None:
            _non_empty("run_dir", self.run_dir)
        _check(not (self.save_model and self.cluster.replica == "node"), "save_model",
               "replica groups keep their model as sharded checkpoints (checkpoint.uri), not "
               "one model.pt; leave save_model off", self.save_model)

    def named(self, clock=None) -> TrainConfig:
        """This config with its job's ``name`` (a unique one if none: ``job-<UTC
        time>-<6 hex>``) and ``run_dir`` (``runs/<name>`` if none) set; what a job runs
        with. Idempotent."""
        import time
        import uuid

        name = self.name
        if name is None:
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(clock() if clock else None))
            name = f"job-{stamp}-{uuid.uuid4().hex[:6]}"
        return replace(self, name=name, run_dir=self.run_dir or f"runs/{name}")

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
