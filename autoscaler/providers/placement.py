"""Where a spot NodeProvider puts nodes: pool selection, launching, return to spot.

Contract: ``SpotPlacementMixin`` is mixed into ``provider_api.SpotNodeProviderBase`` (it is
not a provider on its own) and carries out the ``PoolSelector``'s decisions:
``create_node`` launches across pools (the launch loop: decide, act, observe, repeat; see
provider_api's module docstring), ``release_on_demand`` gives back an on-demand worker once
spot is stable again, ``observations`` is the selector's input. It relies on the base's
state (``placement``, ``history``, ``cloud``, ``cluster_name``, ``_lock``, ``_launch_lock``,
``_nodes``, ``_unlisted``, ``_selectors``, ``_clock``) and methods (``_cloud_launch``,
``_default_pool``, ``_refresh``, ``_record_error``, ``terminate_nodes``).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from typing import Any

from ray.autoscaler.node_launch_exception import NodeLaunchException
from ray.autoscaler.tags import (
    NODE_KIND_HEAD,
    NODE_KIND_WORKER,
    TAG_RAY_CLUSTER_NAME,
    TAG_RAY_NODE_KIND,
)

import moshray.autoscaler.providers.metrics as provider_metrics
from moshray.autoscaler.pools import (
    EventKind,
    Market,
    Observations,
    OnDemandBudget,
    Pool,
    PoolSelector,
    RunningNode,
    decode_pool,
)
from moshray.autoscaler.providers.config import NODE_POOLS_KEY
from moshray.autoscaler.providers.records import LaunchError, NodeRecord, ProviderError
from moshray.autoscaler.tags import CLUSTER_TAG, MARKET_TAG, POOL_TAG, ROLE_TAG

log = logging.getLogger(__name__)


class SpotPlacementMixin:
    """The pool placement half of ``SpotNodeProviderBase`` (see the module docstring)."""

    def _selector_for(self, node_config: Mapping[str, Any], kind: str) -> PoolSelector:
        if kind == NODE_KIND_HEAD:
            pools: tuple[Pool, ...] = (self._default_pool(node_config).with_market(Market.ON_DEMAND),)
            budget = OnDemandBudget(max_nodes=None)  # the head is on-demand by design
        else:
            own = node_config.get(NODE_POOLS_KEY)
            if own:
                pools = tuple(Pool.from_config(self.cloud, e) for e in own)
            elif self.placement.pools:
                pools = self.placement.pools
            else:
                pools = (self._default_pool(node_config),)
            budget = self.placement.budget
        key = (kind,) + pools  # type: ignore[operator]
        with self._lock:
            if key not in self._selectors:
                self._selectors[key] = PoolSelector(pools, budget, self.placement.selector)
            return self._selectors[key]

    def _on_demand_in_use(self) -> tuple[str, ...]:
        """Instance types of the live on-demand workers (one entry per node)."""
        with self._lock:
            records = list(self._nodes.values())
        return tuple(
            decode_pool(r.pool).instance_type
            for r in records
            if r.market == Market.ON_DEMAND.value and r.role == NODE_KIND_WORKER
            and r.pool
        )

    def observations(self) -> Observations:
        """The selector's input now: pool history and on-demand workers in use."""
        return Observations(now=self._clock(), events=self.history.snapshot(),
                            on_demand_in_use=self._on_demand_in_use())

    def _instance_tags(self, tags: Mapping[str, str], pool: Pool, kind: str) -> dict[str, str]:
        out = dict(tags)
        out.update({
            TAG_RAY_CLUSTER_NAME: self.cluster_name,
            CLUSTER_TAG: self.cluster_name,
            ROLE_TAG: NODE_KIND_HEAD if kind == NODE_KIND_HEAD else NODE_KIND_WORKER,
            POOL_TAG: pool.key,
            MARKET_TAG: pool.market.value,
        })
        return out

    def create_node(self, node_config: dict[str, Any], tags: dict[str, str],
                    count: int) -> dict[str, dict[str, str]]:
        """Launch ``count`` nodes across pools (see provider_api's module docstring). Returns
        ``{node_id: tags}`` of the nodes launched; raises ``NodeLaunchException`` only if none
        could be launched."""
        kind = tags.get(TAG_RAY_NODE_KIND, NODE_KIND_WORKER)
        with self._launch_lock:  # one launch at a time: the budget is checked then spent
            selector = self._selector_for(node_config, kind)
            if kind != NODE_KIND_HEAD and self.placement.budget.max_nodes != 0:
                try:
                    self._refresh()  # on-demand usage as of now
                except Exception as exc:  # noqa: BLE001 - decide on the last good listing
                    self._record_error("list", type(exc).__name__, str(exc))
            created, errors = self._launch_loop(selector, node_config, tags, kind, count)
        if not created and errors:
            last = errors[-1]
            summary = "; ".join(
                f"{e.pool or '-'}: {e.code}: {e.message}" for e in errors
            )
            raise NodeLaunchException(
                category=last.code[:20],
                description=f"no pool could launch {count} {kind} node(s): {summary}",
                src_exc_info=None,
            )
        if len(created) < count:
            log.warning("%s provider: launched %d of %d %s nodes", self.cloud, len(created),
                        count, kind)
        return {rec.node_id: dict(rec.tags) for rec in created}

    def _launch_loop(self, selector: PoolSelector, node_config: dict[str, Any],
                     tags: dict[str, str], kind: str,
                     count: int) -> tuple[list[NodeRecord], list[ProviderError]]:
        """Decide, act, observe, repeat. Each failed attempt cools its pool down, so the loop
        ends after at most one attempt per pool plus one per node."""
        launch_id = uuid.uuid4().hex[:24]
        created: list[NodeRecord] = []
        errors: list[ProviderError] = []
        remaining = count
        for attempt in range(len(selector.pools) + count):
            if remaining <= 0:
                break
            plan = selector.decide(self.observations(), remaining)
            cand = plan.first
            if cand is None:
                why = ", ".join(f"{s.pool.key}={s.reason.value}" for s in plan.skipped)
                errors.append(self._record_error("launch", "NoPoolAvailable", why))
                break
            n = min(remaining, cand.max_count)
            token = f"moshray-{launch_id}-{attempt}"
            instance_tags = self._instance_tags(tags, cand.pool, kind)
            try:
                records = list(self._cloud_launch(cand.pool, node_config, instance_tags, n,
                                                  token))
                failure: LaunchError | None = None
            except LaunchError as exc:
                records, failure = list(exc.created), exc
            now = self._clock()
            if records:
                self.history.record(cand.pool.key, EventKind.LAUNCHED, now)
                with self._lock:
                    for rec in records:
                        self._nodes[rec.node_id] = rec
                        self._unlisted[rec.node_id] = now
                created += records
                remaining -= len(records)
                provider_metrics.launched(self.cloud, cand.pool.key, len(records))
                log.info("%s provider: launched %d %s node(s) in pool %s", self.cloud,
                         len(records), kind, cand.pool.key)
            if failure is None and not records:
                failure = LaunchError("NothingLaunched", "the cloud returned no instances",
                                      capacity=True)
            if failure is not None:
                errors.append(self._record_error("launch", failure.code, failure.message,
                                                 cand.pool.key))
                provider_metrics.launch_failed(self.cloud, cand.pool.key, failure.code,
                                               failure.capacity)
                if not failure.capacity:
                    break  # a bad request fails in every pool: stop, report
                self.history.record(cand.pool.key, EventKind.CAPACITY_ERROR, now, failure.code)
        return created, errors

    def release_on_demand(self) -> tuple[str, ...]:
        """Carry out :meth:`PoolSelector.on_demand_to_release`; returns the released ids."""
        selector = self._selector_for({}, NODE_KIND_WORKER) if self.placement.pools else None
        if selector is None:
            return ()
        with self._lock:
            nodes = [RunningNode(r.node_id, r.pool, r.launched_at) for r in self._nodes.values()
                     if r.market == Market.ON_DEMAND.value and r.role == NODE_KIND_WORKER
                     and r.pool]
            pools = {r.node_id: r.pool for r in self._nodes.values()}
        release = selector.on_demand_to_release(self.observations(), nodes)
        for node_id in release:
            log.info("%s provider: spot is stable again; releasing on-demand node %s",
                     self.cloud, node_id)
            self.history.record(pools[node_id], EventKind.RELEASED, self._clock())
            self.terminate_nodes([node_id])
        return release
