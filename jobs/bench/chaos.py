"""`moshray bench chaos`: one bounded run of the training job under a seeded storm of faults.

The schedule mixes up to ten kinds of fault, all drawn from one seed:

- ``notice``: a spot notice, then the node's removal at its deadline;
- ``kill``: a spot raylet SIGKILLed, no notice;
- ``coordinator``: ``ray.kill(coordinator, no_restart=False)`` (Ray restarts it, the
  replicas rebuild it);
- ``nan``: one replica's gradients turn NaN until its peers get it quarantined;
- ``shape``: one replica sends contributions one element too long, likewise;
- ``replica_kill``: one replica's process SIGKILLed, its node left up;
- ``user_error``: one replica's user loop raises once (the job replaces the replica);
- ``disk_full``: the checkpoint disk (a small tmpfs the bench mounts; root only, else the
  kind is ruled out with that reason; separate hosts keep no checkpoints on a local disk:
  ruled out there) is filled while a replica saves a checkpoint;
- ``partition`` (``--hosts netns`` only): one node's link goes down for ``partition_s``
  (its processes keep running), then comes back; a raylet Ray declared dead meanwhile is
  restarted in its namespace, as a machine's init system would;
- ``slow_node`` (``--hosts netns`` only): one node's link is shaped to ``slow_mbit`` Mbit/s
  for ``slow_s``, then unlimited again.

The kinds this bench does not run are in ``chaos_plan.RULED_OUT`` with the reason (and in
the figures). Every fault is counted from what was observed, never from the plan
(``chaos_plan.FaultLedger``): a node the cloud removed counts once Ray shows it gone (a
notice once the Coordinator also has it), a Coordinator kill once it answers from a new
process, a bad replica once a peer rejected its contributions or it was quarantined, a
replica kill once Ray reports the actor dead on a live node, a user error once the replica
reports its loop raised, a full disk once the save returns ``no_space``, a partition once
this machine could no longer open a connection to the node's raylet and, after the heal,
Ray lists the node alive again (the same raylet or a restarted one), a slow node once the
kernel's shaper on its link held back packets during the window. A planned fault that did
not happen fails the run, with why. Network faults go to nodes with no trace event due
during their window (``LocalCloud.quiet_slots``), and are carried out on the cloud's thread
(``LocalCloud.call``); the figures give the global steps committed during each.

Node faults go through the embedded cluster's cloud exactly as a spot trace does: the
schedule's node events are written as a per-node trace (``jobs/bench/chaos_schedule.py``) that
``jobs/local_cloud.run_embedded`` replays while ``train.run_job`` (the elastic controller)
trains. The actor faults are injected by this harness from a thread, with Ray handles found
by name as a test would (the Coordinator by its well-known name, a replica through
``Coordinator.peer_handle``), through ``jobs/bench/chaos_faults.py`` (Ray's generic
``__ray_call__`` and a wrapped user loop: the production actors have no fault hooks); a bad
replica's fault is cleared once the Coordinator lists it as quarantined (or after
``--timeout``), so it resyncs from a donor and rejoins.

Figures (one JSON line on stdout; the job's own lines go to stderr): faults observed by
kind, the planned ones, the ones that did not happen (with why), the kinds ruled out,
steps, lost committed steps (skipped by a replica's lineage, or undone when every replica
holding them died and the swarm fell back to a checkpoint), repeated steps, rollbacks (the
Coordinator keeps their count over its restarts), quarantines seen, seconds stalled (sum of the gaps between global
steps longer than ``STALL_S``), replicas at the end (staying, i.e. not noticed) and the
expected count, ``replicas_consistent``. Invariants: 0 lost, 0 repeated, 0 rollbacks, every
bad replica quarantined, the expected replica count, replicas bitwise identical, every
planned fault observed; a failed
invariant exits 1 with one line on stderr (after the JSON line). Bad arguments exit 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

from moshray.jobs.bench.chaos_faults import (SmallDisk, chaos_job, order_user_error,
                                             user_error_witnessed,
                                             process_pid, save_through, set_replica_fault,
                                             small_disk_refusal, user_error_raised)
from moshray.jobs.bench.chaos_plan import (NETWORK_RULED_OUT, NODE_KINDS, RULED_OUT,
                                           SCHEDULES, ChaosPlan, FaultLedger, draw_plan, invariant_failures,
                                           node_fault_outcome, stall_causes, stalled_seconds)
from moshray.jobs.bench.chaos_schedule import write_trace
from moshray.jobs.bench.results import add_results_argument, save_result
from moshray.jobs.controller.replica_states import join_seconds

log = logging.getLogger("moshray.bench_chaos")

BAD_WAIT_S = 30.0  # at most this long for the ready replicas, then for the quarantine
MIN_READY = 2  # ready replicas a bad-replica fault needs: the bad one and a good one
PICK_QUIET_S = 10.0  # a picked replica's node has no trace event due this soon (its effect
# shows within seconds; a longer window leaves no node to pick when losses come every ~7 s)
REMOVING_KINDS = frozenset({"replica_kill", "user_error"})  # take their replica out a while
CHECKPOINT_EVERY = 200  # global steps between the job's own checkpoints (on the small disk)
NETWORK_MARGIN_S = 6.0  # no trace event this close after a network fault's window
USER_ERROR_POLL_S = 0.1  # read the raise before the controller replaces the replica
REJECTION_OF = {"nan": "non_finite", "shape": "shape_mismatch"}  # what peers reject it for
# The bench's model (small, so that a 2-core machine takes many steps); --set overrides.
DEFAULT_SET = ("model.n_layers=2", "model.d_model=64", "model.d_ff=128", "model.n_heads=2",
               "model.seq_len=64", "training.batch_size=8", "training.target_batch_size=32",
               "training.round_timeout_s=5",
               # The bench raises in user loops and kills replica processes on purpose: the
               # job's failure budget must cover them (the long schedule has 9).
               "training.max_failures=40")


# =========================================================================== the harness


class Injector:
    """Injects ``plan.actor_faults`` into the running job, watches its Coordinator (every
    ``poll_s``: epoch advances, rollbacks, quarantines, delivered notices) and Ray's node
    table, and records every fault in ``ledger`` as observed (``chaos_plan.FaultLedger``):
    a node fault the cloud carried out (``cloud_event``, from the main thread) is decided
    when Ray shows the node gone (and, for a notice, the Coordinator has it); an actor
    fault when its effect is seen (a Coordinator back in a new process, contributions
    rejected, a replica's process dead on a live node, the user's loop raising). Runs in a
    thread sharing the driver's Ray connection; stops by ``end_at`` (monotonic) so that it
    is done before the job disconnects. Every Ray call is bounded by ``timeout_s``;
    failures are recorded in ``errors``, never raised."""

    def __init__(self, plan: ChaosPlan, timeout_s: float, log_fn, seed: int, poll_s: float = 0.5):
        self.plan, self.timeout_s, self.log, self.poll_s = plan, timeout_s, log_fn, poll_s
        self.rng = random.Random(seed)
        self.ledger = FaultLedger()
        self.bad: list[str] = []
        self.bad_lost: list[str] = []
        self.quarantined: dict[str, str] = {}  # peer -> reason, over every Coordinator life
        self.noticed: set[str] = set()  # node ids whose notice reached the Coordinator
        # The Coordinator keeps its rollbacks over restarts (durable.py): the most seen
        self.rollbacks = 0
        self.rolled_back_steps = 0
        self.top_epoch = 0
        self.advances: list[float] = []
        # (monotonic time, kind): faults injected here, node losses and joins seen
        self.events: list[tuple[float, str]] = []
        self._seen_losses = self._seen_members = None
        self.errors: list[str] = []
        self.end_at = float("inf")
        self.disk: SmallDisk | None = None  # the checkpoint disk, for disk_full faults
        self.witness_dir = ""  # where the chaos loops say they raised (chaos_faults.chaos_job)
        self.checkpoint_uri: str | None = None
        self.cloud = None  # the embedded cluster's LocalCloud (network faults), once up
        self.schedule = None  # the ChaosSchedule (network faults' windows)
        self.steps_during: dict[str, list[int]] = {"partition": [], "slow_node": []}
        self.raised_at: dict[str, float] = {}  # user_error targets: when their loop raised

    def _coordinator(self):
        from moshray.cluster import placement

        return placement.sole_coordinator()

    def _get(self, ref):
        import ray

        return ray.get(ref, timeout=self.timeout_s)

    def _wait_s(self) -> float:
        """How long one fault's observation may take (well below --timeout: the
        schedule's later faults must not drift away)."""
        return min(self.timeout_s, BAD_WAIT_S)

    # ------------------------------------------------------------------ observing

    def cloud_event(self, event) -> None:
        """A ``jobs.local.cloud.CloudEvent``: a node loss the cloud carried out is a fault
        pending observation; one it could not carry out is a fault that did not happen."""
        if event.kind not in ("remove", "kill"):
            if not event.done:
                self.errors.append(f"cloud {event.kind} of slot {event.slot}: {event.reason}")
            return
        kind = "notice" if event.kind == "remove" else "kill"
        if event.done:
            self.ledger.tried(kind, event.node_id, event.at)
        else:
            self.ledger.not_done(kind, f"slot {event.slot}", event.at,
                                 f"the cloud could not act: {event.reason}")

    def _alive_nodes(self) -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    def observe(self) -> dict | None:
        """One look at the Coordinator's stats and Ray's nodes (None if the Coordinator did
        not answer); decides the node faults it can."""
        import ray

        try:
            coordinator = self._coordinator()
            stats = self._get(coordinator.stats.remote())
            self.noticed |= set(self._get(coordinator.notice_stats.remote()))
        except (ray.exceptions.RayError, TimeoutError, ValueError) as exc:
            self.errors.append(f"stats: {type(exc).__name__}")
            stats = None
        self._decide_node_faults(final=False)
        if stats is None:
            return None
        if stats["epoch"] > self.top_epoch:
            self.top_epoch = stats["epoch"]
            self.advances.append(time.monotonic())
        self.rollbacks = max(self.rollbacks, stats["rollbacks"])
        self.rolled_back_steps = max(self.rolled_back_steps, stats.get("rolled_back_steps", 0))
        now = time.monotonic()
        losses = stats["preemptions"]  # the driver's NodeLostEvents, kept over restarts
        if self._seen_losses is not None and losses > self._seen_losses:
            self.events.append((now, "node_loss"))
        live = stats["live"]
        if self._seen_members is not None and live > self._seen_members:
            self.events.append((now, "join"))
        self._seen_losses, self._seen_members = losses, live
        for peer, reason in stats["quarantines"]:
            self.quarantined.setdefault(peer, reason)
        return stats

    def _decide_node_faults(self, final: bool) -> None:
        import ray

        pending = [(i, r) for i, r in self.ledger.pending() if r.kind in NODE_KINDS]
        if not pending:
            return
        try:
            alive = self._alive_nodes()
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self.errors.append(f"nodes: {type(exc).__name__}")
            return
        for index, record in pending:
            outcome = node_fault_outcome(record.kind, record.target, alive, self.noticed, final)
            if outcome is not None:
                self.ledger.decide(index, *outcome)

    def finish(self) -> None:
        """The run is over: decide what is still pending (undecided: did not happen)."""
        self._decide_node_faults(final=True)
        for index, record in self.ledger.pending():
            self.ledger.decide(index, False, "not observed before the run ended")

    def _wait_until(self, at: float) -> bool:
        while time.monotonic() < min(at, self.end_at):
            self.observe()
            time.sleep(self.poll_s)
        return time.monotonic() < self.end_at

    # ------------------------------------------------------------------ injecting

    def kill_coordinator(self) -> None:
        """SIGKILL-equivalent ``ray.kill`` with restart; observed when the Coordinator
        answers again from a new process."""
        import ray

        self.observe()
        before = process_pid(self._coordinator(), self.timeout_s)
        ray.kill(self._coordinator(), no_restart=False)
        at = time.monotonic()
        self.events.append((at, "coordinator"))
        index = self.ledger.tried("coordinator", f"pid {before}", at)
        self.log(f"chaos: Coordinator killed (pid {before})")
        deadline = at + self._wait_s()
        while time.monotonic() < deadline:
            try:
                after = process_pid(self._coordinator(), min(5.0, self.timeout_s))
            except (ray.exceptions.RayError, TimeoutError, ValueError):
                after = None
            if after is not None and after != before:
                self.ledger.decide(index, True, f"back in a new process (pid {after})")
                return
            time.sleep(self.poll_s)
        self.ledger.decide(index, False, f"not back in a new process within "
                                         f"{self._wait_s():g} s")

    def _pick(self, kind: str, need: int = MIN_READY):
        """``(peer, handle)`` of a ready replica that is not broken, or None (recorded as a
        fault that did not happen) if fewer than ``need`` are ready by the deadline. The
        pick's node has no trace event due within ``PICK_QUIET_S``, so the cloud does not
        take it before its effect is seen; a fault that takes the replica out
        (``REMOVING_KINDS``) also leaves a ready replica on such a node, so the swarm keeps
        a holder of its state. A replica that dies as it is picked (its node went) is
        replaced by another pick."""
        import ray

        deadline = time.monotonic() + self._wait_s()
        while True:
            # Earlier bad replicas count: quarantined, they copied a donor's state and their
            # fault was cleared, so they are healthy replicas again.
            nodes = {p: n for p, n in self._ready_peer_nodes().items()
                     # a replica whose loop was just told to raise is being replaced
                     if time.monotonic() - self.raised_at.get(p, -1e9) > BAD_WAIT_S}
            quiet = self._quiet_nodes(PICK_QUIET_S)
            safe = sorted(p for p, n in nodes.items() if quiet is None or n in quiet)
            if kind in REMOVING_KINDS and len(safe) < 2:
                safe = []  # the only safe holder would go
            if len(nodes) >= need and safe:
                peer = self.rng.choice(safe)
                try:
                    handle = self._get(self._coordinator().peer_handle.remote(peer))
                    self._get(handle.status.remote())
                    return peer, handle
                except ray.exceptions.RayActorError as exc:
                    self.log(f"chaos: {peer} is gone ({type(exc).__name__}); picking again")
            if time.monotonic() >= min(deadline, self.end_at):
                self.ledger.not_done(kind, "-", time.monotonic(),
                                     f"fewer than {need} ready replicas to pick from, or "
                                     f"none on a node the trace leaves alone meanwhile")
                return None
            self._wait_until(time.monotonic() + self.poll_s)

    def _quiet_nodes(self, window_s: float) -> set[str] | None:
        """Node ids with no trace event due in the next ``window_s`` (None: no cloud yet)."""
        if self.cloud is None:
            return None
        cluster = self.cloud.cluster
        return {cluster.node_id(s) for s in self.cloud.quiet_slots(window_s)}

    def _rejections(self, reason: str) -> dict[str, int]:
        """Per member: contributions it rejected for ``reason`` so far (members that do not
        answer are left out)."""
        import ray

        out = {}
        for peer in self._get(self._coordinator().peer_view.remote())["members"]:
            try:
                handle = self._get(self._coordinator().peer_handle.remote(peer))
                out[peer] = self._get(handle.rejection_counts.remote()).get(reason, 0)
            except (ray.exceptions.RayError, TimeoutError, AttributeError):
                pass
        return out

    def bad_replica(self, kind: str) -> None:
        """Make one ready replica send ``kind`` contributions until it is quarantined. It
        needs one good peer besides, who rejects them (a 1-vs-1 length dispute is settled
        by the swarm's layout: ``cluster/coordinator/quarantine.py``). Observed when a peer
        rejected its contributions or the Coordinator quarantined it."""
        import ray

        reason = REJECTION_OF[kind]
        before = self._rejections(reason)
        picked = self._pick(kind)
        if picked is None:
            return
        peer, handle = picked
        set_replica_fault(handle, kind, self.timeout_s)
        at = time.monotonic()
        index = self.ledger.tried(kind, peer, at)
        self.events.append((at, kind))
        self.bad.append(peer)
        self.log(f"chaos: {peer} sends {kind} contributions")
        deadline = at + self._wait_s()
        while peer not in self.quarantined and time.monotonic() < min(deadline, self.end_at):
            time.sleep(self.poll_s)
            self.observe()
            if peer not in self._get(self._coordinator().peer_view.remote())["members"]:
                self.bad_lost.append(peer)  # its node went first
                break
        after = self._rejections(reason)
        rose = sorted(p for p in after if p != peer and after[p] > before.get(p, 0))
        if peer in self.quarantined:
            self.ledger.decide(index, True, f"quarantined ({self.quarantined[peer]})")
        elif rose:
            self.ledger.decide(index, True, f"{reason} rejections at {', '.join(rose)}")
        else:
            self.ledger.decide(index, False, f"no peer rejected its contributions and it was "
                                             f"not quarantined within {self._wait_s():g} s")
        if peer in self.bad_lost:
            return
        try:
            set_replica_fault(handle, None, self.timeout_s)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            self.errors.append(f"clear {peer}: {type(exc).__name__}")

    def kill_replica_process(self) -> None:
        """SIGKILL one ready replica's process, leaving its node up; observed when Ray
        reports the actor dead while its node is still alive."""
        import ray

        picked = self._pick("replica_kill")
        if picked is None:
            return
        peer, handle = picked
        node = self._get(handle.status.remote())["node"]
        pid = process_pid(handle, self.timeout_s)  # as its node sees it
        if self.cloud is not None:  # separate hosts: each node has a PID namespace of its own
            cluster = self.cloud.cluster
            slot = next((s for s in cluster.live_slots() if cluster.node_id(s) == node), None)
            if slot is not None:
                pid = cluster.host_pid(slot, pid)
        os.kill(pid, signal.SIGKILL)
        at = time.monotonic()
        index = self.ledger.tried("replica_kill", peer, at)
        self.events.append((at, "replica_kill"))
        self.log(f"chaos: {peer}'s process {pid} killed (its node stays)")
        deadline = at + self._wait_s()
        while time.monotonic() < deadline:
            try:
                self._get(handle.status.remote())
            except ray.exceptions.RayActorError:
                if node in self._alive_nodes():
                    self.ledger.decide(index, True, "actor dead, its node alive")
                else:
                    self.ledger.decide(index, False, "its node went too (not a process kill)")
                return
            except TimeoutError:
                pass
            time.sleep(self.poll_s)
        self.ledger.decide(index, False, f"Ray did not report it dead within "
                                         f"{self._wait_s():g} s")

    def user_error(self) -> None:
        """Order one ready replica's loop to raise once (``chaos_faults.chaos_job``);
        observed when the loop's witness file or the replica says that its loop raised."""
        import ray

        picked = self._pick("user_error")
        if picked is None:
            return
        peer, handle = picked
        order_user_error(handle, self.timeout_s)
        at = time.monotonic()
        self.raised_at[peer] = at
        index = self.ledger.tried("user_error", peer, at)
        self.events.append((at, "user_error"))
        self.log(f"chaos: {peer}'s loop told to raise")
        deadline = at + self._wait_s()
        while time.monotonic() < deadline:
            if user_error_witnessed(self.witness_dir, peer) is not None:
                self.ledger.decide(index, True, "its loop raised ChaosUserError")
                return
            try:
                if user_error_raised(handle, min(5.0, self.timeout_s)) is not None:
                    self.ledger.decide(index, True, "its loop raised ChaosUserError")
                    return
            except ray.exceptions.RayActorError:  # replaced: did it raise first?
                raised = user_error_witnessed(self.witness_dir, peer) is not None
                self.ledger.decide(index, raised, "its loop raised ChaosUserError" if raised
                                   else "the replica died and its loop never raised")
                return
            except TimeoutError:
                pass
            time.sleep(USER_ERROR_POLL_S)
        self.ledger.decide(index, False, f"its loop did not raise within {self._wait_s():g} s")

    def disk_full(self) -> None:
        """Fill the checkpoint disk, have one ready replica save a checkpoint through the
        production path, free the disk; observed when the save reports ``no_space``."""
        if self.disk is None:
            self.ledger.not_done("disk_full", "-", time.monotonic(), "no small disk mounted")
            return
        picked = self._pick("disk_full")
        if picked is None:
            return
        peer, handle = picked
        taken = self.disk.fill()
        at = time.monotonic()
        index = self.ledger.tried("disk_full", peer, at)
        self.events.append((at, "disk_full"))
        try:
            result = save_through(handle, self.checkpoint_uri, self.timeout_s)
        finally:
            self.disk.free()
        self.log(f"chaos: checkpoint disk full ({taken} bytes taken): {peer}'s save: {result}")
        if not result.ok and result.kind == "no_space":
            self.ledger.decide(index, True, f"the save of step {result.step} reported "
                                            f"no_space")
        else:
            self.ledger.decide(index, False, f"the save during a full disk returned {result}")

    def _network_slot(self, kind: str, hold_s: float) -> int | None:
        """A live slot with no trace event due during ``hold_s`` plus a margin, chosen by
        the seeded rng; None (recorded as not done) if there is none by the deadline."""
        if self.cloud is None:
            self.ledger.not_done(kind, "-", time.monotonic(), "the embedded cloud is not up")
            return None
        deadline = time.monotonic() + self._wait_s()
        cluster = self.cloud.cluster
        while True:
            # a node whose replica trains (its traffic is what the fault acts on)
            training = set(self._ready_nodes())
            slots = [s for s in self.cloud.quiet_slots(hold_s + NETWORK_MARGIN_S)
                     if cluster.node_id(s) in training]
            if len(cluster.live_slots()) >= 2 and slots:
                return self.rng.choice(slots)
            if time.monotonic() >= min(deadline, self.end_at):
                self.ledger.not_done(kind, "-", time.monotonic(),
                                     "no quiet node (every live node had a trace event due)")
                return None
            self._wait_until(time.monotonic() + self.poll_s)

    def _ready_nodes(self) -> list[str]:
        """Node ids of the ready replicas (those that do not answer are left out)."""
        return list(self._ready_peer_nodes().values())

    def _ready_peer_nodes(self) -> dict[str, str]:
        """Ready replica -> its node id (those that do not answer are left out)."""
        import ray

        out = {}
        for peer in self._get(self._coordinator().peer_view.remote())["ready"]:
            try:
                handle = self._get(self._coordinator().peer_handle.remote(peer))
                if handle is not None:  # None: the Coordinator no longer has it
                    out[peer] = self._get(handle.status.remote())["node"]
            except (ray.exceptions.RayError, TimeoutError, ValueError):
                pass
        return out

    def partition(self) -> None:
        """Cut one node off for ``partition_s``, then heal it (on the cloud's thread);
        observed when this machine could not reach the node's raylet during the cut and Ray
        lists the node alive after the heal."""
        hold = self.schedule.partition_s
        slot = self._network_slot("partition", hold)
        if slot is None:
            return
        cluster = self.cloud.cluster
        self.cloud.cut(slot)  # `ip link`: any thread (a heal may start a raylet: not so)
        at = time.monotonic()
        epoch = self.top_epoch
        index = self.ledger.tried("partition", f"slot {slot}", at)
        self.events.append((at, "partition"))
        self.log(f"chaos: slot {slot} cut off for {hold:g} s")
        unreachable = False
        while time.monotonic() < at + hold:
            unreachable = unreachable or not cluster.reachable(slot, timeout_s=1.0)
            self._wait_until(min(at + hold, time.monotonic() + self.poll_s))
        steps = self.top_epoch - epoch
        self.steps_during["partition"].append(steps)
        outcome = self.cloud.call(lambda: self.cloud.heal(slot), self.timeout_s + 130.0)
        self.log(f"chaos: slot {slot} healed ({outcome}); {steps} steps committed meanwhile")
        if not unreachable:
            self.ledger.decide(index, False, "its raylet stayed reachable during the cut")
        elif outcome is None:
            self.ledger.decide(index, False, "the heal was not done (see the cloud's log)")
        else:
            raylet = "same raylet" if outcome == "same" else "raylet restarted"
            self.ledger.decide(index, True, f"unreachable while cut, alive after the heal "
                                            f"({raylet}); {steps} steps committed meanwhile")

    def slow_node(self) -> None:
        """Shape one node's link to ``slow_mbit`` for ``slow_s``, then lift it; observed when
        the shaper held back packets during the window (the swarm's traffic met the
        rate)."""
        hold, mbit = self.schedule.slow_s, self.schedule.slow_mbit
        slot = self._network_slot("slow_node", hold)
        if slot is None:
            return
        cluster = self.cloud.cluster
        self.cloud.shape(slot, mbit)  # `tc`: any thread
        at = time.monotonic()
        epoch = self.top_epoch
        index = self.ledger.tried("slow_node", f"slot {slot}", at)
        self.events.append((at, "slow_node"))
        self.log(f"chaos: slot {slot} shaped to {mbit:g} Mbit/s for {hold:g} s")
        self._wait_until(at + hold)
        try:
            stats = cluster.link_stats(slot)
        finally:
            self.cloud.shape(slot, None)
        held = stats["overlimits"]
        self.log(f"chaos: slot {slot}'s shaped link: {stats}")
        steps = self.top_epoch - epoch
        self.steps_during["slow_node"].append(steps)
        if held > 0:
            self.ledger.decide(index, True, f"the shaper held back {held} packets; {steps} "
                                            f"steps committed meanwhile")
        else:
            self.ledger.decide(index, False, "no packet met the shaped rate (no traffic?)")

    def run(self) -> None:
        """Wait for the job's Coordinator, then inject each fault at its time."""
        import ray

        start = time.monotonic()
        while self.observe() is None:
            if time.monotonic() - start > self.timeout_s:
                self.errors.append("the job's Coordinator never answered")
                return
            time.sleep(self.poll_s)
        t0 = time.monotonic()
        actions = {"coordinator": self.kill_coordinator, "replica_kill": self.kill_replica_process,
                   "user_error": self.user_error, "disk_full": self.disk_full,
                   "partition": self.partition, "slow_node": self.slow_node}
        for fault in self.plan.actor_faults:
            if not self._wait_until(t0 + fault.at_s):
                break
            try:
                action = actions.get(fault.kind)
                action() if action is not None else self.bad_replica(fault.kind)
            except (ray.exceptions.RayError, TimeoutError, ValueError, OSError) as exc:
                self.errors.append(f"{fault.kind} at {fault.at_s:g} s: {type(exc).__name__}")
        self._wait_until(self.end_at)


