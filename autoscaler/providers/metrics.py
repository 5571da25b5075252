"""What the spot NodeProviders did, as Prometheus metrics, scrapeable from Ray's autoscaler.

The providers run inside Ray's autoscaler process on the head node (the monitor), where
nothing of moshray's own exporter lives. So they keep their own registry (:data:`REGISTRY`,
not prometheus_client's global one, which Ray's process may use for its own metrics) and serve
it over HTTP on a loopback port of the head (:func:`serve`, once per process and port; the
head's Prometheus scrapes ``localhost:<provider.metrics_port>``).

Metrics (all prefixed ``moshray_provider_``; ``pool`` is the pool key of
:func:`moshray.autoscaler.pools.encode_pool`, which names the cloud, zone, type and market):

* ``launches_total{cloud, pool}``: nodes launched.
* ``launch_failures_total{cloud, pool, code, capacity}``: launch attempts a pool refused
  (``capacity="true"``: no capacity / price / quota, the launch moved on to another pool) or
  that failed as a bad request (``capacity="false"``).
* ``terminations_total{cloud, pool}``: nodes this provider terminated (scale-down, release).
* ``preemptions_total{cloud, pool}``: spot nodes the cloud reclaimed.
* ``errors_total{cloud, operation}``: every error the provider collected instead of raising.
* ``spot_price_dollars{pool}``: the spot price per hour of each spot pool
  (:mod:`moshray.autoscaler.clouds.prices`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
REGISTRY = CollectorRegistry(auto_describe=True)

LAUNCHES = Counter("moshray_provider_launches", "Nodes launched by the NodeProvider, by pool",
                   ["cloud", "pool"], registry=REGISTRY)
LAUNCH_FAILURES = Counter(
    "moshray_provider_launch_failures",
    "Launch attempts that failed in a pool (capacity=true: the pool refused and the launch "
    "moved on)", ["cloud", "pool", "code", "capacity"], registry=REGISTRY)
TERMINATIONS = Counter("moshray_provider_terminations",
                       "Nodes the NodeProvider terminated, by pool", ["cloud", "pool"],
                       registry=REGISTRY)
PREEMPTIONS = Counter("moshray_provider_preemptions",
                      "Spot nodes the cloud reclaimed, as the NodeProvider noticed them",
                      ["cloud", "pool"], registry=REGISTRY)
ERRORS = Counter("moshray_provider_errors", "Errors the NodeProvider collected, by operation",
                 ["cloud", "operation"], registry=REGISTRY)
SPOT_PRICE = Gauge("moshray_provider_spot_price_dollars", "Spot price per hour of the pool (USD)",
                   ["pool"], registry=REGISTRY)

_servers: dict[int, tuple[object, int]] = {}  # requested port -> (server, bound port)
_lock = threading.Lock()


def launched(cloud: str, pool: str, count: int) -> None:
    LAUNCHES.labels(cloud, pool).inc(count)


def launch_failed(cloud: str, pool: str, code: str, capacity: bool) -> None:
    LAUNCH_FAILURES.labels(cloud, pool, code, "true" if capacity else "false").inc()


def terminated(cloud: str, pool: str | None) -> None:
    TERMINATIONS.labels(cloud, pool or "unknown").inc()


def preempted(cloud: str, pool: str) -> None:
    PREEMPTIONS.labels(cloud, pool).inc()


def error(cloud: str, operation: str) -> None:
    ERRORS.labels(cloud, operation).inc()


def set_spot_prices(prices: Mapping[str, float]) -> None:
    """Set the gauge of each pool in ``prices`` (pool key -> USD per hour)."""
    for pool, price in prices.items():
        SPOT_PRICE.labels(pool).set(price)


def serve(port: int, host: str = LOOPBACK) -> int | None:
    """Serve :data:`REGISTRY` on ``host:port`` (a daemon thread); idempotent per process and
    port. Returns the bound port (``port=0`` picks a free one), or None when the port cannot
    be bound (logged: metrics are not worth failing the autoscaler for)."""
    with _lock:
        if port in _servers:
            return _servers[port][1]
        try:
            server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
        except OSError as exc:
            log.warning("provider metrics: cannot serve on %s:%d: %s", host, port, exc)
            return None
        bound = server.server_address[1]
        _servers[port] = (server, bound)
        log.info("provider metrics: serving on http://%s:%d/metrics", host, bound)
        return bound


def stop(port: int) -> None:
    """Stop the endpoint :func:`serve` started for ``port`` (tests; a no-op if none)."""
    with _lock:
        entry = _servers.pop(port, None)
    if entry is not None:
        server = entry[0]
        server.shutdown()  # type: ignore[attr-defined]
        server.server_close()  # type: ignore[attr-defined]
