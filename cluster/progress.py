"""DeDLOC-style collaborative steps: pure bookkeeping behind the Coordinator.

Replicas report, after each micro-batch, the last global step they applied (``epoch``),
the samples accumulated since, the mean loss of those samples and a digest of their
parameters. When the samples reported by ready peers at the current epoch reach
``target_batch_size``, the tracker asks ``Membership`` for the plan of the next epoch over
*every* ready, live, non-draining peer at the current epoch, each contributing what it has
(zero samples allowed). A ready peer still finishing the previous step gets a short grace
(``grace_s``) to report at the current epoch before the plan is made without it. The plan
goes to each participant as soon as it exists (the Coordinator pushes it; see
``take_new_plan``) and in the reply to its next report. Peers that hold another digest than
the majority at the same epoch, or that fell behind the last plan without being in it, are
told to resync from a donor. Time is injected.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .membership import Membership
from .messages import RoundPlan
from .quarantine import Quarantine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProgressReport:
    """Replica -> Coordinator, after every micro-batch (also a heartbeat)."""

    peer_id: str
    epoch: int  # last global step applied
    samples: int  # accumulated since that step
    loss: float | None = None  # mean loss over those samples
    checksum: str | None = None  # parameters after ``epoch``
    rejected: int = 0  # own contributions rejected so far (non-finite etc.)
    # Others' contributions this peer rejected since its last report: (sender, reason, epoch).
    saw_rejections: tuple[tuple[str, str, int], ...] = ()


@dataclass(frozen=True)
class ProgressReply:
    plan: RoundPlan | None  # plan of epoch + 1 when this peer takes part in it
    stop: bool = False
    resync: bool = False  # reload state from a donor before going on
    global_epoch: int = 0
    unknown: bool = False  # the Coordinator does not know this peer (it restarted): rejoin


@dataclass(frozen=True)
class StepRecord:
    """One committed global step, as the console, metrics and plots see it."""

    epoch: int
    at_s: float
    samples: int
    loss: float | None
    peers: int


@dataclass
class StepTiming:
    """When one global step was planned, who took part, and when it was first seen applied.

    ``committed_at`` is the time of the first report at ``epoch`` from one of its
    participants (a replica reports the last step its optimizer applied), None until then.
    Benchmarks read it (``CoordinatorCore.step_timings``) to time recovery: a hard kill ->
    the next step committed without the dead peer, a joiner -> its first step.
    """

    epoch: int
    planned_at: float
    participants: tuple[str, ...]
    committed_at: float | None = None


@dataclass
class ProgressTracker:
    membership: Membership
    target_batch_size: int
    ready: set[str] = field(default_factory=set)
    reports: dict[str, ProgressReport] = field(default_factory=dict)
    plan: RoundPlan | None = None  # the latest published plan
    history: list[StepRecord] = field(default_factory=list)
    stop: bool = False
    timings: dict[int, StepTiming] = field(default_factory=dict)  # epoch -> its timing
    rollbacks: list[tuple[int, int]] = field(default_factory=list)  # (from, to) epochs
    grace_s: float = 2.0  # how long a full batch waits for ready peers finishing a step
    quarantine: Quarantine = field(default_factory=Quarantine)
    _loss: dict[int, tuple[float, int]] = field(default_factory=dict)
    _full_since: float | None = None  # when the current epoch's batch became full
    _unpushed: RoundPlan | None = None  # made since the last take_new_plan

    def take_new_plan(self) -> RoundPlan | None:
        """The plan made since the last call (for the Coordinator to push), else None."""
        plan, self._unpushed = self._unpushed, None
        return plan

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    def mark_ready(self, peer_id: str, state_epoch: int) -> bool:
        """A joiner holding the state of ``state_epoch`` may take part from the next plan.

        Accepted only if no plan after ``state_epoch`` exists yet (else it must reload), with
        one exception: when no ready peer is left at all, the steps after ``state_epoch``
        died with the peers that took them, and waiting would deadlock the swarm. Then the
        epoch rolls back to ``state_epoch`` (counted in ``rollbacks``) and training goes on
        from the newest state still held.
        """
        if state_epoch != self.epoch:
            holders = [p for p in self.ready if self.membership.is_member(p)]
            if holders or state_epoch > self.epoch:
                return False
            self.rollbacks.append((self.epoch, state_epoch))
            self.membership.epoch = state_epoch
            self.plan = None
        self.ready.add(peer_id)
        self.quarantine.clear(peer_id)
        return True

    def forget(self, peer_id: str) -> None:
        self.ready.discard(peer_id)
        self.reports.pop(peer_id, None)

    def rejoin(self, peer_id: str, state_epoch: int) -> bool:
        """A registered peer that held the state of ``state_epoch`` before the Coordinator
        lost its memory (a restart). The newest committed step held by a live peer wins: a
        newer epoch is adopted; a peer at the current epoch is ready at once; one behind
        it is not (it resyncs from a donor)."""
        if state_epoch > self.epoch:
            self.membership.epoch = state_epoch
            self.plan = None
        if state_epoch == self.epoch:
            self.ready.add(peer_id)
            return True
        return False

    def report(self, r: ProgressReport, now: float) -> ProgressReply:
        if not self.membership.heartbeat(r.peer_id, now):
            return ProgressReply(None, global_epoch=self.epoch, unknown=True)
        if r.epoch > self.epoch and r.peer_id in self.ready:
            # A step planned before a Coordinator restart completed among its peers.
            self.membership.epoch = r.epoch
            self.plan = None
        self.reports[r.peer_id] = r
        for sender, reason, epoch in r.saw_rejections:
            if self.quarantine.note(r.peer_id, sender, reason, epoch, now):
                self.ready.discard(sender)  # in no further plan; resyncs before it rejoins
                log.warning("quarantined %s: its contributions were rejected (%s) by others "
                            "%d times within %.0f s", sender, reason,
                            self.quarantine.threshold, self.quarantine.window_s)
        timing = self.timings.get(r.epoch)
        if timing is not None and timing.committed_at is None and r.peer_id in timing.participants:
            timing.committed_at = now
        in_plan = self.plan is not None and r.peer_id in self.plan.participants
        if self.stop:
            # Finish a published step first, so no participant waits for a stopped peer.
            if r.peer_id in self.ready and in_plan and r.epoch == self.plan.epoch - 1:
                return ProgressReply(self.plan, global_epoch=self.epoch)
            # A staying peer that fell behind (it missed a step, or was still joining)
            # copies the final state first, so every replica ends with the same parameters.
            behind = r.peer_id not in self.ready or r.epoch < self.epoch
            if behind and r.peer_id not in self.membership.draining() and \
                    any(p != r.peer_id for p in self.ready):
                self.ready.discard(r.peer_id)
                return ProgressReply(None, resync=True, global_epoch=self.epoch)
            return ProgressReply(None, stop=True, global_epoch=self.epoch)
        if r.peer_id in self.membership.draining():
            # Leaving (its node got a notice): finish a published step it is in, so nobody
            # waits for it, then stop training. It stays up as a donor until its deadline.
            if r.peer_id in self.ready and in_plan and r.epoch == self.plan.epoch - 1:
                return ProgressReply(self.plan, global_epoch=self.epoch)
            return ProgressReply(None, stop=True, global_epoch=self.epoch)
        if r.peer_id not in self.ready:
            return ProgressReply(None, resync=True, global_epoch=self.epoch)
        if r.epoch < self.epoch and not (in_plan and r.epoch == self.plan.epoch - 1):
            self.ready.discard(r.peer_id)  # it missed a step: must reload
            return ProgressReply(None, resync=True, global_epoch=self.epoch)
        if self._disagrees(r):
            self.ready.discard(r.peer_id)
            return ProgressReply(None, resync=True, global_epoch=self.epoch)
        if r.epoch == self.epoch:
            self._record_loss(r)
            self._maybe_plan(now)
        if self.plan is not None and r.peer_id in self.plan.participants \
                and r.epoch == self.plan.epoch - 1:
            return ProgressReply(self.plan, global_epoch=self.epoch)
        return ProgressReply(None, global_epoch=self.epoch)

    def _disagrees(self, r: ProgressReport) -> bool:
        """``r``'s digest loses to another held by ready peers at the same epoch: the
        digest with most holders wins; a tie goes to the digest held by the smallest peer
        id (deterministic, so a 1-vs-1 split resolves: exactly one side resyncs)."""
        if r.checksum is None:
            return False
        holders: dict[str, list[str]] = {}
        for p, x in self.reports.items():
            if x.epoch == r.epoch and x.checksum is not None and p in self.ready:
                holders.setdefault(x.checksum, []).append(p)
        if len(holders) < 2:
            return False
        winner = min(holders, key=lambda c: (-len(holders[c]), min(holders[c])))
        return winner != r.checksum

    def _record_loss(self, r: ProgressReport) -> None:
        if r.loss is not None and r.samples > 0:
            total, n = self._loss.get(r.epoch, (0.0, 0))
            self._loss[r.epoch] = (total + r.loss * r.samples, n + r.samples)

    def _maybe_plan(self, now: float) -> None:
        live = {p.peer_id for p in self.membership.live(now)}
        eligible = sorted(p for p in self.ready if p in live)
        if not eligible:
            return
        current = [self.reports[p] for p in eligible
                   if p in self.reports and self.reports[p].epoch == self.epoch]
        samples = sum(r.samples for r in current)
        if samples < self.target_batch_size:
            self._full_since = None
            return
        if self._full_since is None:
            self._full_since = now
        if self._finishing(eligible) and now - self._full_since < self.grace_s:
            return  # a ready peer is still applying the last step: give it a moment
        self.plan_now(now, current)

    def _finishing(self, eligible: list[str]) -> bool:
        """Some of ``eligible`` took part in the latest plan and still report the epoch
        before it (they are applying that step)."""
        if self.plan is None:
            return False
        return any(p in self.plan.participants and p in self.reports
                   and self.reports[p].epoch == self.plan.epoch - 1 for p in eligible)

    def plan_now(self, now: float, current: list[ProgressReport] | None = None) -> bool:
        """Publish the next epoch's plan over the ready live peers at the current epoch
        (``current``: their reports; default all of them), whatever their samples. Used when
        the batch is full, and at once after a notice (the swarm re-plans without the
        node). False if no peer or no sample is there to step with."""
        if current is None:
            live = {p.peer_id for p in self.membership.live(now)}
            current = [self.reports[p] for p in sorted(self.ready)
                       if p in live and p in self.reports and self.reports[p].epoch == self.epoch]
        samples = sum(r.samples for r in current)
        if not current or samples <= 0:
            return False
        at_epoch = tuple(r.peer_id for r in current)
        total, n = self._loss.pop(self.epoch, (0.0, 0))
        plan = self.membership.plan(now, at_epoch)
        if plan is None:
            return False
        self.plan = plan
        self._unpushed = plan
        self._full_since = None
        self.history.append(StepRecord(plan.epoch, now, samples, total / n if n else None,
                                       len(at_epoch)))
        self.timings[plan.epoch] = StepTiming(plan.epoch, now, tuple(plan.participants))
        return True