def job_config(config, plan: ChaosPlan, trace: Path, nodes: int, run_dir: str,
               checkpoint_uri: str | None = None, hosts: str = "loopback"):
    """The ``TrainConfig`` of the job under test: the chaos trace replayed at wall time
    (notices 3 s ahead), room for ``nodes`` nodes laid out as ``hosts``, metrics on any free
    port, JSON mode; checkpoints to ``checkpoint_uri`` every ``CHECKPOINT_EVERY`` steps if
    given."""
    if checkpoint_uri is not None:
        config = replace(config, checkpoint=replace(config.checkpoint, uri=checkpoint_uri,
                                                    every_steps=CHECKPOINT_EVERY))
    return replace(
        config,
        training=replace(config.training, max_seconds=plan.duration_s + plan.settle_s,
                         max_steps=None),
        cluster=replace(config.cluster, address=None, trace=str(trace), time_scale=1.0,
                        notice_s=3.0, max_nodes=nodes, min_nodes=1, hosts=hosts),
        # separate hosts and no durable store here: the run goes without checkpoints
        checkpoint=(replace(config.checkpoint, optional=True) if hosts == "netns"
                    else config.checkpoint),
        metrics=replace(config.metrics, port=0), run_dir=run_dir, json=True)


def run(args: argparse.Namespace, log_fn) -> dict:
    """The whole bench; returns its figures (see the module docstring). With ``disk_full``
    faults in the schedule it mounts a small disk for the job's checkpoints (root only;
    else the kind is ruled out with the reason) and unmounts it at the end."""
    schedule = SCHEDULES[args.schedule]
    seed = schedule.chaos.seed if args.seed is None else args.seed
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    ruled_out = dict(RULED_OUT)
    if args.hosts != "netns":
        ruled_out.update(partition=NETWORK_RULED_OUT, slow_node=NETWORK_RULED_OUT)
        schedule = schedule.without_network()
    else:
        schedule = schedule.on_separate_hosts()
    disk = None
    if args.hosts == "netns" and schedule.disk_fulls:
        ruled_out["disk_full"] = ("separate hosts keep checkpoints on durable storage (s3://, "
                                  "gs://), not on the small local disk this fault fills")
        schedule = replace(schedule, disk_fulls=0)
    if schedule.disk_fulls:
        refusal = small_disk_refusal()
        if refusal is None:
            try:
                disk = SmallDisk(str(out / "checkpoints"))
            except OSError as exc:
                refusal = str(exc)
        if refusal is not None:
            ruled_out["disk_full"] = refusal
            schedule = replace(schedule, disk_fulls=0)
    try:
        return _run(args, log_fn, schedule, seed, out, disk, ruled_out)
    finally:
        if disk is not None:
            disk.close()


