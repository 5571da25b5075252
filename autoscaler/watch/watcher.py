"""The spot-notice watcher actor: one per spot node, and the calls that reach it.

``NoticeWatcher`` runs pinned to its node (``NodeAffinitySchedulingStrategy``, ``soft=False``,
no CPU) and polls its ``NoticeSource`` in a background thread. On a termination notice it:

1. records ``running -> noticed`` in the node's lifecycle;
2. tells the Coordinator (``note_notice``: the node's peers are left out of every plan made
   from then on, and the notice -> rebalanced clock starts), then asks Ray to drain the node
   (``DrainNode``, reason preemption, the notice's deadline): see ``drain.py``;
3. records ``noticed -> draining``;
4. hands off: calls ``on_notice.remote(notice)`` on every actor registered with it
   (replicas flush their accumulated samples, experts snapshot) without waiting for them.

A rebalance recommendation (AWS) only records ``running -> at_risk``.

``start_watcher`` / ``open_watcher`` / ``get_watcher`` start and find a node's watcher
(``open_watcher`` says whether it made it), ``deliver_notice``
delivers a simulated notice and waits until it was acted on, ``wait_rebalanced`` waits for
the Coordinator's first plan without a noticed node.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray

from moshray.cluster import placement

from moshray.autoscaler.watch.drain import DrainOutcome, check_node_id, drain_for_notice
from moshray.autoscaler.watch.lifecycle import NodeLifecycle, NodeState
from moshray.autoscaler.notices.local import SimulatedSource
from moshray.autoscaler.notices.message import SIGTERM, PreemptionNotice
from moshray.autoscaler.watch.config import WatcherConfig, watcher_name

log = logging.getLogger(__name__)


@ray.remote
class NoticeWatcher:
    """Watches one node's notice source; see the module docstring for what a notice does.

    Create it with ``start_watcher`` (pinned to ``node_id``, named ``watcher_name(node_id)``
    in the ``moshray`` namespace so actors on the node can find it with ``get_watcher``).
    A threaded actor: the poll loop runs in its own thread, the methods stay responsive.
    Failure behaviour: a failing Coordinator or GCS is recorded in the ``DrainOutcome``; an
    unexpected error while handling a notice is logged, kept in ``status()["errors"]``, and
    the loop goes on watching.
    """

    def __init__(self, node_id: str, config: WatcherConfig):
        here = ray.get_runtime_context().get_node_id()
        if here != node_id:
            raise ValueError(f"watcher for node {node_id[:12]} started on node {here[:12]}")
        self.node_id = node_id
        self.config = config
        self.source = config.make_source(node_id)
        self.life = NodeLifecycle.start(node_id, time.time(), NodeState.RUNNING, "watcher started")
        self._outcomes: list[DrainOutcome] = []
        self._recommendations: list[PreemptionNotice] = []
        self._duplicates = 0
        self._errors: list[str] = []
        self._targets: list[tuple[str, object]] = []  # (name, actor) told on a notice
        self._handoffs: list[tuple[str, object]] = []  # (name, ObjectRef of on_notice)
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="notice-watcher", daemon=True)
        self._thread.start()

    # -- loop ---------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            notice = self.source.poll(self.config.poll_s)
            if notice is None:
                continue
            try:
                self._handle(notice)
            except Exception as e:  # noqa: BLE001 - one bad notice must not end the watching
                log.exception("watcher %s: handling %s failed", self.node_id[:12], notice)
                with self._cond:
                    self._errors.append(f"{type(e).__name__}: {e}")
                    self._cond.notify_all()

    def _handle(self, notice: PreemptionNotice) -> None:
        if notice.is_rebalance:
            log.warning("node %s: rebalance recommendation from %s", self.node_id[:12], notice.source)
            with self._cond:
                if self.life.can(NodeState.AT_RISK):
                    self.life.to(NodeState.AT_RISK, notice.received_unix_s)
                self._recommendations.append(notice)
                self._cond.notify_all()
            return
        with self._cond:
            if not self.life.can(NodeState.NOTICED):
                self._duplicates += 1
                log.info("node %s: already %s, notice ignored", self.node_id[:12], self.life.state.value)
                return
            self.life.to(NodeState.NOTICED, notice.received_unix_s)
        log.warning("node %s: %s notice, %.1f s left", self.node_id[:12], notice.action,
                    notice.seconds_left(time.time()))
        outcome = drain_for_notice(notice, self._find_coordinators(),
                                   timeout_s=self.config.rpc_timeout_s)
        with self._cond:
            if outcome.coordinator_ok or outcome.ray.accepted:
                self.life.to(NodeState.DRAINING, outcome.draining_unix_s,
                             "drain requested" + ("" if outcome.coordinator_ok and outcome.ray.accepted
                                                  else f" (partly: {outcome.error or outcome.ray.message})"))
            targets = list(self._targets)
        for name, actor in targets:
            try:
                ref = actor.on_notice.remote(notice)
            except AttributeError:
                log.error("hand-off target %s has no on_notice method", name)
                with self._cond:
                    self._errors.append(f"{name}: no on_notice method")
                continue
            with self._cond:
                self._handoffs.append((name, ref))
        with self._cond:
            self._outcomes.append(outcome)
            self._cond.notify_all()

    def _find_coordinators(self) -> dict:
        """The Coordinators to tell: the one named in the config, else every job's on the
        cluster, looked up at each notice (jobs come and go)."""
        name = self.config.coordinator_name
        try:
            if name is not None:
                return {name: ray.get_actor(name, namespace=placement.NAMESPACE)}
            return placement.job_coordinators()
        except (ValueError, ray.exceptions.RayError) as exc:
            log.error("no Coordinator found (%s): only Ray will be told", exc)
            return {}

    # -- methods --------------------------------------------------------------------------------

    def ready(self) -> str:
        """This watcher's node id, once the loop runs (use to wait for start-up)."""
        return self.node_id

    def register(self, actor, name: str = "") -> int:
        """Call ``actor.on_notice.remote(notice)`` on every termination notice; returns the count.

        A notice that already arrived is handed to a late registrant at once.
        """
        name = name or f"target-{len(self._targets)}"
        with self._cond:
            self._targets.append((name, actor))
            past = [o.notice for o in self._outcomes]
        for notice in past[:1]:
            ref = actor.on_notice.remote(notice)
            with self._cond:
                self._handoffs.append((name, ref))
        return len(self._targets)

    def notify(self, notice_s: float, source: str = "SIGTERM") -> PreemptionNotice:
        """A termination notice from outside the node's source, due in ``notice_s`` seconds:
        the watcher process's SIGTERM (``moshray watch --grace-s``: a pod being deleted, its
        grace period the deadline), whatever source the watcher polls. Handled as a polled
        notice (every job's Coordinator told, the node drained in Ray, hand-offs started)
        before this returns; a second one is counted as a duplicate."""
        if not notice_s >= 0:
            raise ValueError(f"notice_s must be >= 0, got {notice_s}")
        now = time.time()
        notice = PreemptionNotice(self.node_id, SIGTERM, "terminate", now + notice_s, now,
                                  source, getattr(self.source, "pool", ""))
        self._handle(notice)
        return notice

    def deliver(self, notice_s: float, action: str = "terminate") -> PreemptionNotice:
        """Simulated source only: a notice for this node due in ``notice_s`` seconds."""
        if not isinstance(self.source, SimulatedSource):
            raise ValueError(f"deliver needs the simulated source; this watcher uses {self.config.source}")
        return self.source.trigger(notice_s, action)

    def wait_outcome(self, timeout_s: float, after: int = 0) -> DrainOutcome | None:
        """The ``after``-th (0-based) termination notice's outcome, waiting up to ``timeout_s``."""
        end = time.monotonic() + timeout_s
        with self._cond:
            while len(self._outcomes) <= after:
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)
            return self._outcomes[after]

    def outcomes(self) -> tuple[DrainOutcome, ...]:
        with self._cond:
            return tuple(self._outcomes)

    def lifecycle(self) -> NodeLifecycle:
        with self._cond:
            return NodeLifecycle(self.life.node_id, list(self.life.history), self.life.rebalanced_at_s)

    def status(self) -> dict:
        """State, counts and errors; hand-offs are counted as acknowledged, failed or pending."""
        with self._cond:
            refs = list(self._handoffs)
            status = {
                "node_id": self.node_id, "source": self.source.describe(),
                "state": self.life.state.value, "notices": len(self._outcomes),
                "recommendations": len(self._recommendations), "duplicates": self._duplicates,
                "source_errors": self.source.errors, "errors": list(self._errors),
                "targets": len(self._targets),
            }
        acked = failed = 0
        if refs:
            done, _ = ray.wait([r for _, r in refs], num_returns=len(refs), timeout=0)
            done = set(done)
            for name, ref in refs:
                if ref in done:
                    try:
                        ray.get(ref, timeout=0)
                        acked += 1
                    except ray.exceptions.RayError:
                        failed += 1
        status.update(handoffs=len(refs), handoffs_acked=acked, handoffs_failed=failed)
        return status

    def stop(self) -> None:
        self._stop.set()
        self.source.close()
        self._thread.join(timeout=self.config.poll_s + 5)


