"""The spot-notice watcher: one Ray actor per spot node, and ``moshray watch``.

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

Driver side, ``WatcherFleet`` starts one watcher per live spot node of a running cluster,
delivers simulated notices (trace replay: a removal becomes a notice, then the node is
removed at its deadline), records how each node ended (``gone`` after a notice, ``lost``
without one) and summarizes the lifecycles with the Coordinator's rebalance times.

``moshray watch`` runs the watcher of the node it is started on (a real cloud node):
``moshray watch --source aws`` (or ``gcp``) connects with ``ray.init(address="auto")``,
starts the watcher actor on this node and stays until the node's deadline has passed.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass

import ray

from moshray.cluster import placement

from .drain import DrainOutcome, check_node_id, drain_for_notice
from .lifecycle import LifecycleSummary, NodeLifecycle, NodeState, summarize
from .notices import (
    AWS_METADATA_URL,
    GCP_METADATA_URL,
    GCP_NOTICE_S,
    NoticeSource,
    PreemptionNotice,
    SimulatedSource,
    make_source,
    node_metadata_service,
)

log = logging.getLogger(__name__)

WATCHER_PREFIX = "moshray-watcher-"
POOL_ENV = "MOSHRAY_POOL"  # a node's pool (instance type, zone, market), set by its setup
SOURCES = ("auto", "aws", "gcp", "simulated", "none")


@dataclass(frozen=True)
class WatcherConfig:
    """How a watcher listens and whom it tells. Validated once, here.

    ``source``: aws, gcp, simulated, none, or auto (the metadata service the node names in
    its environment, see ``notices.node_metadata_service``; none if it names none).
    ``metadata_url`` overrides the cloud's link-local address; without it a node that
    names its own service (``AWS_EC2_METADATA_SERVICE_ENDPOINT`` / ``GCE_METADATA_HOST``)
    is polled there (the embedded cluster's emulators; tests). ``poll_s`` bounds one poll (and so how fast
    ``stop`` is noticed); ``aws_interval_s`` is the IMDS check period; ``gcp_notice_s`` is
    the notice GCP gives. ``rpc_timeout_s`` bounds each call to the Coordinator and the GCS.
    """

    source: str = "simulated"
    metadata_url: str | None = None
    pool: str = ""
    poll_s: float = 1.0
    aws_interval_s: float = 1.0
    gcp_notice_s: float = GCP_NOTICE_S
    rpc_timeout_s: float = 5.0
    coordinator_name: str = placement.COORDINATOR_NAME

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {', '.join(SOURCES)}, got {self.source!r}")
        if self.source == "simulated" and self.metadata_url:
            raise ValueError("the simulated source takes no metadata URL")
        for name in ("poll_s", "aws_interval_s", "gcp_notice_s", "rpc_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")

    def make_source(self, node_id: str, environ: Mapping[str, str] | None = None
                    ) -> NoticeSource:
        """The source for ``node_id``, resolved on that node (``environ``: its environment)."""
        kind, url = self.source, self.metadata_url
        environ = os.environ if environ is None else environ
        named_kind, named_url = node_metadata_service(environ)
        # The node's pool, as its setup names it (infra/ startup scripts export it).
        pool = self.pool or environ.get(POOL_ENV, "")
        if kind == "auto":
            kind, url = named_kind, named_url
        elif kind == named_kind and url is None:
            url = named_url
        options = {}
        if kind == "aws":
            options["interval_s"] = self.aws_interval_s
        elif kind == "gcp":
            options["notice_s"] = self.gcp_notice_s
        return make_source(kind, node_id, metadata_url=url, pool=pool, **options)


def watcher_name(node_id: str) -> str:
    return WATCHER_PREFIX + node_id


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
        self._coordinator = None
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
        outcome = drain_for_notice(notice, self._find_coordinator(),
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

    def _find_coordinator(self):
        if self._coordinator is None:
            try:
                self._coordinator = ray.get_actor(self.config.coordinator_name,
                                                  namespace=placement.NAMESPACE)
            except ValueError:
                log.error("no Coordinator named %s: only Ray will be told", self.config.coordinator_name)
        return self._coordinator

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
    """Start (or find) the watcher of ``node_id``: pinned there, no CPU, named per node."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    check_node_id(node_id)
    return NoticeWatcher.options(
        name=watcher_name(node_id), namespace=placement.NAMESPACE, get_if_exists=True,
        num_cpus=0, max_concurrency=8, max_restarts=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, config)


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