def _run(args, log_fn, schedule, seed: int, out: Path, disk, ruled_out: dict) -> dict:
    from moshray.jobs.config import load_config, parse_set
    from moshray.jobs.local.cloud import run_embedded
    from moshray.jobs.train import run_job

    plan = draw_plan(schedule, seed)
    trace = write_trace(plan.node_events, out / "chaos.csv")
    config = load_config(args.config, parse_set(list(DEFAULT_SET) + list(args.set or [])))
    config = job_config(config, plan, trace, schedule.chaos.nodes, str(out / "job"),
                        disk.path if disk is not None else None, args.hosts)
    injector = Injector(plan, args.timeout, log_fn, seed)
    injector.disk, injector.checkpoint_uri = disk, config.checkpoint.uri
    injector.witness_dir = str((out / "raised").resolve())  # (an earlier run's files go:
    shutil.rmtree(injector.witness_dir, ignore_errors=True)  # peer ids repeat across runs)
    os.makedirs(injector.witness_dir)
    injector.schedule = schedule
    log_fn(f"chaos: {sum(plan.planned.values())} faults planned {plan.planned} over "
           f"{plan.duration_s:g} s; not run: {', '.join(ruled_out)}")

    def make_job():
        # The built-in LM job (as run_job makes it), its loop wrapped so that the harness
        # can make it raise (chaos_faults.chaos_job).
        import moshray.jobs.examples.lm.example as lm
        from moshray.jobs.examples.lm.corpus import resolve_data, ship_files

        if config.data.paths:
            files = resolve_data(list(config.data.paths), config.data.cache_dir)
        else:
            files = ship_files(resolve_data(None, os.path.expanduser(config.data.cache_dir)))
        return chaos_job(lm.job(config, files), injector.witness_dir)

    def job(address: str) -> dict:
        # The injector stops before the job's time limit: the job then disconnects Ray.
        injector.end_at = time.monotonic() + plan.duration_s + plan.settle_s - 10
        thread = threading.Thread(target=injector.run, name="chaos-injector", daemon=True)
        thread.start()
        try:
            return run_job(config, address, make_job)
        finally:
            injector.end_at = 0.0
            thread.join(timeout=args.timeout)
            injector.finish()  # (the cluster is still up: Ray's node table can be read)

    started = time.monotonic()
    summary = run_embedded(config, job, injector.cloud_event,
                           on_cloud=lambda cloud: setattr(injector, "cloud", cloud))
    return figures(plan, injector, summary, time.monotonic() - started, ruled_out)


