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
``missing`` add up to the failure-free samples minus the useful samples.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from moshray.jobs.goodput_rates import ideal_curve, ratio

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
class GapSplit:
    """A system's shortfall against its own failure-free rates, by class of slice."""

    window_s: float
    parts: Mapping[str, GapPart]

    @property
    def missing(self) -> float:
        return sum(p.missing for p in self.parts.values())

    def to_json(self) -> dict:
        return {"window_s": self.window_s, "missing": self.missing,
                **{name: self.parts[name].to_json() for name in CLASSES}}

    def line(self) -> str:
        """``start-up 13,852, after node events 9,948, steady 2,563`` (samples missing)."""
        return ", ".join(f"{LABELS[n]} {self.parts[n].missing:,.0f}" for n in CLASSES)


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
    parts = {name: GapPart() for name in CLASSES}
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
        parts[name] = parts[name].plus(due, gained)
        a = b
    return GapSplit(window_s, parts)
