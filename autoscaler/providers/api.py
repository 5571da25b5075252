"""What the spot NodeProviders for Ray's autoscaler share; the clouds differ only in transport.

A subclass (``clouds/aws/provider.py``, ``clouds/gcp/provider.py``; each cloud's bundle
names it, ``clouds/base.py``) implements six small hooks that talk to its cloud (list, fetch,
launch in one pool, terminate, tag, default pool); this base turns them into Ray's
``NodeProvider`` contract and carries out the :class:`~moshray.autoscaler.pools.PoolSelector`'s
decisions:

* ``create_node`` asks the selector for a plan, launches in the first pool, records the
  outcome (launched / capacity error) in the pool history and asks again for what is left,
  until every node is launched or no pool may be tried. Workers go through the configured
  spot pools (and the on-demand fallback within budget); the head is launched on-demand in
  the pool its ``node_config`` names. Every launch attempt carries an idempotency token
  (EC2 ClientToken / GCE requestId) derived from one id per ``create_node`` call, so a
  retried request cannot launch twice.
* ``non_terminated_nodes`` lists the cluster's instances (by the ``moshray-cluster`` tag),
  and notices preemptions: a spot node that the cloud ended (the cloud says so, or a node seen
  running vanished) while this provider did not terminate it is a ``PREEMPTED`` event of its
  pool, so the selector steers away from that pool.
* ``post_process`` (the end of each of Ray's autoscaler updates) serves the providers'
  metrics on the head's loopback (providers/metrics.py: launches, launch failures,
  terminations and preemptions by pool) and refreshes the spot price gauges (clouds/prices.py).
* ``bootstrap_config`` (``ray up``) gives every node type its identity (instance profile /
  service account) from the provider config (providers/config.py).

Assumptions written down (as in Ray's autoscaler v2 provider interface): listings are
eventually consistent, so nodes launched here are served from a local record until the
listing shows them (``visibility_grace_s``); requests are idempotent; errors are collected in
:attr:`SpotNodeProviderBase.errors` and logged rather than raised into the autoscaler loop,
except where Ray's contract wants an exception: a ``create_node`` that launched nothing
raises ``NodeLaunchException`` (Ray shows it as a failed launch), and a first listing that
fails raises (there is no earlier listing to fall back on).

Node records and errors are in providers/records.py, pool placement (``create_node``,
``release_on_demand``) in providers/placement.py.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ray.autoscaler.node_provider import NodeProvider
from ray.autoscaler.tags import NODE_KIND_HEAD

from moshray.autoscaler.pools import EventKind, Market, Pool, PoolSelector
import moshray.autoscaler.providers.metrics as provider_metrics
from moshray.autoscaler.clouds.prices import Fetch, PriceConfig, SpotPrices
from moshray.autoscaler.providers.config import PlacementConfig, bootstrap_identity, metrics_port
from moshray.autoscaler.providers.placement import SpotPlacementMixin
from moshray.autoscaler.providers.records import LaunchError, NodeRecord, PoolHistory, ProviderError

log = logging.getLogger(__name__)


def _matches(tags: Mapping[str, str], tag_filters: Mapping[str, str]) -> bool:
    return all(tags.get(k) == v for k, v in tag_filters.items())


class SpotNodeProviderBase(SpotPlacementMixin, NodeProvider):
    """Ray ``NodeProvider`` for spot pools; subclasses implement the ``_cloud_*`` hooks.

    ``clock`` (seconds) is injectable for tests; Ray constructs providers with two
    positional arguments only, so production uses ``time.time``.
    """

    cloud: str = ""
    max_terminate_nodes = 1000

    def __init__(self, provider_config: dict[str, Any], cluster_name: str, *,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__(provider_config, cluster_name)
        self.placement = PlacementConfig.from_provider_config(self.cloud, provider_config)
        self.history = PoolHistory(self.placement.selector.horizon_s)
        self.errors: collections.deque[ProviderError] = collections.deque(maxlen=500)
        self._clock = clock
        self._lock = threading.RLock()
        self._launch_lock = threading.Lock()
        self._nodes: dict[str, NodeRecord] = {}  # live nodes: last listing + own launches
        self._unlisted: dict[str, float] = {}  # own launches the listing has not shown yet
        self._seen_live: set[str] = set()  # nodes a listing showed live at least once
        self._terminated_by_us: set[str] = set()
        self._counted_preempted: set[str] = set()
        self._listed_once = False
        self._selectors: dict[tuple[Pool, ...], PoolSelector] = {}
        self.metrics_port = metrics_port(provider_config)
        self.prices = SpotPrices(PriceConfig.from_provider_config(provider_config),
                                 self._price_fetch(), clock)

    # ------------------------------------------------------------------ cloud hooks
    def _cloud_list(self) -> list[NodeRecord]:
        """All instances carrying this cluster's CLUSTER_TAG, in any state the cloud still
        reports (terminated ones included, so preemptions can be seen). Raises on API error."""
        raise NotImplementedError

    def _cloud_fetch(self, node_id: str) -> NodeRecord | None:
        """One instance, or None if the cloud does not know it. Raises on API error."""
        raise NotImplementedError

    def _cloud_launch(self, pool: Pool, node_config: dict[str, Any], tags: dict[str, str],
                      count: int, token: str) -> list[NodeRecord]:
        """Launch exactly ``count`` nodes in ``pool`` with ``tags``; ``token`` is unique per
        attempt and the same on a retry of that attempt. Raises :class:`LaunchError`."""
        raise NotImplementedError

    def _cloud_terminate(self, records: list[NodeRecord]) -> None:
        raise NotImplementedError

    def _cloud_set_tags(self, record: NodeRecord, tags: dict[str, str]) -> None:
        """Set ``tags`` (the node's full new tag set) on the instance. Raises on API error."""
        raise NotImplementedError

    def _price_fetch(self) -> Fetch | None:
        """The cloud's spot price history (see prices.py), or None: configured prices only."""
        return None

    def _default_pool(self, node_config: Mapping[str, Any]) -> Pool:
        """The pool ``node_config`` itself names (its instance type and zone); the head is
        launched there, and workers too when no pools are configured."""
        raise NotImplementedError

    # ------------------------------------------------------------------ bookkeeping
    def _record_error(self, operation: str, code: str, message: str,
                      pool: str | None = None) -> ProviderError:
        err = ProviderError(self._clock(), operation, code, message, pool)
        self.errors.append(err)
        provider_metrics.error(self.cloud, operation)
        log.warning("%s provider: %s failed%s: %s: %s", self.cloud, operation,
                    f" in pool {pool}" if pool else "", code, message)
        return err

    def _refresh(self) -> list[NodeRecord]:
        """List the cloud, update the local records and count preemptions."""
        records = self._cloud_list()
        now = self._clock()
        grace = self.placement.visibility_grace_s
        with self._lock:
            self._listed_once = True
            listed = {r.node_id: r for r in records}
            for rec in records:
                if rec.live:
                    self._seen_live.add(rec.node_id)
                    self._unlisted.pop(rec.node_id, None)
                elif self._is_preemption(rec):
                    self._count_preemption(rec, now, rec.state_reason or "reclaimed")
            # A node once listed live that is gone from the listing, not terminated by us.
            for node_id, rec in list(self._nodes.items()):
                if node_id in listed or node_id in self._unlisted:
                    continue
                if node_id in self._seen_live and self._is_preemption(rec, vanished=True):
                    self._count_preemption(rec, now, "vanished")
            nodes = {r.node_id: r for r in records if r.live}
            for node_id, launched in list(self._unlisted.items()):
                if node_id in listed or now - launched > grace:
                    self._unlisted.pop(node_id)  # listed (maybe already ended) or lost
                elif node_id in self._nodes:
                    nodes[node_id] = self._nodes[node_id]
            self._nodes = nodes
        return records

    def _is_preemption(self, rec: NodeRecord, vanished: bool = False) -> bool:
        return (
            rec.node_id not in self._terminated_by_us
            and rec.node_id not in self._counted_preempted
            and rec.market == Market.SPOT.value
            and rec.pool is not None
            and (vanished or rec.reclaimed)
        )

    def _count_preemption(self, rec: NodeRecord, now: float, detail: str) -> None:
        self._counted_preempted.add(rec.node_id)
        self.history.record(rec.pool, EventKind.PREEMPTED, now, detail)
        provider_metrics.preempted(self.cloud, rec.pool)
        log.info("%s provider: node %s of pool %s was preempted (%s)", self.cloud,
                 rec.node_id, rec.pool, detail)

    def _record(self, node_id: str) -> NodeRecord | None:
        with self._lock:
            rec = self._nodes.get(node_id)
        if rec is not None:
            return rec
        try:
            rec = self._cloud_fetch(node_id)
        except Exception as exc:  # noqa: BLE001 - collected, the caller gets None
            self._record_error("fetch", type(exc).__name__, str(exc))
            return None
        if rec is not None and rec.live:
            with self._lock:
                self._nodes.setdefault(node_id, rec)
        return rec

    # ------------------------------------------------------------------ NodeProvider API
    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        """Live nodes of this cluster matching ``tag_filters``. A failed listing is collected
        and answered from the last good one (raised only if there never was one)."""
        try:
            self._refresh()
        except Exception as exc:  # noqa: BLE001 - see docstring
            self._record_error("list", type(exc).__name__, str(exc))
            if not self._listed_once:
                raise
        with self._lock:
            return [nid for nid, rec in self._nodes.items() if _matches(rec.tags, tag_filters)]

    def is_running(self, node_id: str) -> bool:
        rec = self._record(node_id)
        return rec is not None and rec.running

    def is_terminated(self, node_id: str) -> bool:
        rec = self._record(node_id)
        return rec is None or not rec.live

    def node_tags(self, node_id: str) -> dict[str, str]:
        rec = self._record(node_id)
        if rec is None:
            raise KeyError(f"unknown node {node_id!r}")
        return dict(rec.tags)

    def internal_ip(self, node_id: str) -> str | None:
        rec = self._record(node_id)
        if rec is not None and rec.internal_ip is None:
            rec = self._refetch(node_id) or rec
        return None if rec is None else rec.internal_ip

    def external_ip(self, node_id: str) -> str | None:
        rec = self._record(node_id)
        if rec is not None and rec.external_ip is None:
            rec = self._refetch(node_id) or rec
        return None if rec is None else rec.external_ip

    def _refetch(self, node_id: str) -> NodeRecord | None:
        try:
            rec = self._cloud_fetch(node_id)
        except Exception as exc:  # noqa: BLE001 - collected
            self._record_error("fetch", type(exc).__name__, str(exc))
            return None
        if rec is not None and rec.live:
            with self._lock:
                self._nodes[node_id] = rec
        return rec

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        """Merge ``tags`` into the node's tags (locally at once; a cloud error is collected)."""
        rec = self._record(node_id)
        if rec is None:
            self._record_error("set_tags", "UnknownNode", f"node {node_id} not found")
            return
        merged = {**rec.tags, **tags}
        new = dataclasses.replace(rec, tags=merged)
        with self._lock:
            if node_id in self._nodes:
                self._nodes[node_id] = new
        try:
            self._cloud_set_tags(rec, merged)
        except Exception as exc:  # noqa: BLE001 - collected
            self._record_error("set_tags", type(exc).__name__, str(exc), rec.pool)

    def terminate_node(self, node_id: str) -> None:
        self.terminate_nodes([node_id])

    def terminate_nodes(self, node_ids: list[str]) -> None:
        """Terminate (errors collected, not raised). Nodes terminated here are never counted
        as preemptions."""
        records = []
        with self._lock:
            for node_id in node_ids:
                self._terminated_by_us.add(node_id)
                rec = self._nodes.pop(node_id, None)
                self._unlisted.pop(node_id, None)
                records.append(rec)
        missing = [nid for nid, rec in zip(node_ids, records) if rec is None]
        for node_id in missing:  # not in the cache (e.g. provider restarted): look it up
            rec = self._record(node_id)
            with self._lock:
                self._nodes.pop(node_id, None)
            if rec is not None:
                records[node_ids.index(node_id)] = rec
        known = [rec for rec in records if rec is not None]
        for start in range(0, len(known), self.max_terminate_nodes):
            batch = known[start:start + self.max_terminate_nodes]
            try:
                self._cloud_terminate(batch)
            except Exception as exc:  # noqa: BLE001 - collected
                self._record_error("terminate", type(exc).__name__,
                                   f"{[r.node_id for r in batch]}: {exc}")
                continue
            for rec in batch:
                provider_metrics.terminated(self.cloud, rec.pool)

    def post_process(self) -> None:
        """End of each autoscaler update (only Ray's autoscaler calls it): serve the metrics
        endpoint (once per process), refresh the spot price gauges (at most once per TTL) and,
        with ``return_to_spot``, give back one on-demand worker when the selector says spot is
        stable again (its replacement goes to spot)."""
        if self.metrics_port is not None:
            provider_metrics.serve(self.metrics_port)
        self.update_prices()
        if not self.placement.return_to_spot or not self.placement.pools:
            return
        self.release_on_demand()

    def update_prices(self) -> dict[str, float]:
        """Set the spot price gauge of every known spot pool; returns pool key -> USD/hour.
        A failed price fetch is collected (the last good or configured prices are used)."""
        with self._lock:
            pools = dict.fromkeys(self.placement.pools)
            for key, selector in self._selectors.items():
                if key[0] != NODE_KIND_HEAD:
                    pools.update(dict.fromkeys(selector.spot_pools))
        prices, failure = self.prices.current(tuple(pools))
        if failure is not None:
            self._record_error("prices", type(failure).__name__, str(failure))
        provider_metrics.set_spot_prices(prices)
        return prices

    @classmethod
    def bootstrap_config(cls, cluster_config: dict[str, Any]) -> dict[str, Any]:
        """What ``ray up`` does to the config before the head is launched (Ray calls it on
        the provider class): every node type gets the head's or the workers' identity from
        the provider config (providers/config.py bootstrap_identity). Pure."""
        return bootstrap_identity(cls.cloud, cluster_config)