def figures(plan: ChaosPlan, injector: Injector, summary: dict, wall_s: float,
            ruled_out: dict[str, str]) -> dict:
    """The bench's JSON object from the plan, what the injector saw and the job's summary."""
    observed = injector.ledger.observed()
    return {
        "faults": sum(observed.values()), "faults_by_kind": observed,
        "faults_planned": plan.planned, "faults_missed": injector.ledger.missed(),
        "faults_evidence": [f"{r.kind} {r.target}: {r.evidence}"
                            for r in injector.ledger.records() if r.happened],
        "faults_ruled_out": ruled_out,
        # lost: committed steps skipped by a replica's lineage, or undone with every
        # replica that held them (a fall back to a checkpoint's state or the initial one)
        "steps": summary["steps"],
        "lost": summary.get("skipped_steps", 0) + max(injector.rolled_back_steps,
                                                      summary.get("rolled_back_steps", 0)),
        "repeated": summary.get("repeated_steps", 0),
        "rollbacks": max(injector.rollbacks, summary.get("rollbacks", 0)),
        "steps_during_network_faults": injector.steps_during,
        "quarantines": len(injector.quarantined), "quarantined": sorted(injector.quarantined),
        "quarantine_reasons": sorted(set(injector.quarantined.values())),
        "bad_replicas": injector.bad, "bad_lost": injector.bad_lost,
        "stalled_s": round(stalled_seconds(injector.advances), 2),
        "stalled_by_cause": stall_causes(injector.advances, injector.events),
        "join_to_training_s": _spread(join_seconds(summary.get("replica_timelines", {}))),
        "replicas_at_end": summary["replicas"] - summary["leaving_replicas"],
        "expected_replicas": plan.nodes_at_end,
        "replicas_consistent": summary["replicas_consistent"],
        "hard_losses_seen": summary["hard_losses"], "nodes_joined": summary["nodes_joined"],
        "samples": summary["samples"], "final_loss": summary["final_loss"],
        "wall_s": round(wall_s, 1), "harness_errors": injector.errors[-5:],
    }


