"""The cluster side of `moshray bench recovery`: the real training job, and a cloud that times it.

``JobThread`` runs the training job's driver (``moshray.jobs.train.run_job``, the elastic
controller) against a ``LocalCluster`` in a thread, as ``local_cloud.run_embedded`` does.
``CloudTrials`` plays the cloud from the main thread (Ray starts raylets only there) and
only acts on the cluster: ``add_node``, a spot notice through the node's own metadata
service (``cluster.notice``), ``remove_node`` at the notice's deadline, ``remove_node(hard=True)``
(SIGKILL). It never starts a replica, a watcher or an expert: the job does, as on a real
cluster. It measures from the outside: the job's Coordinator (found by its well-known name;
``notice_stats``, ``step_timings``, ``peer_view``, ``lookup_experts``) and Ray's node table.

Replica ids are ``replica-<slot>-<n>`` (the controller labels a replica with its node's
``moshray-slot``); every node this bench adds gets a slot never used before, so the prefix
``replica-<slot>-`` names one node's replicas. Times of the Coordinator's clock (seconds since
it started) are mapped onto this process's monotonic clock by the best of three round trips.

Failure behaviour: every wait is bounded (``timeout_s``) and raises ``RecoveryTimeout``
naming what did not happen; a job that raised is re-raised by ``JobThread.end``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping

from moshray.jobs.bench.join_profile import JoinProfile, cpu_by_role, node_cpu, read_procs
from moshray.jobs.bench.recovery_steps import (all_contributed, first_commit_after, first_commit_with,
                                         first_commit_without, replica_of)

log = logging.getLogger("moshray.bench_recovery")

POLL_S = 0.1


class RecoveryTimeout(RuntimeError):
    """A recovery did not happen within ``--timeout`` (exit 1, one line)."""


# =========================================================================== waiting

def wait_for(predicate, timeout_s: float, what: str, poll_s: float = POLL_S):
    """``predicate()``'s first truthy value, polled; ``RecoveryTimeout`` after ``timeout_s``."""
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= end:
            raise RecoveryTimeout(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(poll_s)


# =========================================================================== the job


class JobThread:
    """``run_job(config, cluster.address)`` in a daemon thread (connect Ray first, from the
    main thread). ``config.training.max_seconds`` bounds the job; ``end`` ends it sooner.
    One job at a time per process (the driver's stop signal is process-wide)."""

    def __init__(self, config, address: str):
        from moshray.jobs import train
        from moshray.jobs.train import run_job

        self.stop = train.STOP
        self.stop.clear()  # an earlier job's stop must not end this one
        self.config = config
        self.result: dict = {}
        self.done = threading.Event()

        def driver() -> None:
            try:
                self.result["summary"] = run_job(config, address)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                self.result["error"] = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=driver, name="moshray-job", daemon=True)
        self.thread.start()

    def check(self) -> None:
        """Raise what the job raised, or ``RecoveryTimeout`` if it ended before the bench."""
        if self.done.is_set():
            if "error" in self.result:
                raise self.result["error"]
            raise RecoveryTimeout("the training job ended before the bench did "
                                  "(training.max_seconds too short?)")

    def end(self, timeout_s: float) -> dict | None:
        """Stop the job as ``ray job stop`` does (the driver's SIGTERM event: it stops its
        replicas as at its time limit, then summarizes) and wait at most ``timeout_s`` for it
        to return; returns its summary (None if it did not end in time)."""
        self.stop.set()
        if not self.done.wait(timeout_s):
            log.warning("the training job did not end within %.0f s", timeout_s)
            return None
        if "error" in self.result:
            raise self.result["error"]
        return self.result["summary"]


# =========================================================================== the cloud


