"""The embedded cluster as a cloud: nodes come and go; the job is never called.

``run_embedded(config, job)`` starts a ``LocalCluster`` (a head plus ``cluster.local_nodes``
spot raylets, or the nodes a trace has at its start; on 127.0.0.1, or each in a network
namespace of its own with ``cluster.hosts = "netns"``), runs ``job(address)`` —
the same driver a ``RAY_ADDRESS`` cluster runs — in a thread, and meanwhile plays the cloud
on the main thread (Ray starts raylets only from there): with ``cluster.trace`` it replays the
spot trace, where an ``add`` is a new raylet, a ``notice`` is an interruption notice published
on the node's own metadata service (``cluster.notice_s`` trace seconds before its removal),
a ``remove`` stops the raylet and a ``kill`` SIGKILLs it. With separate hosts the cloud also
plays the network: ``LocalCloud.cut``/``heal`` partition a node and end it, ``shape`` limits
its link (the chaos bench's ``partition`` and ``slow_node`` faults). Whatever the job learns about
nodes, it learns from Ray and from the notices its watchers read, as on a real cluster.
Each event the cloud carries out, or cannot (its slot's node already gone), is a
``CloudEvent`` that a caller may watch (``on_cloud_event``): the chaos bench counts faults
from what then happened, never from the trace.

``ChaosCloud``-style schedules are traces too (``jobs/bench/chaos_schedule.py`` writes them).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

log = logging.getLogger("moshray.local_cloud")


@dataclass(frozen=True)
class CloudEvent:
    """One trace event as the cloud carried it out (or did not).

    ``kind``: ``add``, ``notice``, ``remove`` or ``kill`` (trace events), or ``cut``,
    ``heal`` or ``shape`` (network events, separate hosts only); ``node_id``: Ray's hex id
    of the slot's raylet (after an ``add``, the new one; after a ``heal`` that restarted the
    raylet, the new one; None when there was none); ``at``: ``time.monotonic()`` when it was
    done; ``done`` False with ``reason`` when it could not be (the slot's node was already
    gone, or starting it failed); ``detail``: what a network event did (``heal``:
    ``"same"`` raylet or ``"new"``; ``shape``: the Mbit/s or ``"unlimited"``)."""

    kind: str
    slot: int
    node_id: str | None
    at: float
    done: bool
    reason: str = ""
    detail: str = ""


def quiet_slots(events: Iterable, live: Iterable[int], elapsed_s: float,
                window_s: float) -> list[int]:
    """The ``live`` slots that no scheduled trace event (``NodeEvent``: ``at_s``, ``slot``)
    touches between ``elapsed_s`` and ``elapsed_s + window_s`` (seconds since the replay
    began), sorted: where a network fault can run its course without racing a removal."""
    busy = {e.slot for e in events if elapsed_s <= e.at_s <= elapsed_s + window_s}
    return sorted(set(live) - busy)


class LocalCloud:
    """The cloud side of the embedded cluster: carries out trace events on its nodes.

    Every event is reported to ``on_event`` (a ``CloudEvent``; default: none) and kept in
    ``events``. An event for a slot whose node is not live is not carried out: it is
    recorded as not done, with the reason, and logged (never skipped silently)."""

    def __init__(self, cluster, notice_s: float,
                 on_event: Callable[[CloudEvent], None] | None = None,
                 schedule: Iterable = ()):
        self.cluster, self.notice_s, self.on_event = cluster, notice_s, on_event
        self.events: list[CloudEvent] = []
        self.schedule = tuple(schedule)  # the trace's NodeEvents, for quiet_slots
        self.started_at: float | None = None  # monotonic start of the trace replay
        self._calls: queue.SimpleQueue = queue.SimpleQueue()

    # ------------------------------------------------------------ the main thread's work

    def call(self, fn: Callable[[], object], timeout_s: float = 180.0):
        """Run ``fn`` on the cloud's (main) thread — Ray starts raylets only from there, and a
        heal may start one — and return its result or re-raise what it raised. Raises
        TimeoutError if the main thread did not finish it within ``timeout_s`` (it may still
        run later). For other threads (the chaos bench's injector)."""
        box: dict = {}
        done = threading.Event()

        def task() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller
                box["error"] = exc
            finally:
                done.set()

        self._calls.put(task)
        if not done.wait(timeout_s):
            raise TimeoutError(f"the cloud's thread did not run the call within {timeout_s:g} s")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def serve(self, seconds: float) -> None:
        """Sleep up to ``seconds`` on the main thread, running the calls other threads queued
        (``call``) as they come: the replay's sleep, and the wait for the job's end."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                task = self._calls.get(timeout=left)
            except queue.Empty:
                return
            task()

    def quiet_slots(self, window_s: float) -> list[int]:
        """Live slots with no trace event due in the next ``window_s`` seconds."""
        elapsed = 0.0 if self.started_at is None else time.monotonic() - self.started_at
        return quiet_slots(self.schedule, self.cluster.live_slots(), elapsed, window_s)

    def _record(self, kind: str, slot: int, node_id: str | None, done: bool,
                reason: str = "", detail: str = "") -> None:
        event = CloudEvent(kind, slot, node_id, time.monotonic(), done, reason, detail)
        self.events.append(event)
        if not done:
            log.warning("cloud: %s of slot %d not done: %s", kind, slot, reason)
        if self.on_event is not None:
            self.on_event(event)

    def _live(self, kind: str, slot: int) -> str | None:
        """``slot``'s node id if it is live; else records the event as not done."""
        if slot in self.cluster.live_slots():
            return self.cluster.node_id(slot)
        self._record(kind, slot, None, False, f"slot {slot} has no live node")
        return None

    def add(self, slot: int) -> None:
        if slot in self.cluster.live_slots():
            self._record("add", slot, self.cluster.node_id(slot), False,
                         f"slot {slot} already has a live node")
            return
        try:
            self.cluster.add_node(slot)
        except RuntimeError as exc:  # `ray start` failed or the node never registered
            self._record("add", slot, None, False, str(exc).splitlines()[0][:300])
            return
        self._record("add", slot, self.cluster.node_id(slot), True)

    def notice(self, slot: int) -> None:
        node_id = self._live("notice", slot)
        if node_id is not None:
            self.cluster.notice(slot, max(self.notice_s, 0.1))
            self._record("notice", slot, node_id, True)

    def remove(self, slot: int) -> None:
        node_id = self._live("remove", slot)
        if node_id is not None:
            self.cluster.remove_node(slot)
            self._record("remove", slot, node_id, True)

    def kill(self, slot: int) -> None:
        node_id = self._live("kill", slot)
        if node_id is not None:
            self.cluster.remove_node(slot, hard=True)
            self._record("kill", slot, node_id, True)

    # ------------------------------------------------------------ the network (netns)

    def cut(self, slot: int) -> None:
        """Partition ``slot``'s node (its link down, its processes running). Any thread."""
        node_id = self._live("cut", slot)
        if node_id is not None:
            self.cluster.cut(slot)
            self._record("cut", slot, node_id, True)

    def heal(self, slot: int, timeout_s: float = 120.0) -> str | None:
        """End ``slot``'s partition; returns ``"same"`` (its raylet came back), ``"new"`` (Ray
        had declared it dead; a new raylet was started in its namespace) or None (not done:
        recorded with the reason). Main thread (a new raylet may be started): from another
        thread, through ``call``."""
        node_id = self._live("heal", slot)
        if node_id is None:
            return None
        try:
            outcome = self.cluster.heal(slot, timeout_s=timeout_s)
        except RuntimeError as exc:
            self._record("heal", slot, node_id, False, str(exc).splitlines()[0][:300])
            return None
        self._record("heal", slot, self.cluster.node_id(slot), True, detail=outcome)
        return outcome

    def shape(self, slot: int, mbit: float | None) -> None:
        """Limit ``slot``'s link to ``mbit`` Mbit/s each way (None: unlimited again). Any
        thread."""
        node_id = self._live("shape", slot)
        if node_id is not None:
            self.cluster.shape(slot, mbit)
            self._record("shape", slot, node_id, True,
                         detail="unlimited" if mbit is None else f"{mbit:g}")


def _trace_events(config):
    from moshray.autoscaler.traces import load_trace, schedule, with_notices

    c = config.cluster
    return with_notices(schedule(load_trace(c.trace), c.time_scale, c.max_nodes),
                        c.wall_notice_s)


def run_embedded(config, job: Callable[[str], dict],
                 on_cloud_event: Callable[[CloudEvent], None] | None = None,
                 on_cloud: Callable[[LocalCloud], None] | None = None,
                 links=None) -> dict:
    """Start the embedded cluster, run ``job(address)`` on it while replaying the trace,
    stop everything; returns what ``job`` returned (re-raises what it raised).
    ``links`` (a ``jobs.local.links.NodeLinks``, with ``cluster.hosts = "netns"``): every
    node's link and zone as a link profile lays them out, a node the trace adds again
    included (a benchmark's shaped network; the job is not told).
    ``on_cloud_event`` hears each event the cloud carried out or could not
    (``LocalCloud``), on the main thread. ``on_cloud`` receives the ``LocalCloud`` before the
    job starts: a harness that plays more of the cloud (the chaos bench's network faults)
    queues its work on the main thread through ``LocalCloud.call``, served until the job
    ends."""
    from moshray.autoscaler.traces import TraceReplayer, initial_slots
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig, pin_loopback

    c = config.cluster
    if c.hosts == "loopback":
        pin_loopback()
    events = _trace_events(config) if c.trace else ()
    slots = initial_slots(events) if c.trace else tuple(range(c.local_nodes))
    cluster = LocalCluster(LocalClusterConfig(spot_nodes=0, cpus_per_node=2,
                                              gpus_per_node=c.local_gpus, hosts=c.hosts,
                                              dashboard=c.dashboard,
                                              **(links.cluster_fields() if links else {})))
    result: dict = {}
    done = threading.Event()
    try:
        for slot in slots:
            cluster.add_node(slot)
        # From the main thread; the job's driver shares the connection (and, as under
        # `ray job submit`, sees its replicas' logs).
        cluster.connect(log_to_driver=True)
        if c.dashboard:  # cluster.dashboard (`moshray train --dashboard`)
            import sys

            print(f"Ray dashboard: {cluster.dashboard_url}",
                  file=sys.stderr if config.json else sys.stdout, flush=True)
        from moshray.jobs.train import stop_on_sigterm

        stop_on_sigterm()  # after Ray's own handler: SIGTERM ends the run cleanly

        def driver() -> None:
            try:
                result["summary"] = job(cluster.address)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                result["error"] = exc
            finally:
                done.set()

        cloud = LocalCloud(cluster, c.wall_notice_s, on_cloud_event, events)
        if on_cloud is not None:
            on_cloud(cloud)
        thread = threading.Thread(target=driver, name="moshray-job", daemon=True)
        thread.start()
        cloud.started_at = time.monotonic()
        if events:
            replay = TraceReplayer(events, cloud.add, cloud.remove, skip_initial=True,
                                   kill_node=cloud.kill, notice_node=cloud.notice,
                                   sleep=cloud.serve)
            replay.run(stop=done)
        while not done.is_set():
            cloud.serve(0.5)
        thread.join(timeout=30)
    finally:
        cluster.shutdown()
    if "error" in result:
        raise result["error"]
    return result["summary"]