# -- the fleet: one watcher per spot node of a running cluster (driver side) ------------------


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
        """Start a watcher on every live spot node that has none (or only on ``only``).

        Returns the node ids that got a new watcher, once each is running.
        """
        nodes = spot_nodes()
        wanted = None if only is None else set(only)
        started = {}
        with self._lock:
            for node_id, slot in nodes.items():
                if wanted is not None and node_id not in wanted and slot not in wanted:
                    continue
                if slot is not None:
                    self._slots[slot] = node_id
                if node_id in self._watchers:
                    continue
                started[node_id] = start_watcher(node_id, self.config)
        if started:
            ray.get([w.ready.remote() for w in started.values()], timeout=timeout_s)
        with self._lock:
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

        Forgets its watcher (killing it if the node is somehow still up). Returns the final state.
        """
        node_id = self.node_id(node)
        self._pull(node_id)
        at = self.clock() if at_unix_s is None else at_unix_s
        with self._lock:
            watcher = self._watchers.pop(node_id, None)
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
        """Stop and kill every watcher this fleet started (lifecycles are kept)."""
        with self._lock:
            watchers, self._watchers = dict(self._watchers), {}
        for watcher in watchers.values():
            try:
                ray.get(watcher.stop.remote(), timeout=self.config.poll_s + 10)
            except ray.exceptions.RayError:
                pass  # node already gone
            ray.kill(watcher, no_restart=True)


# -- `moshray watch` ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=SOURCES, required=True,
                        help="where notices come from: the cloud's metadata server or simulated")
    parser.add_argument("--metadata-url", default=None,
                        help=f"metadata server base URL (default {AWS_METADATA_URL} for aws, "
                             f"{GCP_METADATA_URL} for gcp)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default: auto)")
    parser.add_argument("--node-id", default=None, help="Ray node id to watch (default: this node)")
    parser.add_argument("--pool", default="", help="capacity pool of this node, for metrics")
    parser.add_argument("--poll-s", type=float, default=1.0, help="seconds per poll (default 1)")
    parser.add_argument("--gcp-notice-s", type=float, default=GCP_NOTICE_S,
                        help="seconds GCP gives between the notice and the stop (default 30)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop watching after this long (default: until the node is noticed "
                             "and its deadline has passed)")
    parser.add_argument("--coordinator-name", default=placement.COORDINATOR_NAME,
                        help="name of the training job's Coordinator actor "
                             f"(default {placement.COORDINATOR_NAME})")
    parser.add_argument("--json", action="store_true", help="print each outcome as a JSON line")


def _finite(x):
    """JSON has no infinity: a missing deadline becomes null."""
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return None if isinstance(x, float) and not math.isfinite(x) else x


def _outcome_json(outcome: DrainOutcome) -> str:
    doc = asdict(outcome)
    doc["notice_to_draining_s"] = outcome.notice_to_draining_s
    return json.dumps(_finite(doc), allow_nan=False)


def main(args: argparse.Namespace) -> int:
    try:
        config = WatcherConfig(source=args.source, metadata_url=args.metadata_url, pool=args.pool,
                               poll_s=args.poll_s, gcp_notice_s=args.gcp_notice_s,
                               coordinator_name=args.coordinator_name)
        if args.node_id is not None:
            check_node_id(args.node_id)
        if args.max_seconds is not None and not args.max_seconds > 0:
            raise ValueError(f"--max-seconds must be positive, got {args.max_seconds}")
    except ValueError as e:
        print(f"moshray watch: {e}", file=sys.stderr)
        return 2
    ray.init(address=args.address, namespace=placement.NAMESPACE, log_to_driver=False)
    node_id = args.node_id or ray.get_runtime_context().get_node_id()
    watcher = start_watcher(node_id, config)
    ray.get(watcher.ready.remote(), timeout=120)
    print(f"watching node {node_id} ({config.source})", file=sys.stderr, flush=True)
    end = math.inf if args.max_seconds is None else time.monotonic() + args.max_seconds
    seen = 0
    try:
        while time.monotonic() < end:
            outcome = ray.get(watcher.wait_outcome.remote(min(config.poll_s * 5, 10.0), seen))
            if outcome is None:
                continue
            seen += 1
            if args.json:
                print(_outcome_json(outcome), flush=True)
            else:
                print(f"{outcome.notice.action} notice: {len(outcome.peers)} peers draining, "
                      f"Ray drain {'accepted' if outcome.ray.accepted else 'FAILED: ' + outcome.ray.message}, "
                      f"{outcome.notice_to_draining_s:.3f} s after the notice", flush=True)
            # Stay until the deadline so in-flight hand-offs (owned by the watcher) finish.
            left = outcome.notice.seconds_left(time.time())
            time.sleep(min(left, max(0.0, end - time.monotonic())))
            return 0
    finally:
        try:
            ray.get(watcher.stop.remote(), timeout=config.poll_s + 10)
        except ray.exceptions.RayError:
            pass  # the node (and its watcher) may already be gone
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.autoscaler.watch"))
