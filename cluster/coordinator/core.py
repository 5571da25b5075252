"""The Coordinator's logic, composed of small services (pure: an injected clock, no Ray).

- steps and membership (``steps.StepService``): register, heartbeat, report, plans, donors;
- notices (``notices.NoticeBook``): preemption notices and their rebalance clock;
- data shards (``shard_ledger.ShardService``): the job's data position;
- the expert registry (``expert_registry.ExpertRegistry``): DMoE expert hosts.

``CoordinatorCore`` holds one of each, routes each remote method to its service, and does
what spans two of them (a notice drains peers and re-plans; a plan closes a notice's
rebalance clock; a rejoin also tells the data position). ``cluster/coordinator/actor.py``
wraps it in the Ray actor and adds the metrics sink (``metrics_sink.py``). Driver-side
counters (node losses) are the driver's (``jobs/controller/elastic.py``).

It may die: Ray restarts the actor with empty memory (``restarted``). With a ``store``
(``durable.DurableState``), ``save`` writes what changed after every call, and a new
Coordinator whose store holds a state restores it: the step history, the newest step known
committed, rollbacks, stale returns, the history's branch, quarantine records, draining
marks, the stop flag, the newest checkpoint, the members, notices and the data position.
Membership and the epoch are rebuilt from the replicas (``rejoin``: the newest step a live
replica holds wins; the members before the restart, and peers heard from since, are
awaited before an older state is accepted), the expert hosts re-register, and the driver
tells it the newest step it saw committed (``note_committed``). Its methods are cheap and never
block on a peer, so a dead peer can never stall it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Mapping

from moshray.cluster.coordinator.durable import DurableState
from moshray.cluster.coordinator.expert_registry import ExpertRegistry, HeartbeatStatus, HostRecord
from moshray.cluster.coordinator.membership import Membership, MembershipConfig
from moshray.cluster.coordinator.notices import NoticeBook, NoticeRecord
from moshray.cluster.coordinator.progress import ProgressReply, ProgressReport, ProgressTracker
from moshray.cluster.coordinator.shard_ledger import REJOIN_GRACE_S, ShardService
from moshray.cluster.coordinator.steps import REBUILD_S, StepService
from moshray.cluster.messages import CheckpointRef, PeerPlan, RoundPlan

__all__ = ["CoordinatorCore", "NoticeRecord", "REBUILD_S", "REJOIN_GRACE_S"]

log = logging.getLogger(__name__)


class CoordinatorCore:
    """The Coordinator's services with an injected clock (the actor is a thin shell)."""

    def __init__(
        self,
        config: MembershipConfig,
        clock: Callable[[], float] = time.monotonic,
        target_batch_size: int = 256,
        step_grace_s: float = 2.0,
        local_steps: int | None = None,
        restarted: bool = False,
        store: DurableState | None = None,
    ):
        """``restarted``: this Coordinator replaces one that died (Ray restarted it), so no
        older state is accepted in the newest's place for ``REBUILD_S``, nor while a member
        it restored or a peer heard from since may still rejoin. ``store``: where
        the state is saved (``save``) and, if it holds one, restored from (then this is a
        restart whatever ``restarted`` says)."""
        self.clock = clock
        self.started = clock()
        self.history_id = uuid.uuid4().hex  # names the step history (kept over restarts)
        self.restarts = 0
        self._core_record: tuple[tuple, dict] = ((), {})  # (its fields, the record)
        self.steps = StepService(config, target_batch_size, step_grace_s, local_steps)
        self.steps.on_plan = self._on_plan
        self.notices = NoticeBook()
        self.shards = ShardService()
        self.experts = ExpertRegistry(clock=clock)  # DMoE expert hosts (replaces the DHT)
        # Called with every new plan and its participants' views (peer id -> ``PeerPlan``)
        # the moment it exists (the actor shell pushes each participant its view); None in
        # pure tests, where views travel only in report replies.
        self.push_plan: Callable[[RoundPlan, Mapping[str, PeerPlan]], None] | None = None
        # A node's zone (its ray.io/availability-zone label; "" = unknown): peers of one zone
        # average inside it first (grid.plan_zoned). The actor shell reads Ray's node table.
        self.zone_of: Callable[[str], str] = lambda node_id: ""
        self.store = store
        if store is not None and self._restore(store):
            restarted = True
        if restarted:
            self.steps.open_rebuild_window(clock())

    def _on_plan(self, plan: RoundPlan, views: Mapping[str, PeerPlan]) -> None:
        if self.push_plan is not None:
            self.push_plan(plan, views)

    # the services' state, for callers and tests that look inside
    @property
    def membership(self) -> Membership:
        return self.steps.membership

    @property
    def progress(self) -> ProgressTracker:
        return self.steps.progress

    @property
    def epoch(self) -> int:
        return self.steps.epoch

    # -- steps and membership ----------------------------------------------------------------

    def register(self, peer_id: str, handle, node_id: str = "", capacity: float = 1.0) -> int:
        return self.steps.register(peer_id, handle, node_id, capacity, self.clock(),
                                   zone=self.zone_of(node_id) if node_id else "")

    def rejoin(self, peer_id: str, handle, node_id: str, state_epoch: int,
               data_position: int = 0, syncing: bool = False,
               branch: int | None = None) -> bool:
        """Re-register after a Coordinator restart (``heartbeat`` or a report answered
        "unknown"): membership, the epoch and the data position are rebuilt from the
        replicas themselves. True if the peer is ready at once (see
        ``ProgressTracker.rejoin``). A first rejoin without a restored data position
        pauses shard grants (see ``ShardService``). ``syncing``: the peer was copying a
        donor's state (it holds ``state_epoch`` but is not ready). ``branch``: the branch
        of the step its state holds (``RoundPlan.branch``; None: not told, never judged
        stale). Calling it again is harmless (the second call refreshes the first)."""
        now = self.clock()
        self.shards.rejoined(data_position, now)
        return self.steps.rejoin(peer_id, handle, node_id, state_epoch, now, syncing,
                                 zone=self.zone_of(node_id) if node_id else "",
                                 branch=branch)

    def heartbeat(self, peer_id: str, throughput: float | None = None) -> bool:
        """A replica is alive; ``throughput`` is its averager's measured rate (bytes/s,
        None without data), which sizes its share of the parts in later plans."""
        return self.steps.heartbeat(peer_id, self.clock(), throughput)

    def leave(self, peer_id: str) -> bool:
        """``peer_id`` is gone (its node died, the controller stopped it). If it was ready,
        the staying peers step at once with what they have (``StepService.replan``)."""
        left, lost = self.steps.leave(peer_id)
        if lost:
            self._replan(self.clock())
        return left

    def report(self, r: ProgressReport) -> ProgressReply:
        now = self.clock()
        reply = self.steps.report(r, now)
        self._replan(now)
        self.steps.publish()
        self.notices.rebalanced(self.epoch, now)
        return reply

    def _replan(self, now: float) -> None:
        if self.steps.replan(now, self.notices.pending()):
            self.notices.rebalanced(self.epoch, now)

    def mark_ready(self, peer_id: str, state_epoch: int) -> bool:
        return self.steps.mark_ready(peer_id, state_epoch, self.clock())

    def resume_from(self, epoch: int) -> int:
        """See ``StepService.resume_from``."""
        return self.steps.resume_from(epoch, self.clock())

    def donor(self, exclude: str) -> tuple[str, object] | None:
        """See ``StepService.donor``."""
        return self.steps.donor(exclude, self.clock())

    def note_checkpoint(self, ref: CheckpointRef) -> None:
        """See ``StepService.note_checkpoint``."""
        self.steps.note_checkpoint(ref)

    def latest_checkpoint(self) -> CheckpointRef | None:
        """See ``StepService.latest_checkpoint``."""
        return self.steps.latest_checkpoint()

    def note_committed(self, epoch: int) -> None:
        """The driver saw ``epoch`` committed before a restart of this Coordinator (see
        ``ProgressTracker.note_committed``)."""
        self.progress.note_committed(epoch)

    def request_stop(self) -> None:
        self.steps.request_stop()

    def mark_draining(self, node_id: str, deadline_s: float) -> tuple[str, ...]:
        """Exclude ``node_id``'s peers from the next plans; ``deadline_s`` is seconds left."""
        now = self.clock()
        return self.steps.mark_draining(node_id, now + deadline_s, now)

    def peer_view(self) -> dict[str, tuple[str, ...]]:
        """Membership as the elastic controller observes it: ``members`` (registered, not
        expired), ``ready`` (holding the swarm's state), ``draining`` (excluded, their node
        got a notice) and ``noticed_nodes`` (node ids a notice arrived for)."""
        return self.steps.peer_view(self.clock(), self.notices.nodes())

    def live_peers(self) -> tuple[str, ...]:
        return self.steps.live_peers(self.clock())

    def plan_round(self, peers: tuple[str, ...] | None = None) -> RoundPlan | None:
        now = self.clock()
        plan = self.steps.plan_round(now, peers)
        self.notices.rebalanced(self.epoch, now)
        return plan

    def peer_handle(self, peer_id: str):
        """The actor handle ``peer_id`` registered with (None if it is not a member): for
        operators and fault-injection harnesses that address one replica by its id."""
        return self.steps.peer_handle(peer_id, self.clock())

    def stats(self, since: int = 0) -> dict:
        """The run's counters and its step history from row ``since`` on (a poller passes
        how many rows it holds, so a long run's history is not resent every poll).
        ``history_len`` is the whole history's length and ``incarnation`` names the
        history: it stays the same over a restart that restored it, so a poller goes on
        from the rows it holds (a new one: the history starts over). ``restarts``: how
        many times this Coordinator was restarted with its state restored."""
        now = self.clock()
        history = self.progress.history
        return {
            "incarnation": self.history_id,
            "restarts": self.restarts,
            "history_len": len(history),
            **self.steps.counters(now),
            "now_s": now - self.started,  # the clock of history's at_s (for plots)
            **self.notices.summary(),
            "history": [(h.epoch, h.at_s - self.started, h.samples, h.loss, h.peers)
                        for h in history[max(0, since):]],
        }

    def step_timings(self, since_epoch: int = 0) -> dict:
        """Global steps after ``since_epoch`` planned by this process, of the latest
        ``progress.TIMINGS_KEEP`` (a window; timings are not kept over a restart):
        ``{"now_s": t, "steps": [(epoch, planned_at_s, committed_at_s or None,
        participants), ...]}``, times on the clock of ``stats()``."""
        now = self.clock()
        steps = [(t.epoch, t.planned_at - self.started,
                  None if t.committed_at is None else t.committed_at - self.started,
                  t.participants)
                 for e, t in sorted(self.progress.timings.items()) if e > since_epoch]
        return {"now_s": now - self.started, "steps": steps}

    # -- preemption notices (autoscaler/watch/drain.py) --------------------------------------

    def note_notice(self, node_id: str, deadline_s: float, notice_age_s: float = 0.0
                    ) -> tuple[str, ...]:
        """A preemption notice for ``node_id``: ``mark_draining`` plus the rebalance clock.

        ``deadline_s`` is seconds left; ``notice_age_s`` how long ago the node received the
        notice (both measured on that node, so no two machines' clocks are compared). The
        node counts as rebalanced at the first plan published after this call (every such
        plan excludes its peers); a node without peers is rebalanced at once. That plan is
        made over the staying peers (``StepService.replan``) at once when no step is in
        flight, else at the first report after the step in flight. A second notice for the
        same node re-marks it draining but keeps the first record. Records are a window
        (``notices.py``: kept until a minute past the node's deadline); the counts in
        ``stats`` are the run's.
        """
        peers = self.mark_draining(node_id, deadline_s)
        now = self.clock()
        self.notices.note(node_id, now, notice_age_s, self.epoch, peers, now + deadline_s)
        if peers:
            self._replan(now)
        return peers

    def notice_stats(self) -> dict[str, dict]:
        """Per noticed node still kept (``NoticeBook``: until a minute past its deadline):
        ``{"peers": [...], "epoch": e, "rebalance_s": s or None}``."""
        return self.notices.stats()

    # -- data shards -------------------------------------------------------------------------

    def grant_shards(self, peer_id: str, count: int = 1, floor: int = 0) -> tuple[int, ...]:
        """The next ``count`` data shard numbers for ``peer_id``; ``floor`` is the data
        position the caller's state holds. Nothing (ask again) for a peer this Coordinator
        does not know, or while it is learning the position after a restart (``rejoin``)."""
        return self.shards.grant(peer_id, count, floor, self.clock(),
                                 self.steps.is_member(peer_id))

    def data_position(self, floor: int = 0) -> int:
        """Every data shard below this number has been handed out (checkpoints keep it)."""
        return self.shards.position(floor)

    # -- DMoE expert registry (expert_registry.py) -------------------------------------------

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

    # -- what survives a restart -------------------------------------------------------------

    def snapshot(self) -> dict[str, dict]:
        """Each service's small record (JSON-able), by record name; the history and the
        members (``StepService.members_record``) are apart. ``progress`` (the newest step
        known committed) changes with every step."""
        core = (self.started, self.history_id, self.restarts)
        if self._core_record[0] != core:  # one object while unchanged (saved at no cost)
            self._core_record = (core, {"started": self.started, "history_id": self.history_id,
                                        "restarts": self.restarts})
        return {
            "core": self._core_record[1],
            "steps": self.steps.snapshot(),
            "progress": {"committed": self.progress.top_held},
            "notices": self.notices.snapshot(),
            "shards": self.shards.snapshot(),
        }

    def save(self) -> int:
        """Write what changed to ``store`` (nothing without one; see ``durable.py`` for
        what is written behind); returns how many keys were written. Call it after every
        call that may change state, before its reply leaves."""
        if self.store is None:
            return 0
        now = self.clock()
        rows = self.store.sync_history(self.progress.history, now)
        written = rows
        for name, record in self.snapshot().items():
            # the committed step goes with each new history row, else written behind
            written += self.store.save_record(name, record, now,
                                              lazy=name == "progress" and not rows)
        if self.store.due("members", now):  # written behind (see durable.py)
            written += self.store.save_record("members", self.steps.members_record(), now)
        return written

    def _restore(self, store: DurableState) -> bool:
        """Take back the state ``store`` holds; False (nothing changes) if it holds none."""
        core = store.load_record("core")
        if core is None:
            return False
        self.started = float(core["started"])
        self.history_id = str(core["history_id"])
        self.restarts = int(core.get("restarts", 0)) + 1
        self.progress.history[:] = store.load_history()
        self.steps.restore({**(store.load_record("steps") or {}),
                            **(store.load_record("members") or {}),
                            **(store.load_record("progress") or {})})
        self.notices.restore(store.load_record("notices") or {})
        self.shards.restore(store.load_record("shards") or {})
        log.warning("Coordinator restarted (%d): %d steps of history, %d notices restored",
                    self.restarts, len(self.progress.history), len(self.notices.records))
        return True
