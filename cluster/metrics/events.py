"""Metrics events: what replicas, experts, watchers and NodeProviders report happened.

Contract: each event is a small frozen dataclass that validates its fields on construction
and raises ``ValueError`` with a one-line message naming the bad field. Events are pickled
and sent to the Coordinator's ``record`` (fire-and-forget), where the ``MetricsExporter``
(``metrics_exporter.py``) counts them; both sides must run this same code. ``Event`` is the
union of every event type. Pure: no Prometheus, no Ray.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Union

from moshray.cluster.messages import AllReduceReport

__all__ = ["EXPERT_OUTCOMES", "MARKETS", "PRICE_SOURCES", "REPLICA_STATES", "Event",
           "RoundEvent", "NoticeEvent", "NodeLostEvent", "RebalanceEvent", "JoinEvent",
           "ExpertCallEvent", "LaunchEvent", "CapacityEvent", "ReplicaStatesEvent",
           "NodeJoinedEvent", "QuarantineEvent", "JobFailureEvent", "FAILURE_KINDS",
           "ReportedEvent", "REPORTED_NAME_MAX"]

EXPERT_OUTCOMES = ("ok", "timeout", "failed", "rejected")
MARKETS = ("spot", "on_demand")
PRICE_SOURCES = ("provider", "table", "config")  # autoscaler/clouds/prices.py PriceSource values


def _seconds(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


def _count(name: str, value: int) -> None:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _label(name: str, value: str) -> None:
    if not (isinstance(value, str) and value):
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")


def _market(value: str) -> None:
    if value not in MARKETS:
        raise ValueError(f"market must be one of {MARKETS}, got {value!r}")


# -- events --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundEvent:
    """One peer's view of one all-reduce call (sent by each replica after each step).

    ``rejected`` holds (reason, count) pairs, reason being a ``RejectReason`` value;
    ``failed`` is true when the round did not average everyone (a rejection, an owner that
    died, or a contributor present in only some parts). ``cross_zone_bytes``: of
    ``bytes_moved``, those sent to peers of another zone (``AllReduceReport``).
    """

    duration_s: float
    bytes_moved: int
    rejected: tuple[tuple[str, int], ...] = ()
    failed: bool = False
    cross_zone_bytes: int = 0

    def __post_init__(self) -> None:
        _seconds("duration_s", self.duration_s)
        _count("bytes_moved", self.bytes_moved)
        _count("cross_zone_bytes", self.cross_zone_bytes)
        if self.cross_zone_bytes > self.bytes_moved:
            raise ValueError(f"cross_zone_bytes ({self.cross_zone_bytes}) exceeds bytes_moved "
                             f"({self.bytes_moved})")
        for pair in self.rejected:
            if not (isinstance(pair, tuple) and len(pair) == 2):
                raise ValueError(f"rejected must hold (reason, count) pairs, got {pair!r}")
            _label("rejection reason", pair[0])
            _count("rejection count", pair[1])

    @classmethod
    def from_report(cls, report: AllReduceReport) -> "RoundEvent":
        """The event for one ``Averager.all_reduce`` report (bytes moved = bytes sent)."""
        counts: dict[str, int] = {}
        for r in report.rejections:
            reason = getattr(r.reason, "value", str(r.reason))
            counts[reason] = counts.get(reason, 0) + 1
        return cls(
            duration_s=max(0.0, float(report.seconds)),
            bytes_moved=int(report.bytes_sent),
            rejected=tuple(sorted(counts.items())),
            failed=not report.complete,
            cross_zone_bytes=int(report.cross_zone_bytes),
        )


@dataclass(frozen=True)
class NoticeEvent:
    """A preemption notice arrived for a node in ``pool`` of ``cloud`` (aws, gcp, simulated)."""

    cloud: str
    pool: str

    def __post_init__(self) -> None:
        _label("cloud", self.cloud)
        _label("pool", self.pool)


@dataclass(frozen=True)
class NodeLostEvent:
    """A worker node is gone; ``with_notice`` is false for a kill nobody announced."""

    with_notice: bool

    def __post_init__(self) -> None:
        if not isinstance(self.with_notice, bool):
            raise ValueError(f"with_notice must be a bool, got {self.with_notice!r}")


@dataclass(frozen=True)
class RebalanceEvent:
    """Seconds from a preemption notice to the first plan that excludes the node."""

    seconds: float

    def __post_init__(self) -> None:
        _seconds("seconds", self.seconds)


@dataclass(frozen=True)
class JoinEvent:
    """Seconds from a replica's start (registration) to its first averaged contribution."""

    seconds_to_first_contribution: float

    def __post_init__(self) -> None:
        _seconds("seconds_to_first_contribution", self.seconds_to_first_contribution)


@dataclass(frozen=True)
class ExpertCallEvent:
    """One call from a mixture layer to one expert: outcome in ``EXPERT_OUTCOMES``."""

    outcome: str
    latency_s: float

    def __post_init__(self) -> None:
        if self.outcome not in EXPERT_OUTCOMES:
            raise ValueError(f"outcome must be one of {EXPERT_OUTCOMES}, got {self.outcome!r}")
        _seconds("latency_s", self.latency_s)


