"""A training replica's life as the controller sees it: an explicit state machine, pure data.

::

    starting --> syncing --> training --> leaving --> gone
        |  \\        |  ^        |  \\_______________^  ^
        |   \\       v  |        |                     |
        |    \\---> leaving <----/                      |
        \\_________________ (died, failed, dropped) ____/

``TRANSITIONS`` is the table of allowed edges, each with the reason it exists; anything else
raises ``IllegalTransition``. Every transition is kept in a timestamped ``history`` (the
controller's monotonic clock, passed in, so tests use plain numbers). No Ray here: the
controller (``elastic.py``) observes, ``reconcile.py`` decides the transitions, and this
module only checks and records them, with the shared helper (``cluster/state_machine.py``).
"""

from __future__ import annotations

import enum
import statistics
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from moshray.cluster.state_machine import IllegalTransition, Transition, TransitionTable


class ReplicaState(str, enum.Enum):
    STARTING = "starting"  # actor asked for on its node; not yet a Coordinator member
    SYNCING = "syncing"  # registered; copying state from a donor (or a checkpoint)
    TRAINING = "training"  # ready: takes part in the steps
    LEAVING = "leaving"  # its node got a notice (or it is dropped): in no further plan
    GONE = "gone"  # ended: node lost, actor died or failed, or dropped

    @property
    def terminal(self) -> bool:
        return self is ReplicaState.GONE


S = ReplicaState
# (from, to) -> why the edge exists. The only edges a replica may take.
TRANSITIONS: dict[tuple[ReplicaState, ReplicaState], str] = {
    # The actor registered with the Coordinator and asks a donor for the state.
    (S.STARTING, S.SYNCING): "registered",
    # Its node got a notice before the actor registered.
    (S.STARTING, S.LEAVING): "node noticed while starting",
    # The actor could not be placed or raised in its constructor, or the node went; or
    # the controller stopped it (it did not start in time, its node got a notice).
    (S.STARTING, S.GONE): "failed to start",
    # The Coordinator accepted its state: it is in the next plan.
    (S.SYNCING, S.TRAINING): "ready",
    (S.SYNCING, S.LEAVING): "node noticed while syncing",
    # The node died (or the actor failed) during the state copy, or its node got a
    # notice (the controller stops a replica that is not ready yet).
    (S.SYNCING, S.GONE): "lost while syncing",
    # Told to resync (it missed a step or its state diverged).
    (S.TRAINING, S.SYNCING): "resync",
    # A preemption notice for its node, or the controller drops it (scale-down).
    (S.TRAINING, S.LEAVING): "node noticed or replica dropped",
    # Died with no notice (hard loss) or raised while its node stayed up.
    (S.TRAINING, S.GONE): "lost",
    # The node left at its deadline, or the replica stopped.
    (S.LEAVING, S.GONE): "left",
}


TABLE = TransitionTable("replica", TRANSITIONS)

__all__ = ["IllegalTransition", "ReplicaRecord", "ReplicaState", "TABLE", "TRANSITIONS",
           "Transition", "end_line", "path_between"]


@dataclass
class ReplicaRecord:
    """One replica the controller started: where it runs and what it went through.

    ``replica_id`` is also its Coordinator peer id. ``num_gpus`` is what Ray gave it.
    """

    replica_id: str
    node_id: str
    num_gpus: float
    started_at_s: float
    state: ReplicaState = ReplicaState.STARTING
    history: list[Transition[ReplicaState]] = field(default_factory=list)  # edges taken

    def to(self, dst: ReplicaState, at_s: float, reason: str = "") -> Transition[ReplicaState]:
        """Take the edge ``state -> dst`` at ``at_s``; raises ``IllegalTransition`` if not
        allowed (nothing changes then)."""
        step = TABLE.step(self.replica_id, self.history, self.state, dst, at_s, reason)
        self.state = dst
        return step


def path_between(src: ReplicaState, dst: ReplicaState) -> tuple[ReplicaState, ...]:
    """The states to pass through from ``src`` to ``dst`` (``dst`` last) along the shortest
    chain of allowed edges; () if ``dst`` is ``src`` or cannot be reached. Observations are
    periodic, so a replica may be seen two edges further on (starting, then training)."""
    return TABLE.path(src, dst)


