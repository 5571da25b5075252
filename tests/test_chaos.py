"""Chaos: seeded schedules (pure) and a bounded chaos run of the training job.

The run (`moshray bench chaos --schedule short`, a subprocess with its own embedded cluster)
replays a seeded schedule of spot notices, hard kills and replacement nodes while the job
trains, kills the Coordinator twice and makes one replica send NaN and one a wrong shape. At
the end: no committed step lost or repeated, no rollback, the expected replica count, the bad
replicas quarantined, every staying replica bitwise identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moshray.jobs.bench.chaos_schedule import ChaosConfig, chaos_events, write_trace
from moshray.autoscaler.traces import load_trace

from moshray.jobs.bench.chaos_plan import (SCHEDULES, draw_plan, invariant_failures, stall_causes,
                                     stalled_seconds)


def live_over_time(events) -> list[int]:
    live, counts = 0, []
    for e in events:
        live += 1 if e.kind == "add" else -1
        counts.append(live)
    return counts


@pytest.mark.parametrize("seed", range(8))
def test_schedule_is_seeded_and_keeps_min_live(seed: int, tmp_path: Path):
    config = ChaosConfig(seed=seed, nodes=3, duration_s=60, losses=5, min_live=2)
    events = chaos_events(config)
    assert events == chaos_events(config)  # same seed, same schedule
    after_start = live_over_time(events)[config.nodes:]
    assert min(after_start, default=config.nodes) >= config.min_live
    losses = [e for e in events if e.kind != "add"]
    assert all(config.quiet_start_s <= e.at_s <= config.duration_s for e in losses)
    gaps = [b.at_s - a.at_s for a, b in zip(losses, losses[1:])]
    assert all(g >= config.min_gap_s for g in gaps)
    trace = load_trace(write_trace(events, tmp_path / "chaos.csv"))
    assert trace.per_node and len(trace.node_events) == len(events)


def test_stalls_are_attributed_to_the_faults_near_them():
    advances = [0.0, 1.0, 6.0, 7.0, 17.0, 18.0, 21.0]  # gaps of 5, 10 and 3 s stall
    events = [(0.5, "coordinator"), (8.0, "kill"), (9.0, "join"), (30.0, "nan")]
    causes = stall_causes(advances, events)
    assert causes == {"coordinator": 5.0, "join": 5.0, "kill": 5.0, "none": 3.0}
    assert sum(causes.values()) == stalled_seconds(advances)


def test_schedules_mix_notices_and_kills():
    kinds = {e.kind for s in range(8) for e in chaos_events(ChaosConfig(seed=s, losses=5))}
    assert kinds == {"add", "remove", "kill"}
    assert chaos_events(ChaosConfig(seed=1)) != chaos_events(ChaosConfig(seed=2))


def test_bad_chaos_config_is_refused():
    with pytest.raises(ValueError, match="min_live"):
        ChaosConfig(nodes=2, min_live=3)
    with pytest.raises(ValueError, match="kill_fraction"):
        ChaosConfig(kill_fraction=1.5)


def test_long_schedule_has_at_least_50_faults_of_every_kind():
    plan = draw_plan(SCHEDULES["long"])
    assert plan == draw_plan(SCHEDULES["long"])  # seeded
    assert sum(plan.planned.values()) >= 50
    assert all(n > 0 for n in plan.planned.values()), plan.planned
    times = [f.at_s for f in plan.actor_faults]
    assert times == sorted(times)
    assert all(b - a >= SCHEDULES["long"].min_gap_s - 1e-6 for a, b in zip(times, times[1:]))
    assert times[-1] <= plan.duration_s and plan.nodes_at_end == 4
    assert draw_plan(SCHEDULES["long"], seed=5) != plan


def test_stalls_and_invariants_are_judged_from_figures():
    assert stalled_seconds([0.0, 0.5, 1.0, 6.0, 6.2]) == pytest.approx(5.0)
    good = {"lost": 0, "repeated": 0, "rollbacks": 0, "bad_replicas": ["a", "b"],
            "quarantined": ["a"], "bad_lost": ["b"], "replicas_at_end": 3,
            "expected_replicas": 3, "replicas_consistent": True, "steps": 10,
            "faults_by_kind": {"nan": 2}, "faults_planned": {"nan": 2}}
    assert invariant_failures(good) == []
    bad = {**good, "repeated": 1, "quarantined": [], "replicas_at_end": 2,
           "replicas_consistent": False, "faults_by_kind": {"nan": 1}}
    failures = invariant_failures(bad)
    assert len(failures) == 5 and "['a']" in failures[1] and "{'nan': 1}" in failures[4]
    assert invariant_failures({**good, "quarantined": ["a", "c"]}) == [
        "good replicas quarantined: ['c']"]


@pytest.mark.cluster
@pytest.mark.timeout(400)
def test_short_chaos_run_loses_nothing_and_quarantines_the_bad_replicas(tmp_path: Path):
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", "moshray.jobs.bench.chaos", "--schedule",
                           "short", "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=360, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stderr[-4000:]
    fig = json.loads(lines[-1])
    assert proc.returncode == 0, (fig, proc.stderr.strip().splitlines()[-1:])
    assert fig["faults_by_kind"] == {"notice": 1, "kill": 2, "coordinator": 2, "nan": 1,
                                     "shape": 1}
    assert fig["lost"] == 0 and fig["repeated"] == 0 and fig["rollbacks"] == 0
    assert fig["replicas_at_end"] == fig["expected_replicas"] == 3
    assert len(fig["bad_replicas"]) == 2
    assert set(fig["bad_replicas"]) <= set(fig["quarantined"]) | set(fig["bad_lost"])
    assert set(fig["quarantined"]) <= set(fig["bad_replicas"])  # no good one
    assert fig["replicas_consistent"] is True and fig["steps"] > 10


def test_join_times_run_from_a_replicas_start_to_its_first_training_state():
    from moshray.jobs.bench.chaos_plan import join_seconds

    timelines = {"r1": [("starting", 1.0), ("syncing", 3.0), ("training", 7.5), ("gone", 9)],
                 "r2": [("starting", 2.0), ("gone", 4.0)]}
    assert join_seconds(timelines) == [6.5]
