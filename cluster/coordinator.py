"""The Coordinator actor: membership and round plans, on the head node.

It may die: Ray restarts it (``max_restarts``) with empty memory, and the replicas rebuild
it (``rejoin``: the newest step a live replica holds wins), the expert hosts re-register.

A named, detached actor (``placement.COORDINATOR_NAME`` in namespace ``moshray``) that holds
the ``Membership`` and publishes ``RoundPlan``s. It keeps no tensors and does no I/O; its
methods are cheap and never block on a peer, so a dead peer can never stall it. Peers that
stop heartbeating are dropped after the TTL; draining peers are excluded from every plan
made after ``mark_draining`` returns.
"""

from __future__ import annotations

import functools
import inspect
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import ray

from . import metrics, placement
from .membership import Membership, MembershipConfig
from .messages import PeerInfo, RoundPlan
from .progress import ProgressReply, ProgressReport, ProgressTracker, StepRecord
from .registry import ExpertRegistry, HeartbeatStatus, HostRecord
from .shard_ledger import ShardLedger


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
        self.progress = ProgressTracker(self.membership, target_batch_size,
                                        grace_s=step_grace_s, hold_s=2 * config.peer_ttl_s)
        if restarted:
            self.progress.rebuild_until = self.started + REBUILD_S
        self.preemptions = 0
        self.notices: dict[str, NoticeRecord] = {}  # node id -> its first preemption notice
        self.experts = ExpertRegistry(clock=clock)  # DMoE expert hosts (replaces the DHT)
        self.shards = ShardLedger()  # the job's data position (rebuilt from floors)
        self._grants_after: float | None = None  # set by the first rejoin (a restart)
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
        return self.membership.heartbeat(peer_id, self.clock(), throughput)

    def leave(self, peer_id: str) -> bool:
        self.progress.forget(peer_id, gone=True)
        return self.membership.leave(peer_id)

    # -- collaborative training ------------------------------------------------------------

    def _expire(self, now: float) -> None:
        """Forget peers silent for longer than the TTL (dead ones stop being donors and
        holders of the newest step, so joiners are never stuck waiting for them)."""
        for gone in self.membership.expire(now):
            self.progress.forget(gone)

    def report(self, r: ProgressReport) -> ProgressReply:
        now = self.clock()
        self._expire(now)
        reply = self.progress.report(r, now)
        self._publish()
        self._note_rebalanced(now)
        return reply

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
        """Start counting global steps at a checkpoint's epoch (only before any step)."""
        if self.membership.epoch == 0 and not self.progress.history:
            self.membership.epoch = epoch
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

    def request_stop(self) -> None:
        self.progress.stop = True

    def stats(self) -> dict:
        now = self.clock()
        history: list[StepRecord] = self.progress.history
        return {
            "epoch": self.membership.epoch,
            "live": len(self.membership.live(now)),
            "ready": len(self.progress.ready),
            "draining": len(self.membership.draining()),
            "preemptions": self.preemptions,
            "rollbacks": len(self.progress.rollbacks),  # steps lost with every holder
            "abandoned": len(self.progress.abandoned),  # plans nobody lived to apply
            "quarantines": [(q.peer_id, q.reason) for q in self.progress.quarantine.records],
            "now_s": now - self.started,  # the clock of history's at_s (for plots)
            **self._notice_summary(),
            "history": [(h.epoch, h.at_s - self.started, h.samples, h.loss, h.peers)
                        for h in history],
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

    # -- preemption notices (autoscaler/watch.py) ----------------------------------------------

    def note_notice(self, node_id: str, deadline_s: float, notice_age_s: float = 0.0
                    ) -> tuple[str, ...]:
        """A preemption notice for ``node_id``: ``mark_draining`` plus the rebalance clock.

        ``deadline_s`` is seconds left; ``notice_age_s`` how long ago the node received the
        notice (both measured on that node, so no two machines' clocks are compared). The
        node counts as rebalanced at the first plan published after this call (every such
        plan excludes its peers); a node without peers is rebalanced at once. When no step
        is in flight, that plan is made at once over the staying peers with the samples
        they have (not at the next full batch). A second notice for the same node re-marks
        it draining but keeps the first record.
        """
        peers = self.mark_draining(node_id, deadline_s)
        now = self.clock()
        if node_id not in self.notices:
            noticed_at = now - max(0.0, notice_age_s)
            self.notices[node_id] = NoticeRecord(noticed_at, self.membership.epoch, peers,
                                                 None if peers else now - noticed_at)
        if peers and self._no_step_in_flight(now) and self.progress.plan_now(now):
            self._publish()
            self._note_rebalanced(now)
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


def _serialized(cls):
    """Wrap every public method of ``cls`` in one lock.

    The actor runs with ``max_concurrency`` > 1 so that a slow caller never queues the others,
    but the core's state is plain Python data: one lock makes each call atomic. No method
    blocks on a peer, so holding the lock is always short.
    """

    def wrap(fn):
        @functools.wraps(fn)
        def locked(self, *args, **kwargs):
            # One lock per instance, made on first use (dict.setdefault is atomic), so the
            # class itself holds nothing unpicklable.
            with self.__dict__.setdefault("_call_lock", threading.RLock()):
                return fn(self, *args, **kwargs)

        return locked

    for name, fn in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_"):
            setattr(cls, name, wrap(fn))
    return cls


@ray.remote
@_serialized
class Coordinator(CoordinatorCore):
    """Ray actor shell around ``CoordinatorCore``; create it with ``get_or_create``.

    Calls are serialized by one lock (see ``_serialized``).
    """

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    # -- metrics (see cluster/metrics.py) ---------------------------------------------------

    def __init__(self, *args, metrics_port: int | None = None,
                 metrics_host: str = metrics.LOOPBACK, prices: metrics.Prices | None = None,
                 **kwargs):
        """``metrics_port`` None: events are counted but not served; 0: the OS picks.
        Ray tells whether this process replaces one that died (``restarted``)."""
        with warnings.catch_warnings():  # Ray 2.60 warns about its own deprecated actor_id
            warnings.simplefilter("ignore")
            kwargs.setdefault("restarted",
                              ray.get_runtime_context().was_current_actor_reconstructed)
        super().__init__(*args, **kwargs)
        self.push_plan = self._push_plan
        self._rebalances_seen: set[str] = set()  # noticed nodes already in the histogram
        self.metrics = metrics.MetricsExporter(prices or metrics.Prices(), self.metrics_state)
        if metrics_port is not None:
            self.metrics.serve(metrics_host, metrics_port)

    @staticmethod
    def _push_plan(plan: RoundPlan) -> None:
        """Send ``plan`` to each participant (fire-and-forget: a dead one is the round's
        problem, its deadline bounds it; the plan also rides on report replies)."""
        for peer_id, handle in plan.handles:
            try:
                handle.receive_plan.remote(plan)
            except Exception:  # noqa: BLE001 - a handle of a dead actor; never block here
                pass

    def report(self, r: ProgressReport) -> ProgressReply:
        seen = len(self.progress.quarantine.records)
        reply = super().report(r)
        for q in self.progress.quarantine.records[seen:]:
            self.metrics.apply(metrics.QuarantineEvent(q.reason))
        return reply

    def record(self, events: tuple) -> int:
        """Count metrics events (fire-and-forget); bad ones are logged and skipped."""
        self._resolve_rebalances()
        return self.metrics.apply_all(events)

    def metrics_address(self) -> str | None:
        """``host:port`` where ``/metrics`` is served (None if not served)."""
        if self.metrics.address is None:
            return None
        host, port = self.metrics.address
        if host in ("", "0.0.0.0", "::"):
            host = ray.util.get_node_ip_address()
        return f"{host}:{port}"

    def metrics_state(self) -> metrics.TrainingState:
        """The run as the exporter sees it at scrape time (also observes rebalance delays)."""
        self._resolve_rebalances()
        s = self.stats()
        return metrics.training_state(
            s["history"], now_s=self.clock() - self.started, live=s["live"],
            draining=s["draining"], epoch=s["epoch"], preemptions=s["preemptions"],
            live_experts=len(self.experts.locations()))

    def _resolve_rebalances(self) -> None:
        """Observe each notice's rebalance delay (``note_notice`` records) once."""
        for node_id, r in self.notices.items():
            if r.rebalance_s is not None and node_id not in self._rebalances_seen:
                self._rebalances_seen.add(node_id)
                self.metrics.apply(metrics.RebalanceEvent(r.rebalance_s))


def get_or_create(
    config: MembershipConfig | None = None, target_batch_size: int = 256, name: str | None = None,
    metrics_port: int | None = None, metrics_host: str = metrics.LOOPBACK,
    prices: metrics.Prices | None = None, step_grace_s: float = 2.0,
) -> ray.actor.ActorHandle:
    """The cluster's Coordinator: created detached on the head node on first call.

    With ``metrics_port`` (0: any free port) it serves Prometheus metrics on
    ``metrics_host``; ``metrics_address.remote()`` tells where. Ignored if it exists already.
    """
    # Restarted by Ray if its process dies; calls made meanwhile are retried once it is back
    # (a service that can be briefly away). It keeps nothing the replicas cannot rebuild:
    # they rejoin with their epoch (``rejoin``), experts re-register on an unknown heartbeat.
    return Coordinator.options(
        name=name or placement.COORDINATOR_NAME,
        namespace=placement.NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_concurrency=64,
        max_restarts=-1,
        max_task_retries=-1,
        **placement.on_head(),
    ).remote(config or MembershipConfig(), target_batch_size=target_batch_size,
             metrics_port=metrics_port, metrics_host=metrics_host, prices=prices,
             step_grace_s=step_grace_s)
