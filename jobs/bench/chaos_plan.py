"""The chaos bench's pure side: seeded fault plans, what counts as a fault that happened,
stall accounting and invariants.

A ``ChaosSchedule`` names how many faults of each kind to draw; ``draw_plan`` turns it into
a ``ChaosPlan`` (node events for the embedded cloud's trace replay plus timed actor faults),
the same for the same seed. A ``FaultLedger`` holds every fault the harness tried, each
pending until an observation decides it (``node_fault_outcome`` for node faults): the
bench's counts are the ledger's, never the plan's, and a planned fault that did not happen
fails the run with its reason. ``RULED_OUT`` names the fault kinds this bench does
not run, each with why. ``stalled_seconds`` and ``stall_causes`` account for the gaps
between global steps; ``invariant_failures`` says which of the run's promises its figures
break. No Ray, no clock: ``jobs/bench/chaos.py`` runs the plan.
"""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass, replace
from typing import Iterable

from moshray.jobs.bench.chaos_schedule import ChaosConfig, chaos_events
from moshray.autoscaler.traces import TraceNodeEvent

STALL_S = 2.0  # a gap between global steps longer than this counts as stalled
NODE_KINDS = ("notice", "kill")
# Actor faults: the Coordinator's process killed (Ray restarts it); a replica sending NaN
# or wrong-shape contributions; a replica's process SIGKILLed on a live node; a replica's
# user loop raising once; the checkpoint disk full during a save.
ACTOR_KINDS = ("coordinator", "nan", "shape", "replica_kill", "user_error", "disk_full")
# Network faults, separate hosts only (``--hosts netns``): a node partitioned from every
# other (its processes keep running) and healed; a node's link starved to a few Mbit/s, then
# unlimited again. Each holds the injector for its window.
NETWORK_KINDS = ("partition", "slow_node")
ALL_KINDS = NODE_KINDS + ACTOR_KINDS + NETWORK_KINDS
# Fault kinds this bench does not run, and why (printed with the figures); where a
# kind needs what a machine or mode may lack (``disk_full``: root, to mount a small disk;
# the network kinds: separate hosts), the bench adds it with the reason at run time.
RULED_OUT = {
    "driver": "this bench's driver shares its process with the embedded cluster; a driver "
              "kill and resubmission needs a `ray start` cluster and a driver process of its "
              "own: tests/test_driver_restart.py covers it (SIGKILL mid-run, resubmission "
              "adopts the swarm, 0 committed steps lost)",
}
NETWORK_RULED_OUT = ("needs separate hosts: run the bench with --hosts netns (root, "
                     "`ip netns` and `tc`); loopback nodes share one link")


@dataclass(frozen=True)
class ActorFault:
    """One fault the harness injects ``at_s`` seconds after the job's Coordinator is up."""

    at_s: float
    kind: str  # one of ACTOR_KINDS or NETWORK_KINDS


@dataclass(frozen=True)
class ChaosSchedule:
    """What to draw: ``nodes`` node faults come from ``chaos`` (its seed seeds everything);
    ``coordinator_kills``, ``nan_replicas``, ``shape_replicas``, ``replica_kills``,
    ``user_errors`` and ``disk_fulls`` actor faults and ``partitions`` (each ``partition_s``
    long) and ``slow_nodes`` (``slow_s`` at ``slow_mbit``) network faults spread over the
    same window, at least ``min_gap_s`` apart after each one's hold;
    the job runs ``settle_s`` past the end so the last replacements sync before the
    replicas are compared."""

    chaos: ChaosConfig
    coordinator_kills: int
    nan_replicas: int
    shape_replicas: int
    replica_kills: int = 0
    user_errors: int = 0
    disk_fulls: int = 0
    partitions: int = 0
    slow_nodes: int = 0
    min_gap_s: float = 4.0
    settle_s: float = 30.0
    partition_s: float = 8.0  # over a round deadline: the swarm must go on without the node
    slow_s: float = 10.0
    slow_mbit: float = 2.0
    netns_chaos: ChaosConfig | None = None  # the node faults on separate hosts, if others

    def hold_s(self, kind: str) -> float:
        """How long a fault of ``kind`` holds the injector (0 for the instant ones)."""
        return {"partition": self.partition_s, "slow_node": self.slow_s}.get(kind, 0.0)

    def on_separate_hosts(self) -> "ChaosSchedule":
        """The schedule for the separate-hosts mode: its node faults from ``netns_chaos``
        where set (a node there takes 10-30 s to join and sync, twice loopback's)."""
        return self if self.netns_chaos is None else replace(self, chaos=self.netns_chaos)

    def without_network(self) -> "ChaosSchedule":
        """The same schedule with no network faults (loopback nodes)."""
        return replace(self, partitions=0, slow_nodes=0)


