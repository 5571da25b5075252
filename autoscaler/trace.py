"""Spot-availability traces: parse, scale onto a local cluster, replay.

Pure logic, no Ray. Three layers, each testable with plain data:

1. ``load_trace(path) -> Trace``: parse a trace file into a step function of the
   live instance count (trace seconds, original counts), keeping per-node identity
   when the file has it.
2. ``schedule(trace, ...) -> tuple[NodeEvent, ...]``: map trace time onto wall
   time, scale the count down to the slots one machine can host and emit
   add/remove events per slot.
3. ``TraceReplayer``: apply a schedule at the right wall times through injected
   ``add_node(slot)`` / ``remove_node(slot)`` callables and an injected clock.

Accepted file formats (auto-detected from the first data row; blank lines and
lines starting with ``#`` are ignored; an optional header row is accepted if it
names the columns below):

* count format, ``seconds_since_start,available_instances``: a step function;
  two rows with the same time mark a change (the last row at a time wins).
* per-node event format, ``timestamp_ms,action,node_id``: ``action`` is ``add``,
  ``remove`` (a preemption with notice) or ``kill`` (a hard loss: no notice, the node's
  processes die at once); time in milliseconds since trace start.

Anything else raises :class:`TraceError` naming the file, the line and what was
expected.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Literal

log = logging.getLogger(__name__)

# remove: with notice; kill: without; notice: the spot notice ahead of a remove (only in
# schedules passed through with_notices, never in a parsed trace)
NodeKind = Literal["add", "remove", "kill", "notice"]

# Header rows we accept (lower-cased, stripped). Anything else non-numeric in the
# first data row is rejected rather than guessed at.
_COUNT_HEADERS = {
    ("seconds_since_start", "available_instances"),
    ("seconds", "count"),
    ("time_s", "count"),
}
_EVENT_HEADERS = {
    ("timestamp_ms", "action", "node_id"),
    ("ms", "action", "node"),
    ("time_ms", "action", "node"),
}
_COUNT_EXPECTED = "`seconds_since_start,available_instances` (number >= 0, integer >= 0)"
_EVENT_EXPECTED = "`timestamp_ms,add|remove|kill,node_id` (number >= 0, action, non-empty name)"


class TraceError(ValueError):
    """A trace file is malformed. The message is one line: ``file:line: problem``."""


@dataclass(frozen=True)
class TraceNodeEvent:
    """One row of a per-node trace: node ``node`` was added/removed at ``at_s``.

    ``at_s`` is in trace seconds (the file's milliseconds / 1000).
    """

    at_s: float
    kind: NodeKind
    node: str


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


@dataclass(frozen=True)
class Trace:
    """A parsed availability trace.

    ``points`` is the step function ``(trace_seconds, live_count)``: strictly
    increasing times, the first at ``0.0`` (a leading ``(0.0, 0)`` is inserted if
    the file starts later), each count holds until the next point. Consecutive
    counts differ, except that the last point may repeat the previous count to
    mark the end of the trace. ``node_events`` holds the per-node rows of a
    per-node trace (empty for a count trace).
    """

    name: str
    points: tuple[tuple[float, int], ...]
    node_events: tuple[TraceNodeEvent, ...] = ()

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("Trace.points must not be empty")
        times = [t for t, _ in self.points]
        if any(b <= a for a, b in zip(times, times[1:])):
            raise ValueError("Trace.points times must be strictly increasing")
        if any(c < 0 for _, c in self.points):
            raise ValueError("Trace.points counts must be >= 0")

    @property
    def duration_s(self) -> float:
        """Trace seconds from the start (0) to the last recorded row."""
        return self.points[-1][0]

    @property
    def max_count(self) -> int:
        """The largest live count in the trace (0 for an all-empty trace)."""
        return max(c for _, c in self.points)

    @property
    def per_node(self) -> bool:
        """True if the trace carries node identities (per-node event format)."""
        return bool(self.node_events)

    def first_nonzero_s(self) -> float:
        """Trace time at which capacity first appears; 0.0 if it never does."""
        for t, c in self.points:
            if c > 0:
                return t
        return 0.0

    def live_at(self, t: float) -> int:
        """Live count at trace time ``t``; 0 before the start, the last count after the end."""
        count = 0
        for pt, c in self.points:
            if pt > t:
                break
            count = c
        return count


# --------------------------------------------------------------------------- parsing


def _fail(path: Path, lineno: int, what: str) -> TraceError:
    return TraceError(f"{path}:{lineno}: {what}")


def _show(line: str) -> str:
    s = line if len(line) <= 80 else line[:77] + "..."
    return repr(s)  # repr keeps the message on one line


def _parse_time(raw: str) -> float | None:
    try:
        v = float(raw)
    except ValueError:
        return None
    return v if math.isfinite(v) and v >= 0 else None


def _parse_count(raw: str) -> int | None:
    try:
        v = int(raw)
    except ValueError:
        return None
    return v if v >= 0 else None


def _is_number(raw: str) -> bool:
    try:
        float(raw)
    except ValueError:
        return False
    return True


def _rows(path: Path) -> Iterable[tuple[int, str, list[str]]]:
    """(line number, raw line, stripped fields) for every non-blank, non-comment line."""
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            raw = line.rstrip("\r\n")
            s = raw.strip()
            if not s or s.startswith("#"):
                continue
            yield lineno, raw, [x.strip() for x in s.split(",")]


SHIPPED_DIR = Path(__file__).with_name("traces")
DEFAULT_TRACE = "aws-g4dn-xlarge-us-east-1c-2020-11-20"


def shipped_traces() -> tuple[str, ...]:
    """Names of the traces that ship with moshray (file names without ``.csv``)."""
    return tuple(sorted(p.stem for p in SHIPPED_DIR.glob("*.csv")))


def resolve_trace(name_or_path: str) -> Path:
    """A shipped trace by name (``DEFAULT_TRACE``...), else the path as given. Raises
    ``TraceError`` (one line, listing the shipped names) when neither exists."""
    shipped = SHIPPED_DIR / f"{name_or_path}.csv"
    if "/" not in name_or_path and shipped.is_file():
        return shipped
    path = Path(name_or_path).expanduser()
    if path.is_file():
        return path
    raise TraceError(f"trace {name_or_path!r} is neither a file nor a shipped trace "
                     f"({', '.join(shipped_traces())})")


def load_trace(path: str | Path) -> Trace:
    """Parse a trace file, auto-detecting count vs per-node event format.

    The format is decided by the first data row (or header): 2 columns = count,
    3 columns = per-node events. Every later row must have the same shape.

    Raises:
        TraceError: unreadable shape, unknown header, negative or non-numeric
            time, non-integer or negative count, unknown action, time going
            backwards, a node added twice or removed while not live, or no data
            rows. The message names the file and line number.
        OSError: the file cannot be read.

    ``path`` may also name a shipped trace (see ``resolve_trace``).
    """
    path = resolve_trace(str(path))
    path = Path(path)
    rows = iter(_rows(path))
    first = next(rows, None)
    if first is None:
        raise _fail(path, 1, f"no data rows; expected {_COUNT_EXPECTED} or {_EVENT_EXPECTED}")
    lineno, raw, fields = first
    header = tuple(x.lower() for x in fields)
    if _is_number(fields[0]):
        body = [first]
        n_cols = len(fields)
    elif header in _COUNT_HEADERS:
        body, n_cols = [], 2
    elif header in _EVENT_HEADERS:
        body, n_cols = [], 3
    else:
        raise _fail(
            path,
            lineno,
            f"unknown header or row {_show(raw)}; expected {_COUNT_EXPECTED} or {_EVENT_EXPECTED}",
        )
    body.extend(rows)
    if not body:
        raise _fail(path, lineno, "header but no data rows")
    if n_cols == 2:
        return _parse_counts(path, body)
    if n_cols == 3:
        return _parse_events(path, body)
    raise _fail(
        path,
        lineno,
        f"{n_cols} columns in {_show(raw)}; expected {_COUNT_EXPECTED} or {_EVENT_EXPECTED}",
    )


def _parse_counts(path: Path, body: list[tuple[int, str, list[str]]]) -> Trace:
    by_time: list[tuple[float, int]] = []  # last row per distinct time, in file order
    for lineno, raw, fields in body:
        if len(fields) != 2:
            raise _fail(path, lineno, f"{len(fields)} columns in {_show(raw)}; expected {_COUNT_EXPECTED}")
        t, c = _parse_time(fields[0]), _parse_count(fields[1])
        if t is None or c is None:
            raise _fail(path, lineno, f"bad row {_show(raw)}; expected {_COUNT_EXPECTED}")
        if by_time and t < by_time[-1][0]:
            raise _fail(path, lineno, f"time {t:g} goes backwards (previous {by_time[-1][0]:g}); expected non-decreasing times")
        if by_time and t == by_time[-1][0]:
            by_time[-1] = (t, c)
        else:
            by_time.append((t, c))
    return Trace(name=path.stem, points=_step_points(by_time))


def _parse_events(path: Path, body: list[tuple[int, str, list[str]]]) -> Trace:
    events: list[TraceNodeEvent] = []
    live: set[str] = set()
    by_time: list[tuple[float, int]] = []
    last_ms = -1.0
    for lineno, raw, fields in body:
        if len(fields) != 3:
            raise _fail(path, lineno, f"{len(fields)} columns in {_show(raw)}; expected {_EVENT_EXPECTED}")
        ms, action, node = _parse_time(fields[0]), fields[1].lower(), fields[2]
        if ms is None:
            raise _fail(path, lineno, f"bad time in {_show(raw)}; expected {_EVENT_EXPECTED}")
        if action not in ("add", "remove", "kill"):
            raise _fail(path, lineno, f"unknown action {fields[1]!r}; expected `add`, `remove` or `kill`")
        if not node:
            raise _fail(path, lineno, f"empty node name in {_show(raw)}; expected {_EVENT_EXPECTED}")
        if ms < last_ms:
            raise _fail(path, lineno, f"time {ms:g} ms goes backwards (previous {last_ms:g} ms); expected non-decreasing times")
        if action == "add" and node in live:
            raise _fail(path, lineno, f"node {node!r} added while already live; expected a remove first")
        if action != "add" and node not in live:
            raise _fail(path, lineno, f"node {node!r} removed while not live; expected an add first")
        last_ms = ms
        t = ms / 1000.0
        (live.add if action == "add" else live.discard)(node)
        events.append(TraceNodeEvent(at_s=t, kind=action, node=node))  # type: ignore[arg-type]
        if by_time and by_time[-1][0] == t:
            by_time[-1] = (t, len(live))
        else:
            by_time.append((t, len(live)))
    return Trace(name=path.stem, points=_step_points(by_time), node_events=tuple(events))


def _step_points(by_time: list[tuple[float, int]]) -> tuple[tuple[float, int], ...]:
    """Collapse (time, count) rows with distinct increasing times into change points.

    Keeps a leading (0, 0) if the first row is later than 0, and keeps the last
    row as the end marker even when its count did not change.
    """
    pts: list[tuple[float, int]] = []
    if by_time[0][0] > 0:
        pts.append((0.0, 0))
    for t, c in by_time:
        if not pts or c != pts[-1][1]:
            pts.append((t, c))
    end_t = by_time[-1][0]
    if pts[-1][0] != end_t:
        pts.append((end_t, pts[-1][1]))
    return tuple(pts)


# -------------------------------------------------------------------------- schedule


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


# -------------------------------------------------------------------------- replayer


@dataclass(frozen=True)
class ReplayError:
    """A callable failed while applying ``event`` at wall ``wall_s`` (relative to replay start)."""

    wall_s: float
    event: NodeEvent
    error: str


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


class TraceReplayer:
    """Apply a schedule at its wall times through injected callables.

    ``add_node(slot)`` / ``remove_node(slot)`` carry out the events; ``clock``
    and ``sleep`` are injectable so tests can run on a fake clock. Time is
    measured from the moment :meth:`run` starts. Late events (the loop fell
    behind) are applied at once, in order.

    Failure behaviour: an exception from a callable is logged and recorded in
    :attr:`errors`; the replay continues with the next event. ``history`` lists
    every attempted event as ``(wall_s, event)``, failed ones included.
    """

    def __init__(
        self,
        events: Iterable[NodeEvent],
        add_node: Callable[[int], None],
        remove_node: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        *,
        skip_initial: bool = False,
        max_sleep_s: float = 0.25,
        kill_node: Callable[[int], None] | None = None,
        notice_node: Callable[[int], None] | None = None,
    ) -> None:
        """``skip_initial``: do not apply the ``at_s == 0`` adds (the caller already
        started those nodes, see :func:`initial_slots`). ``max_sleep_s`` bounds one
        sleep so a stop request is noticed within that time. ``kill_node`` carries out
        ``kill`` events (hard losses); without it they go to ``remove_node``. ``notice_node``
        carries out ``notice`` events (see :func:`with_notices`); without it they are skipped."""
        self.events: tuple[NodeEvent, ...] = tuple(sorted(events, key=lambda e: e.at_s))
        self._add = add_node
        self._remove = remove_node
        self._kill = kill_node or remove_node
        self._notice = notice_node or (lambda slot: None)
        self._clock = clock
        self._sleep = sleep
        self._skip_initial = skip_initial
        self._max_sleep_s = max_sleep_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._history: list[tuple[float, NodeEvent]] = []
        self._errors: list[ReplayError] = []

    @property
    def history(self) -> tuple[tuple[float, NodeEvent], ...]:
        """Attempted events as ``(wall seconds since run start, event)``, in order."""
        return tuple(self._history)

    @property
    def errors(self) -> tuple[ReplayError, ...]:
        """Events whose callable raised, with the error text."""
        return tuple(self._errors)

    def run(self, stop: threading.Event | None = None) -> None:
        """Apply every event at its time; return when done or when ``stop`` (or :meth:`stop`) is set.

        Never raises because of a callable; see the class docstring.
        """

        def stopped() -> bool:
            return self._stop.is_set() or (stop is not None and stop.is_set())

        t0 = self._clock()
        for ev in self.events:
            if self._skip_initial and ev.at_s == 0 and ev.kind == "add":
                log.info("trace replay: slot %d is initial, not applied", ev.slot)
                continue
            while True:
                if stopped():
                    log.info("trace replay stopped before event %s", ev)
                    return
                wait = ev.at_s - (self._clock() - t0)
                if wait <= 0:
                    break
                self._sleep(min(wait, self._max_sleep_s))
            now = self._clock() - t0
            self._history.append((now, ev))
            fn = {"add": self._add, "remove": self._remove, "kill": self._kill,
                  "notice": self._notice}[ev.kind]
            try:
                fn(ev.slot)
            except Exception as e:  # noqa: BLE001 - recorded, the replay must go on
                log.warning("trace replay: %s slot %d at %.2fs failed: %r", ev.kind, ev.slot, now, e)
                self._errors.append(ReplayError(now, ev, repr(e)))
            else:
                log.info(
                    "trace replay: %s slot %d at %.2fs (scheduled %.2fs)", ev.kind, ev.slot, now, ev.at_s
                )
        log.info("trace replay finished: %d events, %d errors", len(self._history), len(self._errors))

    def start(self) -> threading.Thread:
        """Run in a daemon thread; returns the thread. Raises RuntimeError if already started."""
        if self._thread is not None:
            raise RuntimeError("TraceReplayer already started")
        self._thread = threading.Thread(target=self.run, name="trace-replayer", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Ask the loop to return before its next event (within ``max_sleep_s``)."""
        self._stop.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the thread started by :meth:`start`; True if it has finished."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()
