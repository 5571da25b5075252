"""The chaos bench's pure side: seeded fault plans, stall accounting and invariants.

A ``ChaosSchedule`` names how many faults of each kind to draw; ``draw_plan`` turns it into
a ``ChaosPlan`` (node events for the embedded cloud's trace replay plus timed actor faults),
the same for the same seed. ``stalled_seconds`` and ``stall_causes`` account for the gaps
between global steps; ``invariant_failures`` says which of the run's promises its figures
break. No Ray, no clock: ``jobs/bench/chaos.py`` runs the plan.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Iterable

from moshray.jobs.bench.chaos_schedule import ChaosConfig, chaos_events
from moshray.autoscaler.traces import TraceNodeEvent

STALL_S = 2.0  # a gap between global steps longer than this counts as stalled
ACTOR_KINDS = ("coordinator", "nan", "shape")


@dataclass(frozen=True)
class ActorFault:
    """One fault the harness injects ``at_s`` seconds after the job's Coordinator is up."""

    at_s: float
    kind: str  # one of ACTOR_KINDS


@dataclass(frozen=True)
class ChaosSchedule:
    """What to draw: ``nodes`` node faults come from ``chaos`` (its seed seeds everything);
    ``coordinator_kills``, ``nan_replicas`` and ``shape_replicas`` actor faults spread over
    the same window at least ``min_gap_s`` apart; the job runs ``settle_s`` past the end so
    the last replacements sync before the replicas are compared."""

    chaos: ChaosConfig
    coordinator_kills: int
    nan_replicas: int
    shape_replicas: int
    min_gap_s: float = 4.0
    settle_s: float = 30.0


SCHEDULES: dict[str, ChaosSchedule] = {
    "long": ChaosSchedule(ChaosConfig(seed=0, nodes=4, duration_s=260, losses=26,
                                      kill_fraction=0.5, replace_after_s=4, min_live=3,
                                      min_gap_s=5.0),
                          coordinator_kills=16, nan_replicas=5, shape_replicas=5),
    "short": ChaosSchedule(ChaosConfig(seed=2, nodes=3, duration_s=70, losses=3,
                                       kill_fraction=0.5, replace_after_s=4, min_live=2),
                           coordinator_kills=2, nan_replicas=1, shape_replicas=1,
                           settle_s=30.0),
}


@dataclass(frozen=True)
class ChaosPlan:
    node_events: tuple[TraceNodeEvent, ...]
    actor_faults: tuple[ActorFault, ...]
    duration_s: float
    settle_s: float

    @property
    def planned(self) -> dict[str, int]:
        """Faults by kind (``notice``/``kill`` from the node events)."""
        out = {"notice": 0, "kill": 0, **{k: 0 for k in ACTOR_KINDS}}
        for e in self.node_events:
            if e.kind in ("remove", "kill"):
                out["notice" if e.kind == "remove" else "kill"] += 1
        for f in self.actor_faults:
            out[f.kind] += 1
        return out

    @property
    def nodes_at_end(self) -> int:
        return sum(1 if e.kind == "add" else -1 for e in self.node_events)


def draw_plan(schedule: ChaosSchedule, seed: int | None = None) -> ChaosPlan:
    """The seeded plan (same seed, same plan). ``seed`` overrides ``schedule.chaos.seed``.
    Actor faults fall in ``[quiet_start_s, duration_s - min_gap_s]``, at least
    ``min_gap_s`` apart, kinds in seeded order. Raises ``ValueError`` if they do not fit."""
    chaos = schedule.chaos if seed is None else replace(schedule.chaos, seed=seed)
    kinds = (["coordinator"] * schedule.coordinator_kills + ["nan"] * schedule.nan_replicas
             + ["shape"] * schedule.shape_replicas)
    rng = random.Random(chaos.seed * 7919 + 1)
    rng.shuffle(kinds)
    start, end = chaos.quiet_start_s, chaos.duration_s - schedule.min_gap_s
    slack = (end - start) - schedule.min_gap_s * max(len(kinds) - 1, 0)
    if slack < 0:
        raise ValueError(f"{len(kinds)} actor faults {schedule.min_gap_s:g} s apart do not fit "
                         f"in {end - start:g} s")
    offsets = sorted(rng.uniform(0.0, slack) for _ in kinds)
    faults = tuple(ActorFault(round(start + o + i * schedule.min_gap_s, 3), k)
                   for i, (o, k) in enumerate(zip(offsets, kinds)))
    return ChaosPlan(chaos_events(chaos), faults, chaos.duration_s, schedule.settle_s)


def stalled_seconds(advances: list[float], threshold: float = STALL_S) -> float:
    """Sum of the gaps longer than ``threshold`` between consecutive global-step times."""
    return sum(b - a for a, b in zip(advances, advances[1:]) if b - a > threshold)


def invariant_failures(fig: dict) -> list[str]:
    """Which of the run's invariants ``fig`` (the bench's figures) breaks, one line each."""
    out = []
    for key in ("lost", "repeated", "rollbacks"):
        if fig[key] != 0:
            out.append(f"{fig[key]} {key} steps" if key != "rollbacks" else
                       f"{fig[key]} rollbacks")
    missed = sorted(set(fig["bad_replicas"]) - set(fig["quarantined"]) - set(fig["bad_lost"]))
    if missed:
        out.append(f"bad replicas never quarantined: {missed}")
    wrong = sorted(set(fig["quarantined"]) - set(fig["bad_replicas"]))
    if wrong:
        out.append(f"good replicas quarantined: {wrong}")
    if fig["replicas_at_end"] != fig["expected_replicas"]:
        out.append(f"{fig['replicas_at_end']} replicas at the end, expected "
                   f"{fig['expected_replicas']}")
    if not fig["replicas_consistent"]:
        out.append("staying replicas are not bitwise identical")
    missing = {k: n - fig["faults_by_kind"].get(k, 0) for k, n in fig["faults_planned"].items()
               if fig["faults_by_kind"].get(k, 0) < n}
    if missing:
        out.append(f"faults planned but not injected: {missing}")
    if fig["steps"] <= 0:
        out.append("no global step committed")
    return out


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


def stall_causes(advances: list[float], events: Iterable[tuple[float, str]],
                 threshold: float = STALL_S, lead_s: float = STALL_S) -> dict[str, float]:
    """Stalled seconds by cause: each gap longer than ``threshold`` between global steps
    (``advances``: times) goes to the kinds of the ``(time, kind)`` events that fell in it
    or up to ``lead_s`` before it began (split evenly among distinct kinds), else to
    ``"none"`` (no fault near: joins, slowness). The values sum to ``stalled_seconds``."""
    events = sorted(events)
    out: dict[str, float] = {}
    for a, b in zip(advances, advances[1:]):
        if b - a <= threshold:
            continue
        kinds = sorted({k for t, k in events if a - lead_s <= t <= b}) or ["none"]
        for k in kinds:
            out[k] = out.get(k, 0.0) + (b - a) / len(kinds)
    return {k: round(v, 2) for k, v in sorted(out.items())}
