"""The steps-and-membership service of the Coordinator (pure: an injected clock, no Ray).

Who is in the swarm (``Membership``), which global step comes next and who takes part in
it (``ProgressTracker``): register, heartbeat, leave, rejoin after a restart, report after
every micro-batch, mark ready after a copy, find a donor, drain a noticed node's peers,
stop. Its methods are cheap and never block on a peer, so a dead peer can never stall it.
Peers that stop heartbeating are dropped after the TTL; draining peers are excluded from
every plan made after ``mark_draining`` returns.

It may die with the Coordinator's process: what the summary, the plans and the quarantine
need (the step history, the newest step known committed, rollbacks, abandoned plans,
stale returns, the history's branch and where each branch started, draining marks,
quarantine records, the stop flag, the newest checkpoint, the members) is in ``snapshot``
(small, JSON-able; the history travels apart, see ``cluster/coordinator/durable.py``) and
comes back with ``restore``; membership and the epoch are rebuilt from the replicas
themselves (``rejoin``: the newest step a live replica holds wins). Until every member
known before the restart has rejoined or is presumed gone (silent for the hold time), and
for at least ``REBUILD_S``, no state older than the newest step known committed is
accepted (``ProgressTracker.await_rejoin``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from moshray.cluster.coordinator.donors import spread_pick
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.coordinator.progress import ProgressReply, ProgressReport, ProgressTracker
from moshray.cluster.coordinator.quarantine import QuarantineRecord
from moshray.cluster.messages import CheckpointRef, PeerInfo, PeerPlan, RoundPlan

# After a restart, the least time every live replica has to be heard from (they heartbeat
# every second) before an older state may be accepted in its place. Only a floor: the rebuild
# lasts while a replica known before the restart, or heard from since, has not rejoined (one
# inside a long step rejoins once it is applied), up to the hold time of its silence.
REBUILD_S = 3.0


class StepService:
    """Membership and collaborative steps (see the module docstring).

    ``on_plan(plan, views)`` is called with every new plan and its participants' views
    (``RoundPlan.views``, by peer id) the moment it exists (the actor pushes each
    participant its view); None in pure tests, where views travel only in report replies.
    """

    def __init__(self, config: MembershipConfig, target_batch_size: int = 256,
                 step_grace_s: float = 2.0, local_steps: int | None = None):
        self.membership = Membership(config)
        self.progress = ProgressTracker(self.membership, target_batch_size, local_steps,
                                        grace_s=step_grace_s, hold_s=2 * config.peer_ttl_s)
        self._lost_peer = False  # a ready peer left: re-plan without it (``replan``)
        self.checkpoint: CheckpointRef | None = None  # the newest one saved (``note_checkpoint``)
        self.on_plan: Callable[[RoundPlan, Mapping[str, PeerPlan]], None] | None = None
        self._known_before: tuple[str, ...] = ()  # members before a restart (``restore``)
        self._peers_key: tuple | None = None  # ``members_record``'s cache
        self._peers_of: list[str] | None = None
        self._members_record: dict = {"peers": []}
        self._donor_asks = 0  # donor requests so far (spreads the choice: ``donor``)
        self._snapshot: tuple[tuple, dict] | None = None  # (what it was built from, it)

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    def open_rebuild_window(self, now: float) -> None:
        """This service replaces one that died: no older state is accepted in the newest's
        place before ``now + REBUILD_S``, nor while a member of the one that died (restored)
        or a peer heard from since may still rejoin (``ProgressTracker.await_rejoin``)."""
        self.progress.rebuild_until = now + REBUILD_S
        for peer_id in self._known_before:
            self.progress.await_rejoin(peer_id, now)
        self._known_before = ()

    # -- membership --------------------------------------------------------------------------

    def register(self, peer_id: str, handle, node_id: str, capacity: float,
                 now: float, zone: str = "") -> int:
        self.membership.register(PeerInfo(peer_id, handle, node_id, capacity, zone), now)
        self.progress.arrived(peer_id)
        return self.membership.epoch

    def rejoin(self, peer_id: str, handle, node_id: str, state_epoch: int, now: float,
               syncing: bool = False, zone: str = "", branch: int | None = None) -> bool:
        """Register and rebuild the epoch from ``peer_id``'s state of ``branch`` (see
        ``ProgressTracker.rejoin``); a first rejoin nobody announced opens the rebuild
        window (a restart the actor could not tell)."""
        self.register(peer_id, handle, node_id, 1.0, now, zone)
        if self.progress.rebuild_until is None:
            self.open_rebuild_window(now)
        return self.progress.rejoin(peer_id, state_epoch, now, syncing, branch)

    def heartbeat(self, peer_id: str, now: float, throughput: float | None = None) -> bool:
        """Refresh ``peer_id``; False if unknown (it rejoins): while a restarted Coordinator
        rebuilds, it is awaited (``ProgressTracker.await_rejoin``)."""
        if self.membership.heartbeat(peer_id, now, throughput):
            return True
        self.progress.await_rejoin(peer_id, now)
        return False

    def is_member(self, peer_id: str) -> bool:
        return self.membership.is_member(peer_id)

    def leave(self, peer_id: str) -> tuple[bool, bool]:
        """``peer_id`` is gone; returns ``(it was a member, it was ready and staying)``: in
        the second case the caller re-plans (``replan``) so the staying peers step at once."""
        lost = self._ready_and_staying(peer_id)
        self.progress.forget(peer_id, gone=True)
        left = self.membership.leave(peer_id)
        self._lost_peer |= lost
        return left, lost

    def mark_draining(self, node_id: str, deadline: float,
                      now: float | None = None) -> tuple[str, ...]:
        """Exclude ``node_id``'s peers (and later ones there) from the next plans (see
        ``Membership.mark_draining``: with ``now``, nodes long past their deadline are
        forgotten)."""
        return self.membership.mark_draining(node_id, deadline, now)

    def expire(self, now: float) -> None:
        """Forget peers silent for longer than the TTL (dead ones stop being donors and
        holders of the newest step, so joiners are never stuck waiting for them), and stop
        awaiting the rejoin of those silent for the hold time since a restart."""
        for gone in self.membership.expire(now):
            self._lost_peer |= self._ready_and_staying(gone)
            self.progress.forget(gone)
        self.progress.expire_awaited(now)
        self.progress.prune_held(now)

    def _ready_and_staying(self, peer_id: str) -> bool:
        return peer_id in self.progress.ready and not self.membership.is_draining(peer_id)

    # -- steps -------------------------------------------------------------------------------

    def report(self, r: ProgressReport, now: float) -> ProgressReply:
        self.expire(now)
        return self.progress.report(r, now)

    def replan(self, now: float, rebalance_pending: bool) -> bool:
        """After a notice (``rebalance_pending``) or the loss of a ready peer, plan the next
        step over the staying peers with the samples they have, instead of at the next full
        batch: at once, or right after the step in flight (at the first report that finds
        none: the replicas' report right after a step does). Also with no sample reported
        yet: a replica takes a plan at its next micro-batch, so it steps with at least that
        one. True if a plan was made (and published)."""
        if self.progress.stop or not (self._lost_peer or rebalance_pending):
            return False
        if self.progress.idle(now) and self.progress.plan_now(now, empty_ok=True):
            self._lost_peer = False
            self.publish()
            return True
        return False

    def publish(self) -> None:
        """Hand the plan made since the last call (if any) and its views to ``on_plan``."""
        plan = self.progress.take_new_plan()
        if plan is not None and self.on_plan is not None:
            self.on_plan(plan, self.progress.views_of(plan))

    def mark_ready(self, peer_id: str, state_epoch: int, now: float) -> bool:
        # Expire first: when every peer is syncing nobody reports, and a dead holder of the
        # newest step would otherwise block the rollback forever.
        self.expire(now)
        return self.progress.mark_ready(peer_id, state_epoch, now)

    def resume_from(self, epoch: int, now: float) -> int:
        """Start counting global steps at a checkpoint's epoch (only before this process
        planned or heard of any step, and not while a restarted Coordinator waits for
        holders of newer steps to rejoin); a checkpoint older than a step committed before a
        restart (a restored or told ``committed``) is a counted rollback."""
        if self.membership.epoch == 0 and not self.progress.timings:
            self.progress.resume_at(epoch, now)
        return self.membership.epoch

    def note_checkpoint(self, ref: CheckpointRef) -> None:
        """A replica saved the checkpoint ``ref``; kept if it is the newest step seen (a
        replica that finds no donor resumes from it: ``latest_checkpoint``)."""
        if self.checkpoint is None or ref.step >= self.checkpoint.step:
            self.checkpoint = ref

    def latest_checkpoint(self) -> CheckpointRef | None:
        """The newest checkpoint saved in this run (across restarts), or None."""
        return self.checkpoint

    def donor(self, exclude: str, now: float) -> tuple[str, object] | None:
        """A peer (other than ``exclude``, who is noted as joining) to copy state from, or
        None. A ready live one first, else a ready one that is draining but still up (it
        may hold the newest steps), else, as a last resort, any member holding the
        current epoch (a quarantined peer: its contributions were bad, its state is the
        swarm's). Within each group, one that holds the current epoch first. Which one is
        spread by a hash of the request (``donors.spread_pick``: the joiner and a count of
        requests), so the joiners of a burst copy from different peers; O(1) expected per
        call (the candidates are indexed: the ready peers, the current epoch's holders)."""
        self.expire(now)
        self.progress.note_joining(exclude, now)
        p, m = self.progress, self.membership
        self._donor_asks += 1
        key = f"{exclude}/{self._donor_asks}"
        holders, ready = p.holders(p.epoch), p.ready

        def up(draining: bool) -> Callable[[str], bool]:
            return lambda q: q != exclude and m.is_up(q, now, draining)

        live, present = up(False), up(True)
        found = (spread_pick(holders, key, lambda q: q in ready and live(q))
                 or spread_pick(ready.pool, key, live)
                 or spread_pick(holders, key, lambda q: q in ready and present(q))
                 or spread_pick(ready.pool, key, present)
                 or spread_pick(holders, key, present))
        if found is None:
            return None
        return found, m.info(found).handle

    def request_stop(self) -> None:
        self.progress.stop = True

    # -- views -------------------------------------------------------------------------------

    def peer_view(self, now: float, noticed_nodes: tuple[str, ...]) -> dict:
        """Membership as the elastic controller observes it (see ``CoordinatorCore``)."""
        self.expire(now)
        members = tuple(p.peer_id for p in self.membership.present(now))
        return {"members": members,
                "ready": tuple(sorted(p for p in self.progress.ready if p in members)),
                "draining": self.membership.draining(),
                "noticed_nodes": noticed_nodes}

    def live_peers(self, now: float) -> tuple[str, ...]:
        self.membership.expire(now)
        return tuple(p.peer_id for p in self.membership.live(now))

    def plan_round(self, now: float, peers: tuple[str, ...] | None = None) -> RoundPlan | None:
        self.membership.expire(now)
        return self.membership.plan(now, peers)

    def peer_handle(self, peer_id: str, now: float):
        for info in self.membership.present(now):
            if info.peer_id == peer_id:
                return info.handle
        return None

    def counters(self, now: float) -> dict:
        """The step counters of ``CoordinatorCore.stats`` (no history)."""
        p = self.progress
        return {
            "epoch": self.membership.epoch,
            "live": len(self.membership.live(now)),
            "ready": len(p.ready),
            "draining": len(self.membership.draining()),
            "rollbacks": len(p.rollbacks),  # falls back below a committed step
            "rolled_back_steps": sum(f - t for f, t in p.rollbacks),  # committed, then lost
            "abandoned": len(p.abandoned),  # plans nobody lived to apply
            # peers back with a step of a branch the swarm fell back from (they resynced)
            "stale_returns": len(p.stale_returns),
            "branch": p.branch,  # fall backs (and resumes) the history went through
            # steps a replica committed with a digest that lost the vote (then resynced)
            "diverged": [list(x) for x in p.diverged],
            "committed": p.top_held,  # newest step seen applied
            "stopping": p.stop,
            "quarantines": [(q.peer_id, q.reason) for q in p.quarantine.records],
        }

    # -- what survives a restart -------------------------------------------------------------

    def snapshot(self) -> dict:
        """The small state a restarted Coordinator needs (JSON-able; see the module
        docstring), but for the newest step known committed, which changes with every
        step, and the members, which change with every join (``members_record``): both
        are saved apart (written behind). Times are on the Coordinator's clock
        (``time.monotonic`` of the head node, which the restarted actor shares). The
        same object while nothing in it changed (its lists only grow, but at a
        ``restore``), so saving it unchanged after every call costs no rebuild."""
        p = self.progress
        draining = self.membership.draining_nodes()  # (the same list until one changes)
        key = (p.stop, len(p.rollbacks), len(p.abandoned), len(p.stale_returns), p.branch,
               len(p.forks), len(p.diverged), len(p.quarantine.records), self.checkpoint)
        if self._snapshot is not None and self._snapshot[0] == key and \
                self._snapshot[1]["draining_nodes"] is draining:
            return self._snapshot[1]
        record = {
            "stop": p.stop,
            "rollbacks": [list(x) for x in p.rollbacks],
            "abandoned": [list(x) for x in p.abandoned],
            "stale_returns": [list(x) for x in p.stale_returns],
            "branch": p.branch,
            "forks": sorted([b, e] for b, e in p.forks.items()),
            "diverged": [list(x) for x in p.diverged],
            "quarantines": [[q.peer_id, q.at, q.reason] for q in p.quarantine.records],
            "draining_nodes": draining,
            "checkpoint": (None if self.checkpoint is None else
                           [self.checkpoint.uri, self.checkpoint.run_id, self.checkpoint.step]),
        }
        self._snapshot = (key, record)
        return record

    def members_record(self) -> dict:
        """``{"peers": [...]}``: who a restarted Coordinator awaits (``restore``,
        ``open_rebuild_window``): the members, the peers awaited now and those known
        before the last restart, sorted. The same object until one of them changes (then
        a new one; do not mutate it), so saving it unchanged costs nothing."""
        order = self.membership.ordered()  # the same list object until a member changes
        key = (self.progress.awaited, self._known_before)
        if self._peers_of is not order or self._peers_key != key:
            self._peers_of, self._peers_key = order, key
            self._members_record = {
                "peers": sorted({*order, *self.progress.awaited, *self._known_before})}
        return self._members_record

    def restore(self, snap: dict) -> None:
        """Take back a ``snapshot`` (into a fresh service, before any call), plus the
        newest step known ``committed`` and the ``members_record``'s ``peers`` if the dict
        has them. Draining marks apply to the
        peers that register on those nodes again; the epoch is not restored (the replicas'
        rejoins rebuild it) but the newest step known committed is, so a fall back below
        it counts as a rollback, and so is the history's branch, so a replica cut off
        before a fall back is told apart. The members are awaited by the rebuild
        (``open_rebuild_window``)."""
        p = self.progress
        self._snapshot = None
        p.note_committed(int(snap.get("committed", 0)))  # (before the rollbacks: its own)
        p.stop = bool(snap.get("stop", False))
        p.rollbacks[:] = [tuple(x) for x in snap.get("rollbacks", ())]
        p.abandoned[:] = [tuple(x) for x in snap.get("abandoned", ())]
        p.stale_returns[:] = [(str(peer), int(e), int(b))
                              for peer, e, b in snap.get("stale_returns", ())]
        p.branch = int(snap.get("branch", 0))
        p.forks = {int(b): int(e) for b, e in snap.get("forks", ())}
        self._known_before = tuple(str(peer) for peer in snap.get("peers", ()))
        p.diverged[:] = [(str(peer), int(e)) for peer, e in snap.get("diverged", ())]
        p.quarantine.records[:] = [QuarantineRecord(peer, float(at), reason)
                                   for peer, at, reason in snap.get("quarantines", ())]
        for node, deadline in snap.get("draining_nodes", ()):
            self.membership.mark_draining(node, float(deadline))
        if snap.get("checkpoint"):
            uri, run_id, step = snap["checkpoint"]
            self.checkpoint = CheckpointRef(str(uri), str(run_id), int(step))
