"""The Coordinator's logic (pure: an injected clock, no Ray): membership, round plans, the
progress of collaborative steps, notices and their rebalance clock, the data ledger and
the expert registry. ``cluster/coordinator/actor.py`` wraps it in the Ray actor.

It may die: Ray restarts the actor with empty memory (``restarted``), and the replicas
rebuild it (``rejoin``: the newest step a live replica holds wins), the expert hosts
re-register, the driver tells it the newest step it saw committed (``note_committed``).
Its methods are cheap and never block on a peer, so a dead peer can never stall it.
Peers that stop heartbeating are dropped after the TTL; draining peers are excluded from
every plan made after ``mark_draining`` returns.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.messages import PeerInfo, RoundPlan
from moshray.cluster.coordinator.progress import ProgressReply, ProgressReport, ProgressTracker, StepRecord
from moshray.cluster.coordinator.expert_registry import ExpertRegistry, HeartbeatStatus, HostRecord
from moshray.cluster.coordinator.shard_ledger import ShardLedger


@dataclass
class NoticeRecord:
    """A preemption notice as the Coordinator saw it (see ``CoordinatorCore.note_notice``)."""

    noticed_at: float  # Coordinator clock: when the node received the notice
    epoch: int  # plans up to this epoch were made before the node was excluded
    peers: tuple[str, ...]  # the node's peers marked draining
    rebalance_s: float | None = None  # notice -> first plan without the node (None: no plan yet)


REJOIN_GRACE_S = 2.5  # after a restart, positions are heard before shards are granted
# After a restart, how long every live replica has to rejoin (they heartbeat every second and
# report after every micro-batch) before an older state may be accepted in its place.
REBUILD_S = 3.0


class CoordinatorCore:
    """The Coordinator's logic with an injected clock (the actor below is a thin shell)."""

    def __init__(
        self,
        config: MembershipConfig,
        clock: Callable[[], float] = time.monotonic,
        target_batch_size: int = 256,
        step_grace_s: float = 2.0,
        restarted: bool = False,
    ):
        """``restarted``: this Coordinator replaces one that died (Ray restarted it), so
        its memory is empty and the replicas rebuild it (``rejoin``); no older state is
        accepted in the newest's place for ``REBUILD_S``."""
        self.membership = Membership(config)
        self.clock = clock
        self.started = clock()
        self.incarnation = uuid.uuid4().hex  # a restarted Coordinator is a new one
        self.progress = ProgressTracker(self.membership, target_batch_size,
                                        grace_s=step_grace_s, hold_s=2 * config.peer_ttl_s)
        if restarted:
            self.progress.rebuild_until = self.started + REBUILD_S
        self.preemptions = 0
        self.notices: dict[str, NoticeRecord] = {}  # node id -> its first preemption notice
        self.experts = ExpertRegistry(clock=clock)  # DMoE expert hosts (replaces the DHT)
        self.shards = ShardLedger()  # the job's data position (rebuilt from floors)
        self._grants_after: float | None = None  # set by the first rejoin (a restart)
        self._lost_peer = False  # a ready peer left: re-plan without it (``_replan``)
        # Called with every new plan the moment it exists (the actor shell pushes it to the
        # participants); None in pure tests, where plans travel only in report replies.
        self.push_plan: Callable[[RoundPlan], None] | None = None

    def register(self, peer_id: str, handle, node_id: str = "", capacity: float = 1.0) -> int:
        self.membership.register(PeerInfo(peer_id, handle, node_id, capacity), self.clock())
        return self.membership.epoch

    def rejoin(self, peer_id: str, handle, node_id: str, state_epoch: int,
               data_position: int = 0, syncing: bool = False) -> bool:
        """Re-register after a Coordinator restart (``heartbeat`` or a report answered
        "unknown"): membership, the epoch and the data position are rebuilt from the
        replicas themselves. True if the peer is ready at once (see
        ``ProgressTracker.rejoin``). The first rejoin opens a window of
        ``REJOIN_GRACE_S`` in which no data shard is granted, so that every live replica
        (they heartbeat every second) has told its position first: no shard is repeated.
        ``syncing``: the peer was copying a donor's state (it holds ``state_epoch`` but is
        not ready). Calling it again is harmless (the second call refreshes the first)."""
        self.register(peer_id, handle, node_id)
        self.shards.raise_floor(data_position)
        now = self.clock()
        if self._grants_after is None:
            self._grants_after = now + REJOIN_GRACE_S
        if self.progress.rebuild_until is None:
            # A restart the shell could not tell (first call is a rejoin): same window.
            self.progress.rebuild_until = now + REBUILD_S
        return self.progress.rejoin(peer_id, state_epoch, now, syncing)

    def heartbeat(self, peer_id: str, throughput: float | None = None) -> bool:
        """A replica is alive; ``throughput`` is its averager's measured rate (bytes/s,
        None without data), which sizes its share of the parts in later plans."""
        return self.membership.heartbeat(peer_id, self.clock(), throughput)

    def leave(self, peer_id: str) -> bool:
        """``peer_id`` is gone (its node died, the controller stopped it). If it was ready,
        the staying peers step at once with what they have (see ``_replan``)."""
        lost = self._ready_and_staying(peer_id)
        self.progress.forget(peer_id, gone=True)
        left = self.membership.leave(peer_id)
        if lost:
            self._lost_peer = True
            self._replan(self.clock())
        return left

    def _ready_and_staying(self, peer_id: str) -> bool:
        return peer_id in self.progress.ready and peer_id not in self.membership.draining()

    def _replan(self, now: float) -> None:
        """After a notice or the loss of a ready peer, plan the next step over the staying
        peers with the samples they have, instead of at the next full batch: at once, or
        right after the step in flight (at the first report that finds none: the replicas'
        report right after a step does). Also with no sample reported yet: a replica takes
        a plan at its next micro-batch, so it steps with at least that one."""
        if self.progress.stop or not (self._lost_peer or self._rebalance_pending()):
            return
        if self._no_step_in_flight(now) and self.progress.plan_now(now, empty_ok=True):
            self._lost_peer = False
            self._publish()
            self._note_rebalanced(now)

    # -- collaborative training ------------------------------------------------------------

    def _expire(self, now: float) -> None:
        """Forget peers silent for longer than the TTL (dead ones stop being donors and
        holders of the newest step, so joiners are never stuck waiting for them)."""
        for gone in self.membership.expire(now):
            self._lost_peer |= self._ready_and_staying(gone)
            self.progress.forget(gone)

    def report(self, r: ProgressReport) -> ProgressReply:
        now = self.clock()
        self._expire(now)
        reply = self.progress.report(r, now)
        self._replan(now)
        self._publish()
        self._note_rebalanced(now)
        return reply

    def _rebalance_pending(self) -> bool:
        """A notice for a node with peers is waiting for the plan that leaves them out."""
        return any(r.rebalance_s is None for r in self.notices.values())

    def _publish(self) -> None:
        plan = self.progress.take_new_plan()
        if plan is not None and self.push_plan is not None:
            self.push_plan(plan)

    def mark_ready(self, peer_id: str, state_epoch: int) -> bool:
        # Expire first: when every peer is syncing nobody reports, and a dead holder of the
        # newest step would otherwise block the rollback forever.
        now = self.clock()
        self._expire(now)
        return self.progress.mark_ready(peer_id, state_epoch, now)

    def resume_from(self, epoch: int) -> int:
        """Start counting global steps at a checkpoint's epoch (only before any step, and
        not while a restarted Coordinator waits for holders of newer steps to rejoin); a
        checkpoint older than a step committed before a restart is a counted rollback."""
        if self.membership.epoch == 0 and not self.progress.history:
            self.progress.resume_at(epoch, self.clock())
        return self.membership.epoch

    def donor(self, exclude: str) -> tuple[str, object] | None:
        """A peer (other than ``exclude``, who is noted as joining) to copy state from, or
        None. A ready live one first, else a ready one that is draining but still up (it
        may hold the newest steps), else, as a last resort, any member holding the
        current epoch (a quarantined peer: its contributions were bad, its state is the
        swarm's). Within each group, one that holds the current epoch first."""
        now = self.clock()
        self._expire(now)
        self.progress.note_joining(exclude, now)
        ready = self.progress.ready
        groups = ([p for p in self.membership.live(now) if p.peer_id in ready],
                  [p for p in self.membership.present(now) if p.peer_id in ready],
                  [p for p in self.membership.present(now)
                   if self.progress.holds_current(p.peer_id)])
        for group in groups:
            for info in sorted(group, key=lambda i: not self.progress.holds_current(i.peer_id)):
                if info.peer_id != exclude:
                    return info.peer_id, info.handle
        return None

    def grant_shards(self, peer_id: str, count: int = 1, floor: int = 0) -> tuple[int, ...]:
        """The next ``count`` data shard numbers for ``peer_id``; ``floor`` is the data
        position the caller's state holds. Nothing (ask again) for a peer this Coordinator
        does not know, or while it is learning the position after a restart (``rejoin``)."""
        self.shards.raise_floor(floor)
        if not self.membership.is_member(peer_id) or (
                self._grants_after is not None and self.clock() < self._grants_after):
            return ()
        return self.shards.grant(peer_id, count, floor)

    def data_position(self, floor: int = 0) -> int:
        """Every data shard below this number has been handed out (checkpoints keep it)."""
        return self.shards.raise_floor(floor)

    def note_preemption(self, count: int = 1) -> int:
        self.preemptions += count
        return self.preemptions

    def note_committed(self, epoch: int) -> None:
        """The driver saw ``epoch`` committed before a restart of this Coordinator (see
        ``ProgressTracker.note_committed``)."""
        self.progress.note_committed(epoch)

    def request_stop(self) -> None:
        self.progress.stop = True

    def stats(self, since: int = 0) -> dict:
        """The run's counters and its step history from row ``since`` on (a poller passes
        how many rows it holds, so a long run's history is not resent every poll).
        ``history_len`` is the whole history's length and ``incarnation`` tells this
        Coordinator from a restarted one (whose history starts over)."""
        now = self.clock()
        history: list[StepRecord] = self.progress.history
        return {
            "incarnation": self.incarnation,
            "history_len": len(history),
            "epoch": self.membership.epoch,
            "live": len(self.membership.live(now)),
            "ready": len(self.progress.ready),
            "draining": len(self.membership.draining()),
            "preemptions": self.preemptions,
            "rollbacks": len(self.progress.rollbacks),  # steps lost with every holder
            "abandoned": len(self.progress.abandoned),  # plans nobody lived to apply
            "committed": self.progress.top_held,  # newest step seen applied
            "quarantines": [(q.peer_id, q.reason) for q in self.progress.quarantine.records],
            "now_s": now - self.started,  # the clock of history's at_s (for plots)
            **self._notice_summary(),
            "history": [(h.epoch, h.at_s - self.started, h.samples, h.loss, h.peers)
                        for h in history[max(0, since):]],
        }

    def step_timings(self, since_epoch: int = 0) -> dict:
        """Global steps after ``since_epoch``: ``{"now_s": t, "steps": [(epoch, planned_at_s,
        committed_at_s or None, participants), ...]}``, times on the clock of ``stats()``."""
        now = self.clock()
        steps = [(t.epoch, t.planned_at - self.started,
                  None if t.committed_at is None else t.committed_at - self.started,
                  t.participants)
                 for e, t in sorted(self.progress.timings.items()) if e > since_epoch]
        return {"now_s": now - self.started, "steps": steps}

    def mark_draining(self, node_id: str, deadline_s: float) -> tuple[str, ...]:
        """Exclude ``node_id``'s peers from the next plans; ``deadline_s`` is seconds left."""
        return self.membership.mark_draining(node_id, self.clock() + deadline_s)

    # -- preemption notices (autoscaler/watch/watcher.py) -------------------------------------

    def note_notice(self, node_id: str, deadline_s: float, notice_age_s: float = 0.0
                    ) -> tuple[str, ...]:
        """A preemption notice for ``node_id``: ``mark_draining`` plus the rebalance clock.

        ``deadline_s`` is seconds left; ``notice_age_s`` how long ago the node received the
        notice (both measured on that node, so no two machines' clocks are compared). The
        node counts as rebalanced at the first plan published after this call (every such
        plan excludes its peers); a node without peers is rebalanced at once. That plan is
        made over the staying peers (``_replan``) at once when no step is in flight, else
        at the first report after the step in flight. A second notice for the same node
        re-marks it draining but keeps the first record.
        """
        peers = self.mark_draining(node_id, deadline_s)
        now = self.clock()
        if node_id not in self.notices:
            noticed_at = now - max(0.0, notice_age_s)
            self.notices[node_id] = NoticeRecord(noticed_at, self.membership.epoch, peers,
                                                 None if peers else now - noticed_at)
        if peers:
            self._replan(now)
        return peers

    def _no_step_in_flight(self, now: float) -> bool:
        """Every ready live peer reported at the current epoch (none is inside a round)."""
        live = {p.peer_id for p in self.membership.live(now)}
        eligible = [p for p in self.progress.ready if p in live]
        reports = self.progress.reports
        return bool(eligible) and all(p in reports and reports[p].epoch == self.epoch
                                      for p in eligible)

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    def notice_stats(self) -> dict[str, dict]:
        """Per noticed node: ``{"peers": [...], "epoch": e, "rebalance_s": s or None}``."""
        return {node: {"peers": list(r.peers), "epoch": r.epoch, "rebalance_s": r.rebalance_s}
                for node, r in self.notices.items()}

    def _note_rebalanced(self, now: float) -> None:
        """Close the rebalance clock of every notice older than the latest plan."""
        for r in self.notices.values():
            if r.rebalance_s is None and self.membership.epoch > r.epoch:
                r.rebalance_s = max(0.0, now - r.noticed_at)

    def peer_handle(self, peer_id: str):
        """The actor handle ``peer_id`` registered with (None if it is not a member): for
        operators and fault-injection harnesses that address one replica by its id."""
        for info in self.membership.present(self.clock()):
            if info.peer_id == peer_id:
                return info.handle
        return None

    def _notice_summary(self) -> dict:
        done = [r.rebalance_s for r in self.notices.values() if r.rebalance_s is not None]
        return {"notices": len(self.notices), "rebalance_s": done,
                "rebalance_pending": len(self.notices) - len(done)}

    def peer_view(self) -> dict[str, tuple[str, ...]]:
        """Membership as the elastic controller observes it: ``members`` (registered, not
        expired), ``ready`` (holding the swarm's state), ``draining`` (excluded, their node
        got a notice) and ``noticed_nodes`` (node ids a notice arrived for)."""
        now = self.clock()
        self._expire(now)
        members = tuple(p.peer_id for p in self.membership.present(now))
        return {"members": members,
                "ready": tuple(sorted(p for p in self.progress.ready if p in members)),
                "draining": self.membership.draining(),
                "noticed_nodes": tuple(sorted(self.notices))}

    def live_peers(self) -> tuple[str, ...]:
        now = self.clock()
        self.membership.expire(now)
        return tuple(p.peer_id for p in self.membership.live(now))

    def plan_round(self, peers: tuple[str, ...] | None = None) -> RoundPlan | None:
        now = self.clock()
        self.membership.expire(now)
        plan = self.membership.plan(now, peers)
        self._note_rebalanced(now)
        return plan

    # -- DMoE expert registry (see registry.py) -----------------------------------------------

    def register_experts(self, host_id: str, uids: tuple[str, ...], handle, node_id: str = "",
                         instance: str = "") -> int:
        return self.experts.register(host_id, uids, handle, node_id, instance)

    def heartbeat_experts(self, host_id: str, instance: str = "") -> HeartbeatStatus:
        return self.experts.heartbeat(host_id, instance)

    def unregister_experts(self, host_id: str, instance: str = "") -> bool:
        return self.experts.unregister(host_id, instance)

    def lookup_experts(self, prefix: str = "") -> tuple[HostRecord, ...]:
        return self.experts.lookup(prefix)

    def expert_locations(self) -> dict[str, tuple[str, str]]:
        return self.experts.locations()
