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
from dataclasses import dataclass, field

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
           "Transition", "path_between"]


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
