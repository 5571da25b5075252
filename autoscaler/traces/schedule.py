"""Spot-trace schedules: a parsed ``Trace`` mapped onto the slots of a local cluster.

Contract: ``schedule(trace, ...) -> tuple[NodeEvent, ...]`` maps trace time onto wall
time, scales the count down to the slots one machine can host and emits add/remove
events per slot; ``with_notices`` adds a spot notice ahead of each removal;
``initial_slots`` and ``live_node_seconds`` read a schedule. Pure and deterministic:
no Ray, no clock. ``trace_replay.py`` applies a schedule on the wall clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from moshray.autoscaler.traces.parse import NodeKind, Trace


@dataclass(frozen=True)
class NodeEvent:
    """One scheduled change of a local node slot.

    ``at_s`` is wall-clock seconds after replay start (already time-scaled);
    events with ``at_s == 0`` describe the nodes present when the replay starts.
    ``slot`` is the local node slot, ``0 <= slot < max_nodes``.
    """

    at_s: float
    kind: NodeKind
    slot: int



def scale_count(count: int, max_count: int, max_nodes: int, min_nodes: int = 1) -> int:
    """``round(count * max_nodes / max_count)`` (halves round up), clamped to [min_nodes, max_nodes].

    An all-empty trace (``max_count == 0``) maps to ``min_nodes``.
    """
    if max_count <= 0:
        scaled = 0
    else:
        # exact integer half-up rounding; float round() is banker's and inexact
        scaled = (2 * count * max_nodes + max_count) // (2 * max_count)
    return max(min_nodes, min(max_nodes, scaled))


class _Slots:
    """Slot bookkeeping for ``schedule``: which slots are live, in add order, and who holds them."""

    def __init__(self) -> None:
        self.order: list[int] = []  # live slots, oldest first (LIFO removal pops the end)
        self.holder: dict[int, str | None] = {}  # slot -> trace node name, None if anonymous

    def add(self, holder: str | None) -> int:
        slot = 0
        while slot in self.holder:  # lowest free slot; keeps slots in 0..max_nodes-1
            slot += 1
        self.order.append(slot)
        self.holder[slot] = holder
        return slot

    def remove(self, slot: int) -> None:
        self.order.remove(slot)
        del self.holder[slot]

    def slot_of(self, node: str) -> int | None:
        for s, h in self.holder.items():
            if h == node:
                return s
        return None

    def victim(self) -> int:
        """Slot to drop when the count falls without a named node: anonymous first, then LIFO."""
        for s in reversed(self.order):
            if self.holder[s] is None:
                return s
        return self.order[-1]


def schedule(
    trace: Trace,
    time_scale: float,
    max_nodes: int,
    duration_s: float | None = None,
    start_s: float | None = None,
    min_nodes: int = 1,
) -> tuple[NodeEvent, ...]:
    """Turn a trace into per-slot add/remove events on the wall clock.

    Args:
        trace: the parsed trace.
        time_scale: trace seconds per wall second (60 -> one trace hour per wall minute).
        max_nodes: local slots available; counts are scaled so ``trace.max_count``
            maps to ``max_nodes`` (see :func:`scale_count`).
        duration_s: wall seconds to schedule; events with ``at_s > duration_s``
            are dropped. ``None`` = to the end of the trace.
        start_s: trace second that maps to wall 0; the trace state at that time
            (events at exactly ``start_s`` included) becomes the initial nodes.
            ``None`` (default) = :meth:`Trace.first_nonzero_s`, i.e. skip the
            leading period with no capacity. Pass ``0.0`` to replay it.
        min_nodes: lower clamp of the scaled count (the replay never drops below it).

    Returns:
        Events sorted by ``at_s``; at equal times removals come before adds.
        Events at ``at_s == 0`` add the initial slots ``0..n-1``. After every
        batch of events at one time the number of live slots equals the scaled
        trace count at the corresponding trace time. The result is deterministic.

    Slot choice: a count trace removes the most recently added slot (LIFO). A
    per-node trace gives each slot to a trace node; when the trace removes a node
    that holds a slot, that slot is removed (and a replacement added at the same
    time if the scaled count did not fall). A fall with no slot-holding node
    removed drops an anonymous slot first, then LIFO. Adds take the lowest free
    slot, given to nodes added at that time first, then to live nodes without a slot.

    Raises:
        ValueError: ``time_scale <= 0``, ``max_nodes < 1``,
            ``min_nodes`` outside ``[0, max_nodes]``, negative ``duration_s``
            or ``start_s``.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    if max_nodes < 1:
        raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
    if not 0 <= min_nodes <= max_nodes:
        raise ValueError(f"min_nodes must be in [0, max_nodes={max_nodes}], got {min_nodes}")
    if duration_s is not None and duration_s < 0:
        raise ValueError(f"duration_s must be >= 0, got {duration_s}")
    if start_s is None:
        start_s = trace.first_nonzero_s()
    if start_s < 0:
        raise ValueError(f"start_s must be >= 0, got {start_s}")

    max_count = trace.max_count

    def target(count: int) -> int:
        return scale_count(count, max_count, max_nodes, min_nodes)

    slots = _Slots()
    out: list[NodeEvent] = []
    # Trace nodes live right now, oldest first (per-node traces only).
    live_nodes: list[str] = []

    def fill(at: float, want: int, fresh: list[str]) -> None:
        while len(slots.order) < want:
            # a node added and removed in the same batch is in `fresh` but not live
            unslotted = [n for n in fresh + live_nodes if n in live_nodes and slots.slot_of(n) is None]
            holder = unslotted[0] if unslotted else None
            out.append(NodeEvent(at, "add", slots.add(holder)))

    def drain(at: float, want: int) -> None:
        while len(slots.order) > want:
            s = slots.victim()
            slots.remove(s)
            out.append(NodeEvent(at, "remove", s))

    if trace.per_node:
        # Initial state: nodes live at start_s, in add order.
        for ev in trace.node_events:
            if ev.at_s > start_s:
                break
            if ev.kind == "add":
                live_nodes.append(ev.node)
            else:
                live_nodes.remove(ev.node)
        fill(0.0, target(len(live_nodes)), [])
        later = [ev for ev in trace.node_events if ev.at_s > start_s]
        i = 0
        while i < len(later):
            t = later[i].at_s
            batch = []
            while i < len(later) and later[i].at_s == t:
                batch.append(later[i])
                i += 1
            at = (t - start_s) / time_scale
            if duration_s is not None and at > duration_s:
                break
            added = [ev.node for ev in batch if ev.kind == "add"]
            for ev in batch:
                if ev.kind != "add":  # remove (with notice) or kill (without)
                    live_nodes.remove(ev.node)
                    s = slots.slot_of(ev.node)
                    if s is not None:
                        slots.remove(s)
                        out.append(NodeEvent(at, ev.kind, s))
                else:
                    live_nodes.append(ev.node)
            want = target(len(live_nodes))
            drain(at, want)
            fill(at, want, added)
    else:
        fill(0.0, target(trace.live_at(start_s)), [])
        for t, c in trace.points:
            if t <= start_s:
                continue
            at = (t - start_s) / time_scale
            if duration_s is not None and at > duration_s:
                break
            want = target(c)
            drain(at, want)
            fill(at, want, [])

    # Already in time order; within one time removals precede adds by construction.
    return tuple(out)


