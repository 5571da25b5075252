"""What the elastic controller sees, as plain frozen data (no Ray in here).

The controller's shell (``jobs/controller/elastic.py``) reads Ray's node table, the Coordinator's
membership and the replicas' run refs into an ``Observation``;
``jobs/controller/reconcile.py`` decides from it. ``node_view`` turns one row of ``ray.nodes()`` into a ``NodeView`` (pure, so the
parsing is tested with plain dicts).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moshray.cluster.placement import (
    CLOUD_LABEL,
    HEAD_RESOURCE,
    INSTANCE_TYPE_LABEL,
    LEGACY_MARKET_LABEL,
    MARKET_LABEL,
    SPOT_RESOURCE,
    ZONE_LABEL,
)


class Market(str, enum.Enum):
    SPOT = "spot"
    ON_DEMAND = "on-demand"


@dataclass(frozen=True)
class NodeView:
    """One Ray node. ``worker``: a node replicas may use (it carries the ``spot`` market
    resource, which spot and on-demand-fallback workers both declare; the head never).
    ``draining``: Ray is draining it (a notice's DrainNode, or an autoscaler scale-down).
    ``address``: the machine (NodeManagerAddress); two nodes with different addresses are
    different machines. ``market``, ``cloud``, ``instance_type`` and ``zone`` come from the
    node's labels (cluster/placement.py); a node without a market label counts as spot, and
    ``""`` means the label is absent (its price is then the configured one)."""

    node_id: str
    alive: bool
    worker: bool
    market: Market = Market.SPOT
    gpus: float = 0.0
    address: str = ""
    draining: bool = False
    slot: int | None = None  # the embedded cluster's slot label, for display only
    cloud: str = ""  # aws | gcp
    instance_type: str = ""  # e.g. g4dn.xlarge
    zone: str = ""  # e.g. us-east-1a


@dataclass(frozen=True)
class ReplicaError:
    """What a replica's ``run()`` raised (not a ``UserError``, which stops the job at once):
    the exception's class name, its message on one line, and the remote traceback as Ray
    reported it. ``signature`` is what "the same failure" means: class and message."""

    type_name: str
    message: str
    traceback: str = ""

    @property
    def signature(self) -> tuple[str, str]:
        return self.type_name, self.message

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}" if self.message else self.type_name


class RunOutcome(str, enum.Enum):
    RUNNING = "running"  # run() has not returned
    FINISHED = "finished"  # run() returned (told to stop)
    RAISED = "raised"  # run() raised while its actor lived
    DIED = "died"  # the actor (or its node) died


@dataclass(frozen=True)
class ReplicaView:
    """One replica the controller started, as the Coordinator and its run ref show it."""

    replica_id: str
    outcome: RunOutcome = RunOutcome.RUNNING
    member: bool = False  # registered with the Coordinator (not left, not expired)
    ready: bool = False  # holds the swarm's state: takes part in the next plan
    draining: bool = False  # the Coordinator excludes it (its node got a notice)
    error: ReplicaError | None = None  # what run() raised (outcome RAISED)


@dataclass(frozen=True)
class Observation:
    """Everything ``reconcile.decide`` looks at, taken at ``now_s`` (controller clock)."""

    now_s: float
    nodes: tuple[NodeView, ...]
    replicas: tuple[ReplicaView, ...] = ()
    noticed_nodes: frozenset[str] = frozenset()  # nodes the Coordinator got a notice for

    def node(self, node_id: str) -> NodeView | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def replica(self, replica_id: str) -> ReplicaView | None:
        return next((r for r in self.replicas if r.replica_id == replica_id), None)

    @property
    def machines(self) -> frozenset[str]:
        """Distinct machines among the live nodes (by address)."""
        return frozenset(n.address for n in self.nodes if n.alive and n.address)


def market_of(labels: Mapping[str, str]) -> Market:
    """The market a node's labels name: Ray's ``ray.io/market-type``, else the older
    ``moshray-market``; ``on-demand`` in any case, with ``_`` or ``-``, is on-demand, anything
    else (absent included) spot."""
    value = labels.get(MARKET_LABEL) or labels.get(LEGACY_MARKET_LABEL) or ""
    return Market.ON_DEMAND if str(value).strip().lower().replace("_", "-") == "on-demand" \
        else Market.SPOT


def node_view(row: Mapping[str, Any], draining: frozenset[str] = frozenset()) -> NodeView:
    """A ``NodeView`` of one ``ray.nodes()`` row; ``draining``: node ids Ray is draining."""
    resources = row.get("Resources") or {}
    labels = row.get("Labels") or {}
    worker = resources.get(SPOT_RESOURCE, 0) > 0 and HEAD_RESOURCE not in resources
    slot = labels.get("moshray-slot")
    return NodeView(
        node_id=row["NodeID"], alive=bool(row.get("Alive")), worker=worker,
        market=market_of(labels),
        gpus=float(resources.get("GPU", 0.0)), address=str(row.get("NodeManagerAddress", "")),
        draining=row["NodeID"] in draining,
        slot=int(slot) if isinstance(slot, str) and slot.isdigit() else None,
        cloud=str(labels.get(CLOUD_LABEL, "")),
        instance_type=str(labels.get(INSTANCE_TYPE_LABEL, "")),
        zone=str(labels.get(ZONE_LABEL, "")))


@dataclass(frozen=True)
class Memory:
    """What the controller remembers between observations (plain data for ``decide``).

    ``replicas``: ``(replica_id, node_id, state, num_gpus)`` of every replica not yet gone;
    ``known_nodes``: worker nodes seen alive and not yet reported lost, with the time first
    seen; ``failures``: per node, ``(count, last_at_s)`` of replicas that failed while it
    stayed up; ``requested_nodes``: the last capacity request (None: none made yet);
    ``job_failures``: ``(replica_id, node_id, error)`` of every replica whose ``run()``
    raised, across the job (``training.max_failures`` bounds them); ``checkpoint_failures``:
    checkpoint saves that failed since the last one that succeeded.
    """

    replicas: tuple[tuple[str, str, str, float], ...] = ()
    known_nodes: tuple[tuple[str, float], ...] = ()
    failures: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    requested_nodes: int | None = None
    started_at_s: Mapping[str, float] = field(default_factory=dict)  # replica -> start time
    job_failures: tuple[tuple[str, str, ReplicaError], ...] = ()
    checkpoint_failures: int = 0
