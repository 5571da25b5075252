"""`moshray bench recovery`: the figures' math and bad input without Ray, and one short real run.

The real run is a subprocess (``python -m moshray.jobs.bench.recovery``) that starts its own
local cluster (so it never clashes with the session fixture cluster), runs the training job
on it (twice: dense, then with DMoE layers) and one trial of cloud events with a tiny model.
Its checks are about the JSON's shape and sanity, never about the targets.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moshray.cluster.coordinator.core import CoordinatorCore
from moshray.cluster.coordinator.membership import MembershipConfig
from moshray.cluster.coordinator.progress import ProgressReport
import moshray.jobs.bench.recovery as br
import moshray.jobs.bench.recovery_steps as rs
KEYS = [k for m in br.MEASURES for k in (m, f"{m}_max")]


def samples(**values):
    out = {m: [1.0] for m in br.MEASURES}
    out.update(values)
    return out


# --------------------------------------------------------------------------- pure parts


def test_aggregate_gives_median_and_worst_of_every_measure():
    got = br.aggregate(samples(notice_to_rebalanced_s=[0.5, 0.1, 0.3],
                               join_to_contribution_s=[4.0, 2.0]))
    assert sorted(got) == sorted(KEYS)
    assert got["notice_to_rebalanced_s"] == 0.3 and got["notice_to_rebalanced_s_max"] == 0.5
    assert got["join_to_contribution_s"] == 3.0 and got["join_to_contribution_s_max"] == 4.0


@pytest.mark.parametrize("values, needle", [
    ([], "no sample of expert_respawn_s"),
    ([1.0, math.nan], "finite"),
    ([-0.1], ">= 0"),
])
def test_aggregate_rejects_missing_or_bad_samples(values, needle):
    with pytest.raises(ValueError, match=needle):
        br.aggregate(samples(expert_respawn_s=values))


def test_summary_has_the_eight_figures_samples_and_target_verdicts():
    s = br.summarize(samples(notice_to_rebalanced_s=[2.0], hard_kill_to_progress_s=[4.0]),
                     {"trials": 1})
    assert all(k in s for k in KEYS) and s["trials"] == 1
    assert s["samples"]["hard_kill_to_progress_s"] == [4.0]
    assert s["meets_targets"] == {"notice_to_rebalanced_s": False,
                                  "hard_kill_to_progress_s": True,
                                  "join_to_contribution_s": True}
    json.dumps(s)  # JSON-able as is


STEPS = [  # (epoch, planned_at_s, committed_at_s, participants)
    (1, 1.0, 2.0, ("a", "b", "c")),
    (2, 3.0, 9.0, ("a", "b", "c")),  # waited for c's contribution until the deadline
    (3, 9.5, 10.0, ("a", "b")),
    (4, 10.5, None, ("a", "b", "d")),  # d's first step, not committed yet
]


def test_first_commit_with_and_without_a_peer():
    assert rs.first_commit_with(STEPS, "a") == 2.0
    assert rs.first_commit_with(STEPS, "d") is None
    assert rs.first_commit_without(STEPS, "c", after_s=5.0) == 10.0
    assert rs.first_commit_without(STEPS, "c", after_s=10.0) is None
    assert rs.first_commit_after(STEPS, 5.0) == 9.0  # step 2 still had c in it
    assert rs.first_commit_after(STEPS, 10.0) is None
    assert rs.all_contributed(STEPS, ["a", "b", "c"])
    assert not rs.all_contributed(STEPS, ["a", "d"])


def test_replica_of_a_slot_is_its_newest_replica():
    members = ["replica-1-2", "replica-10-3", "replica-1-7", "replica-2-4", "replica-1-x"]
    assert rs.replica_of(1, members) == "replica-1-7"  # not replica-10-3, not a bad suffix
    assert rs.replica_of(10, members) == "replica-10-3"
    assert rs.replica_of(3, members) is None


def test_job_config_bounds_the_job_and_adds_experts_only_for_the_moe_run():
    from moshray.jobs.config import TrainConfig

    base = TrainConfig()
    dense = br.job_config(base, nodes=6, bound_s=120.0, run_dir="r/job")
    moe = br.job_config(base, nodes=2, bound_s=120.0, run_dir="r/job-moe", moe=True)
    assert dense.training.max_seconds == 120.0 and dense.metrics.port == 0 and dense.json
    assert dense.cluster.max_nodes == 6 and dense.cluster.min_nodes == 1
    assert not dense.model.moe and moe.model.moe and moe.cluster.max_nodes == 4
    assert base.training.max_seconds is None  # the caller's config is left as it was


def test_median_step_is_the_median_gap_between_plans():
    assert rs.median_step_s(STEPS) == 2.0  # gaps 2.0, 6.5, 1.0
    assert rs.median_step_s(STEPS[:1]) is None


def test_coordinator_step_timings_record_plan_commit_and_participants():
    clock = [100.0]
    core = CoordinatorCore(MembershipConfig(peer_ttl_s=1e6), clock=lambda: clock[0],
                           target_batch_size=4)
    for peer in "ab":
        core.register(peer, None, f"n-{peer}")
        core.mark_ready(peer, 0)
    clock[0] += 1
    replies = [core.report(ProgressReport(p, 0, 2)) for p in "ab"]
    assert any(r.plan is not None for r in replies)
    assert core.step_timings()["steps"] == [(1, 1.0, None, ("a", "b"))]
    clock[0] += 2
    core.report(ProgressReport("b", 1, 1))  # b applied step 1: committed
    clock[0] += 1
    core.report(ProgressReport("a", 1, 1))  # later reports keep the first commit time
    got = core.step_timings()
    assert got["steps"] == [(1, 1.0, 3.0, ("a", "b"))] and got["now_s"] == 4.0
    assert core.step_timings(since_epoch=1)["steps"] == []


def run_cli(*args: str) -> int:
    from moshray.jobs.cli import main

    return main(["bench", "recovery", *args])


@pytest.mark.parametrize("args, needle", [
    (["--trials", "0"], "--trials"),
    (["--nodes", "1"], "--nodes"),
    (["--notice-s", "0"], "--notice-s"),
    (["--timeout", "-5"], "--timeout"),
    (["--set", "model.n_layers"], "KEY=VALUE"),
    (["--set", "model.d_modle=64"], "model.d_modle"),
    (["--set", "training.batch_size=0"], "training.batch_size"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, args, needle):
    assert run_cli("--out", str(tmp_path), *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not list(tmp_path.iterdir())  # nothing started, nothing written


def test_plot_is_written_next_to_the_json(tmp_path):
    s = br.summarize(samples(), {"trials": 1, "nodes": 3})
    out = br.write_outputs(s, str(tmp_path), lambda *a: None)
    assert out["json"] == str(tmp_path / "recovery.json")
    assert Path(out["plot"]) == tmp_path / "recovery.png"
    assert (tmp_path / "recovery.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "recovery.json").read_text()) == out


# --------------------------------------------------------------------------- a real run

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=64", "--set", "model.d_ff=128",
        "--set", "model.seq_len=32", "--set", "training.target_batch_size=16",
        "--set", "training.batch_size=4"]


@pytest.mark.cluster
@pytest.mark.timeout(420)
def test_one_trial_reports_all_eight_figures(tmp_path: Path):
    out = tmp_path / "out"
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "moshray.jobs.bench.recovery", "--trials", "1", "--nodes", "3",
         "--notice-s", "3", "--timeout", "150", "--out", str(out), *TINY, "--json"],
        capture_output=True, text=True, timeout=390, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((out / "recovery.json").read_text())
    for key in KEYS:
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, \
            (key, result[key])
        assert result[key.removesuffix("_max")] <= result[key.removesuffix("_max") + "_max"]
    assert len(result["samples"]["join_to_contribution_s"]) == 2  # after the notice and the kill
    # Where each join's time and CPU went: its instants in order, ending at the join figure;
    # the new node's replica and daemons used CPU, and so did the replicas already training.
    profiles = result["join_profiles"]
    assert len(profiles) == 2
    for p, join_s in zip(profiles, result["samples"]["join_to_contribution_s"]):
        assert 0 < p["registered_s"] <= p["ready_s"] <= p["committed_s"] == round(join_s, 2)
        cpu = p["cpu_s"]
        assert cpu["replica"] > 0.5 and cpu["node"] > 0 and cpu["running_replicas"] > 0, p
        assert sum(cpu.values()) <= p["window_s"] * p["cpus"] * 1.05, p
        start = p["start_cpu_s"]  # to ready: a part of the window's
        assert 0.5 < start["replica"] <= cpu["replica"] and start["node"] > 0, p
    [any_commit] = result["hard_kill_to_any_commit_s"]
    assert 0 < any_commit <= result["hard_kill_to_progress_s"]
    assert (out / "recovery.png").stat().st_size > 0
    # The figures came from the real job: it trained through the events and ended cleanly.
    job = result["job"]
    assert job["steps"] > 0 and job["nodes_joined"] == 2 and job["hard_losses"] == 1
    assert job["notices"] == 1 and job["replicas_consistent"], job
    assert result["job_moe"]["steps"] >= 0 and result["experts_moved"][0] > 0
