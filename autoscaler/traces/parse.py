"""Spot-availability trace files: the parsed model and its parser.

Contract: ``load_trace(path) -> Trace`` parses a trace file (or a shipped trace by name, see
``resolve_trace``) into a step function of the live instance count (trace seconds, original
counts), keeping per-node identity when the file has it. Pure: no Ray, no clock.

Accepted file formats (auto-detected from the first data row; blank lines and
lines starting with ``#`` are ignored; an optional header row is accepted if it
names the columns below):

* count format, ``seconds_since_start,available_instances``: a step function;
  two rows with the same time mark a change (the last row at a time wins).
* per-node event format, ``timestamp_ms,action,node_id``: ``action`` is ``add``,
  ``remove`` (a preemption with notice) or ``kill`` (a hard loss: no notice, the node's
  processes die at once); time in milliseconds since trace start.

Anything else raises :class:`TraceError` naming the file, the line and what was
expected. ``trace_schedule.py`` turns a ``Trace`` into wall-clock node events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal

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


SHIPPED_DIR = Path(__file__).parent
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
