"""The Prometheus exporter: counts metrics events in a private registry and serves ``/metrics``.

Contract: a ``MetricsExporter`` applies events (``metrics_events.py``) to counters, gauges and
histograms in its own ``CollectorRegistry`` (never the process-global one, so several
exporters can live in one process); ``apply`` is thread-safe. Gauges derived from the run
(peers, global step, samples, loss, nodes and cost) are computed at scrape time from a
``state`` callable returning a ``TrainingState`` (``metrics_state.py``); a scrape still
succeeds, with zeros, if it raises. Cost is the sum of the live worker nodes' prices as the
last ``CapacityEvent`` gave them (each with its source: the cloud's live price, the shipped
table or the configured price; ``Prices`` only for nodes reported without one). ``serve``
starts a daemon HTTP thread, ``close`` stops it. Names follow Prometheus conventions:
``moshray_`` prefix, base units, ``_total`` for counters. Nothing here talks to Ray.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from moshray.cluster.metrics.events import (
    EXPERT_OUTCOMES,
    REPLICA_STATES,
    CapacityEvent,
    Event,
    ExpertCallEvent,
    JoinEvent,
    LaunchEvent,
    NodeJoinedEvent,
    NodeLostEvent,
    NoticeEvent,
    FAILURE_KINDS,
    JobFailureEvent,
    QuarantineEvent,
    RebalanceEvent,
    ReplicaStatesEvent,
    ReportedEvent,
    RoundEvent,
)
from moshray.cluster.metrics.state import Prices, TrainingState

__all__ = ["MetricsExporter", "PREFIX", "LOOPBACK", "ROUND_BUCKETS", "REBALANCE_BUCKETS",
           "JOIN_BUCKETS", "EXPERT_BUCKETS"]

# The logger keeps the name the metrics warnings have always had (moshray.cluster.metrics).
log = logging.getLogger(f"{__package__}.metrics")

PREFIX = "moshray_"
LOOPBACK = "127.0.0.1"

ROUND_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
REBALANCE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
JOIN_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
EXPERT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# -- the exporter --------------------------------------------------------------------------


class _DerivedCollector(Collector):
    """Gauges and counters computed at scrape time from the exporter's state callable."""

    def __init__(self, exporter: "MetricsExporter"):
        self.exporter = exporter

    def describe(self):  # no describe-time samples: do not call ``state`` on registration
        return []

    def collect(self):
        ex = self.exporter
        try:
            state = ex.state() if ex.state is not None else TrainingState()
        except Exception as exc:  # a scrape must not fail because the Coordinator is busy
            log.warning("metrics: training state unavailable (%s); exporting zeros", exc)
            state = TrainingState()
        spot, on_demand, node_prices = ex.capacity()
        peers = GaugeMetricFamily(PREFIX + "peers", "Averaging peers by state.",
                                  labels=["state"])
        peers.add_metric(["live"], state.live_peers)
        peers.add_metric(["draining"], state.draining_peers)
        yield peers
        yield GaugeMetricFamily(PREFIX + "global_step", "Global steps (epochs) committed.",
                                value=state.global_step)
        yield CounterMetricFamily(PREFIX + "samples_processed",
                                  "Training samples in committed global steps.",
                                  value=state.samples_total)
        yield GaugeMetricFamily(PREFIX + "samples_per_second",
                                "Samples per second over the last minute.",
                                value=state.samples_per_s)
        yield GaugeMetricFamily(PREFIX + "training_loss",
                                "Mean training loss of the last committed step.",
                                value=state.loss if state.loss is not None else math.nan)
        yield CounterMetricFamily(PREFIX + "preemptions",
                                  "Replicas lost to preemption, as the job counted them.",
                                  value=state.preemptions)
        yield GaugeMetricFamily(PREFIX + "live_experts", "Experts registered and live.",
                                value=state.live_experts)
        nodes = GaugeMetricFamily(PREFIX + "nodes", "Worker nodes by market.",
                                  labels=["market"])
        nodes.add_metric(["spot"], spot)
        nodes.add_metric(["on_demand"], on_demand)
        yield nodes
        price = GaugeMetricFamily(
            PREFIX + "node_price_dollars_per_hour",
            "Mean price of one live worker node, by market and by where the price came from "
            "(provider: the cloud's live price, table: the shipped price table, config: the "
            "configured price, also shown for a market without live nodes).",
            labels=["market", "source"])
        groups: dict[tuple[str, str], list[float]] = {}
        for market, dollars, source in node_prices:
            groups.setdefault((market, source), []).append(dollars)
        for market, configured in (("spot", ex.prices.spot_per_hour),
                                   ("on_demand", ex.prices.on_demand_per_hour)):
            if not any(m == market for m, _ in groups):
                groups[(market, "config")] = [configured]
        for (market, source), values in sorted(groups.items()):
            price.add_metric([market, source], sum(values) / len(values))
        yield price
        per_hour = sum(dollars for _, dollars, _ in node_prices)
        yield GaugeMetricFamily(PREFIX + "estimated_cost_dollars_per_hour",
                                "Sum of the live worker nodes' prices.", value=per_hour)
        per_sample = per_hour / 3600.0 / state.samples_per_s if state.samples_per_s > 0 \
            else math.nan
        yield GaugeMetricFamily(PREFIX + "estimated_cost_dollars_per_sample",
                                "Estimated cost per hour divided by samples per hour.",
                                value=per_sample)


