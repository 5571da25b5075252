"""Prometheus metrics: the typed events peers report and the exporter that counts them.

Replicas, experts, preemption watchers and NodeProviders describe what happened as small
frozen dataclasses (``RoundEvent``, ``NoticeEvent``, ...) and send tuples of them to the
Coordinator's ``record`` (fire-and-forget). The Coordinator owns one ``MetricsExporter``,
which applies events to counters and histograms in its own ``CollectorRegistry`` (never the
process-global one, so several exporters can live in one process) and serves ``/metrics``
over HTTP. State the Coordinator already holds (peers, global step, samples, loss) is not
reported as events: a ``state`` callable passed to the exporter returns a ``TrainingState``
at scrape time.

Who sends what (``coordinator.record.remote((event, ...))``):

- a replica, after each ``Averager.all_reduce``: ``RoundEvent.from_report(report)``; once,
  after its first averaged step: ``JoinEvent(seconds since it started)``; it sends them in
  batches, at most once a second (``actors/metrics_outbox.MetricsOutbox``), so they arrive
  up to a second late (every event carries its own measurement, not its arrival time);
- the training job / watcher: ``NoticeEvent(cloud, pool)`` per preemption notice,
  ``NodeLostEvent(with_notice)`` per lost node, ``CapacityEvent(spot, on_demand, node_prices)``
  on change (each live worker's $/h and where it came from);
- the mixture layer: ``ExpertCallEvent(outcome, latency_s)`` per expert call (batch them);
- a NodeProvider: ``LaunchEvent(pool, ok, market)`` per launch attempt.

The rebalance delay (notice -> first plan without the node) and live experts come from the
Coordinator's own records.

Names follow Prometheus conventions: ``moshray_`` prefix, base units (seconds, bytes),
``_total`` for counters. Costs are in dollars. Every event validates its fields on
construction and raises ``ValueError`` with a one-line message naming the bad field.
"""

from __future__ import annotations

# Split by role; this module keeps every name importable from ``moshray.cluster.metrics``
# (each role module's ``__all__`` lists its public names):
#   metrics_events.py    the typed events (validated, pickled to the Coordinator), Event,
#                        EXPERT_OUTCOMES, MARKETS, REPLICA_STATES
#   metrics_state.py     Prices, TrainingState, training_state
#   metrics_exporter.py  MetricsExporter (events -> Prometheus registry, /metrics over HTTP),
#                        PREFIX, LOOPBACK and the histogram buckets
from moshray.cluster.metrics.events import *  # noqa: F403
from moshray.cluster.metrics.exporter import *  # noqa: F403
from moshray.cluster.metrics.state import *  # noqa: F403
