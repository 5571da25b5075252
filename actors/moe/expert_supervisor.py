"""ExpertSupervisor: keeps every shard of an expert set served on spot nodes (head-node actor).

Contract: ``spawn_expert_set`` starts the supervisor on the head node and one ``ExpertActor``
per shard (``layout_shards``), spread over the spot nodes, and returns once all serve. The
supervisor takes periodic snapshots (kept in the object store, owned by the supervisor on
the head node, and written durably by each expert), re-spawns a lost shard on another node
from its latest snapshot, and hands shards off on preemption notices.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray

from moshray.cluster import placement
from moshray.cluster.coordinator.expert_registry import choose_node, spread_shards

from moshray.actors.moe.expert_config import ExpertSetConfig, layout_shards
from moshray.actors.moe.expert_host import ExpertActor

log = logging.getLogger(__name__)

__all__ = ["ExpertSupervisor", "notice_node_id", "spawn_expert_set", "spot_nodes", "uids_of"]


@dataclass
class _Shard:
    host_id: str
    uids: tuple[str, ...]
    handle: Any = None
    instance: str = ""
    node_id: str = ""
    snapshot: list = field(default_factory=list)  # [ObjectRef] of the latest state, or []
    step: int = -1
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def notice_node_id(notice: Any) -> str:
    """The node a preemption notice is about: ``notice.node_id``, ``notice["node_id"]`` or
    the string itself; raises ``ValueError`` otherwise."""
    node_id = getattr(notice, "node_id", None)
    if node_id is None and isinstance(notice, Mapping):
        node_id = notice.get("node_id")
    if node_id is None and isinstance(notice, str):
        node_id = notice
    if not isinstance(node_id, str) or not node_id:
        raise ValueError(f"a notice must name its node (node_id), got {notice!r}")
    return node_id


def spot_nodes() -> list[str]:
    """Node ids of the live nodes carrying the spot resource, sorted."""
    return sorted(n["NodeID"] for n in ray.nodes()
                  if n.get("Alive") and n.get("Resources", {}).get(placement.SPOT_RESOURCE, 0) > 0)


@ray.remote
class ExpertSupervisor:
    """Keeps every shard of an ``ExpertSetConfig`` served by one live ExpertActor.

    Policy (pure helpers in ``moshray.cluster.coordinator.expert_registry``): shards spread over spot nodes, least
    loaded first; a replacement never goes to the node it is replacing nor to a node that
    sent a notice. Detection: a shard whose actor raises ``ActorDiedError`` on ping is re-spawned
    from its latest snapshot (object store; else the actor loads the durable one; else fresh).
    ``events()`` is the history: ``(t, host_id, event, node_id, detail)``.
    """

    def __init__(self, config: ExpertSetConfig, coordinator):
        self.config = config
        self.coordinator = coordinator
        self.shards = {h: _Shard(h, u) for h, u in layout_shards(config).items()}
        self.avoid: set[str] = set()  # nodes that sent a notice or died
        self.history: list[tuple[float, str, str, str, str]] = []
        self.t0 = time.monotonic()
        self.monitor: asyncio.Task | None = None
        self.last_snapshot = time.monotonic()

    def _event(self, host_id: str, event: str, node_id: str = "", detail: str = "") -> None:
        self.history.append((time.monotonic() - self.t0, host_id, event, node_id, detail))
        log.info("expert shard %s: %s on %s %s", host_id, event, node_id[:8], detail)

    async def start(self) -> dict[str, str]:
        """Spawn every shard (spread over spot nodes) and start monitoring; ``{host: node}``."""
        nodes = spot_nodes()
        placed = spread_shards(list(self.shards), nodes)
        await asyncio.gather(*(self._spawn(self.shards[h], prefer=n)
                               for h, n in placed.items()))
        if self.monitor is None:
            self.monitor = asyncio.create_task(self._monitor())
        return {h: s.node_id for h, s in self.shards.items()}

    def hosts(self) -> dict[str, dict]:
        """``{host_id: {uids, node_id, instance, handle, step}}`` for every shard."""
        return {h: {"uids": s.uids, "node_id": s.node_id, "instance": s.instance,
                    "handle": s.handle, "step": s.step} for h, s in self.shards.items()}

    def events(self) -> list[tuple[float, str, str, str, str]]:
        return list(self.history)

    async def wait_healthy(self, timeout_s: float = 60.0) -> bool:
        """True once every shard has a started actor (False after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(s.handle is not None for s in self.shards.values()):
                return True
            await asyncio.sleep(0.1)
        return False

    async def snapshot_all(self) -> dict[str, int]:
        """Snapshot every shard now (object store + durable); ``{host_id: step}``."""
        await asyncio.gather(*(self._snapshot(s) for s in self.shards.values()))
        self.last_snapshot = time.monotonic()
        return {h: s.step for h, s in self.shards.items()}

    async def handoff(self, host_id: str, instance: str, node_id: str, state: dict) -> str:
        """Called by an ExpertActor on notice: re-spawn its shard elsewhere from ``state``."""
        shard = self.shards[host_id]
        self.avoid.add(node_id)
        async with shard.lock:
            if shard.instance != instance:
                return shard.node_id  # already replaced
            self._keep(shard, state)
            old = shard.handle
            self._event(host_id, "notice", node_id, f"snapshot step {shard.step}")
            await self._spawn_locked(shard)
        try:
            await asyncio.wait_for(old.retire.remote(), 5.0)
        except (ray.exceptions.RayError, asyncio.TimeoutError):
            pass  # the old copy is gone already; the registry has the new one
        return shard.node_id

    async def on_notice(self, notice: Any) -> list[str]:
        """A node-level notice: hand off every shard on that node; returns their host ids.

        ``notice`` names the node by a ``node_id`` attribute or key, or is the node id itself.
        """
        node_id = notice_node_id(notice)
        self.avoid.add(node_id)
        moved = []
        for shard in list(self.shards.values()):
            if shard.node_id == node_id and shard.handle is not None:
                try:
                    await asyncio.wait_for(shard.handle.on_notice.remote(notice),
                                           self.config.spawn_timeout_s)
                    moved.append(shard.host_id)
                except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
                    self._event(shard.host_id, "notice_failed", node_id, type(exc).__name__)
        return moved

    async def stop(self) -> None:
        """Stop monitoring and kill every expert actor."""
        if self.monitor is not None:
            self.monitor.cancel()
        for shard in self.shards.values():
            if shard.handle is not None:
                try:
                    await asyncio.wait_for(shard.handle.retire.remote(), 5.0)
                except (ray.exceptions.RayError, asyncio.TimeoutError):
                    pass
                ray.kill(shard.handle)
                shard.handle = None

    # -- internals ---------------------------------------------------------------------------------

    def _keep(self, shard: _Shard, state: dict) -> None:
        if state["step"] > shard.step:
            shard.snapshot = [ray.put(state)]  # owned here, stored on the head node
            shard.step = state["step"]

    async def _snapshot(self, shard: _Shard) -> None:
        handle = shard.handle
        if handle is None:
            return
        try:
            state = await asyncio.wait_for(
                handle.snapshot.remote(durable=bool(self.config.snapshot_uri)),
                self.config.spawn_timeout_s)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            self._event(shard.host_id, "snapshot_failed", shard.node_id, type(exc).__name__)
            return
        self._keep(shard, state)

    async def _spawn(self, shard: _Shard, prefer: str | None = None) -> None:
        async with shard.lock:
            await self._spawn_locked(shard, prefer)

    async def _spawn_locked(self, shard: _Shard, prefer: str | None = None) -> None:
        """Start a new actor for ``shard`` from its latest snapshot; retries other nodes."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        me = ray.get_runtime_context().current_actor
        tried: set[str] = set()
        for attempt in range(5):
            nodes = spot_nodes()
            load: dict[str, int] = defaultdict(int)
            for other in self.shards.values():
                if other is not shard and other.handle is not None:
                    load[other.node_id] += 1
            avoid = self.avoid | tried | ({shard.node_id} if shard.handle else set())
            node = prefer if prefer in nodes and prefer not in avoid else \
                choose_node(nodes, load, avoid)
            prefer = None
            options = placement.on_spot(self.config.num_cpus)
            if node is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
            args = (shard.host_id, shard.uids, self.config.spec, self.coordinator, me)
            kwargs = dict(snapshot_uri=self.config.snapshot_uri,
                          heartbeat_s=self.config.heartbeat_s, batch=self.config.batch)
            state = shard.snapshot[0] if shard.snapshot else None
            handle = ExpertActor.options(max_concurrency=1000, **options).remote(
                *args, state=state, **kwargs)
            try:
                info = await asyncio.wait_for(handle.start.remote(), self.config.spawn_timeout_s)
            except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
                self._event(shard.host_id, "spawn_failed", node or "", type(exc).__name__)
                ray.kill(handle)
                tried.add(node or "")
                await asyncio.sleep(0.5 * (attempt + 1))
                continue
            shard.handle, shard.instance, shard.node_id = handle, info["instance"], \
                info["node_id"]
            self._event(shard.host_id, "spawned", shard.node_id, info["restored_from"])
            return
        shard.handle = None
        self._event(shard.host_id, "unplaced", "", "no node accepted the shard")

    async def _check(self, shard: _Shard) -> None:
        handle, instance = shard.handle, shard.instance
        if handle is None:
            await self._spawn(shard)
            return
        try:
            await asyncio.wait_for(handle.ping.remote(), 10.0)
            return
        except ray.exceptions.ActorDiedError as exc:
            cause = type(exc).__name__
        except (ray.exceptions.ActorUnavailableError, asyncio.TimeoutError):
            return  # busy or restarting: not proof of death
        except ray.exceptions.RayError as exc:
            cause = type(exc).__name__
        async with shard.lock:
            if shard.instance != instance:
                return  # replaced meanwhile (handoff)
            lost_at = time.monotonic()
            self._event(shard.host_id, "lost", shard.node_id, cause)
            await self._spawn_locked(shard)  # not on the node it died on
            self._event(shard.host_id, "respawned", shard.node_id,
                        f"{time.monotonic() - lost_at:.2f}s from snapshot step {shard.step}")

    async def _monitor(self) -> None:
        while True:
            await asyncio.sleep(self.config.check_interval_s)
            try:
                await asyncio.gather(*(self._check(s) for s in self.shards.values()))
                if time.monotonic() - self.last_snapshot >= self.config.snapshot_interval_s:
                    await self.snapshot_all()
            except Exception:  # noqa: BLE001 - the monitor must outlive any one failure
                log.exception("expert supervisor: monitor tick failed")


def spawn_expert_set(config: ExpertSetConfig, coordinator, timeout_s: float = 120.0):
    """Start an ``ExpertSupervisor`` on the head node and all its shards; returns its handle.

    Blocks until every shard serves (raises ``TimeoutError`` after ``timeout_s``).
    """
    supervisor = ExpertSupervisor.options(max_concurrency=1000, **placement.on_head()).remote(
        config, coordinator)
    ray.get(supervisor.start.remote(), timeout=timeout_s)
    if not ray.get(supervisor.wait_healthy.remote(timeout_s), timeout=timeout_s + 10):
        raise TimeoutError(f"expert shards not all serving after {timeout_s} s")
    return supervisor


def uids_of(hosts: Mapping[str, dict]) -> dict[str, str]:
    """``{uid: host_id}`` from ``ExpertSupervisor.hosts()``."""
    return {u: h for h, info in hosts.items() for u in info["uids"]}
