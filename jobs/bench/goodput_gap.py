"""`moshray bench goodput`, pure part 3: when a system's samples went missing under the trace.

No Ray, no I/O. A system's *failure-free* samples on the trace are its own calibrated rate at
each live node count times the seconds at that count (``goodput_rates``); its useful samples
under the trace fall short of that by what its start-up and the node events cost it (the
``elasticity`` ratio). :func:`gap_split` says when the shortfall happened. The window
``[0, duration_s]`` is cut into slices of ``window_s`` from 0, and each slice is one of

* ``startup``: it begins before the system's first useful step;
* ``node_events``: otherwise, a node event (an add or a removal after t = 0) falls in it or
  in the slice before it (a join costs the running replicas the seconds after it as well);
* ``steady``: the rest.

Per class (:class:`GapPart`): the slices, the samples ``expected`` at the system's own rates
over the live counts in them, the useful ``samples`` it gained in them (its useful curve at
the slice's end minus at its start, so a rollback to a checkpoint makes that negative) and
``missing`` = expected - samples (negative: above its calibrated rates). The three
``missing`` add up to the failure-free samples minus the useful samples. Each slice is kept
too (:class:`SliceGap`, ``by_slice`` in the JSON), and ``worst_line`` names the slices that
missed the most: where in the trace the shortfall sits.

What the node events cost moshray is mostly its joins: the run summary's
``replica_starts`` (``jobs/controller/replica_states.replica_starts``, from the controller's
replica timelines) says how many replicas were started, how many trained, how long each took
from its start to training, and how many were gone before they ever trained.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from moshray.jobs.bench.goodput_rates import ideal_curve, ratio

CLASSES = ("startup", "node_events", "steady")
LABELS = {"startup": "start-up", "node_events": "after node events", "steady": "steady"}
GAP_WINDOW_S = 20.0


@dataclass(frozen=True)
class GapPart:
    """One class of slices: how many, the samples expected at the system's own rates there
    and the useful samples it gained there."""

    slices: int = 0
    expected: float = 0.0
    samples: float = 0.0

    @property
    def missing(self) -> float:
        return self.expected - self.samples

    def plus(self, expected: float, samples: float) -> "GapPart":
        return GapPart(self.slices + 1, self.expected + expected, self.samples + samples)

    def to_json(self) -> dict:
        return {"slices": self.slices, "expected": self.expected, "samples": self.samples,
                "missing": self.missing, "ratio": ratio(self.samples, self.expected)}


@dataclass(frozen=True)
class SliceGap:
    """One slice ``[start_s, end_s)`` of class ``kind``: the samples expected there at the
    system's own rates and the useful samples it gained there."""

    start_s: float
    end_s: float
    kind: str
    expected: float
    samples: float

    @property
    def missing(self) -> float:
        return self.expected - self.samples

    def to_json(self) -> list:
        """``[start_s, kind, expected, samples]`` (compact: a run has dozens of slices)."""
        return [self.start_s, self.kind, round(self.expected, 1), self.samples]


@dataclass(frozen=True)
class GapSplit:
    """A system's shortfall against its own failure-free rates: its slices in time order,
    and (``parts``) their sums by class."""

    window_s: float
    slices: tuple[SliceGap, ...]

    @property
    def parts(self) -> dict[str, GapPart]:
        parts = {name: GapPart() for name in CLASSES}
        for piece in self.slices:
            parts[piece.kind] = parts[piece.kind].plus(piece.expected, piece.samples)
        return parts

    @property
    def missing(self) -> float:
        return sum(p.missing for p in self.slices)

    def to_json(self) -> dict:
        parts = self.parts
        return {"window_s": self.window_s, "missing": self.missing,
                **{name: parts[name].to_json() for name in CLASSES},
                "by_slice": [piece.to_json() for piece in self.slices]}

    def worst(self, n: int = 3) -> list[SliceGap]:
        """The ``n`` slices that missed the most samples, in time order; none that gained
        above their expectation."""
        top = sorted((p for p in self.slices if p.missing > 0), key=lambda p: -p.missing)[:n]
        return sorted(top, key=lambda p: p.start_s)

    def worst_line(self, n: int = 3) -> str:
        """``20-40 s (after node events) 6,912 of 12,052 missing; ...``, or ``none``."""
        return "; ".join(f"{p.start_s:.0f}-{p.end_s:.0f} s ({LABELS[p.kind]}) "
                         f"{p.missing:,.0f} of {p.expected:,.0f} missing"
                         for p in self.worst(n)) or "none"

    def line(self) -> str:
        """``start-up 13,852, after node events 9,948, steady 2,563`` (samples missing)."""
        parts = self.parts
        return ", ".join(f"{LABELS[n]} {parts[n].missing:,.0f}" for n in CLASSES)


def _value_at(curve: Sequence[tuple[float, float]], times: list[float], t: float) -> float:
    """The useful count at ``t``: the curve's last point at or before it (0 before any)."""
    i = bisect.bisect_right(times, t)
    return curve[i - 1][1] if i else 0.0


def _linear_at(curve: Sequence[tuple[float, float]], times: list[float], t: float) -> float:
    """A piecewise-linear cumulative ``curve`` (``goodput_rates.ideal_curve``) at ``t``."""
    i = bisect.bisect_right(times, t)
    if i == 0:
        return 0.0
    if i == len(curve):
        return curve[-1][1]
    (t0, v0), (t1, v1) = curve[i - 1], curve[i]
    return v0 + (v1 - v0) * (t - t0) / (t1 - t0)


def gap_split(curve: Sequence[tuple[float, float]], events: Iterable,
              rates: Mapping[int, float], duration_s: float,
              window_s: float = GAP_WINDOW_S) -> GapSplit:
    """Split one system's shortfall by class of slice (module docstring).

    ``curve`` is its useful cumulative samples ``(t_s, samples)`` in time order, starting at
    0 (``goodput_curves.SystemResult.curve``); ``events`` the trace's ``NodeEvent``-like
    schedule (``at_s``, ``kind``; the adds at 0 are the initial nodes); ``rates`` its own
    failure-free ``{count: samples/s}``. A count without a rate expects nothing. Raises
    ValueError if ``window_s`` or ``duration_s`` is not positive.
    """
    if window_s <= 0 or duration_s <= 0:
        raise ValueError(f"window_s and duration_s must be > 0, got {window_s}, {duration_s}")
    events = list(events)
    expected = ideal_curve(events, dict(rates), duration_s)  # at the system's own rates
    expected_times = [t for t, _ in expected]
    times = [t for t, _ in curve]
    first = next((t for t, samples in curve if samples > 0), None)
    event_times = sorted(e.at_s for e in events if 0 < e.at_s <= duration_s)
    slices: list[SliceGap] = []
    a = 0.0
    while a < duration_s:
        b = min(a + window_s, duration_s)
        if first is None or a < first:
            name = "startup"
        else:
            i = bisect.bisect_left(event_times, a - window_s)
            name = "node_events" if i < len(event_times) and event_times[i] < b else "steady"
        gained = _value_at(curve, times, b) - _value_at(curve, times, a)
        due = (_linear_at(expected, expected_times, b)
               - _linear_at(expected, expected_times, a))
        slices.append(SliceGap(a, b, name, due, gained))
        a = b
    return GapSplit(window_s, tuple(slices))


