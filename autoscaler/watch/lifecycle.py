"""A spot node's life as an explicit state machine: pure data, no Ray, no cloud.

::

    requested --> running --> noticed --> draining --> gone
        |            |  \\        ^  \\                   ^
        v            |   v       |   \\-----------------/   (died before the drain was done)
  launch_failed      |  at_risk -+
                     v     |
                    lost <-+          (hard loss: gone without a termination notice)

``TRANSITIONS`` is the table of allowed edges, each with the reason it exists; anything
else raises ``IllegalTransition`` naming the node, the edge and the allowed targets.
Every transition is kept in a timestamped ``history`` (wall-clock unix seconds, passed in
by the caller, so tests use plain numbers). The checking and the history are the shared
helper's (``cluster/state_machine.py``). Derived measurements are properties computed
from the history: notice -> draining, notice -> rebalanced (first round plan without the
node, reported by the Coordinator), and whether the node ended with or without notice.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field

from moshray.cluster.state_machine import IllegalTransition, Transition, TransitionTable


class NodeState(str, enum.Enum):
    REQUESTED = "requested"  # asked the cloud / Ray for it; not in the cluster yet
    RUNNING = "running"  # its raylet is in the cluster and its watcher polls
    AT_RISK = "at_risk"  # AWS rebalance recommendation: elevated risk, no deadline yet
    NOTICED = "noticed"  # a termination notice arrived; deadline known
    DRAINING = "draining"  # Coordinator excludes it, Ray schedules nothing new there
    GONE = "gone"  # left the cluster after a notice (or a planned drain)
    LAUNCH_FAILED = "launch_failed"  # never came up (capacity error, timeout)
    LOST = "lost"  # left the cluster without any termination notice (hard loss)

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL = frozenset({NodeState.GONE, NodeState.LAUNCH_FAILED, NodeState.LOST})

S = NodeState
# (from, to) -> why the edge exists. The only edges a node may take.
TRANSITIONS: dict[tuple[NodeState, NodeState], str] = {
    # The raylet registered with the GCS and the node's watcher started.
    (S.REQUESTED, S.RUNNING): "node joined the cluster",
    # The provider got a capacity/quota error, or the node never joined within its timeout.
    (S.REQUESTED, S.LAUNCH_FAILED): "launch failed",
    # The request was withdrawn before the node came up (scale-down, replaced by a retry).
    (S.REQUESTED, S.GONE): "request cancelled",
    # AWS rebalance recommendation: keep working, but expect a notice soon.
    (S.RUNNING, S.AT_RISK): "rebalance recommendation",
    # Termination notice (AWS instance-action, GCP preempted, simulated by trace replay).
    (S.RUNNING, S.NOTICED): "preemption notice",
    (S.AT_RISK, S.NOTICED): "preemption notice after a rebalance recommendation",
    # We decided to take the node away ourselves (scale-down): drained without a notice.
    (S.RUNNING, S.DRAINING): "planned drain",
    (S.AT_RISK, S.DRAINING): "planned drain of an at-risk node",
    # Coordinator told (its peers leave every later plan) and Ray asked to drain the node.
    (S.NOTICED, S.DRAINING): "drain requested",
    # The node left after its drain (at or before the deadline).
    (S.DRAINING, S.GONE): "left after drain",
    # The node went before the drain was carried out (a very short notice): still announced.
    (S.NOTICED, S.GONE): "left before the drain completed",
    # Gone with no termination notice at all: a hard kill, a crash, a missed notice.
    (S.RUNNING, S.LOST): "lost without notice",
    (S.AT_RISK, S.LOST): "lost without a termination notice (rebalance only)",
}
TABLE = TransitionTable("node", TRANSITIONS)

__all__ = ["IllegalTransition", "LifecycleSummary", "NodeLifecycle", "NodeState", "TABLE",
           "TERMINAL", "TRANSITIONS", "Transition", "summarize"]


@dataclass
class NodeLifecycle:
    """The life of one node: its current state and how it got there.

    Create with ``NodeLifecycle.start(node_id, at_s)`` (state ``requested``, or another
    initial state such as ``running`` for a node found already up). ``to(dst, at_s)``
    applies one edge; ``note_rebalanced(at_s)`` records when the Coordinator first published
    a plan without this node after its notice (an observation, not a state).
    """

    node_id: str
    history: list[Transition[NodeState]] = field(default_factory=list)
    rebalanced_at_s: float | None = None

    @classmethod
    def start(cls, node_id: str, at_s: float, state: NodeState = NodeState.REQUESTED,
              reason: str = "") -> "NodeLifecycle":
        if state not in (S.REQUESTED, S.RUNNING):
            raise IllegalTransition(f"node {node_id}: a life starts requested or running, "
                                    f"not {state.value}")
        life = cls(node_id)
        life.history.append(Transition(at_s, None, state, reason or
                                       ("requested" if state is S.REQUESTED else "found running")))
        return life

    @property
    def state(self) -> NodeState:
        return self.history[-1].dst

    def allowed(self) -> tuple[NodeState, ...]:
        """States reachable from the current one."""
        return TABLE.allowed(self.state)

    def can(self, dst: NodeState) -> bool:
        return (self.state, NodeState(dst)) in TRANSITIONS

    def to(self, dst: NodeState | str, at_s: float, reason: str = "") -> Transition[NodeState]:
        """Move to ``dst`` at ``at_s``; raises ``IllegalTransition`` for an edge not in the
        table and ``ValueError`` for a time that is not finite (nothing changes then).

        ``at_s`` earlier than the last transition is clamped to it (clocks of different
        processes may disagree by a little; history stays ordered).
        """
        return TABLE.step(self.node_id, self.history, self.state, NodeState(dst), at_s, reason)

    def note_rebalanced(self, at_s: float) -> None:
        """The first round plan without this node was published at ``at_s`` (kept once)."""
        if self.entered(S.NOTICED) is None and self.entered(S.DRAINING) is None:
            raise IllegalTransition(f"node {self.node_id}: rebalanced without a notice or drain")
        if self.rebalanced_at_s is None:
            self.rebalanced_at_s = at_s

    # derived measurements -------------------------------------------------------------------

    def entered(self, state: NodeState) -> float | None:
        """When the node first entered ``state`` (None if it never did)."""
        return next((t.at_s for t in self.history if t.dst is state), None)

    @property
    def terminal(self) -> bool:
        return self.state.terminal

    @property
    def noticed(self) -> bool:
        return self.entered(S.NOTICED) is not None

    @property
    def notice_to_draining_s(self) -> float | None:
        n, d = self.entered(S.NOTICED), self.entered(S.DRAINING)
        return None if n is None or d is None else d - n

    @property
    def notice_to_rebalanced_s(self) -> float | None:
        n = self.entered(S.NOTICED)
        if n is None or self.rebalanced_at_s is None:
            return None
        return max(0.0, self.rebalanced_at_s - n)

    @property
    def notice_to_gone_s(self) -> float | None:
        n, g = self.entered(S.NOTICED), self.entered(S.GONE)
        return None if n is None or g is None else g - n

    @property
    def lost_without_notice(self) -> bool:
        """A hard loss: the node left and no termination notice came first."""
        return self.state is S.LOST

    @property
    def left_with_notice(self) -> bool:
        return self.state is S.GONE and self.noticed


@dataclass(frozen=True)
class LifecycleSummary:
    """What the training job reports about node lives (``--json``: notices, hard_losses)."""

    nodes: int
    notices: int  # nodes that received a termination notice
    rebalance_recommendations: int
    gone_with_notice: int
    hard_losses: int  # nodes lost without a termination notice
    launch_failures: int
    notice_to_draining_s: tuple[float, ...]
    notice_to_rebalanced_s: tuple[float, ...]

    @property
    def rebalance_s_max(self) -> float | None:
        return max(self.notice_to_rebalanced_s, default=None)

    @property
    def draining_s_max(self) -> float | None:
        return max(self.notice_to_draining_s, default=None)


def summarize(lives: Iterable[NodeLifecycle]) -> LifecycleSummary:
    lives = list(lives)
    return LifecycleSummary(
        nodes=len(lives),
        notices=sum(life.noticed for life in lives),
        rebalance_recommendations=sum(life.entered(S.AT_RISK) is not None for life in lives),
        gone_with_notice=sum(life.left_with_notice for life in lives),
        hard_losses=sum(life.lost_without_notice for life in lives),
        launch_failures=sum(life.state is S.LAUNCH_FAILED for life in lives),
        notice_to_draining_s=tuple(x for life in lives
                                   if (x := life.notice_to_draining_s) is not None),
        notice_to_rebalanced_s=tuple(x for life in lives
                                     if (x := life.notice_to_rebalanced_s) is not None),
    )
