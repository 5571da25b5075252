"""Chaos: seeded schedules (pure) and a bounded chaos run of the training job.

The run (`moshray bench chaos --schedule short`, a subprocess with its own embedded cluster)
replays a seeded schedule of spot notices, hard kills and replacement nodes while the job
trains, kills the Coordinator twice, makes one replica send NaN and one a wrong shape, kills
one replica's process, makes one user loop raise and (as root) fills the checkpoint disk
during a save. Every fault is counted from what was
observed. At the end: every planned fault observed, no committed step lost or repeated, no
rollback, the expected replica count, the bad replicas quarantined, every staying replica
bitwise identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import replace
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


def test_a_loss_never_leaves_fewer_warm_nodes_than_asked():
    """A node just added has not yet copied the swarm's state: losses keep ``min_warm``
    nodes that have been up for ``warm_s``, so the trace never takes every holder."""
    # denser than the long schedule (a loss every ~7 s), where the rule has work to do
    config = replace(SCHEDULES["long"].chaos, duration_s=300, min_gap_s=5.0, losses=36)
    events = chaos_events(config)
    up_at: dict[str, float] = {}
    for e in events:
        if e.kind == "add":
            up_at[e.node] = e.at_s
            continue
        up_at.pop(e.node)
        warm = [n for n, t in up_at.items() if e.at_s - t >= config.warm_s]
        assert len(warm) >= config.min_warm, (e, up_at)
    looser = chaos_events(replace(config, min_warm=0))
    assert len([e for e in looser if e.kind != "add"]) > \
        len([e for e in events if e.kind != "add"])  # the rule did skip losses


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
    with pytest.raises(ValueError, match="min_warm"):
        ChaosConfig(nodes=3, min_live=2, min_warm=3)
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


def test_network_faults_wait_out_their_windows_and_only_run_on_separate_hosts():
    schedule = SCHEDULES["short"]
    plan = draw_plan(schedule)
    kinds = [f.kind for f in plan.actor_faults]
    assert {"partition", "slow_node"} <= set(kinds)
    for a, b in zip(plan.actor_faults, plan.actor_faults[1:]):
        # the next fault comes min_gap_s after the previous one's window ended
        assert b.at_s - a.at_s >= schedule.min_gap_s + schedule.hold_s(a.kind) - 1e-6
    loopback = draw_plan(schedule.without_network())
    assert loopback.planned["partition"] == loopback.planned["slow_node"] == 0
    assert sum(plan.planned.values()) == sum(loopback.planned.values()) + 2
    with pytest.raises(ValueError, match="holds"):
        draw_plan(replace(schedule, partitions=9))


def test_quiet_slots_leave_out_nodes_with_a_trace_event_due():
    from moshray.autoscaler.traces.schedule import NodeEvent
    from moshray.jobs.local.cloud import quiet_slots

    events = [NodeEvent(10.0, "remove", 1), NodeEvent(30.0, "add", 2), NodeEvent(2.0, "kill", 0)]
    assert quiet_slots(events, [0, 1, 2], elapsed_s=5.0, window_s=10.0) == [0, 2]
    assert quiet_slots(events, [0, 1, 2], elapsed_s=5.0, window_s=30.0) == [0]


def test_the_clouds_thread_runs_queued_calls_and_hands_back_errors():
    import threading

    from moshray.jobs.local.cloud import LocalCloud

    cloud = LocalCloud(cluster=None, notice_s=1.0)
    main = threading.current_thread()
    seen = {}

    def caller():
        seen["value"] = cloud.call(lambda: threading.current_thread() is main, timeout_s=10)
        try:
            cloud.call(lambda: 1 / 0, timeout_s=10)
        except ZeroDivisionError as exc:
            seen["error"] = exc

    thread = threading.Thread(target=caller)
    thread.start()
    deadline = time.monotonic() + 10
    while thread.is_alive() and time.monotonic() < deadline:
        cloud.serve(0.2)
    thread.join(timeout=5)
    assert seen["value"] is True and isinstance(seen["error"], ZeroDivisionError)
    with pytest.raises(TimeoutError, match="within 0.1 s"):
        cloud.call(lambda: None, timeout_s=0.1)  # nobody serves


def test_the_kernels_qdisc_counters_are_read():
    from moshray.jobs.local.netns import parse_qdisc_stats

    text = ("qdisc tbf 8001: root refcnt 2 rate 2Mbit burst 24224b lat 200ms\n"
            " Sent 1234 bytes 12 pkt (dropped 1, overlimits 7 requeues 0)\n")
    assert parse_qdisc_stats(text) == {"sent_bytes": 1234, "sent_packets": 12, "dropped": 1,
                                       "overlimits": 7}
    assert parse_qdisc_stats("")["overlimits"] == 0


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
    # disk_full needs root (a small tmpfs for the checkpoints); elsewhere it is ruled out
    # with that reason, and not planned.
    full_disk = 0 if "disk_full" in fig["faults_ruled_out"] else 1
    assert fig["faults_by_kind"] == {"notice": 1, "kill": 1, "coordinator": 2, "nan": 1,
                                     "shape": 1, "replica_kill": 1, "user_error": 1,
                                     "disk_full": full_disk, "partition": 0, "slow_node": 0}
    assert fig["faults_missed"] == [] and fig["faults_planned"] == fig["faults_by_kind"]
    assert {"partition", "slow_node", "driver"} <= set(fig["faults_ruled_out"])
    assert (os.geteuid() == 0) == (full_disk == 1)
    assert fig["lost"] == 0 and fig["repeated"] == 0 and fig["rollbacks"] == 0
    assert fig["replicas_at_end"] == fig["expected_replicas"] == 3
    assert len(fig["bad_replicas"]) == 2
    assert set(fig["bad_replicas"]) <= set(fig["quarantined"]) | set(fig["bad_lost"])
    assert set(fig["quarantined"]) <= set(fig["bad_replicas"])  # no good one
    assert fig["replicas_consistent"] is True and fig["steps"] > 10


def test_join_times_run_from_a_replicas_start_to_its_first_training_state():
    from moshray.jobs.controller.replica_states import join_seconds

    timelines = {"r1": [("starting", 1.0), ("syncing", 3.0), ("training", 7.5), ("gone", 9)],
                 "r2": [("starting", 2.0), ("gone", 4.0)]}
    assert join_seconds(timelines) == [6.5]


# --------------------------------------------------------------------------- observed counts


def test_node_faults_count_only_once_observed():
    from moshray.jobs.bench.chaos_plan import node_fault_outcome

    alive, noticed = {"a", "b"}, {"c"}
    assert node_fault_outcome("kill", "a", alive, noticed) is None  # not yet gone
    assert node_fault_outcome("kill", "x", alive, noticed) == (True, "node gone from Ray")
    assert node_fault_outcome("notice", "c", alive, noticed)[0] is True  # noticed, then gone
    assert node_fault_outcome("notice", "d", alive, noticed) is None  # gone, notice unseen
    assert node_fault_outcome("notice", "d", alive, noticed, final=True) == (
        False, "the node went but its notice never reached the Coordinator")
    assert node_fault_outcome("kill", "a", alive, noticed, final=True) == (
        False, "the node is still alive in Ray")


def test_the_ledger_counts_observations_not_attempts():
    from moshray.jobs.bench.chaos_plan import FaultLedger

    ledger = FaultLedger()
    seen = ledger.tried("kill", "n1", 1.0)
    unseen = ledger.tried("coordinator", "pid 7", 2.0)
    ledger.not_done("notice", "slot 3", 3.0, "slot 3 has no live node")
    assert [r.kind for _, r in ledger.pending()] == ["kill", "coordinator"]
    ledger.decide(seen, True, "node gone from Ray")
    ledger.decide(seen, False, "ignored: already decided")
    ledger.decide(unseen, False, "not back in a new process within 30 s")
    counts = ledger.observed()
    assert counts["kill"] == 1 and counts["coordinator"] == 0 and counts["notice"] == 0
    assert ledger.missed() == ["coordinator pid 7: not back in a new process within 30 s",
                               "notice slot 3: slot 3 has no live node"]
    fig = {"lost": 0, "repeated": 0, "rollbacks": 0, "bad_replicas": [], "quarantined": [],
           "bad_lost": [], "replicas_at_end": 3, "expected_replicas": 3,
           "replicas_consistent": True, "steps": 10, "faults_by_kind": counts,
           "faults_planned": {"kill": 1, "coordinator": 1, "notice": 1},
           "faults_missed": ledger.missed()}
    [line] = invariant_failures(fig)
    assert line == ("planned faults that did not happen: {'coordinator': 1, 'notice': 1} "
                    "(first: coordinator pid 7: not back in a new process within 30 s)")


class _Slots:
    """The embedded cluster's slot interface (live slots, node ids, add/remove/notice), kept
    in memory: what LocalCloud drives, without Ray."""

    def __init__(self, live):
        self.live, self.calls = dict(live), []

    def live_slots(self):
        return tuple(sorted(self.live))

    def node_id(self, slot):
        return self.live[slot]

    def add_node(self, slot):
        self.live[slot] = f"node-{slot}-new"
        self.calls.append(("add", slot))

    def remove_node(self, slot, hard=False):
        del self.live[slot]
        self.calls.append(("kill" if hard else "remove", slot))

    def notice(self, slot, notice_s):
        self.calls.append(("notice", slot))


def test_local_cloud_records_a_dead_slot_as_a_fault_that_did_not_happen(caplog):
    from moshray.jobs.local.cloud import LocalCloud

    heard = []
    slots = _Slots({0: "n0", 1: "n1"})
    cloud = LocalCloud(slots, notice_s=3.0, on_event=heard.append)
    cloud.kill(1)
    cloud.notice(1)  # its node is gone: nothing done, and said so
    cloud.remove(1)
    cloud.add(2)
    assert slots.calls == [("kill", 1), ("add", 2)]
    assert [(e.kind, e.slot, e.node_id, e.done) for e in heard] == [
        ("kill", 1, "n1", True), ("notice", 1, None, False), ("remove", 1, None, False),
        ("add", 2, "node-2-new", True)]
    assert heard[2].reason == "slot 1 has no live node" and cloud.events == heard
    assert "remove of slot 1 not done: slot 1 has no live node" in caplog.text


def test_production_code_has_no_fault_hooks():
    """Faults come from the bench's wrappers (``chaos_faults``), not from parameters or
    attributes of the strategies and the step manager."""
    import inspect

    from moshray.actors.replica.step_manager import StepManager
    from moshray.actors.replica.strategies import STRATEGIES, Strategy

    for cls in (Strategy, *STRATEGIES.values()):
        for method in ("after_backward", "contribution", "global_step"):
            assert "fault" not in inspect.signature(getattr(cls, method)).parameters
    manager = StepManager("p0", None, None, "n0", round_timeout_s=1.0)
    assert not hasattr(manager, "fault")


@pytest.mark.parametrize("fault,reason", [("nan", "non_finite"), ("shape", "shape_mismatch")])
def test_a_faulty_averager_sends_bad_contributions_through_the_real_round(fault, reason):
    """``FaultyAverager`` (what ``set_replica_fault`` installs in a replica) changes only
    what the wrapped averager is given: the others reject it with the fault's reason, the
    wrapped one gets back tensors shaped as it passed them, and the transport calls reach
    the wrapped averager."""
    import asyncio

    import numpy as np
    import torch

    from moshray.cluster.collective.averager import Averager
    from moshray.cluster.collective.auth import new_job_key
    from moshray.cluster.coordinator.membership import Membership, MembershipConfig
    from moshray.cluster.collective.transport import LocalNetwork
    from moshray.cluster.messages import PeerInfo
    from moshray.jobs.bench.chaos_faults import FaultyAverager

    network, key = LocalNetwork(), new_job_key()
    membership = Membership(MembershipConfig(max_group=16, min_part=1))
    averagers = {}
    for pid in ("p0", "p1", "p2"):
        averagers[pid] = Averager(pid, transport=network.transport(pid), job_key=key)
        membership.register(PeerInfo(pid, pid), now=0.0)
    averagers["p2"] = FaultyAverager(averagers["p2"], fault)
    for pid, averager in averagers.items():
        network.add(pid, averager)  # its deliver_* calls go through the wrapper
    plan = membership.plan(now=0.0)
    tensors = {p: [torch.full((40,), float(i + 1)), torch.ones(3)]
               for i, p in enumerate(averagers)}

    async def run():
        return await asyncio.gather(*(a.all_reduce(tensors[p], 1.0, plan, 2.0)
                                      for p, a in averagers.items()))

    (good, rep0), _, (bad, _) = asyncio.run(run())
    assert {r.reason.value for r in rep0.rejections if r.sender == "p2"} == {reason}
    assert torch.allclose(good[0], torch.full((40,), 1.5))  # the mean of p0 and p1
    assert [t.shape for t in bad] == [t.shape for t in tensors["p2"]]
    assert all(np.isfinite(t.numpy()).all() for t in bad)
    with pytest.raises(ValueError, match="unknown fault"):
        FaultyAverager(averagers["p0"], "bogus")