def initial_slots(events: Iterable[NodeEvent]) -> tuple[int, ...]:
    """Slots added at ``at_s == 0`` (the nodes a caller should start before replaying)."""
    return tuple(e.slot for e in events if e.at_s == 0 and e.kind == "add")


def live_node_seconds(events: Iterable[NodeEvent], duration_s: float, initial: int = 0) -> float:
    """Integral of the live node count over wall ``[0, duration_s]``.

    ``initial`` is the count before any event (0 if the schedule's t=0 adds
    describe the initial nodes, as :func:`schedule` produces). Events after
    ``duration_s`` are ignored; the count holds from the last event to
    ``duration_s``. Raises ValueError if the count would go negative.
    """
    total = 0.0
    live = initial
    prev = 0.0
    for ev in sorted(events, key=lambda e: e.at_s):
        if ev.at_s > duration_s:
            break
        t = max(ev.at_s, 0.0)
        total += live * (t - prev)
        prev = t
        live += 1 if ev.kind == "add" else -1
        if live < 0:
            raise ValueError(f"live count goes negative at t={ev.at_s} (slot {ev.slot})")
    total += live * max(duration_s - prev, 0.0)
    return total


def with_notices(events: Iterable[NodeEvent], notice_s: float) -> tuple[NodeEvent, ...]:
    """``events`` plus a ``notice`` event ``notice_s`` before each ``remove`` (not before
    0, and not before the slot's previous event, so a notice never precedes the node's add).

    A ``kill`` gets none: it is a loss without notice. Raises ``ValueError`` for a negative
    or non-finite ``notice_s``. Sorted by time; a notice clamped to its slot's add comes right after it.
    """
    if not math.isfinite(notice_s) or notice_s < 0:
        raise ValueError(f"notice_s must be a finite number >= 0, got {notice_s!r}")
    ordered = sorted(events, key=lambda e: e.at_s)
    out: list[NodeEvent] = []
    last_at: dict[int, float] = {}
    for ev in ordered:
        if ev.kind == "remove":
            at = max(ev.at_s - notice_s, last_at.get(ev.slot, 0.0), 0.0)
            out.append(NodeEvent(at, "notice", ev.slot))
        out.append(ev)
        last_at[ev.slot] = ev.at_s
    return tuple(sorted(out, key=lambda e: e.at_s))  # stable: a clamped notice follows its add
