"""Chaos: seeded schedules (pure) and a bounded chaos run of the training job.

The run replays a seeded schedule of preemptions with notice, hard kills and replacement
nodes onto a local cluster while the job trains; at the end every surviving replica holds
identical parameters, the global step advanced, no committed step was lost or applied
twice, and the job completed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moshray.autoscaler.chaos import ChaosConfig, chaos_events, write_trace
from moshray.autoscaler.trace import load_trace

from test_train import train


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


def test_schedules_mix_notices_and_kills():
    kinds = {e.kind for s in range(8) for e in chaos_events(ChaosConfig(seed=s, losses=5))}
    assert kinds == {"add", "remove", "kill"}
    assert chaos_events(ChaosConfig(seed=1)) != chaos_events(ChaosConfig(seed=2))


def test_bad_chaos_config_is_refused():
    with pytest.raises(ValueError, match="min_live"):
        ChaosConfig(nodes=2, min_live=3)
    with pytest.raises(ValueError, match="kill_fraction"):
        ChaosConfig(kill_fraction=1.5)


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_chaos_run_keeps_replicas_identical_and_loses_no_step(tmp_path: Path):
    config = ChaosConfig(seed=2, nodes=3, duration_s=70, losses=4, kill_fraction=0.5,
                         replace_after_s=5, min_live=2)
    events = chaos_events(config)
    assert {"remove", "kill"} <= {e.kind for e in events}
    trace = write_trace(events, tmp_path / "chaos.csv")
    proc, summary = train("--local-nodes", "3", "--max-nodes", "3", "--trace", str(trace),
                          "--time-scale", "1", "--max-seconds", "80",
                          "--set", "cluster.notice_s=3", timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert summary is not None
    losses = [e for e in events if e.kind != "add"]
    assert summary["preemptions"] >= len(losses) - 1  # a loss near the end may go unseen
    assert summary["hard_losses"] >= 1
    assert summary["steps"] > 10
    assert summary["lost_steps"] == 0
    assert summary["replicas_consistent"] is True, json.dumps(summary)
