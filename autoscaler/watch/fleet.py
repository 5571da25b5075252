"""The watcher fleet (driver side): one ``NoticeWatcher`` per spot node of a running cluster.

Contract: ``WatcherFleet`` starts one watcher per live spot node (``spot_nodes``), delivers
simulated notices (trace replay: a removal becomes a notice, then the node is removed at its
deadline), records how each node ended (``gone`` after a notice, ``lost`` without one) and
summarizes the lifecycles with the Coordinator's rebalance times. Thread-safe. A node that
already has a watcher (its own ``moshray watch``, a job's) is watched through that one, which
the fleet never stops or removes; it stops only the watchers it started.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable

import ray

from moshray.cluster import placement

from moshray.autoscaler.watch.drain import DrainOutcome, check_node_id
from moshray.autoscaler.watch.lifecycle import LifecycleSummary, NodeLifecycle, NodeState, summarize
from moshray.autoscaler.watch.watcher import deliver_notice, open_watcher
from moshray.autoscaler.watch.config import WatcherConfig

log = logging.getLogger(__name__)

_SLOT = re.compile(r"^slot-(\d+)$")


def spot_nodes() -> dict[str, int | None]:
    """Alive spot nodes of the connected cluster: node id -> local slot (None off a local cluster)."""
    nodes = {}
    for n in ray.nodes():
        if not n.get("Alive") or placement.SPOT_RESOURCE not in n.get("Resources", {}):
            continue
        slots = [int(m.group(1)) for r in n["Resources"] if (m := _SLOT.match(r))]
        nodes[n["NodeID"]] = slots[0] if slots else None
    return nodes


class WatcherFleet:
    """One ``NoticeWatcher`` per live spot node, and every node's lifecycle.

    Nodes are named by Ray node id or, on the embedded local cluster, by slot number.
    Thread-safe (trace replay may call it from its thread). ``lifecycles`` keeps nodes that
    have left, so ``summary`` covers the whole run.
    """

    def __init__(self, config: WatcherConfig = WatcherConfig(), clock: Callable[[], float] = time.time):
        self.config = config
        self.clock = clock
        self._lock = threading.RLock()
        self._watchers: dict[str, object] = {}  # node id -> actor handle (live nodes)
        self._own: set[str] = set()  # node ids whose watcher this fleet started
        self._slots: dict[int, str] = {}  # slot -> node id (live nodes)
        self._lives: dict[str, NodeLifecycle] = {}

    def node_id(self, node: str | int) -> str:
        """Node id of a slot (or the id itself); KeyError for an unknown slot."""
        if isinstance(node, int):
            with self._lock:
                if node not in self._slots:
                    raise KeyError(f"slot {node} has no live watched node (call sync() after adding it)")
                return self._slots[node]
        return check_node_id(node)

    def sync(self, timeout_s: float = 60.0, only: Iterable[str | int] | None = None) -> tuple[str, ...]:
        """Watch every live spot node not yet watched (or only those in ``only``): start its
        watcher, or use the one the node already has (left running by ``stop``).

        Returns the node ids this call began watching, once each watcher is running.
        """
        nodes = spot_nodes()
        wanted = None if only is None else set(only)
        started, created = {}, set()
        with self._lock:
            for node_id, slot in nodes.items():
                if wanted is not None and node_id not in wanted and slot not in wanted:
                    continue
                if slot is not None:
                    self._slots[slot] = node_id
                if node_id in self._watchers:
                    continue
                opened = open_watcher(node_id, self.config)
                started[node_id] = opened.actor
                if opened.created:
                    created.add(node_id)
        if started:
            ray.get([w.ready.remote() for w in started.values()], timeout=timeout_s)
        with self._lock:
            self._own |= created
            for node_id, watcher in started.items():
                self._watchers[node_id] = watcher
                self._lives[node_id] = ray.get(watcher.lifecycle.remote(), timeout=timeout_s)
        return tuple(started)

    def watcher(self, node: str | int):
        with self._lock:
            return self._watchers[self.node_id(node)]

    def watched(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._watchers)

    def register(self, node: str | int, actor, name: str = "") -> None:
        """Hand-off: ``actor.on_notice.remote(notice)`` is called when ``node`` is noticed."""
        ray.get(self.watcher(node).register.remote(actor, name), timeout=self.config.rpc_timeout_s)

    def notify(self, node: str | int, notice_s: float, timeout_s: float = 30.0) -> DrainOutcome:
        """Deliver a simulated termination notice to ``node`` and wait until it is draining."""
        node_id = self.node_id(node)
        outcome = deliver_notice(node_id, notice_s, timeout_s=timeout_s)
        self._pull(node_id)
        return outcome

    def preempt(self, node: str | int, notice_s: float, remove: Callable[[int | str], None],
                sleep: Callable[[float], None] = time.sleep) -> DrainOutcome:
        """Trace replay's removal: a notice, then ``remove(node)`` at the deadline, then ``gone``.

        Blocks for about ``notice_s``; run it in a thread per removal.
        """
        outcome = self.notify(node, notice_s)
        sleep(outcome.notice.seconds_left(self.clock()))
        remove(node)
        self.node_gone(node)
        return outcome

    def node_gone(self, node: str | int, at_unix_s: float | None = None) -> NodeState:
        """``node`` left the cluster: ``gone`` after a notice, ``lost`` without one.

        Forgets its watcher (killing it, if this fleet started it, in case the node is somehow
        still up). Returns the final state.
        """
        node_id = self.node_id(node)
        self._pull(node_id)
        at = self.clock() if at_unix_s is None else at_unix_s
        with self._lock:
            watcher = self._watchers.pop(node_id, None)
            if node_id not in self._own:
                watcher = None  # someone else's: theirs to remove
            self._own.discard(node_id)
            self._slots = {s: n for s, n in self._slots.items() if n != node_id}
            life = self._lives.setdefault(node_id, NodeLifecycle.start(node_id, at, NodeState.RUNNING))
            if not life.terminal:
                if life.can(NodeState.GONE):
                    life.to(NodeState.GONE, at)
                else:
                    life.to(NodeState.LOST, at)
            state = life.state
        if watcher is not None:
            ray.kill(watcher, no_restart=True)
        return state

    def _pull(self, node_id: str) -> None:
        """Copy the watcher's lifecycle of ``node_id`` (it holds the noticed/draining times)."""
        with self._lock:
            watcher = self._watchers.get(node_id)
            mine = self._lives.get(node_id)
        if watcher is None:
            return
        try:
            theirs = ray.get(watcher.lifecycle.remote(), timeout=self.config.rpc_timeout_s)
        except ray.exceptions.RayError as e:  # node already gone: keep what we have
            log.info("lifecycle of %s not available: %s", node_id[:12], e)
            return
        with self._lock:
            if mine is None or len(theirs.history) >= len(mine.history):
                if mine is not None:
                    theirs.rebalanced_at_s = mine.rebalanced_at_s
                self._lives[node_id] = theirs

    def refresh(self, coordinator=None) -> None:
        """Pull every live watcher's lifecycle; with ``coordinator``, fill in rebalance times."""
        for node_id in self.watched():
            self._pull(node_id)
        if coordinator is None:
            return
        stats = ray.get(coordinator.notice_stats.remote(), timeout=self.config.rpc_timeout_s)
        with self._lock:
            for node_id, record in stats.items():
                life = self._lives.get(node_id)
                noticed = life.entered(NodeState.NOTICED) if life is not None else None
                if noticed is not None and record["rebalance_s"] is not None:
                    life.note_rebalanced(noticed + record["rebalance_s"])

    def lifecycles(self) -> dict[str, NodeLifecycle]:
        with self._lock:
            return {n: NodeLifecycle(l.node_id, list(l.history), l.rebalanced_at_s)
                    for n, l in self._lives.items()}

    def summary(self, coordinator=None) -> LifecycleSummary:
        """Notices, hard losses, notice->draining and notice->rebalanced over every node seen."""
        self.refresh(coordinator)
        return summarize(self.lifecycles().values())

    def stop(self) -> None:
        """Stop and kill every watcher this fleet started and forget the ones it found (they
        keep running). Lifecycles are kept."""
        with self._lock:
            watchers = [w for n, w in self._watchers.items() if n in self._own]
            self._watchers, self._own = {}, set()
        for watcher in watchers:
            try:
                ray.get(watcher.stop.remote(), timeout=self.config.poll_s + 10)
            except ray.exceptions.RayError:
                pass  # node already gone
            ray.kill(watcher, no_restart=True)
