"""`moshray bench goodput`, pure part 2: the trace's node counts, failure-free rates, the ideal.

No Ray, no I/O. The schedule (``NodeEvent``-like rows: ``at_s``, ``kind``) says how many
seconds the window spends at each live node count (:func:`count_seconds`). Each system's
failure-free rate at a count is measured by a calibration run (:func:`steady_rate` on its
steps). From the two systems' rates :func:`compare_rates` derives:

* the ideal's rate at each count: the better of the two systems' failure-free rates there
  (:func:`best_rates`), so the ideal is what the faster system would do with no failures;
  ``ideal = sum_n rate(n) * seconds_at(n)`` (:func:`ideal_samples`);
* ``steady_state_vs_raytrain``: moshray's failure-free rate over Ray Train's (DDP) at the
  trace's most common node count (:func:`most_common_count`: most seconds, ties -> larger);
* each system's scaling figure (:func:`scaling`): its failure-free rate at the largest
  measured count over its rate at the smallest measured count >= 2 (1 node has no
  communication, so it says nothing about scaling). 1.0 = the total rate holds as nodes
  are added, below 1 = it falls. "moshray's rate does not fall from 2 to 4 nodes by more
  than DDP's" reads as ``moshray_scaling >= raytrain_scaling``;
* each system's failure-free samples on the trace (:func:`ideal_samples` of its own rates):
  what it would train if no node event cost it anything. A system's samples under the trace
  over that figure is its *elasticity* (the share of its own failure-free training it kept
  through the node events), and moshray's failure-free samples over the ideal is the most
  ``moshray_vs_ideal`` could be at its measured rates; ``moshray_vs_ideal`` is their product.

With one calibration count (``--calib-nodes N``) both systems are measured only with N nodes,
the ideal's rate is the better per-node rate scaled linearly to every count, the steady-state
ratio is taken at N and there is no scaling figure.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from moshray.jobs.bench.goodput_curves import Progress

MOSHRAY = "moshray"
RAYTRAIN = "raytrain"
RAYTRAIN_TORCHFT = "raytrain_torchft"


class BenchError(ValueError):
    """Bad benchmark input; the message is one line saying what to fix."""


def count_seconds(events: Iterable, duration_s: float) -> dict[int, float]:
    """Seconds the schedule spends at each live node count over ``[0, duration_s]``.

    ``events`` are ``NodeEvent``-like (``at_s``, ``kind``); the ``at_s == 0`` adds are the
    initial nodes. Counts held for zero seconds are left out.
    """
    out: dict[int, float] = {}
    live, prev = 0, 0.0
    for ev in sorted(events, key=lambda e: e.at_s):
        if ev.at_s > duration_s:
            break
        if ev.at_s > prev:
            out[live] = out.get(live, 0.0) + ev.at_s - prev
            prev = ev.at_s
        live += 1 if ev.kind == "add" else -1
    if duration_s > prev:
        out[live] = out.get(live, 0.0) + duration_s - prev
    return {n: s for n, s in out.items() if s > 0}


def steady_rate(records: Sequence[Progress], peers: Sequence[int] | None = None,
                want_peers: int | None = None) -> float:
    """Samples per second from the first step on which every node took part to the last step.

    With ``peers`` (the participants of each step) the measurement starts at the first step
    with at least ``want_peers`` participants (the ramp while replicas start is left out);
    without, at the first step. That step's own samples are not counted (they were computed
    before it). Raises BenchError if fewer than two steps remain.
    """
    if peers is not None and want_peers is not None:
        first = next((i for i, p in enumerate(peers) if p >= want_peers), len(records))
        records = records[first:]
    if len(records) < 2:
        raise BenchError(f"calibration recorded {len(records)} steps with every node taking "
                         "part; need at least 2: raise --calib-seconds or use a smaller model")
    span = records[-1].t_s - records[0].t_s
    if span <= 0:
        raise BenchError("calibration steps have no time span; raise --calib-seconds")
    return sum(r.samples for r in records[1:]) / span


def steady_elapsed(history: Sequence[Sequence], n: int) -> float:
    """Seconds from the first step with at least ``n`` participants to the last step, in a
    Coordinator's history (rows ``(epoch, at_s, samples, loss, peers)``); -inf before such a
    step."""
    first = next((row[1] for row in history if row[4] >= n), None)
    return -math.inf if first is None else history[-1][1] - first


def ideal_samples(rates: dict[int, float], seconds: dict[int, float]) -> float:
    """``sum_n rates[n] * seconds[n]`` (count 0 contributes nothing).

    Raises BenchError if a count with time has no measured rate.
    """
    missing = sorted(n for n in seconds if n > 0 and n not in rates)
    if missing:
        raise BenchError(f"no failure-free rate measured for node counts {missing}")
    return sum(rates[n] * s for n, s in seconds.items() if n > 0)


def linear_rates(per_node: float, counts: Iterable[int]) -> dict[int, float]:
    """``{n: per_node * n}``: the ideal when nodes do not share hardware."""
    return {n: per_node * n for n in counts}


def ideal_curve(events: Iterable, rates: dict[int, float], duration_s: float
                ) -> tuple[tuple[float, float], ...]:
    """Piecewise-linear cumulative ideal samples: ``(t, samples)`` at each count change."""
    curve = [(0.0, 0.0)]
    live, prev, total = 0, 0.0, 0.0
    for ev in sorted(events, key=lambda e: e.at_s):
        if ev.at_s > duration_s:
            break
        if ev.at_s > prev:
            total += rates.get(live, 0.0) * (ev.at_s - prev)
            curve.append((ev.at_s, total))
            prev = ev.at_s
        live += 1 if ev.kind == "add" else -1
    total += rates.get(live, 0.0) * max(duration_s - prev, 0.0)
    curve.append((duration_s, total))
    return tuple(curve)


def live_timeline(events: Iterable, duration_s: float) -> tuple[tuple[float, int], ...]:
    """``(t, live count)`` after each batch of events, starting at t = 0 (for the plot)."""
    out: list[tuple[float, int]] = []
    live = 0
    for ev in sorted(events, key=lambda e: e.at_s):
        if ev.at_s > duration_s:
            break
        live += 1 if ev.kind == "add" else -1
        if out and out[-1][0] == ev.at_s:
            out[-1] = (ev.at_s, live)
        else:
            out.append((ev.at_s, live))
    if not out or out[0][0] > 0:
        out.insert(0, (0.0, 0))
    out.append((duration_s, out[-1][1]))
    return tuple(out)


def ratio(a: float, b: float) -> float | None:
    """``a / b``, or None when ``b`` is 0 (JSON has no infinity)."""
    return a / b if b else None


def most_common_count(seconds: Mapping[int, float]) -> int:
    """The live node count (> 0) held for the most seconds; ties go to the larger count.

    Raises BenchError if no count above 0 has any time.
    """
    held = [(s, n) for n, s in seconds.items() if n > 0 and s > 0]
    if not held:
        raise BenchError("the trace holds no live node in the window; check --trace and "
                         "--time-scale")
    return max(held)[1]


def best_rates(by_system: Mapping[str, Mapping[int, float]]
               ) -> tuple[dict[int, float], dict[int, str]]:
    """At each count, the highest rate among the systems and the system that has it.

    ``by_system`` maps a system name to its ``{count: samples/s}``; every system must have
    the same counts (BenchError naming the missing ones otherwise). Ties go to the system
    named first.
    """
    systems = list(by_system)
    if not systems:
        raise BenchError("no system's failure-free rates to compare")
    counts = set().union(*(set(r) for r in by_system.values()))
    for name in systems:
        missing = sorted(counts - set(by_system[name]))
        if missing:
            raise BenchError(f"no failure-free {name} rate measured for node counts {missing}")
    rates: dict[int, float] = {}
    source: dict[int, str] = {}
    for n in sorted(counts):
        best = max(systems, key=lambda s: (by_system[s][n], -systems.index(s)))
        rates[n], source[n] = by_system[best][n], best
    return rates, source


@dataclass(frozen=True)
class Scaling:
    """A system's failure-free rate at ``high`` nodes over its rate at ``low`` nodes."""

    low: int
    high: int
    value: float