def _spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "median": xs[len(xs) // 2] if xs else None,
            "max": xs[-1] if xs else None}


# =========================================================================== command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--schedule", choices=sorted(SCHEDULES), default="long",
                        help="long: 63 faults over ~6 min; short: 10 faults, ~2 min (--hosts "
                             "netns adds partitions and slow links and rules out the full "
                             "disk: 67 and 11)")
    parser.add_argument("--hosts", choices=("loopback", "netns"), default="loopback",
                        help="netns: each node in a network namespace of its own (root, "
                             "`ip netns`, `tc`), which adds the partition and slow_node "
                             "kinds")
    parser.add_argument("--seed", type=int, default=None, help="override the schedule's seed")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="bound on every wait of the harness")
    parser.add_argument("--config", metavar="FILE", help="TrainConfig file (TOML or JSON)")
    parser.add_argument("--set", metavar="KEY=VALUE", action="append", default=None,
                        help="override a TrainConfig setting (default: a small model)")
    parser.add_argument("--out", default="runs/bench-chaos", metavar="DIR",
                        help="where the chaos trace and the job's run go")
    add_results_argument(parser)


def main(args: argparse.Namespace) -> int:
    from moshray.jobs.config import ConfigError, load_config, parse_set

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    started = time.monotonic()

    def log_fn(*a):
        print(f"[{time.monotonic() - started:6.1f} s]", *a, file=sys.stderr, flush=True)

    try:
        if not args.timeout > 0:
            raise ValueError(f"--timeout must be > 0, got {args.timeout}")
        load_config(args.config, parse_set(list(DEFAULT_SET) + list(args.set or [])))
        draw_plan(SCHEDULES[args.schedule], args.seed)
        if args.hosts == "netns":
            from moshray.jobs.local.netns import unavailable

            refusal = unavailable()
            if refusal is not None:
                raise ValueError(f"--hosts netns: {refusal}")
    except (ValueError, ConfigError) as exc:
        print(f"moshray bench chaos: {exc}", file=sys.stderr)
        return 2
    fig = run(args, log_fn)
    print(json.dumps(fig), flush=True)
    failures = invariant_failures(fig)
    save_result("chaos", args, fig | {"invariant_failures": failures})
    if failures:
        print(f"moshray bench chaos: invariant failed: {'; '.join(failures)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    from moshray.jobs.cli import run_module

    sys.exit(run_module("moshray.jobs.bench.chaos"))
