"""The metrics-sink service of the Coordinator: the events replicas, watchers and the driver
send (``record``), the Prometheus exporter they feed, and the replicas' step profile.

No Ray here: the exporter's HTTP server is the only I/O (``serve``). A ``StepPhases`` goes to
the ``StepProfile``; every other event to the exporter (a bad one is logged and skipped).
The sink also counts the ``NodeLostEvent``s it was sent (the driver's node losses, for the
``moshray_preemptions`` metric and ``stats()``) and the all-reduce bytes the ``RoundEvent``s
name (all, and those sent to another zone: ``stats()``), and observes each notice's rebalance delay
once. The rows training loops reported (``ReportedEvent``) are kept in order, the newest
``reported_keep``, for the driver to read (``reported``: TensorBoard, the summary, the
user's callback); a restart forgets them. ``snapshot`` / ``restore`` carry the step profile
and the counts across a restart (the exporter's own counters start over, as Prometheus
counters may).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

from moshray.cluster import metrics
from moshray.cluster.coordinator.notices import NoticeBook
from moshray.cluster.coordinator.step_profile import StepPhases, StepProfile


class MetricsSink:
    """``state`` returns the run's ``TrainingState`` at scrape time (the core's stats)."""

    def __init__(self, prices: metrics.Prices, state: Callable[[], metrics.TrainingState],
                 profile_keep: int = 4000, reported_keep: int = 100_000,
                 labels: dict[str, str] | None = None):
        self.exporter = metrics.MetricsExporter(prices, state, labels)
        self.profile = StepProfile(profile_keep)
        self.profiled = 0  # StepPhases ever added (the profile keeps the last ``keep``)
        self.nodes_lost = 0  # NodeLostEvents received
        # all-reduce bytes sent, all and to another zone (RoundEvents), for ``stats``
        self.sent_bytes = 0
        self.cross_zone_bytes = 0
        self._rebalances_seen = 0  # rebalance clocks closed already in the histogram
        self._quarantines_seen = 0
        # (peer, name, step, value) rows reported, oldest first; ``reported_total`` ever
        self._reported: collections.deque = collections.deque(maxlen=reported_keep)
        self.reported_total = 0

    def serve(self, host: str, port: int) -> None:
        self.exporter.serve(host, port)

    @property
    def address(self) -> tuple[str, int] | None:
        return self.exporter.address

    def record(self, events: Iterable[object]) -> int:
        """Count ``events``; returns how many were applied (bad ones are skipped)."""
        phases, others = [], []
        for e in events:
            (phases if isinstance(e, StepPhases) else others).append(e)
        for p in phases:
            self.profile.add(p)
        self.profiled += len(phases)
        self.nodes_lost += sum(isinstance(e, metrics.NodeLostEvent) for e in others)
        for e in others:
            if isinstance(e, metrics.RoundEvent) and isinstance(e.bytes_moved, int) and \
                    isinstance(e.cross_zone_bytes, int):
                self.sent_bytes += max(0, e.bytes_moved)
                self.cross_zone_bytes += max(0, min(e.cross_zone_bytes, e.bytes_moved))
        for e in others:
            if isinstance(e, metrics.ReportedEvent):
                try:
                    metrics.ReportedEvent(e.peer_id, e.rows)  # (validated before it is kept)
                except ValueError:
                    continue  # the exporter logs and skips it
                self._reported.extend((e.peer_id, *row) for row in e.rows)
                self.reported_total += len(e.rows)
        return len(phases) + self.exporter.apply_all(others)

    def observe_quarantines(self, records: list) -> None:
        """Count the quarantines in ``records`` (the tracker's list, oldest first) not yet
        counted."""
        for q in records[self._quarantines_seen:]:
            self.exporter.apply(metrics.QuarantineEvent(q.reason))
        self._quarantines_seen = len(records)

    def observe_rebalances(self, notices: NoticeBook) -> None:
        """Observe each notice's rebalance delay once, when it is known (O(delays new since
        the last call); more than ``notices.RECENT`` closed between two calls: the older
        ones are not observed)."""
        for delay in notices.closed_since(self._rebalances_seen):
            self.exporter.apply(metrics.RebalanceEvent(delay))
        self._rebalances_seen = notices.closed

    def reported(self, since: int = 0) -> tuple[int, list]:
        """``(total, rows)``: the rows reported after the first ``since`` ever (those still
        kept), each ``(peer, name, step, value)``; a reader passes the total it last got."""
        first = self.reported_total - len(self._reported)
        rows = list(self._reported)[max(0, since - first):]
        return self.reported_total, rows

    def step_profile(self, since_epoch: int = 0) -> dict:
        return self.profile.summary(since_epoch)

    def snapshot(self) -> dict:
        """The counts (the profile rows and ``profiled``, their count, travel apart, as an
        append log: ``restore``'s ``profile_rows``)."""
        return {"nodes_lost": self.nodes_lost, "sent_bytes": self.sent_bytes,
                "cross_zone_bytes": self.cross_zone_bytes,
                "rebalances_seen": self._rebalances_seen,
                "quarantines_seen": self._quarantines_seen}

    def restore(self, snap: dict, profile_rows: Iterable[StepPhases] = ()) -> None:
        self.nodes_lost = int(snap.get("nodes_lost", 0))
        self.sent_bytes = int(snap.get("sent_bytes", 0))
        self.cross_zone_bytes = int(snap.get("cross_zone_bytes", 0))
        self.profiled = int(snap.get("profiled", 0))
        seen = snap.get("rebalances_seen", 0)  # (a list of nodes in older records)
        self._rebalances_seen = len(seen) if isinstance(seen, list) else int(seen)
        self._quarantines_seen = int(snap.get("quarantines_seen", 0))
        for p in profile_rows:
            self.profile.add(p)