def scaling(rates: Mapping[int, float]) -> Scaling | None:
    """``rates[high] / rates[low]``: ``high`` the largest count, ``low`` the smallest count
    >= 2. None when fewer than two counts >= 2 were measured or ``rates[low]`` is 0."""
    counts = sorted(n for n in rates if n >= 2)
    if len(counts) < 2 or not rates[counts[0]]:
        return None
    return Scaling(counts[0], counts[-1], rates[counts[-1]] / rates[counts[0]])


@dataclass(frozen=True)
class RateComparison:
    """Both systems' failure-free rates and what the benchmark derives from them.

    ``moshray`` and ``raytrain`` are the measured ``{count: samples/s}``; ``ideal`` the rate the
    ideal uses at every count the trace holds and ``ideal_source`` which system it came from;
    ``steady_nodes`` the count of ``steady_state_vs_raytrain`` (moshray / Ray Train, None if
    Ray Train's rate is 0); the scalings are None without two measured counts >= 2;
    ``failure_free`` each system's samples at its own rates over the trace's seconds
    (module docstring), ``ideal_total`` the ideal's, ``own`` the rates ``failure_free`` used
    (the measured ones, or with one calibration count its per-node rate scaled linearly).
    """

    moshray: dict[int, float]
    raytrain: dict[int, float]
    ideal: dict[int, float]
    ideal_source: dict[int, str]
    steady_nodes: int
    steady_state_vs_raytrain: float | None
    moshray_scaling: Scaling | None
    raytrain_scaling: Scaling | None
    failure_free: dict[str, float]
    ideal_total: float
    own: dict[str, dict[int, float]]  # each system's rate at every count the trace holds

    def elasticity(self, system: str, samples: float) -> float | None:
        """``samples`` (``system``'s useful samples under the trace) over its failure-free
        samples on the same trace; None if those are 0."""
        return ratio(samples, self.failure_free[system])

    def to_json(self) -> dict:
        """The JSON fields (counts as string keys, as JSON objects need)."""
        def keyed(d: Mapping[int, object]) -> dict:
            return {str(n): v for n, v in sorted(d.items())}

        both = self.moshray_scaling is not None and self.raytrain_scaling is not None
        return {
            "moshray_rate_by_nodes": keyed(self.moshray),
            "raytrain_rate_by_nodes": keyed(self.raytrain),
            "rate_by_nodes": keyed(self.ideal),
            "per_node_samples_per_s": keyed({n: r / n for n, r in self.ideal.items()}),
            "ideal_source_by_nodes": keyed(self.ideal_source),
            "steady_state_nodes": self.steady_nodes,
            "steady_state_vs_raytrain": self.steady_state_vs_raytrain,
            "scaling_nodes": ([self.moshray_scaling.low, self.moshray_scaling.high]
                              if self.moshray_scaling else None),
            "moshray_scaling": self.moshray_scaling.value if self.moshray_scaling else None,
            "raytrain_scaling": self.raytrain_scaling.value if self.raytrain_scaling else None,
            "scaling_vs_raytrain": (ratio(self.moshray_scaling.value,
                                          self.raytrain_scaling.value) if both else None),
            "moshray_failure_free_samples": self.failure_free[MOSHRAY],
            "raytrain_failure_free_samples": self.failure_free[RAYTRAIN],
            "moshray_failure_free_vs_ideal": ratio(self.failure_free[MOSHRAY],
                                                   self.ideal_total),
        }