def start_watcher(node_id: str, config: WatcherConfig = WatcherConfig()):
    """Start (or find) the watcher of ``node_id``: pinned there, no CPU, named per node.
    Returns the actor; ``open_watcher`` also says whether this call made it."""
    return open_watcher(node_id, config).actor


@dataclass(frozen=True)
class OpenedWatcher:
    """``open_watcher``'s answer: the node's watcher and whether this call created it (the
    caller then owns it and may stop it) or found one someone else started (a node's own
    ``moshray watch``, an earlier job's), which the caller must leave running."""

    actor: object
    created: bool


def open_watcher(node_id: str, config: WatcherConfig = WatcherConfig()) -> OpenedWatcher:
    """Find the watcher of ``node_id`` or start one (as ``start_watcher``), saying which.

    Ray's own get-or-create, with the answer kept: look the name up; if absent, create it;
    if a creation elsewhere took the name first (``ActorAlreadyExistsError``), that one is
    found. As with Ray's ``get_if_exists``, two creations racing past the look-up both count
    as created (Ray checks the name before registering; the later one then fails to start).
    ``RuntimeError`` if the name keeps being taken and freed (three looks)."""
    from ray.exceptions import ActorAlreadyExistsError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    check_node_id(node_id)
    for _ in range(3):  # a name taken, then freed again between two looks: look again
        found = get_watcher(node_id)
        if found is not None:
            return OpenedWatcher(found, created=False)
        try:
            return OpenedWatcher(NoticeWatcher.options(
                name=watcher_name(node_id), namespace=placement.NAMESPACE,
                num_cpus=0, max_concurrency=8, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(node_id, config), created=True)
        except ActorAlreadyExistsError:
            continue
    raise RuntimeError(f"the watcher name of node {node_id[:12]} keeps changing hands")


def close_watchers(watchers: dict[str, Any], timeout_s: float = 10.0) -> None:
    """Stop and remove ``watchers`` (node id -> watcher actor; the ones a job started, so
    their names are free for the next job): each closes its source, then is killed.
    Bounded by ``timeout_s``; each failure is logged, never raised."""
    refs = []
    for node_id, watcher in watchers.items():
        try:
            refs.append(watcher.stop.remote())
        except ray.exceptions.RayError as exc:
            log.info("watcher of %s not stopped: %r", node_id[:12], exc)
    if refs:  # let each close its source, then remove it (a stopped one hears nothing)
        ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    for node_id, watcher in watchers.items():
        try:
            ray.kill(watcher, no_restart=True)
        except ray.exceptions.RayError as exc:
            log.info("watcher of %s not removed: %r", node_id[:12], exc)


def get_watcher(node_id: str):
    """The watcher actor of ``node_id``, or None (e.g. for a replica registering hand-off)."""
    try:
        return ray.get_actor(watcher_name(node_id), namespace=placement.NAMESPACE)
    except ValueError:
        return None


def deliver_notice(node_id: str, notice_s: float, *, timeout_s: float = 30.0,
                   action: str = "terminate") -> DrainOutcome | None:
    """Deliver a simulated notice to ``node_id``'s watcher and wait until it was acted on.

    A ``"rebalance"`` recommendation is only delivered (returns None). Raises
    ``LookupError`` if the node has no watcher, ``TimeoutError`` if the watcher did
    not finish within ``timeout_s``.
    """
    watcher = get_watcher(node_id)
    if watcher is None:
        raise LookupError(f"node {node_id[:12]} has no watcher (start one with start_watcher)")
    index = len(ray.get(watcher.outcomes.remote(), timeout=timeout_s))
    ray.get(watcher.deliver.remote(notice_s, action), timeout=timeout_s)
    if action == "rebalance":
        return None
    outcome = ray.get(watcher.wait_outcome.remote(timeout_s, index), timeout=timeout_s + 5)
    if outcome is None:
        raise TimeoutError(f"watcher of node {node_id[:12]} did not act on the notice in {timeout_s} s")
    return outcome


def wait_rebalanced(coordinator, node_id: str, timeout_s: float, poll_s: float = 0.05) -> float | None:
    """Seconds from ``node_id``'s notice to the first plan without it, once the Coordinator
    has published that plan; None if it has not within ``timeout_s`` (or never noticed it)."""
    end = time.monotonic() + timeout_s
    while True:
        record = ray.get(coordinator.notice_stats.remote(), timeout=max(1.0, timeout_s)).get(node_id)
        if record is not None and record["rebalance_s"] is not None:
            return float(record["rebalance_s"])
        if time.monotonic() >= end:
            return None
        time.sleep(poll_s)
