"""The replica's side of the Coordinator protocol as an explicit state machine, and its one
plan-acceptance rule. Pure data: no Ray, no torch (``step_manager.py`` carries it out).

::

    joining --> syncing --> training <--> stepping        (a synchronous global step)
                   |          |  ^  \\
                   |          |  |   <--> overlapping     (averaging while the loop goes on)
                   |          |  |
                   |          v  |
                   |        resyncing                     (told to, or own rejections)
                   |          |
                   |          v
                   |        stopping                      (the Coordinator said stop)
                   \\___________________________________ --> closed (the loop ended)

Every phase can end in ``closed`` (the loop returned or raised). ``TRANSITIONS`` holds the
edges with why each exists; the shared helper (``cluster/state_machine.py``) rejects any
other edge and keeps the timestamped history.

``accept_plan(view, plan)`` is the only place that decides whether a plan is taken: when it
is pushed (``StepManager.receive_plan``), when the loop's micro-batch decides whether a
routine report is needed, and when the micro-batch takes the held plan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from moshray.cluster.state_machine import TransitionTable


class Phase(str, enum.Enum):
    JOINING = "joining"  # created; not registered with the Coordinator yet
    SYNCING = "syncing"  # registered; copying a donor's state (or the checkpoint)
    TRAINING = "training"  # ready: micro-batches accumulate, plans are taken
    STEPPING = "stepping"  # a synchronous global step: averaging and applying it
    OVERLAPPING = "overlapping"  # an overlapped step's averaging runs; the loop goes on
    RESYNCING = "resyncing"  # copying a donor's state again while the loop waits
    STOPPING = "stopping"  # the Coordinator said stop; the loop is ending
    CLOSED = "closed"  # the loop ended (returned or raised)


P = Phase
# (from, to) -> why the edge exists. The only edges the replica's protocol takes.
TRANSITIONS: dict[tuple[Phase, Phase], str] = {
    # ``start``: registered; heartbeats run from here so a restarted Coordinator hears of it.
    (P.JOINING, P.SYNCING): "registered",
    # The Coordinator accepted the copied state (``mark_ready``): the loop starts.
    (P.SYNCING, P.TRAINING): "ready",
    # A plan for the next step, taken at a micro-batch; the loop waits for the step.
    (P.TRAINING, P.STEPPING): "synchronous step",
    (P.STEPPING, P.TRAINING): "step committed",
    # A plan taken with an overlapping strategy: the averaging runs in the background.
    (P.TRAINING, P.OVERLAPPING): "overlapped step begun",
    (P.OVERLAPPING, P.TRAINING): "overlapped step applied",
    # The Coordinator said resync (a missed step, a diverged digest), or too many of this
    # replica's own contributions were rejected in a row.
    (P.TRAINING, P.RESYNCING): "resync",
    (P.RESYNCING, P.TRAINING): "ready again",
    # The job is ending: the loop's ``batches()`` stops at the next batch.
    (P.TRAINING, P.STOPPING): "stop",
    # The loop returned or raised, whatever it was doing (a failed sync, a step that
    # raised, the user's own error).
    (P.JOINING, P.CLOSED): "loop ended before joining",
    (P.SYNCING, P.CLOSED): "loop ended while syncing",
    (P.TRAINING, P.CLOSED): "loop ended",
    (P.STEPPING, P.CLOSED): "loop ended in a step",
    (P.OVERLAPPING, P.CLOSED): "loop ended in an overlapped step",
    (P.RESYNCING, P.CLOSED): "loop ended while resyncing",
    (P.STOPPING, P.CLOSED): "stopped",
}
TABLE = TransitionTable("replica protocol", TRANSITIONS)

COPYING = frozenset({P.SYNCING, P.RESYNCING})  # the state is being replaced by a donor's
LOOP_RUNS = frozenset({P.TRAINING, P.STEPPING, P.OVERLAPPING, P.RESYNCING, P.STOPPING})


class PlanAction(str, enum.Enum):
    STEP = "step"  # run it as a synchronous global step at the next micro-batch
    OVERLAP = "overlap"  # begin its averaging at the next micro-batch; the loop goes on
    REJECT = "reject"


class PlanRejection(str, enum.Enum):
    NOT_JOINED = "not_joined"  # no state yet
    BUSY = "step_in_flight"  # a step is being averaged or applied
    STALE = "stale"  # for a step this replica already holds
    AHEAD = "ahead"  # skips a step this replica does not hold (the Coordinator resyncs it)
    ENDED = "ended"  # stopping or closed


@dataclass(frozen=True)
class ReplicaView:
    """What the plan rule looks at: the protocol's ``phase``, the ``epoch`` of the state
    held (global steps applied) and whether the step strategy ``overlap``\\s its averaging."""

    phase: Phase
    epoch: int
    overlap: bool


@dataclass(frozen=True)
class PlanDecision:
    action: PlanAction
    rejection: PlanRejection | None = None

    @property
    def take(self) -> bool:
        return self.action is not PlanAction.REJECT


def accept_plan(view: ReplicaView, plan) -> PlanDecision:
    """Whether a replica in ``view`` takes ``plan`` (anything with an ``epoch``: the
    ``PeerPlan`` the Coordinator sends), and how.

    Taken: the plan for the step right after the state held (``view.epoch + 1``), while
    training or while a copy of a donor's state is being made (the Coordinator may plan the
    step right after marking the replica ready, before its reply arrives: the plan is held
    and checked again by the micro-batch that would take it). Rejected, with the reason:
    before joining, after stopping, while a step is in flight, for a step already held or
    one that skips a step. Pure; never raises."""
    if view.phase is P.JOINING:
        return PlanDecision(PlanAction.REJECT, PlanRejection.NOT_JOINED)
    if view.phase in (P.STOPPING, P.CLOSED):
        return PlanDecision(PlanAction.REJECT, PlanRejection.ENDED)
    if view.phase in (P.STEPPING, P.OVERLAPPING):
        return PlanDecision(PlanAction.REJECT, PlanRejection.BUSY)
    if plan.epoch <= view.epoch:
        return PlanDecision(PlanAction.REJECT, PlanRejection.STALE)
    if plan.epoch > view.epoch + 1:
        return PlanDecision(PlanAction.REJECT, PlanRejection.AHEAD)
    return PlanDecision(PlanAction.OVERLAP if view.overlap else PlanAction.STEP)
