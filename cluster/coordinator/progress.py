"""DeDLOC-style collaborative steps: pure bookkeeping behind the Coordinator.

Replicas report, after each micro-batch, the last global step they applied (``epoch``),
the samples and micro-batches accumulated since, the mean loss of those samples and a
digest of their parameters. When the step is due (``step_due``: in collaborative mode the
samples reported by ready peers at the current epoch reach ``target_batch_size``; in local
SGD the ready peers' micro-batches, their local steps, average ``local_steps``), the tracker
asks ``Membership`` for the plan of the next epoch over
*every* ready, live, non-draining peer at the current epoch, each contributing what it has
(zero samples allowed). A ready peer still finishing the previous step gets a short grace
(``grace_s``) to report at the current epoch before the plan is made without it. Each
participant gets its view of the plan (``messages.PeerPlan``: its groups, their members'
handles, shares and zones) as soon as the plan exists (the Coordinator pushes it; see
``take_new_plan`` and ``views_of``) and in the reply to its next report; the tracker keeps
the whole plan. Peers that hold another digest than
the majority at the same epoch, or that fell behind the last plan without being in it, are
told to resync from a donor. After a notice or a lost peer the Coordinator plans the next
step as soon as no step is in flight (``plan_now`` with ``empty_ok``). Time is injected.

Committed steps are never rolled back while a replica that holds them may still be up. The
tracker remembers, per peer, the newest epoch it was seen holding (``_held``: reports,
rejoins, readiness), also after the peer expired or was quarantined, and the newest step
known committed (``top_held``: also one committed before a Coordinator restart,
``note_committed``). A state older than the current epoch or than that step is accepted
(``mark_ready``, a rejoin) only when no member holds a newer one, nobody was seen holding
one for ``hold_s`` (a slow peer whose heartbeats were late rejoins within that), no
participant of the in-flight plan is still a member, and a restarted Coordinator is done
rebuilding (``_rebuilding``): not before ``rebuild_until``, and not while a replica known
before the restart, or heard from since (heartbeats and reports answered "unknown"),
has not rejoined (``await_rejoin``; one silent for ``hold_s`` is presumed gone, logged).
So a joiner that finds no donor during a long step (the replicas rejoin only once it is
applied) waits for them. A rejoined replica holding an older state than the newest
committed step waits meanwhile (no plan, no resync: it may hold the newest state left).
Falling back below a committed step is a *rollback*, over steps nobody was ever seen
applying an *abandoned* plan; both are counted and logged.

Every fall back starts a new *branch* of the history (``branch``; ``forks`` keeps the
epoch each branch started from): plans carry it (``RoundPlan.branch``), replicas keep the
branch of the last step they applied and report it (``ProgressReport.branch``,
``rejoin``). A peer that comes back holding a step past the fork of a later branch (it
was cut off before the fall back; the steps after the fork were dropped with its branch)
holds a *stale* state: it is not ready, holds nothing, moves no epoch, is told to resync
from a donor, and is counted in ``stale_returns`` (once per peer, epoch and branch). A
step of the current branch that is newer than the epoch (completed among its peers while
the Coordinator restarted) is adopted as before. A peer that reports no branch (None) is
never judged stale.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, MutableSet, Sequence
from dataclasses import dataclass, field

from moshray.cluster.coordinator.donors import EMPTY, PeerPool
from moshray.cluster.coordinator.eligible import AtEpoch, EligibleTally
from moshray.cluster.coordinator.membership import Membership
from moshray.cluster.messages import PeerPlan, RoundPlan
from moshray.cluster.coordinator.quarantine import Quarantine
from moshray.cluster.coordinator.step_samples import StepSamples

log = logging.getLogger(__name__)

# How many epochs behind the newest reported one the digests are kept for ``_disagrees``
# (a report of an older epoch, from a replica that far behind, is resynced anyway).
DIGEST_EPOCHS = 8
# How many of the latest global steps keep their ``StepTiming`` (each holds its
# participants: a window, not the run's history; ``CoordinatorCore.step_timings``).
TIMINGS_KEEP = 256


@dataclass(frozen=True)
class ProgressReport:
    """Replica -> Coordinator, after every micro-batch (also a heartbeat)."""

    peer_id: str
    epoch: int  # last global step applied
    samples: int  # accumulated since that step
    loss: float | None = None  # mean loss over those samples
    checksum: str | None = None  # parameters after ``epoch``
    rejected: int = 0  # own contributions rejected so far (non-finite etc.)
    # Others' contributions this peer rejected since its last report: (sender, reason,
    # epoch) or (sender, reason, epoch, the length the sender's tensor had: -1 unknown).
    saw_rejections: tuple[tuple, ...] = ()
    numel: int = 0  # the length of this peer's averaged tensor (its model's layout; 0: unknown)
    # (epoch, samples): what this peer put into the step ``epoch`` it just applied, once
    # (see step_samples.py); None otherwise
    contributed: tuple[int, int] | None = None
    micro: int = 0  # micro-batches (local steps in local SGD) since ``epoch``
    branch: int | None = None  # the branch of the step ``epoch`` (its plan's); None: unknown


def step_due(current: Sequence[ProgressReport], eligible: int, target_batch_size: int,
             local_steps: int | None = None) -> bool:
    """Is the next global step due, from the reports at the current epoch of the
    ``eligible`` ready, live peers? Collaborative steps (``local_steps`` None): once their
    samples reach ``target_batch_size``. Local SGD: once their micro-batches (local steps)
    since the last average reach ``local_steps`` per eligible peer on average (a slow peer
    contributes fewer, a fast one more; the average weighs them by samples), and some
    samples were taken. Pure."""
    return due_by_counts(sum(r.samples for r in current), sum(r.micro for r in current),
                         eligible, target_batch_size, local_steps)


def due_by_counts(samples: int, micro: int, eligible: int, target_batch_size: int,
                  local_steps: int | None = None) -> bool:
    """``step_due`` from the sums of the reports' ``samples`` and ``micro``. Pure."""
    if local_steps is None:
        return samples >= target_batch_size
    return samples > 0 and micro >= local_steps * max(eligible, 1)


