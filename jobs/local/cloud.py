"""The embedded cluster as a cloud: nodes come and go; the job is never called.

``run_embedded(config, job)`` starts a ``LocalCluster`` (a head plus ``cluster.local_nodes``
spot raylets, or the nodes a trace has at its start; on 127.0.0.1, or each in a network
namespace of its own with ``cluster.hosts = "netns"``), runs ``job(address)`` —
the same driver a ``RAY_ADDRESS`` cluster runs — in a thread, and meanwhile plays the cloud
on the main thread (Ray starts raylets only from there): with ``cluster.trace`` it replays the
spot trace, where an ``add`` is a new raylet, a ``notice`` is an interruption notice published
on the node's own metadata service (``cluster.notice_s`` trace seconds before its removal),
a ``remove`` stops the raylet and a ``kill`` SIGKILLs it. Whatever the job learns about
nodes, it learns from Ray and from the notices its watchers read, as on a real cluster.

``ChaosCloud``-style schedules are traces too (``jobs/bench/chaos_schedule.py`` writes them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("moshray.local_cloud")


class LocalCloud:
    """The cloud side of the embedded cluster: carries out trace events on its nodes."""

    def __init__(self, cluster, notice_s: float):
        self.cluster, self.notice_s = cluster, notice_s

    def add(self, slot: int) -> None:
        if slot not in self.cluster.live_slots():
            self.cluster.add_node(slot)

    def notice(self, slot: int) -> None:
        if slot in self.cluster.live_slots():
            self.cluster.notice(slot, max(self.notice_s, 0.1))

    def remove(self, slot: int) -> None:
        if slot in self.cluster.live_slots():
            self.cluster.remove_node(slot)

    def kill(self, slot: int) -> None:
        if slot in self.cluster.live_slots():
            self.cluster.remove_node(slot, hard=True)


def _trace_events(config):
    from moshray.autoscaler.traces import load_trace, schedule, with_notices

    c = config.cluster
    return with_notices(schedule(load_trace(c.trace), c.time_scale, c.max_nodes),
                        c.wall_notice_s)


def run_embedded(config, job: Callable[[str], dict]) -> dict:
    """Start the embedded cluster, run ``job(address)`` on it while replaying the trace,
    stop everything; returns what ``job`` returned (re-raises what it raised)."""
    from moshray.autoscaler.traces import TraceReplayer, initial_slots
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig, pin_loopback

    c = config.cluster
    if c.hosts == "loopback":
        pin_loopback()
    events = _trace_events(config) if c.trace else ()
    slots = initial_slots(events) if c.trace else tuple(range(c.local_nodes))
    cluster = LocalCluster(LocalClusterConfig(spot_nodes=0, cpus_per_node=2,
                                              gpus_per_node=c.local_gpus, hosts=c.hosts))
    result: dict = {}
    done = threading.Event()
    try:
        for slot in slots:
            cluster.add_node(slot)
        # From the main thread; the job's driver shares the connection (and, as under
        # `ray job submit`, sees its replicas' logs).
        cluster.connect(log_to_driver=True)
        from moshray.jobs.train import stop_on_sigterm

        stop_on_sigterm()  # after Ray's own handler: SIGTERM ends the run cleanly

        def driver() -> None:
            try:
                result["summary"] = job(cluster.address)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                result["error"] = exc
            finally:
                done.set()

        thread = threading.Thread(target=driver, name="moshray-job", daemon=True)
        thread.start()
        if events:
            cloud = LocalCloud(cluster, c.wall_notice_s)
            replay = TraceReplayer(events, cloud.add, cloud.remove, skip_initial=True,
                                   kill_node=cloud.kill, notice_node=cloud.notice)
            replay.run(stop=done)
        while not done.wait(0.5):
            pass
        thread.join(timeout=30)
    finally:
        cluster.shutdown()
    if "error" in result:
        raise result["error"]
    return result["summary"]