SCHEDULES: dict[str, ChaosSchedule] = {
    # 66 faults over 420 s: one every ~6 s, about a node's time to join and sync (at one
    # every ~5 s the swarm was sometimes left with one holder, and lost it)
    "long": ChaosSchedule(ChaosConfig(seed=0, nodes=4, duration_s=420, losses=40,
                                      kill_fraction=0.5, replace_after_s=4, min_live=3,
                                      min_gap_s=9.0, min_warm=2, warm_s=12.0),
                          coordinator_kills=16, nan_replicas=5, shape_replicas=5,
                          replica_kills=7, user_errors=3, disk_fulls=2, partitions=3,
                          slow_nodes=3,
                          # separate hosts: 540 s, a loss only with 2 nodes up 30 s besides
                          netns_chaos=ChaosConfig(seed=0, nodes=4, duration_s=540, losses=48,
                                                  kill_fraction=0.5, replace_after_s=4,
                                                  min_live=3, min_gap_s=10.0, min_warm=2,
                                                  warm_s=30.0)),
    "short": ChaosSchedule(ChaosConfig(seed=2, nodes=3, duration_s=70, losses=3,
                                       kill_fraction=0.5, replace_after_s=4, min_live=2),
                           coordinator_kills=2, nan_replicas=1, shape_replicas=1,
                           replica_kills=1, user_errors=1, disk_fulls=1, partitions=1,
                           slow_nodes=1, settle_s=30.0),
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
        out = {k: 0 for k in ALL_KINDS}
        for e in self.node_events:
            if e.kind in ("remove", "kill"):
                out["notice" if e.kind == "remove" else "kill"] += 1
        for f in self.actor_faults:
            out[f.kind] += 1
        return out

    @property
    def nodes_at_end(self) -> int:
        return sum(1 if e.kind == "add" else -1 for e in self.node_events)


# =========================================================================== what happened


@dataclass(frozen=True)
class FaultRecord:
    """One fault the harness tried: ``happened`` is None while no observation has decided
    it; ``evidence`` says what was observed (or why it did not happen)."""

    kind: str
    target: str  # a node id, a peer id, "coordinator"
    at: float  # the harness's monotonic clock when it was injected
    happened: bool | None = None
    evidence: str = ""


class FaultLedger:
    """Every fault tried, as observed. Thread-safe (the cloud's thread reports node faults,
    the injector's thread actor faults and the observations)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list[FaultRecord] = []

    def tried(self, kind: str, target: str, at: float) -> int:
        """A fault was injected (or the cloud acted); returns its index, pending."""
        with self._lock:
            self._records.append(FaultRecord(kind, target, at))
            return len(self._records) - 1

    def not_done(self, kind: str, target: str, at: float, reason: str) -> None:
        """A fault the plan wanted could not even be injected (e.g. its node was gone)."""
        with self._lock:
            self._records.append(FaultRecord(kind, target, at, False, reason))

    def decide(self, index: int, happened: bool, evidence: str) -> None:
        """Settle a pending record (a settled one is left as it is)."""
        with self._lock:
            record = self._records[index]
            if record.happened is None:
                self._records[index] = replace(record, happened=happened, evidence=evidence)

    def pending(self) -> list[tuple[int, FaultRecord]]:
        with self._lock:
            return [(i, r) for i, r in enumerate(self._records) if r.happened is None]

    def records(self) -> list[FaultRecord]:
        with self._lock:
            return list(self._records)

    def observed(self) -> dict[str, int]:
        """Faults observed to have happened, by kind (every kind of ``ALL_KINDS`` present,
        0 if none)."""
        out = {k: 0 for k in ALL_KINDS}
        for r in self.records():
            if r.happened:
                out[r.kind] = out.get(r.kind, 0) + 1
        return out

    def missed(self) -> list[str]:
        """One line per fault that did not happen (or was never decided): kind, target,
        reason."""
        return [f"{r.kind} {r.target}: {r.evidence or 'never observed'}"
                for r in self.records() if not r.happened]


def node_fault_outcome(kind: str, node_id: str, alive: set[str], noticed: set[str],
                       final: bool = False) -> tuple[bool, str] | None:
    """Whether a node fault the cloud carried out happened, from Ray's live nodes
    (``alive``: node ids) and the nodes whose notice reached the Coordinator (``noticed``).

    ``kill``: happened once the node is gone from Ray. ``notice`` (a notice, then the
    node's removal at its deadline): happened once the node is gone and its notice was
    delivered. None while undecided; with ``final`` (the run is over) an undecided fault
    did not happen, with the reason."""
    gone = node_id not in alive
    if kind == "kill":
        if gone:
            return True, "node gone from Ray"
        return (False, "the node is still alive in Ray") if final else None
    if gone and node_id in noticed:
        return True, "notice delivered to the Coordinator, then the node gone from Ray"
    if not final:
        return None
    if not gone:
        return False, "the node is still alive in Ray"
    return False, "the node went but its notice never reached the Coordinator"


def draw_plan(schedule: ChaosSchedule, seed: int | None = None) -> ChaosPlan:
    """The seeded plan (same seed, same plan). ``seed`` overrides ``schedule.chaos.seed``.
    Injected faults (actor and network) fall in ``[quiet_start_s, duration_s - min_gap_s]``
    in seeded order, each at least ``min_gap_s`` after the previous one's hold
    (``ChaosSchedule.hold_s``) ended. Raises ``ValueError`` if they do not fit."""
    chaos = schedule.chaos if seed is None else replace(schedule.chaos, seed=seed)
    kinds = (["coordinator"] * schedule.coordinator_kills + ["nan"] * schedule.nan_replicas
             + ["shape"] * schedule.shape_replicas + ["replica_kill"] * schedule.replica_kills
             + ["user_error"] * schedule.user_errors + ["disk_full"] * schedule.disk_fulls
             + ["partition"] * schedule.partitions + ["slow_node"] * schedule.slow_nodes)
    rng = random.Random(chaos.seed * 7919 + 1)
    rng.shuffle(kinds)
    start, end = chaos.quiet_start_s, chaos.duration_s - schedule.min_gap_s
    holds = [schedule.hold_s(k) for k in kinds]
    slack = (end - start) - schedule.min_gap_s * max(len(kinds) - 1, 0) - sum(holds)
    if slack < 0:
        raise ValueError(f"{len(kinds)} injected faults {schedule.min_gap_s:g} s apart (with "
                         f"{sum(holds):g} s of holds) do not fit in {end - start:g} s")
    offsets = sorted(rng.uniform(0.0, slack) for _ in kinds)
    faults, taken = [], 0.0
    for i, (o, k) in enumerate(zip(offsets, kinds)):
        faults.append(ActorFault(round(start + o + i * schedule.min_gap_s + taken, 3), k))
        taken += holds[i]
    return ChaosPlan(chaos_events(chaos), tuple(faults), chaos.duration_s, schedule.settle_s)


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
        why = fig.get("faults_missed") or []
        out.append(f"planned faults that did not happen: {missing}"
                   + (f" (first: {why[0]})" if why else ""))
    if fig["steps"] <= 0:
        out.append("no global step committed")
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