class ReadySet(MutableSet):
    """The ready peers (a set of ids) that tells ``on_change`` of every peer added or
    removed, so the tracker's counts follow (``ProgressTracker._refresh``); ``pool`` is
    the same peers as a ``donors.PeerPool`` (donors are picked from it in O(1))."""

    def __init__(self, on_change: Callable[[str], None]):
        self._peers = PeerPool()
        self._on_change = on_change

    @property
    def pool(self) -> PeerPool:
        """The ready peers, indexable (do not mutate it)."""
        return self._peers

    def __contains__(self, peer: object) -> bool:
        return peer in self._peers

    def __iter__(self) -> Iterator[str]:
        return iter(self._peers)

    def __len__(self) -> int:
        return len(self._peers)

    def __repr__(self) -> str:
        return f"ReadySet({sorted(self._peers)})"

    def add(self, peer: str) -> None:
        if peer not in self._peers:
            self._peers.add(peer)
            self._on_change(peer)

    def discard(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            self._on_change(peer)


@dataclass(frozen=True)
class JoinWait:
    """A joiner's donor requests: its first (``first``), its latest (``asked``) and how
    long the attempt before the latest took (``copy_s``: ask to ask, 0 on the first)."""

    first: float
    asked: float
    copy_s: float = 0.0


def join_wait(w: JoinWait, now: float, grace_s: float, cap_s: float) -> bool:
    """Do full batches still wait for this joiner? For ``grace_s`` after each donor
    request, stretched to 1.5 x its last attempt's duration (a copy over a slow link takes
    longer than a step: without the stretch it would never catch up), and never past
    ``cap_s`` after its first request (a joiner that cannot keep up stops holding the swarm
    back; it goes on trying). Pure."""
    return now - w.asked < max(grace_s, 1.5 * w.copy_s) and now - w.first < cap_s


@dataclass(frozen=True)
class ProgressReply:
    # this peer's part of the plan of epoch + 1 when it takes part in it (``PeerPlan``:
    # its groups and their members' handles, not the whole plan)
    plan: PeerPlan | None
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
    local_steps: int | None = None  # local SGD: the local steps between averages (step_due)
    # peers holding the swarm's state (a ``ReadySet``: the eligible counts follow it)
    ready: MutableSet[str] = field(init=False, repr=False)
    reports: dict[str, ProgressReport] = field(default_factory=dict)
    plan: RoundPlan | None = None  # the latest published plan (of the current epoch)
    history: list[StepRecord] = field(default_factory=list)
    stop: bool = False
    # epoch -> its timing, the latest ``TIMINGS_KEEP`` steps planned (oldest first)
    timings: dict[int, StepTiming] = field(default_factory=dict)
    # (newest committed, fallen back to) epochs: every holder of the steps between died
    rollbacks: list[tuple[int, int]] = field(default_factory=list)
    # (peer, epoch): a step a replica committed with a digest that lost the vote
    # (``_disagrees``: a part owner died after some but not all got its result); it resynced
    diverged: list[tuple[str, int]] = field(default_factory=list)
    grace_s: float = 2.0  # how long a full batch waits for ready peers finishing a step
    join_grace_s: float = 2.0  # ... and for a joiner copying a donor's state (from its ask)
    join_cap_s: float = 30.0  # the longest full batches wait for one joiner (join_wait)
    hold_s: float = 60.0  # a newer state seen this recently blocks a fallback (2 x TTL)
    rebuild_until: float | None = None  # after a restart: no fallback before this time
    abandoned: list[tuple[int, int]] = field(default_factory=list)  # plans nobody applied
    # (peer, epoch, branch): a peer came back holding a step of a branch the swarm had
    # fallen back from (``_stale``): its steps after the fork were dropped; it resynced
    stale_returns: list[tuple[str, int, int]] = field(default_factory=list)
    branch: int = 0  # the history's branch: one more at every fall back (plans carry it)
    forks: dict[int, int] = field(default_factory=dict)  # branch -> the epoch it started from
    quarantine: Quarantine = field(default_factory=Quarantine)
    step_samples: StepSamples = field(default_factory=StepSamples)
    _loss: dict[int, tuple[float, int]] = field(default_factory=dict)
    _full_since: float | None = None  # when the current epoch's batch became full
    _unpushed: RoundPlan | None = None  # made since the last take_new_plan
    # the participants' views (``RoundPlan.views``) of ``_views_of``, built once per plan
    _views: dict[str, PeerPlan] = field(default_factory=dict, repr=False)
    _views_of: RoundPlan | None = field(default=None, repr=False)
    # peer -> (epoch, seen); a non-member's is dropped once unseen for ``hold_s``
    # (``prune_held``), so the peers that came and went do not pile up
    _held: dict[str, tuple[int, float]] = field(default_factory=dict)
    _pruned_at: float = field(default=float("-inf"), repr=False)
    _top_held: int = 0  # the newest epoch any peer was ever seen holding (committed)
    # epoch -> the peers of ``_held`` at it (donors are picked from the current one's)
    _holders: dict[int, PeerPool] = field(default_factory=dict, repr=False)
    _joining: dict[str, JoinWait] = field(default_factory=dict)  # peer -> its donor requests
    # after a restart: peers that may still rejoin -> when last heard of (``await_rejoin``)
    _awaited: dict[str, float] = field(default_factory=dict)
    _parked: set[str] = field(default_factory=set)  # rejoined, older than top_held: waiting
    # epoch -> the distinct digests reported at it (while it may still be voted on): one
    # digest means no vote to count (``_disagrees`` is O(1) then)
    _digests: dict[int, set[str]] = field(default_factory=dict)
    # the eligible peers (ready, members, not draining) and their latest reports, counted
    # as they change (``_refresh``), with the participants of ``_watching`` counted apart
    _tally: EligibleTally = field(default_factory=EligibleTally, repr=False)
    _watching: RoundPlan | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.ready = ReadySet(self._refresh)
        self.membership.on_change = self._refresh

    def _refresh(self, peer_id: str) -> None:
        """``peer_id``'s readiness, membership, draining mark or latest report changed:
        tell the tally whether it is eligible and what it reported (O(1))."""
        m, r = self.membership, self.reports.get(peer_id)
        self._tally.update(
            peer_id, peer_id in self.ready and m.is_member(peer_id) and not m.is_draining(peer_id),
            None if r is None else (r.epoch, r.samples, r.micro))

    def take_new_plan(self) -> RoundPlan | None:
        """The plan made since the last call (for the Coordinator to push), else None."""
        plan, self._unpushed = self._unpushed, None
        return plan

    def views_of(self, plan: RoundPlan) -> dict[str, PeerPlan]:
        """Each participant's ``PeerPlan`` of ``plan``, by peer id: built once for the
        latest plan (O(N)), so the pushes and every report's reply look theirs up in O(1).
        Do not mutate it."""
        if plan is not self._views_of:
            self._views, self._views_of = plan.views(), plan
        return self._views

    @property
    def epoch(self) -> int:
        return self.membership.epoch

    def mark_ready(self, peer_id: str, state_epoch: int, now: float = 0.0) -> bool:
        """A registered peer holding the state of ``state_epoch`` may take part from the
        next plan (it is counted at that epoch at once, so a plan made before its first
        report includes it). False (copy again) for a non-member, a state from the future,
        or a state older than the current epoch or the newest step known committed while a
        newer one may still be held (see ``_may_fall_back``); accepted, such a state is a
        counted fall back (``_fall_back``)."""
        if not self.membership.is_member(peer_id) or state_epoch > self.epoch:
            return False
        if state_epoch < max(self.epoch, self._top_held) and not self._fall_back(state_epoch, now):
            return False
        if self._rebuilding(now) and not any(
                e == state_epoch for p, (e, _) in self._held.items() if p != peer_id):
            return False  # a fresh Coordinator's epoch 0 is no state: wait for the holders'
        # rejoins (or the rebuild's end), else a copy of nothing would restart the count
        self._make_ready(peer_id, state_epoch, now)
        return True

    def _make_ready(self, peer_id: str, state_epoch: int, now: float) -> None:
        self.ready.add(peer_id)
        self._parked.discard(peer_id)
        self._joining.pop(peer_id, None)
        self.hold(peer_id, state_epoch, now)
        if self.reports.get(peer_id) is None or self.reports[peer_id].epoch != state_epoch:
            self._put_report(ProgressReport(peer_id, state_epoch, 0))

    def hold(self, peer_id: str, epoch: int, now: float) -> None:
        """``peer_id`` was seen holding the state of ``epoch`` at ``now``."""
        old = self._held.get(peer_id)
        if old is None or old[0] != epoch:
            self._unhold(peer_id)
            pool = self._holders.get(epoch)
            if pool is None:
                pool = self._holders[epoch] = PeerPool()
            pool.add(peer_id)
        self._held[peer_id] = (epoch, now)
        self._top_held = max(self._top_held, epoch)

    def _unhold(self, peer_id: str) -> None:
        """Forget what ``peer_id`` was seen holding."""
        old = self._held.pop(peer_id, None)
        if old is not None:
            pool = self._holders[old[0]]
            pool.discard(peer_id)
            if not pool:
                del self._holders[old[0]]

    def holders(self, epoch: int) -> PeerPool:
        """The peers last seen holding ``epoch`` (members or not; do not mutate it)."""
        return self._holders.get(epoch, EMPTY)

    @property
    def top_held(self) -> int:
        """The newest epoch any peer was seen holding (committed), in this life or, through
        ``note_committed``, an earlier one."""
        return self._top_held

    def note_committed(self, epoch: int) -> None:
        """``epoch`` was committed before this Coordinator's restart (the driver remembers
        it across restarts): a fallback below it is a rollback, even when every holder died
        before rejoining. Ignored for a step already counted lost in a rollback (the driver
        tells the newest step it ever saw; the swarm may be on a later branch below it)."""
        if any(to < epoch <= top for top, to in self.rollbacks):
            return
        self._top_held = max(self._top_held, epoch)

    def resume_at(self, epoch: int, now: float) -> bool:
        """Count steps from a checkpoint's ``epoch`` (a fresh swarm); refused (False) while a
        restarted Coordinator rebuilds (``_rebuilding``). Below a step known committed it is
        a rollback (counted). The history goes on on a new branch from ``epoch`` (unless
        nothing changes), so a replica cut off before this holds a stale state."""
        if self._rebuilding(now):
            return False
        if self._top_held > epoch:
            self.rollbacks.append((self._top_held, epoch))
            log.warning("rollback from epoch %d to the checkpoint's %d: no holder of the "
                        "newer steps is left", self._top_held, epoch)
        if self._top_held > epoch or self.membership.epoch != epoch:
            self._fork(epoch)
        self._top_held = epoch
        self.membership.epoch = epoch
        self.plan = None
        return True

    def _fall_back(self, state_epoch: int, now: float) -> bool:
        """Make ``state_epoch`` the swarm's epoch and newest committed step if nothing newer
        can still be held (``_may_fall_back``): a rollback (counted, logged) if a newer step
        was seen applied or is known committed, else the newer plans are abandoned
        (counted); either way the history goes on on a new branch from ``state_epoch``.
        False (and nothing changes) otherwise, and for a state from the future."""
        if state_epoch > self.epoch or not self._may_fall_back(state_epoch, now):
            return False
        if self._top_held > state_epoch:  # from the newest committed step (a planned one
            self.rollbacks.append((self._top_held, state_epoch))  # after it was abandoned)
            log.warning("rollback from epoch %d to %d: no holder of the newer steps is left",
                        self._top_held, state_epoch)
        else:
            self.abandoned.append((self.epoch, state_epoch))
        self._top_held = state_epoch
        if state_epoch < self.epoch:
            self.membership.epoch = state_epoch
            self.plan = None
        self._fork(state_epoch)
        return True

    def _fork(self, epoch: int) -> None:
        """A new branch of the history starts from the state of ``epoch``."""
        self.branch += 1
        self.forks[self.branch] = epoch

    def _stale(self, epoch: int, branch: int | None) -> bool:
        """A state at ``epoch`` on ``branch`` is off the swarm's history: a later branch
        started from below ``epoch`` (the steps after that fork on ``branch`` were dropped
        by a fall back). Never for an unknown (None) or the current branch."""
        if branch is None or branch >= self.branch:
            return False
        return epoch > min((at for b, at in self.forks.items() if b > branch), default=epoch)

    def _stale_return(self, peer_id: str, epoch: int, branch: int) -> None:
        """``peer_id`` holds a stale state (``_stale``): out of the ready set, holding
        nothing (it blocks no fall back and is no donor), counted in ``stale_returns``
        and logged once per (peer, epoch, branch)."""
        self.ready.discard(peer_id)
        self._parked.discard(peer_id)
        self._drop_report(peer_id)
        self._unhold(peer_id)
        if (peer_id, epoch, branch) not in self.stale_returns:
            self.stale_returns.append((peer_id, epoch, branch))
            log.warning("%s came back holding step %d of branch %d, which the swarm fell back "
                        "from (to step %d, branch %d; now at %d): its steps are dropped, it "
                        "resyncs from a donor", peer_id, epoch, branch,
                        min(at for b, at in self.forks.items() if b > branch), self.branch,
                        self.epoch)

    def _note_branch(self, branch: int | None) -> None:
        """A replica holds a step of a later branch than this tracker knows (a Coordinator
        that restarted without its state): that branch is the swarm's."""
        if branch is not None and branch > self.branch:
            self.branch = branch

    def _may_fall_back(self, state_epoch: int, now: float) -> bool:
        """No replica that may still be up holds (or is taking) a step after
        ``state_epoch``: not while rebuilding after a restart (``_rebuilding``), not while a
        member or a peer seen within ``hold_s`` holds a newer epoch, not while a member
        takes the latest plan."""
        if self._rebuilding(now):
            return False
        for p, (e, seen) in self._held.items():
            if e > state_epoch and (self.membership.is_member(p) or now - seen <= self.hold_s):
                return False
        plan = self.plan
        return not (plan is not None and plan.epoch > state_epoch
                    and any(self.membership.is_member(p) for p in plan.participants))

    def _next_plan(self, peer_id: str, epoch: int) -> PeerPlan | None:
        """``peer_id``'s view of the latest plan if it takes part in it and holds the epoch
        before it (O(1))."""
        plan = self.plan
        if plan is not None and plan.epoch == epoch + 1:
            return self.views_of(plan).get(peer_id)
        return None

    def _rebuilding(self, now: float) -> bool:
        """A restarted Coordinator is still rebuilding: before ``rebuild_until`` (the floor,
        ``steps.REBUILD_S``), or while a peer awaited to rejoin (``await_rejoin``) was heard
        of within ``hold_s`` (``expire_awaited``)."""
        if self.rebuild_until is None:
            return False
        self.expire_awaited(now)
        return now < self.rebuild_until or bool(self._awaited)

    def expire_awaited(self, now: float) -> None:
        """Stop waiting for awaited peers (``await_rejoin``) silent for longer than
        ``hold_s``: presumed gone (logged), as a holder not seen for that long is."""
        for p in [p for p, heard in self._awaited.items() if now - heard > self.hold_s]:
            del self._awaited[p]
            log.warning("%s did not rejoin the restarted Coordinator within %.0f s: presumed "
                        "gone", p, self.hold_s)

    def await_rejoin(self, peer_id: str, now: float) -> None:
        """While a restarted Coordinator rebuilds: ``peer_id`` may hold a newer state than
        any rejoined so far (it was a member before the restart, or it heartbeats or
        reports without having rejoined: a replica inside a long step rejoins only once
        the step is applied). The rebuild lasts until it rejoins, registers anew, leaves
        or is silent for ``hold_s``. Ignored once the rebuild is over."""
        if self._rebuilding(now):
            self._awaited[peer_id] = now

    def arrived(self, peer_id: str) -> None:
        """``peer_id`` registered anew (a fresh start: it holds no state): not awaited."""
        self._awaited.pop(peer_id, None)

    @property
    def awaited(self) -> tuple[str, ...]:
        """The peers a rebuild still waits for (``await_rejoin``), sorted."""
        return tuple(sorted(self._awaited))

    def prune_held(self, now: float) -> None:
        """Forget what the peers that are no longer members were seen holding once they
        are unseen for ``hold_s`` (a held step then blocks no fall back anyway): one pass
        over ``_held`` at most once per ``hold_s``, so O(1) per call amortized."""
        if now - self._pruned_at < self.hold_s:
            return
        self._pruned_at = now
        m = self.membership
        for p in [p for p, (_, seen) in self._held.items()
                  if now - seen > self.hold_s and not m.is_member(p)]:
            self._unhold(p)

    def holds_current(self, peer_id: str) -> bool:
        """``peer_id`` was last seen holding the current epoch (a donor that gives a state
        ``mark_ready`` accepts)."""
        return self._held.get(peer_id, (-1, 0.0))[0] == self.epoch

    def note_joining(self, peer_id: str, now: float) -> None:
        """``peer_id`` asked for a donor (a first copy, or another after a copy that came
        too late): full batches wait for it (``join_wait``), else a fast swarm, or one whose
        copies cross a slow link, outruns every copy it makes."""
        wait = self._joining.get(peer_id)
        self._joining[peer_id] = (JoinWait(now, now) if wait is None else
                                  JoinWait(wait.first, now, now - wait.asked))

    def forget(self, peer_id: str, gone: bool = False) -> None:
        """``peer_id`` expired (it may still be up: what it held is kept for ``hold_s``)
        or, with ``gone``, left for good."""
        self.ready.discard(peer_id)
        self._drop_report(peer_id)
        self._joining.pop(peer_id, None)
        self._parked.discard(peer_id)
        if gone:
            self._unhold(peer_id)
            self._awaited.pop(peer_id, None)

    def rejoin(self, peer_id: str, state_epoch: int, now: float = 0.0,
               syncing: bool = False, branch: int | None = None) -> bool:
        """A registered peer that held the state of ``state_epoch`` (of ``branch``: the
        branch of its last step; None: not told) before the Coordinator lost its memory (a
        restart) or forgot it (it expired). The newest committed step held by a live peer
        wins: a newer epoch is adopted; a peer at the current epoch is ready at once
        (counted at that epoch); one behind it is not (it resyncs from a donor). A
        ``syncing`` peer (it was told to reload) counts as a holder and may set the epoch,
        but is not ready (it finishes its copy and calls ``mark_ready``). A stale state
        (``_stale``) is none of this: not ready, no holder, the epoch stays. A state older
        than the newest step known committed is ready only as a counted fall back; until
        one may happen the peer waits (parked: ``report`` answers it with no plan and no
        resync, and makes it ready once the fall back may happen)."""
        self._awaited.pop(peer_id, None)
        if self._stale(state_epoch, branch):
            self._stale_return(peer_id, state_epoch, branch)
            return False
        self._note_branch(branch)
        self.hold(peer_id, state_epoch, now)
        if state_epoch > self.epoch:
            self.membership.epoch = state_epoch
            self.plan = None
        if state_epoch != self.epoch or syncing:
            return False
        if state_epoch < self._top_held and not self._fall_back(state_epoch, now):
            self._parked.add(peer_id)  # it may hold the newest state left: it waits
            return False
        self._make_ready(peer_id, state_epoch, now)
        return True

    def _unpark(self, r: ProgressReport, now: float) -> bool:
        """A parked peer (``rejoin``) reports: it becomes ready once its state may be the
        swarm's (a counted fall back), and stops waiting when the swarm moved on without it
        (it resyncs); False while it still waits."""
        if r.epoch == self.epoch and r.epoch < self._top_held and \
                not self._fall_back(r.epoch, now):
            return False
        self._parked.discard(r.peer_id)
        if r.epoch == self.epoch:
            self._make_ready(r.peer_id, r.epoch, now)
        return True

    def report(self, r: ProgressReport, now: float) -> ProgressReply:
        """A peer's progress (also a heartbeat): the plan it takes next, or what to do
        (rejoin when unknown, resync, stop). A stale state (``_stale``) is resynced (or
        stopped, when it is leaving or nobody is left to copy at the stop), holding
        nothing and moving no epoch; a parked peer waits (see ``rejoin``)."""
        if not self.membership.heartbeat(r.peer_id, now):
            self.await_rejoin(r.peer_id, now)
            return ProgressReply(None, global_epoch=self.epoch, unknown=True)
        if self._stale(r.epoch, r.branch):
            self._stale_return(r.peer_id, r.epoch, r.branch)
            if self.membership.is_draining(r.peer_id) or (self.stop and not self.ready):
                return ProgressReply(None, stop=True, global_epoch=self.epoch)
            return ProgressReply(None, resync=True, global_epoch=self.epoch)
        self._note_branch(r.branch)
        self.hold(r.peer_id, r.epoch, now)
        if r.epoch > self.epoch and r.peer_id in self.ready:
            # A step planned before a Coordinator restart completed among its peers.
            self.membership.epoch = r.epoch
            self.plan = None
        self._put_report(r)
        if r.checksum is not None:
            seen = self._digests.setdefault(r.epoch, set())
            if not seen:  # a new epoch's first digest: forget the epochs long behind it
                floor = min(r.epoch, self.epoch) - DIGEST_EPOCHS
                for e in [e for e in self._digests if e < floor]:
                    del self._digests[e]
            seen.add(r.checksum)
        made = [self.quarantine.note(r.peer_id, *seen[:3], now, *seen[3:])
                for seen in r.saw_rejections]
        # the layout is O(N): read only when a dispute waits to be settled
        settled = (self.quarantine.settle(self.epoch, now, self._layout())
                   if self.quarantine.disputed else [])
        for q in [q for q in made if q is not None] + settled:
            self.ready.discard(q.peer_id)  # in no further plan; resyncs before it rejoins
            log.warning("quarantined %s: its contributions were rejected (%s) by others "
                        "%d times within %.0f s", q.peer_id, q.reason,
                        self.quarantine.threshold, self.quarantine.window_s)
        timing = self.timings.get(r.epoch)
        if timing is not None and timing.committed_at is None and r.peer_id in timing.participants:
            timing.committed_at = now
        if r.contributed is not None:
            self.step_samples.correct(self.history, r.peer_id, *r.contributed)
        nxt = self._next_plan(r.peer_id, r.epoch)  # the published plan it takes next
        if self.stop:
            # Finish a published step first, so no participant waits for a stopped peer.
            if r.peer_id in self.ready and nxt is not None:
                return ProgressReply(nxt, global_epoch=self.epoch)
            # A staying peer that fell behind (it missed a step, or was still joining)
            # copies the final state first, so every replica ends with the same parameters.
            behind = r.peer_id not in self.ready or r.epoch < self.epoch
            if behind and not self.membership.is_draining(r.peer_id) and \
                    any(p != r.peer_id for p in self.ready):
                self.ready.discard(r.peer_id)
                return ProgressReply(None, resync=True, global_epoch=self.epoch)
            return ProgressReply(None, stop=True, global_epoch=self.epoch)
        if self.membership.is_draining(r.peer_id):
            # Leaving (its node got a notice): finish a published step it is in, so nobody
            # waits for it, then stop training. It stays up as a donor until its deadline.
            if r.peer_id in self.ready and nxt is not None:
                return ProgressReply(nxt, global_epoch=self.epoch)
            return ProgressReply(None, stop=True, global_epoch=self.epoch)
        if r.peer_id in self._parked and not self._unpark(r, now):
            return ProgressReply(None, global_epoch=self.epoch)  # it waits, holding its state
        if r.peer_id not in self.ready:
            return ProgressReply(None, resync=True, global_epoch=self.epoch)
        if r.epoch < self.epoch and nxt is None:
            self.ready.discard(r.peer_id)  # it missed a step: must reload
            return ProgressReply(None, resync=True, global_epoch=self.epoch)
        if self._disagrees(r):
            self._diverged(r)
            return ProgressReply(None, resync=True, global_epoch=self.epoch)
        if r.epoch == self.epoch:
            self._record_loss(r)
            self._maybe_plan(now)
            nxt = self._next_plan(r.peer_id, r.epoch)
        if nxt is not None:
            return ProgressReply(nxt, global_epoch=self.epoch)
        return ProgressReply(None, global_epoch=self.epoch)

    def _layout(self) -> int | None:
        """The swarm's tensor length: the most common among ready peers' reports (a tie goes
        to the smallest peer id's); None if nobody reported one."""
        sizes: dict[int, list[str]] = {}
        for p, x in self.reports.items():
            if x.numel > 0 and p in self.ready:
                sizes.setdefault(x.numel, []).append(p)
        if not sizes:
            return None
        return min(sizes, key=lambda n: (-len(sizes[n]), min(sizes[n])))

    def _disagrees(self, r: ProgressReport) -> bool:
        """``r``'s digest loses to another held by ready peers at the same epoch: the
        digest with most holders wins; a tie goes to the digest held by the smallest peer
        id (deterministic, so a 1-vs-1 split resolves: exactly one side resyncs)."""
        if r.checksum is None or len(self._digests.get(r.epoch, ())) < 2:
            return False  # one digest was ever reported at this epoch: no vote to count
        holders: dict[str, list[str]] = {}
        for p, x in self.reports.items():
            if x.epoch == r.epoch and x.checksum is not None and p in self.ready:
                holders.setdefault(x.checksum, []).append(p)
        if len(holders) < 2:
            return False
        winner = min(holders, key=lambda c: (-len(holders[c]), min(holders[c])))
        return winner != r.checksum

    def _diverged(self, r: ProgressReport) -> None:
        """``r``'s peer lost the digest vote: out of the ready set (it resyncs from a donor
        at its next report), counted in ``diverged``."""
        self.ready.discard(r.peer_id)
        self.diverged.append((r.peer_id, r.epoch))
        log.warning("%s committed step %d with a digest the other replicas of that step do "
                    "not hold: it resyncs from a donor", r.peer_id, r.epoch)

    def _put_report(self, r: ProgressReport) -> None:
        """Keep ``r`` as its peer's latest report (the tally follows)."""
        self.reports[r.peer_id] = r
        self._refresh(r.peer_id)

    def _drop_report(self, peer_id: str) -> None:
        if self.reports.pop(peer_id, None) is not None:
            self._refresh(peer_id)

    def _record_loss(self, r: ProgressReport) -> None:
        if r.loss is not None and r.samples > 0:
            total, n = self._loss.get(r.epoch, (0.0, 0))
            self._loss[r.epoch] = (total + r.loss * r.samples, n + r.samples)

    def _maybe_plan(self, now: float) -> None:
        """Plan the next step if it is due (``step_due``) and nobody is waited for (a ready
        peer still applying the latest plan's step, within ``grace_s``; a joiner copying
        the state, ``join_wait``). O(1) but for the plan itself and the joiners."""
        if self.local_steps is None and \
                self._tally.at(self.epoch).samples < self.target_batch_size:
            # the eligible peers' samples at the epoch (a bound on the live ones') fall
            # short: not due
            self._full_since = None
            return
        eligible, current, finishing = self._standing(now)
        if not eligible:
            return
        if not due_by_counts(current.samples, current.micro, eligible,
                             self.target_batch_size, self.local_steps):
            self._full_since = None
            return
        if self._full_since is None:
            self._full_since = now
        if finishing and now - self._full_since < self.grace_s:
            return  # a ready peer is still applying the last step: give it a moment
        if any(join_wait(w, now, self.join_grace_s, self.join_cap_s)
               for w in self._joining.values()):
            return  # a joiner is copying the current state: let it in first
        self.plan_now(now)

    def _standing(self, now: float) -> tuple[int, AtEpoch, bool]:
        """``(eligible, current, finishing)``: how many peers are ready and live, the
        counts of those whose latest report is at the current epoch, and whether one of
        them takes part in the latest plan and still reports the epoch before it (it is
        applying that step). O(1) from the tally when every member was heard from within
        the TTL (always right after ``Membership.expire``), else counted over the members."""
        plan = self.plan
        if self.membership.within_ttl(now):
            if self._watching is not plan:  # a new plan: count its participants apart
                self._tally.watch(self.views_of(plan) if plan is not None else ())
                self._watching = plan
            finishing = plan is not None and self._tally.at(plan.epoch - 1).watched > 0
            return self._tally.count, self._tally.at(self.epoch), finishing
        live = {p.peer_id for p in self.membership.live(now)}
        eligible = [p for p in self.ready if p in live]
        current = [self.reports[p] for p in eligible
                   if p in self.reports and self.reports[p].epoch == self.epoch]
        finishing = any(p in self.reports and
                        self._next_plan(p, self.reports[p].epoch) is not None
                        for p in eligible)
        return len(eligible), AtEpoch(len(current), sum(r.samples for r in current),
                                      sum(r.micro for r in current)), finishing

    def idle(self, now: float) -> bool:
        """Some peer is ready and live, and every such peer reports at the current epoch:
        no step is in flight (O(1), see ``_standing``)."""
        eligible, current, _ = self._standing(now)
        return eligible > 0 and current.peers == eligible

    def plan_now(self, now: float, current: list[ProgressReport] | None = None,
                 empty_ok: bool = False) -> bool:
        """Publish the next epoch's plan over the ready live peers at the current epoch
        (``current``: their reports; default all of them), whatever their samples. Used when
        the batch is full, and at once after a notice or a lost peer (the swarm re-plans
        without the node). False if no peer is there to step with, or no sample unless
        ``empty_ok``: a replica takes a plan at its next micro-batch, so it steps with at
        least that one even when it had reported none (right after the step before)."""
        if current is None:
            live = {p.peer_id for p in self.membership.live(now)}
            current = [self.reports[p] for p in sorted(self.ready)
                       if p in live and p in self.reports and self.reports[p].epoch == self.epoch]
        # A peer whose digest lost the vote since its report was read takes no further
        # step on that state (it would carry the split into the next average).
        for r in [r for r in current if self._disagrees(r)]:
            self._diverged(r)
        current = [r for r in current if r.peer_id in self.ready]
        samples = sum(r.samples for r in current)
        if not current or (samples <= 0 and not empty_ok):
            return False
        at_epoch = tuple(r.peer_id for r in current)
        total, n = self._loss.pop(self.epoch, (0.0, 0))
        plan = self.membership.plan(now, at_epoch, self.branch)
        if plan is None:
            return False
        self.plan = plan
        self._unpushed = plan
        self._full_since = None
        while self.history and self.history[-1].epoch >= plan.epoch:
            # a plan nobody applied (the epoch fell back, e.g. after a restart): one row per
            # step of the swarm's lineage, the newest plan's
            self.history.pop()
        self.history.append(StepRecord(plan.epoch, now, samples, total / n if n else None,
                                       len(at_epoch)))
        self.step_samples.planned(plan.epoch, {r.peer_id: r.samples for r in current})
        self.timings[plan.epoch] = StepTiming(plan.epoch, now, tuple(plan.participants))
        while len(self.timings) > TIMINGS_KEEP:
            del self.timings[next(iter(self.timings))]
        return True