def compare_rates(moshray: Mapping[int, float], raytrain: Mapping[int, float],
                  seconds: Mapping[int, float], calib_nodes: int | None = None
                  ) -> RateComparison:
    """Derive the ideal's rates, the steady-state ratio and the scalings (module docstring).

    Without ``calib_nodes`` both systems must have a rate at every count > 0 in ``seconds``;
    with it, at ``calib_nodes`` (the per-node rate is scaled linearly to every count).
    Raises BenchError naming what is missing.
    """
    counts = sorted(n for n, s in seconds.items() if n > 0 and s > 0)
    steady = most_common_count(seconds) if calib_nodes is None else calib_nodes
    needed = counts if calib_nodes is None else [calib_nodes]
    measured = {MOSHRAY: {n: moshray[n] for n in needed if n in moshray},
                RAYTRAIN: {n: raytrain[n] for n in needed if n in raytrain}}
    for name, rates in measured.items():
        missing = [n for n in needed if n not in rates]
        if missing:
            raise BenchError(f"no failure-free {name} rate measured for node counts {missing}")
    own = measured if calib_nodes is None else {  # one measurement: per-node rate, linearly
        name: linear_rates(rates[calib_nodes] / calib_nodes, counts)
        for name, rates in measured.items()}
    ideal, source = best_rates(own)
    common = set(moshray) & set(raytrain)
    return RateComparison(
        moshray=dict(moshray), raytrain=dict(raytrain), ideal=ideal, ideal_source=source,
        steady_nodes=steady,
        steady_state_vs_raytrain=ratio(moshray[steady], raytrain[steady]),
        moshray_scaling=scaling({n: moshray[n] for n in common}),
        raytrain_scaling=scaling({n: raytrain[n] for n in common}),
        failure_free={name: ideal_samples(rates, seconds) for name, rates in own.items()},
        ideal_total=ideal_samples(ideal, seconds), own=own)
