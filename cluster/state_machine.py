"""One small helper for the explicit state machines: a table of allowed edges, a checked
step, and a timestamped history. Pure data: no Ray, no clock of its own.

Three machines use it: a spot node's life (``autoscaler/watch/lifecycle.py``), a replica as
the controller sees it (``jobs/controller/replica_states.py``) and the replica's own side of
the Coordinator protocol (``actors/replica/step_manager.py``). Each declares its states as
an ``enum.Enum`` and its edges as a ``TransitionTable`` (``(src, dst) -> why the edge
exists``); ``TransitionTable.step`` checks one edge and appends it to a history; anything
not in the table raises ``IllegalTransition`` naming the subject, the edge and what is
allowed from the current state. Times are whatever clock the caller passes (unix seconds
for nodes, a monotonic clock for replicas), so tests use plain numbers.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, MutableSequence
from dataclasses import dataclass
from typing import Generic, TypeVar

E = TypeVar("E", bound=enum.Enum)


class IllegalTransition(ValueError):
    """An edge not in the machine's table. Pickles cleanly (one string argument)."""


@dataclass(frozen=True)
class Transition(Generic[E]):
    """One step of a machine: ``src -> dst`` at ``at_s`` (the caller's clock), with a
    reason. ``src`` is None for the state a history starts in."""

    at_s: float
    src: E | None
    dst: E
    reason: str


class TransitionTable(Generic[E]):
    """The allowed edges of one machine, each with the reason it exists.

    ``kind`` names the machine's subjects in errors (``"node"``, ``"replica"``). Raises
    ``ValueError`` at construction for an edge without a reason or between two enums."""

    def __init__(self, kind: str, edges: Mapping[tuple[E, E], str]):
        for (src, dst), why in edges.items():
            if not why or type(src) is not type(dst):
                raise ValueError(f"{kind} transitions: edge {src} -> {dst} needs a reason "
                                 "and states of one enum")
        self.kind = kind
        self.edges: dict[tuple[E, E], str] = dict(edges)

    def __contains__(self, edge: tuple[E, E]) -> bool:
        return edge in self.edges

    def __iter__(self):
        return iter(self.edges)

    def allowed(self, src: E) -> tuple[E, ...]:
        """The states reachable from ``src`` in one edge, in table order."""
        return tuple(dst for (s, dst) in self.edges if s is src)

    def reason(self, subject: str, src: E, dst: E) -> str:
        """Why ``src -> dst`` exists; ``IllegalTransition`` if it does not."""
        why = self.edges.get((src, dst))
        if why is None:
            allowed = ", ".join(s.value for s in self.allowed(src)) or "none (terminal)"
            raise IllegalTransition(f"{self.kind} {subject}: {src.value} -> {dst.value} is "
                                    f"not allowed (from {src.value}: {allowed})")
        return why

    def step(self, subject: str, history: MutableSequence[Transition[E]], src: E, dst: E,
             at_s: float, reason: str = "") -> Transition[E]:
        """Check ``src -> dst`` and append it to ``history`` (the subject's, oldest first).

        ``reason`` defaults to the edge's own. ``at_s`` earlier than the last entry is
        clamped to it (clocks of different processes may disagree by a little; the
        history stays ordered). Raises ``IllegalTransition`` for an edge not in the table
        and ``ValueError`` for a time that is not finite; either way nothing is appended."""
        why = self.reason(subject, src, dst)
        if not math.isfinite(at_s):
            raise ValueError(f"{self.kind} {subject}: transition time must be finite, "
                             f"got {at_s}")
        if history:
            at_s = max(at_s, history[-1].at_s)
        t = Transition(at_s, src, dst, reason or why)
        history.append(t)
        return t

    def path(self, src: E, dst: E) -> tuple[E, ...]:
        """The states to pass through from ``src`` to ``dst`` (``dst`` last) along the
        shortest chain of allowed edges; () if ``dst`` is ``src`` or cannot be reached."""
        if dst is src:
            return ()
        frontier: list[tuple[E, ...]] = [(src,)]
        seen = {src}
        while frontier:
            nxt = []
            for chain in frontier:
                for b in self.allowed(chain[-1]):
                    if b is dst:
                        return chain[1:] + (b,)
                    if b not in seen:
                        seen.add(b)
                        nxt.append(chain + (b,))
            frontier = nxt
        return ()


class StateMachine(Generic[E]):
    """A subject's current state and how it got there, for a machine that owns its clock.

    ``clock`` gives the time of each transition (inject a fake one in tests); ``keep``
    bounds the history to the newest entries (a replica takes a transition per step: an
    unbounded history would grow for the whole run). The first entry (``src`` None) is the
    initial state, kept while the history is within ``keep``."""

    def __init__(self, table: TransitionTable[E], subject: str, initial: E,
                 clock: Callable[[], float], keep: int | None = None, reason: str = "created"):
        self.table, self.subject, self._clock = table, subject, clock
        self.history: deque[Transition[E]] = deque(maxlen=keep)
        self.history.append(Transition(clock(), None, initial, reason))

    @property
    def state(self) -> E:
        return self.history[-1].dst

    def is_in(self, states: Iterable[E]) -> bool:
        return self.state in tuple(states)

    def can(self, dst: E) -> bool:
        return (self.state, dst) in self.table

    def to(self, dst: E, reason: str = "") -> Transition[E]:
        """Take ``state -> dst`` now; ``IllegalTransition`` (nothing changes) if the table
        has no such edge."""
        return self.table.step(self.subject, self.history, self.state, dst, self._clock(),
                               reason)