def end_line(record: ReplicaRecord) -> str:
    """What the run says, once, when ``record`` has ended (its last edge is to ``gone``), in
    the run's words: how long it trained (seconds in ``training``), whether its node gave
    notice first (it passed through ``leaving``), and why it ended (the edge's reason). Pure.

    e.g. ``replica-1-3 left after 41 s of training (its node's notice; node lost)``,
    ``replica-2-5 lost after 12 s of training: no notice (node lost)``, ``replica-0-7 ended
    before it trained, 9 s after it started (node lost)``, ``replica-1-2 finished after 80 s
    of training``."""
    trained, since = 0.0, None
    for t in record.history:
        if since is not None and t.src is ReplicaState.TRAINING:
            trained += t.at_s - since
            since = None
        if t.dst is ReplicaState.TRAINING:
            since = t.at_s
    last = record.history[-1] if record.history else None
    reason = last.reason if last is not None and last.reason else "ended"
    ended_at = last.at_s if last is not None else record.started_at_s
    noticed = any(t.dst is ReplicaState.LEAVING for t in record.history)
    if not any(t.dst is ReplicaState.TRAINING for t in record.history):
        return (f"{record.replica_id} ended before it trained, "
                f"{ended_at - record.started_at_s:.0f} s after it started ({reason})")
    after = f"after {trained:.0f} s of training"
    if reason == "run finished":
        return f"{record.replica_id} finished {after}"
    if reason == "run raised":
        return f"{record.replica_id} failed {after} (its error is logged above)"
    if noticed:
        return f"{record.replica_id} left {after} (its node's notice; {reason})"
    return f"{record.replica_id} lost {after}: no notice ({reason})"


# -- what a run's replica starts came to (the run summary, bench goodput, bench chaos) ---


def join_seconds(timelines: dict[str, list]) -> list[float]:
    """Seconds from each replica's start to its first ``training`` state (replicas that
    never trained are left out)."""
    out = []
    for steps in timelines.values():
        start = steps[0][1]
        trained = [at for state, at in steps if state == "training"]
        if trained:
            out.append(round(trained[0] - start, 2))
    return out


@dataclass(frozen=True)
class ReplicaStarts:
    """The replicas a run started: ``trained`` of ``started`` reached training, after
    ``to_training_s`` seconds each (from the start); ``gone_untrained`` were gone first,
    after ``gone_untrained_s`` seconds of starting in all."""

    started: int
    to_training_s: tuple[float, ...]
    gone_untrained: int
    gone_untrained_s: float

    @property
    def trained(self) -> int:
        return len(self.to_training_s)

    def to_json(self) -> dict:
        waits = self.to_training_s
        return {"started": self.started, "trained": self.trained,
                "to_training_median_s": statistics.median(waits) if waits else None,
                "to_training_max_s": max(waits) if waits else None,
                "gone_untrained": self.gone_untrained,
                "gone_untrained_s": round(self.gone_untrained_s, 2)}

    def line(self) -> str:
        """``26 replicas started, 12 trained (start -> training median 14.0 s, max 18.6 s),
        14 gone before training (59.7 s of starting)``."""
        return starts_line(self.to_json())


def starts_line(figures: Mapping) -> str:
    """``ReplicaStarts.line`` from its JSON form (what a run summary holds)."""
    waits = (f" (start -> training median {figures['to_training_median_s']:.1f} s, "
             f"max {figures['to_training_max_s']:.1f} s)" if figures["trained"] else "")
    return (f"{figures['started']} replicas started, {figures['trained']} trained{waits}, "
            f"{figures['gone_untrained']} gone before training "
            f"({figures['gone_untrained_s']:.1f} s of starting)")


def replica_starts(timelines: Mapping[str, Sequence]) -> ReplicaStarts:
    """Summarize the controller's ``{replica: [(state, t_s), ...]}`` timelines (states in
    time order, the first one the start). A replica still starting at the end counts as
    started only. Raises nothing on an empty mapping (all counts 0)."""
    runs = {replica: steps for replica, steps in timelines.items() if steps}
    gone_s = [next(t for state, t in steps if state == "gone") - steps[0][1]
              for steps in runs.values()
              if not any(state == "training" for state, _ in steps)
              and any(state == "gone" for state, _ in steps)]
    return ReplicaStarts(len(runs), tuple(join_seconds(runs)), len(gone_s), sum(gone_s))