class _Labelled:
    """A view of ``registry`` whose every sample carries ``labels`` as well (the job's name,
    so that several jobs' series stay apart in one Prometheus); what is rendered and served."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]):
        self.registry, self.labels = registry, labels

    def collect(self):
        from prometheus_client.metrics_core import Metric

        for family in self.registry.collect():
            if not self.labels:
                yield family
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                out.add_sample(s.name, {**s.labels, **self.labels}, s.value, s.timestamp,
                               s.exemplar)
            yield out


class MetricsExporter:
    """Applies events to metrics in a private registry and serves them over HTTP.

    ``state`` (optional) is called first in every scrape, from the HTTP thread, and returns a
    ``TrainingState``; if it raises, the scrape still succeeds with zeros for those gauges.
    ``apply`` is thread-safe. ``labels`` (e.g. ``{"job": name}``) are added to every series
    rendered and served.
    ``serve`` starts a daemon HTTP thread; ``close`` stops it. Nothing here talks to Ray.
    """

    def __init__(self, prices: Prices = Prices(),
                 state: Callable[[], TrainingState] | None = None,
                 labels: dict[str, str] | None = None):
        self.prices = prices
        self.state = state
        self.registry = CollectorRegistry(auto_describe=True)
        self.view = _Labelled(self.registry, dict(labels or {}))
        self._lock = threading.Lock()
        self._nodes = (0, 0)
        self._node_prices: tuple[tuple[str, float, str], ...] = ()
        self._server = None
        self._thread = None
        self.address: tuple[str, int] | None = None
        r = self.registry
        # First in the registry, so ``state`` runs first in every scrape: events it applies
        # (the Coordinator observes rebalance delays there) show up in the same scrape.
        r.register(_DerivedCollector(self))
        self.round_seconds = Histogram(
            PREFIX + "allreduce_round_duration_seconds",
            "Duration of one all-reduce call as one peer saw it.",
            buckets=ROUND_BUCKETS, registry=r)
        self.round_bytes = Counter(
            PREFIX + "allreduce_sent_bytes", "Bytes peers put into the object store for "
            "all-reduce (contributions and reduced parts).", registry=r)
        self.cross_zone_bytes = Counter(
            PREFIX + "allreduce_cross_zone_sent_bytes", "Of the all-reduce bytes sent, those "
            "sent to a peer in another zone (the slow link between zones, billed per GB).",
            registry=r)
        self.failed_rounds = Counter(
            PREFIX + "allreduce_failed_rounds",
            "All-reduce calls that did not average every participant.", registry=r)
        self.rejected = Counter(
            PREFIX + "allreduce_rejected_contributions",
            "Contributions left out of an average, by reason.", ["reason"], registry=r)
        self.notices = Counter(
            PREFIX + "preemption_notices", "Preemption notices received.",
            ["cloud", "pool"], registry=r)
        self.nodes_lost = Counter(
            PREFIX + "nodes_lost", "Worker nodes lost, with or without a notice.",
            ["notice"], registry=r)
        self.rebalance_seconds = Histogram(
            PREFIX + "rebalance_seconds",
            "Seconds from a preemption notice to the first plan without the node.",
            buckets=REBALANCE_BUCKETS, registry=r)
        self.join_seconds = Histogram(
            PREFIX + "join_to_first_contribution_seconds",
            "Seconds from a replica's start to its first averaged contribution.",
            buckets=JOIN_BUCKETS, registry=r)
        self.expert_calls = Counter(
            PREFIX + "expert_calls", "Calls to experts, by outcome.", ["outcome"], registry=r)
        self.expert_latency = Histogram(
            PREFIX + "expert_call_latency_seconds", "Latency of one call to one expert.",
            buckets=EXPERT_BUCKETS, registry=r)
        self.launches = Counter(
            PREFIX + "launches", "Node launch attempts, by pool and market.",
            ["pool", "market"], registry=r)
        self.launch_failures = Counter(
            PREFIX + "launch_failures", "Node launch attempts that failed, by pool and market.",
            ["pool", "market"], registry=r)
        self.replicas = Gauge(
            PREFIX + "replicas", "Training replicas by state (elastic controller).",
            ["state"], registry=r)
        self.nodes_joined = Counter(
            PREFIX + "nodes_joined", "Worker nodes that joined the cluster, by market.",
            ["market"], registry=r)
        self.quarantines = Counter(
            PREFIX + "quarantines", "Peers excluded from plans after repeated rejected "
            "contributions, by the rejection reason.", ["reason"], registry=r)
        self.job_failures = Counter(
            PREFIX + "job_failures", "Failures counted against the job's bounds: replicas "
            "whose loop raised, checkpoint saves that failed.", ["kind"], registry=r)
        # What training loops reported (Session.report): the user's own names go in a
        # label, so any name is safe; the newest step's value wins.
        self.reported = Gauge(
            PREFIX + "reported", "Last value a training loop reported, by name "
            "(session.report).", ["name"], registry=r)
        self.reported_step = Gauge(
            PREFIX + "reported_step", "Global step of the last reported value, by name.",
            ["name"], registry=r)
        self._reported_at: dict[str, int] = {}
        for kind in FAILURE_KINDS:
            self.job_failures.labels(kind)
        for state in REPLICA_STATES:
            self.replicas.labels(state)
        for outcome in EXPERT_OUTCOMES:  # export zeros so rate() works from the start
            self.expert_calls.labels(outcome)
        for notice in ("true", "false"):
            self.nodes_lost.labels(notice)
        self._apply = {
            RoundEvent: self._round,
            NoticeEvent: lambda e: self.notices.labels(e.cloud, e.pool).inc(),
            NodeLostEvent: lambda e: self.nodes_lost.labels(
                "true" if e.with_notice else "false").inc(),
            RebalanceEvent: lambda e: self.rebalance_seconds.observe(e.seconds),
            JoinEvent: lambda e: self.join_seconds.observe(e.seconds_to_first_contribution),
            ExpertCallEvent: self._expert_call,
            LaunchEvent: self._launch,
            CapacityEvent: self._capacity,
            ReplicaStatesEvent: self._replica_states,
            NodeJoinedEvent: lambda e: self.nodes_joined.labels(e.market).inc(),
            QuarantineEvent: lambda e: self.quarantines.labels(e.reason).inc(),
            JobFailureEvent: lambda e: self.job_failures.labels(e.kind).inc(),
            ReportedEvent: self._reported,
        }

    # events

    def apply(self, event: Event) -> None:
        """Count one event; raises TypeError for anything that is not an ``Event``."""
        handler = self._apply.get(type(event))
        if handler is None:
            raise TypeError(f"not a metrics event: {type(event).__name__}")
        handler(event)

    def apply_all(self, events: Iterable[object]) -> int:
        """Apply each event; a bad one is logged and skipped. Returns how many were applied."""
        applied = 0
        for event in events:
            try:
                self.apply(event)
                applied += 1
            except (TypeError, ValueError) as exc:
                log.warning("metrics: dropped %r (%s)", event, exc)
        return applied

    def _round(self, e: RoundEvent) -> None:
        self.round_seconds.observe(e.duration_s)
        self.round_bytes.inc(e.bytes_moved)
        self.cross_zone_bytes.inc(e.cross_zone_bytes)
        if e.failed:
            self.failed_rounds.inc()
        for reason, count in e.rejected:
            self.rejected.labels(reason).inc(count)

    def _reported(self, e: ReportedEvent) -> None:
        with self._lock:
            for name, step, value in e.rows:
                if step >= self._reported_at.get(name, -1):
                    self._reported_at[name] = step
                    self.reported.labels(name).set(value)
                    self.reported_step.labels(name).set(step)

    def _expert_call(self, e: ExpertCallEvent) -> None:
        self.expert_calls.labels(e.outcome).inc()
        self.expert_latency.observe(e.latency_s)

    def _launch(self, e: LaunchEvent) -> None:
        self.launches.labels(e.pool, e.market).inc()
        if not e.ok:
            self.launch_failures.labels(e.pool, e.market).inc()

    def _replica_states(self, e: ReplicaStatesEvent) -> None:
        counts = dict(e.counts)
        for state in REPLICA_STATES:
            self.replicas.labels(state).set(counts.get(state, 0))

    def _capacity(self, e: CapacityEvent) -> None:
        prices = e.node_prices or (
            (("spot", self.prices.spot_per_hour, "config"),) * e.spot_nodes
            + (("on_demand", self.prices.on_demand_per_hour, "config"),) * e.on_demand_nodes)
        with self._lock:
            self._nodes = (e.spot_nodes, e.on_demand_nodes)
            self._node_prices = tuple(prices)

    def nodes(self) -> tuple[int, int]:
        """(spot, on-demand) worker nodes, as last reported."""
        with self._lock:
            return self._nodes

    def capacity(self) -> tuple[int, int, tuple[tuple[str, float, str], ...]]:
        """(spot, on-demand, per-node (market, $/h, source)) as last reported; nodes reported
        without prices are priced at the configured ``Prices``."""
        with self._lock:
            return self._nodes + (self._node_prices,)

    # exposition

    def render(self) -> str:
        """The registry in Prometheus text exposition format."""
        return generate_latest(self.view).decode()

    def metric_names(self) -> frozenset[str]:
        """Every sample name this exporter can export (with _bucket/_count/_sum/_total)."""
        names = set()
        for family in self.registry.collect():
            names.add(family.name)
            for sample in family.samples:
                names.add(sample.name)
            if family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_count", "_sum"))
            if family.type == "counter":
                names.add(family.name + "_total")
        return frozenset(names)

    def serve(self, host: str = LOOPBACK, port: int = 0) -> tuple[str, int]:
        """Serve ``/metrics`` on ``host:port`` (port 0: the OS picks); returns the bound pair.

        Raises OSError if the port is taken; calling it twice raises RuntimeError.
        """
        from prometheus_client import start_http_server

        if self._server is not None:
            raise RuntimeError(f"metrics exporter already serving on {self.address}")
        if not (isinstance(port, int) and 0 <= port <= 65535):
            raise ValueError(f"metrics port must be an integer in 0..65535, got {port!r}")
        self._server, self._thread = start_http_server(port, addr=host, registry=self.view)
        self.address = (host, self._server.server_port)
        return self.address

    def close(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
            self.address = None