class CloudTrials:
    """Plays the cloud on ``cluster`` (a connected ``LocalCluster``) while ``job`` trains,
    and times each event from the Coordinator and Ray's node table (see module docstring)."""

    def __init__(self, cluster, job: JobThread, timeout_s: float, notice_s: float, log_fn,
                 previous_coordinator=None):
        import ray

        from moshray.cluster import placement

        self.ray, self.cluster, self.job = ray, cluster, job
        self.timeout_s, self.notice_s, self.log = timeout_s, notice_s, log_fn
        self.next_slot = max(cluster.live_slots(), default=-1) + 1
        self.any_commit_s: list[float] = []
        self.node_start_s: list[float] = []
        self.join_profiles: list[JoinProfile] = []
        self.offset = 0.0

        def find():
            self.job.check()
            try:
                actor = placement.sole_coordinator()
            except ValueError:
                return None
            if previous_coordinator is not None and \
                    actor._actor_id == previous_coordinator._actor_id:
                return None
            return actor

        self.coordinator = wait_for(find, timeout_s, "the job's Coordinator")

    # -- reading the job ---------------------------------------------------------------------

    def _get(self, ref):
        return self.ray.get(ref, timeout=self.timeout_s)

    def steps(self, since_epoch: int = 0) -> list:
        self.job.check()
        return self._get(self.coordinator.step_timings.remote(since_epoch))["steps"]

    def view(self) -> dict:
        return self._get(self.coordinator.peer_view.remote())

    def epoch(self) -> int:
        return self._get(self.coordinator.stats.remote())["epoch"]

    def sync_clock(self) -> None:
        """``offset``: Coordinator time + offset = this process's monotonic time."""
        best = None
        for _ in range(3):
            t0 = time.monotonic()
            now_s = self._get(self.coordinator.step_timings.remote(10**12))["now_s"]
            t1 = time.monotonic()
            if best is None or t1 - t0 < best[0]:
                best = (t1 - t0, (t0 + t1) / 2 - now_s)
        self.offset = best[1]

    def replicas(self) -> dict[int, str]:
        """``{slot: replica id}`` of every live slot whose node has a ready replica."""
        view = self.view()
        ready = set(view["ready"])
        out = {}
        for slot in self.cluster.live_slots():
            peer = replica_of(slot, view["members"])
            if peer is not None and peer in ready:
                out[slot] = peer
        return out

    def wait_steady(self, what: str) -> dict[int, str]:
        """Wait until every live node has a ready replica that took part in a committed step."""
        def steady():
            peers = self.replicas()
            if len(peers) < len(self.cluster.live_slots()):
                return None
            return peers if all_contributed(self.steps(), list(peers.values())) else None

        peers = wait_for(steady, self.timeout_s, f"a replica on every node to contribute ({what})",
                         poll_s=0.5)
        self.sync_clock()
        return peers

    def wait_watcher(self, node_id: str, targets: int = 0) -> None:
        """Wait for the job's notice watcher on ``node_id`` (with ``targets`` hand-offs)."""
        from moshray.autoscaler.watch import get_watcher

        def ready():
            watcher = get_watcher(node_id)
            if watcher is None:
                return False
            return self._get(watcher.status.remote())["targets"] >= targets

        wait_for(ready, self.timeout_s, f"the job's notice watcher on node {node_id[:12]}",
                 poll_s=0.5)

    # -- the events ---------------------------------------------------------------------------

    def notice(self, slot: int) -> float:
        """A spot notice for ``slot``'s node through its metadata service, the node removed at
        the deadline; returns notice -> rebalanced (the Coordinator's ``rebalance_s``: from the
        node's watcher receiving the notice to the first plan without the node's replicas)."""
        node = self.cluster.node_id(slot)
        self.wait_watcher(node)
        self.log(f"notice for spot node {slot} ({self.notice_s:g} s)")
        self.cluster.notice(slot, self.notice_s)
        deadline = time.monotonic() + self.notice_s
        rebalance_s, removed = None, False
        end = deadline + self.timeout_s
        while rebalance_s is None or not removed:
            if rebalance_s is None:
                record = self._get(self.coordinator.notice_stats.remote()).get(node)
                if record is not None and record["rebalance_s"] is not None:
                    rebalance_s = float(record["rebalance_s"])
            if not removed and time.monotonic() >= deadline:
                self.cluster.remove_node(slot)
                removed = True
            if time.monotonic() > end:
                raise RecoveryTimeout(f"timed out after {self.timeout_s:.0f} s waiting for the "
                                      f"first plan without the noticed node {slot}")
            self.job.check()
            time.sleep(0.05)
        self.log(f"  notice -> rebalanced {rebalance_s:.2f} s; node {slot} removed")
        return rebalance_s

    def add_node(self) -> tuple[int, float]:
        """A new spot node on a never-used slot; ``(slot, monotonic time it was alive)``."""
        slot, self.next_slot = self.next_slot, self.next_slot + 1
        t0 = time.monotonic()
        self.cluster.add_node(slot)
        node = self.cluster.node_id(slot)
        wait_for(lambda: any(n["NodeID"] == node and n["Alive"] for n in self.ray.nodes()),
                 self.timeout_s, f"node {slot} alive in Ray's node table")
        up = time.monotonic()
        self.node_start_s.append(up - t0)
        return slot, up

    def join(self) -> float:
        """Add a node; returns join -> first contribution (node alive -> commit of the first
        step its replica took part in). Where the time and the machine's CPU went meanwhile
        is appended to ``join_profiles`` (``join_profile.JoinProfile``)."""
        self.sync_clock()
        before = read_procs()
        added = time.monotonic()
        slot, up = self.add_node()
        peer = wait_for(lambda: replica_of(slot, self.view()["members"]), self.timeout_s,
                        f"the job to start a replica on the new node {slot}")
        registered = time.monotonic()
        since = max(0, self.epoch() - 2)
        wait_for(lambda: peer in self.view()["ready"], self.timeout_s,
                 f"{peer} on the new node {slot} to copy the state and be ready")
        ready = time.monotonic()
        at_ready = read_procs()
        committed = wait_for(lambda: first_commit_with(self.steps(since), peer), self.timeout_s,
                             f"the first contribution of {peer} on the new node {slot}")
        after = read_procs()
        join_s = committed + self.offset - up
        roots = self.cluster.node_pids(slot)
        profile = JoinProfile(registered - up, ready - up, join_s, time.monotonic() - added,
                              os.cpu_count() or 1,
                              cpu_by_role(before, after, roots) if after else None,
                              node_cpu(at_ready, roots) if at_ready else None)
        self.join_profiles.append(profile)
        self.log(f"  node {slot} up in {self.node_start_s[-1]:.1f} s; {peer}'s first "
                 f"contribution after {join_s:.2f} s")
        self.log(f"  {profile.line()}")
        return join_s

    def hard_kill(self, slot: int, peer: str) -> float:
        """SIGKILL ``slot``'s node (replica ``peer``), no notice; returns kill -> progress (the
        commit of the first step without ``peer`` committed after the kill)."""
        since = max(0, self.epoch() - 2)
        self.log(f"hard kill of spot node {slot} (replica {peer})")
        killed_at = time.monotonic()
        self.cluster.remove_node(slot, hard=True)
        after = killed_at - self.offset
        committed = wait_for(lambda: first_commit_without(self.steps(since), peer, after),
                             self.timeout_s, f"a committed step after the hard kill of {peer}",
                             poll_s=0.05)
        progress_s = committed + self.offset - killed_at
        # For reference: the first commit of any step (a round in flight may still commit,
        # with or without the dead peer's contribution, before the swarm has moved on).
        self.any_commit_s.append(first_commit_after(self.steps(since), after) + self.offset
                                 - killed_at)
        self.log(f"  next step without {peer} committed after {progress_s:.2f} s (first "
                 f"commit of any step after {self.any_commit_s[-1]:.2f} s)")
        return progress_s

    def trial(self, values: dict[str, list[float]]) -> None:
        """Notice, join, hard kill, join (each from a steady swarm)."""
        peers = self.wait_steady("before the notice")
        values["notice_to_rebalanced_s"].append(self.notice(min(peers)))
        values["join_to_contribution_s"].append(self.join())
        peers = self.wait_steady("before the hard kill")
        slot = min(peers)
        values["hard_kill_to_progress_s"].append(self.hard_kill(slot, peers[slot]))
        values["join_to_contribution_s"].append(self.join())
        self.wait_steady("end of trial")

    # -- experts (a job with DMoE layers) ---------------------------------------------------

    def expert_hosts(self) -> dict[str, object]:
        """``{host_id: HostRecord}`` of the registry's live expert hosts."""
        return {r.host_id: r for r in self._get(self.coordinator.lookup_experts.remote(""))}

    def expert_notice(self, d_model: int) -> tuple[float, int]:
        """Notice the node hosting the most expert shards; returns ``(seconds from the notice
        to every one of its shards served again elsewhere, experts moved)``. The node is
        removed at the notice's deadline and a replacement node added."""
        # The job starts its controller (and so the watchers, each registered for the
        # experts' hand-off) only once every expert shard serves.
        for s in self.cluster.live_slots():
            self.wait_watcher(self.cluster.node_id(s), targets=1)
        hosts = self.expert_hosts()
        by_slot = {s: [h for h, r in hosts.items() if r.node_id == self.cluster.node_id(s)]
                   for s in self.cluster.live_slots()}
        slot = max(sorted(by_slot), key=lambda s: len(by_slot[s]))
        node = self.cluster.node_id(slot)
        moving = {h: hosts[h] for h in by_slot[slot]}
        if not moving:
            raise RecoveryTimeout("no expert shard on any spot node")
        experts = sum(len(r.uids) for r in moving.values())
        self.log(f"notice for spot node {slot} (expert shards {sorted(moving)})")
        noticed = time.monotonic()
        self.cluster.notice(slot, self.notice_s)
        deadline = noticed + self.notice_s
        respawn_s, removed = None, False
        end = deadline + self.timeout_s
        while respawn_s is None or not removed:
            if respawn_s is None and self._served_elsewhere(moving, node, d_model):
                respawn_s = time.monotonic() - noticed
            if not removed and time.monotonic() >= deadline:
                self.cluster.remove_node(slot)
                removed = True
            if time.monotonic() > end:
                raise RecoveryTimeout(f"timed out after {self.timeout_s:.0f} s waiting for the "
                                      f"noticed node's experts to be served again")
            self.job.check()
            time.sleep(0.05)
        self.log(f"  {experts} experts served again elsewhere after {respawn_s:.2f} s")
        self.add_node()
        return respawn_s, experts

    def _served_elsewhere(self, moving: Mapping[str, object], node: str, d_model: int) -> bool:
        """Every shard of ``moving`` registered on a new instance off ``node``, and a forward
        call through the registry's handle answers."""
        import numpy as np

        records = self.expert_hosts()
        for host_id, old in moving.items():
            r = records.get(host_id)
            if r is None or r.node_id == node or r.instance == old.instance \
                    or set(r.uids) != set(old.uids):
                return False
        x = np.zeros((1, d_model), dtype=np.float32)
        try:
            for host_id in moving:
                r = records[host_id]
                self.ray.get(r.handle.forward.remote(r.uids, (x,) * len(r.uids)), timeout=10)
        except (self.ray.exceptions.RayError, TimeoutError):
            return False
        return True