@dataclass(frozen=True)
class LaunchEvent:
    """A NodeProvider launch attempt in ``pool`` on ``market`` (spot or on_demand)."""

    pool: str
    ok: bool
    market: str = "spot"

    def __post_init__(self) -> None:
        _label("pool", self.pool)
        _market(self.market)
        if not isinstance(self.ok, bool):
            raise ValueError(f"ok must be a bool, got {self.ok!r}")


@dataclass(frozen=True)
class CapacityEvent:
    """How many worker nodes run now on each market, and what each costs (a gauge, last
    value wins).

    ``node_prices``: one ``(market, dollars_per_hour, source)`` per live worker node, source
    in ``PRICE_SOURCES`` (autoscaler/clouds/prices.py ``PriceSource``: the cloud's live price, the
    shipped table, or the configured price); its markets must add up to the two counts.
    Empty: the exporter prices every node at its configured ``Prices`` (source ``config``).
    """

    spot_nodes: int
    on_demand_nodes: int
    node_prices: tuple[tuple[str, float, str], ...] = ()

    def __post_init__(self) -> None:
        _count("spot_nodes", self.spot_nodes)
        _count("on_demand_nodes", self.on_demand_nodes)
        for row in self.node_prices:
            if not (isinstance(row, tuple) and len(row) == 3):
                raise ValueError(f"node_prices must hold (market, dollars_per_hour, source) "
                                 f"triples, got {row!r}")
            market, price, source = row
            _market(market)
            if isinstance(price, bool) or not (isinstance(price, (int, float))
                                               and math.isfinite(price) and price >= 0):
                raise ValueError(f"node price must be a finite number of dollars >= 0, "
                                 f"got {price!r}")
            if source not in PRICE_SOURCES:
                raise ValueError(f"price source must be one of {PRICE_SOURCES}, "
                                 f"got {source!r}")
        if self.node_prices:
            spot = sum(1 for row in self.node_prices if row[0] == "spot")
            if (spot, len(self.node_prices) - spot) != (self.spot_nodes, self.on_demand_nodes):
                raise ValueError(f"node_prices name {spot} spot and "
                                 f"{len(self.node_prices) - spot} on-demand nodes, the counts "
                                 f"say {self.spot_nodes} and {self.on_demand_nodes}")


REPLICA_STATES = ("starting", "syncing", "training", "leaving")


@dataclass(frozen=True)
class ReplicaStatesEvent:
    """How many replicas the elastic controller holds in each live state (a gauge)."""

    counts: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        for state, n in self.counts:
            if state not in REPLICA_STATES:
                raise ValueError(f"replica state must be one of {REPLICA_STATES}, got {state!r}")
            _count(state, n)


@dataclass(frozen=True)
class NodeJoinedEvent:
    """A worker node joined the cluster (seen by the elastic controller)."""

    market: str = "spot"

    def __post_init__(self) -> None:
        _market(self.market)


@dataclass(frozen=True)
class QuarantineEvent:
    """A peer left the plans because others kept rejecting its contributions."""

    reason: str

    def __post_init__(self) -> None:
        _label("reason", self.reason)


FAILURE_KINDS = ("replica", "checkpoint")


@dataclass(frozen=True)
class JobFailureEvent:
    """A failure the job counts against its bounds (``jobs/controller/reconcile.py`` rule
    6): a replica whose loop raised (``replica``), or a checkpoint save that failed
    (``checkpoint``). Sent by the elastic controller."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in FAILURE_KINDS:
            raise ValueError(f"kind must be one of {FAILURE_KINDS}, got {self.kind!r}")


REPORTED_NAME_MAX = 200  # characters of a reported metric's name


@dataclass(frozen=True)
class ReportedEvent:
    """What a training loop reported (``Session.report``): ``rows`` of ``(name, step,
    value)``, the last value of each name since the replica's previous event, with the
    global step it was reported at. Sent by the replica (``actors/replica/step_manager``)."""

    peer_id: str
    rows: tuple[tuple[str, int, float], ...]

    def __post_init__(self) -> None:
        _label("peer_id", self.peer_id)
        for row in self.rows:
            if not (isinstance(row, tuple) and len(row) == 3):
                raise ValueError(f"rows must hold (name, step, value) triples, got {row!r}")
            name, step, value = row
            if not (isinstance(name, str) and 0 < len(name) <= REPORTED_NAME_MAX):
                raise ValueError(f"reported name must be a string of 1 to "
                                 f"{REPORTED_NAME_MAX} characters, got {name!r}")
            _count("reported step", step)
            if not (isinstance(value, float) and math.isfinite(value)):
                raise ValueError(f"reported {name!r} must be a finite float, got {value!r}")


Event = Union[RoundEvent, NoticeEvent, NodeLostEvent, RebalanceEvent, JoinEvent,
              ExpertCallEvent, LaunchEvent, CapacityEvent, ReplicaStatesEvent, NodeJoinedEvent,
              QuarantineEvent, JobFailureEvent, ReportedEvent]
