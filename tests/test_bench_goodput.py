"""`moshray bench goodput`: the figures' math on plain data, bad input, and one short real run.

The real run is a subprocess (``python -m moshray.jobs.bench.goodput``) that starts its own
local clusters one after the other (so it never clashes with the session fixture cluster),
replays a tiny per-node trace (one removal, one addition) and trains a tiny model under
moshray and Ray Train, after calibrating both with 2 nodes. Its checks are about consistency, never about speed.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moshray.autoscaler.traces import NodeEvent, live_node_seconds
import moshray.jobs.bench.goodput_curves as gc
import moshray.jobs.bench.goodput_rates as gr
from moshray.jobs.bench.goodput_curves import Progress


def steps(*rows):
    return [Progress(t, step, samples, loss) for t, step, samples, loss in rows]


# --------------------------------------------------------------------------- pure math


def test_useful_curve_without_rollback_is_the_running_sum():
    records = steps((1.0, 1, 32, 5.0), (2.0, 2, 32, 4.0), (3.5, 3, 48, 3.0))
    assert gc.useful_curve(records) == ((0.0, 0), (1.0, 32), (2.0, 64), (3.5, 112))


def test_rollback_to_a_checkpoint_drops_the_lost_steps():
    # steps 1..5, crash, a new group resumes from the checkpoint after step 4 at t=10
    records = steps(*[(float(i), i, 32, None) for i in range(1, 6)],
                    (11.0, 5, 16, None), (12.0, 6, 16, None))
    result = gc.summarize("x", records, duration_s=20.0, gap_s=2.0, rewinds=[(0.5, 0), (10.0, 4)])
    assert [c for _, c in result.curve] == [0, 0, 32, 64, 96, 128, 160, 128, 144, 160]
    assert result.samples == 160  # 4 * 32 kept + 2 * 16 redone/new
    assert result.samples_processed == 5 * 32 + 2 * 16
    assert result.steps == 6
    # new highs at 1..5 s (160 at 5 s); 160 again at 12 s is not a new high, so the system
    # stalls from 5 s to the end of the window (15 s); the 1 s before the first step is < 2 s
    assert result.stall_s == pytest.approx(15.0)


def test_a_repeated_step_number_implies_a_rollback():
    records = steps((1.0, 1, 10, None), (2.0, 2, 10, None), (3.0, 2, 10, None))
    assert gc.useful_curve(records)[-1] == (3.0, 20)


def test_rewind_at_the_end_of_the_window_counts_the_loss():
    records = steps((1.0, 1, 10, None), (2.0, 2, 10, None))
    result = gc.summarize("x", records, 5.0, 2.0, rewinds=[(0.0, 0), (3.0, 0)])
    assert result.samples == 0 and result.steps == 0
    assert result.samples_processed == 20


def test_events_after_the_window_are_ignored():
    records = steps((1.0, 1, 10, 2.0), (9.0, 2, 10, 1.0))
    result = gc.summarize("x", records, 5.0, 10.0)
    assert result.samples == 10 and result.final_loss == 2.0
    assert result.goodput == pytest.approx(2.0)


def test_stall_counts_only_gaps_at_least_the_threshold():
    curve = [(0.0, 0), (3.0, 10), (3.5, 20), (4.0, 30), (9.0, 40)]
    assert gc.stall_seconds(curve, 10.0, gap_s=2.0) == pytest.approx(3.0 + 5.0)
    assert gc.stall_seconds([(0.0, 0)], 10.0, gap_s=2.0) == pytest.approx(10.0)
    with pytest.raises(ValueError):
        gc.stall_seconds(curve, 10.0, gap_s=0)


def test_final_loss_is_the_mean_of_the_last_steps():
    records = steps(*[(float(i), i, 1, float(i)) for i in range(1, 21)])
    assert gc.final_loss(records, 100.0, last=10) == pytest.approx(sum(range(11, 21)) / 10)
    assert gc.final_loss(steps((1.0, 1, 1, None)), 10.0) is None


def schedule_events():
    # two nodes from the start, slot 1 removed at 10 s, slot 1 back at 15 s, slot 2 at 20 s
    return (NodeEvent(0.0, "add", 0), NodeEvent(0.0, "add", 1), NodeEvent(10.0, "remove", 1),
            NodeEvent(15.0, "add", 1), NodeEvent(20.0, "add", 2))


def test_count_seconds_and_ideal_match_live_node_seconds():
    events = schedule_events()
    seconds = gr.count_seconds(events, 30.0)
    assert seconds == {2: 15.0, 1: 5.0, 3: 10.0}
    rates = gr.linear_rates(10.0, seconds)
    ideal = gr.ideal_samples(rates, seconds)
    assert ideal == pytest.approx(10.0 * live_node_seconds(events, 30.0))
    curve = gr.ideal_curve(events, rates, 30.0)
    assert curve[0] == (0.0, 0.0) and curve[-1] == (30.0, pytest.approx(ideal))
    assert gr.live_timeline(events, 30.0) == ((0.0, 2), (10.0, 1), (15.0, 2), (20.0, 3),
                                             (30.0, 3))
    with pytest.raises(gr.BenchError, match=r"\[3\]"):
        gr.ideal_samples({1: 5.0, 2: 9.0}, seconds)


def test_steady_rate_uses_full_steps_after_the_first():
    records = steps((1.0, 1, 8, None), (5.0, 2, 32, None), (6.0, 3, 32, None),
                    (7.0, 4, 32, None))
    assert gr.steady_rate(records, [1, 2, 2, 2], 2) == pytest.approx(64 / 2.0)
    # a later step without every node still counts: the window runs on from the first full one
    assert gr.steady_rate(records, [1, 2, 1, 2], 2) == pytest.approx(64 / 2.0)
    assert gr.steady_rate(records) == pytest.approx(96 / 6.0)
    with pytest.raises(gr.BenchError, match="--calib-seconds"):
        gr.steady_rate(records, [1, 1, 1, 2], 2)


def test_steady_window_runs_from_the_first_step_with_every_node():
    history = [(1, 2.0, 8, None, 1), (2, 5.0, 16, None, 2), (3, 9.5, 16, None, 1),
               (4, 12.0, 16, None, 2)]
    assert gr.steady_elapsed(history, 2) == pytest.approx(7.0)
    assert gr.steady_elapsed(history, 3) == -math.inf
    assert gr.steady_elapsed([], 1) == -math.inf


def test_a_calibration_is_stopped_once_its_steady_window_has_passed():
    from moshray.jobs.bench.goodput_moshray import steady_stop

    rows = [(1, 1.0, 8, None, 1), (2, 3.0, 16, None, 2), (3, 6.0, 16, None, 2),
            (4, 9.0, 16, None, 2)]
    stop_when = steady_stop(2, 5.0)
    # the job's supervision loop asks at every poll, with the history so far
    asked = [stop_when({"history": rows[:k]}) for k in range(len(rows) + 1)]
    assert asked == [False, False, False, False, True]  # at the 4th row: 9.0 - 3.0 >= 5
    assert not steady_stop(3, 1.0)({"history": rows})  # never 3 participants
    assert not stop_when({})  # a Coordinator not read yet


def test_a_killed_ray_train_driver_is_evaluated_on_its_newest_persisted_checkpoint(tmp_path):
    from moshray.jobs.bench.goodput_runs import latest_persisted

    assert latest_persisted(str(tmp_path)) is None
    run = tmp_path / "raytrain-baseline-1"
    for stamp in ("2026-11-25_00-16-14.747637", "2026-11-25_00-16-16.805877",
                  "2026-11-25_00-09-50.838672"):
        (run / f"checkpoint_{stamp}").mkdir(parents=True)
        (run / f"checkpoint_{stamp}" / "state.pt").write_bytes(b"x")
    (run / "checkpoint_2026-11-25_00-17-00.000000").mkdir()  # not written yet: no state
    assert latest_persisted(str(tmp_path)) == str(
        run / "checkpoint_2026-11-25_00-16-16.805877" / "state.pt")


def test_a_ray_train_run_is_kept_as_plain_json():
    from moshray.jobs.bench.goodput_runs import RayTrainRun

    run = RayTrainRun(records=(Progress(1.5, 1, 32, 5.2), Progress(2.0, 2, 64, None)),
                      rewinds=((0.0, 0),), checkpoint=None, error=None,
                      node_log=((30.0, "remove", 1),), worlds=(2, 1))
    out = json.loads(json.dumps(run.to_json()))
    assert out["steps"] == [[1.5, 1, 32, 5.2, 2], [2.0, 2, 64, None, 1]]
    assert out["rewinds"] == [[0.0, 0]] and out["node_log"] == [[30.0, "remove", 1]]


def test_ratio_is_none_when_the_baseline_did_nothing():
    assert gr.ratio(10, 4) == 2.5 and gr.ratio(10, 0) is None


# --------------------------------------------------------------------------- both systems' rates


def test_most_common_count_is_the_longest_held_ties_to_the_larger():
    assert gr.most_common_count({1: 5.0, 2: 15.0, 3: 10.0}) == 2
    assert gr.most_common_count({2: 10.0, 3: 10.0, 1: 2.0}) == 3
    assert gr.most_common_count({0: 50.0, 1: 1.0}) == 1  # no node: no rate to compare
    with pytest.raises(gr.BenchError, match="no live node"):
        gr.most_common_count({0: 30.0})


def test_best_rates_take_the_faster_system_at_each_count():
    rates, source = gr.best_rates({"moshray": {1: 50.0, 2: 90.0, 4: 120.0},
                                   "raytrain": {1: 60.0, 2: 90.0, 4: 100.0}})
    assert rates == {1: 60.0, 2: 90.0, 4: 120.0}
    assert source == {1: "raytrain", 2: "moshray", 4: "moshray"}  # a tie: the first named
    with pytest.raises(gr.BenchError, match=r"raytrain rate .* \[4\]"):
        gr.best_rates({"moshray": {2: 1.0, 4: 1.0}, "raytrain": {2: 1.0}})


def test_scaling_is_the_rate_at_the_largest_count_over_the_smallest_from_two():
    figure = gr.scaling({1: 80.0, 2: 100.0, 3: 95.0, 4: 90.0})
    assert (figure.low, figure.high) == (2, 4) and figure.value == pytest.approx(0.9)
    assert gr.scaling({1: 80.0, 2: 100.0}) is None  # one count >= 2: nothing to compare
    assert gr.scaling({2: 0.0, 4: 5.0}) is None


def test_compare_rates_ideal_steady_state_and_scalings():
    seconds = {1: 10.0, 2: 30.0, 4: 30.0}  # 2 and 4 tie: the larger count is the steady one
    cmp = gr.compare_rates({1: 50.0, 2: 100.0, 4: 90.0}, {1: 60.0, 2: 120.0, 4: 80.0}, seconds)
    assert cmp.ideal == {1: 60.0, 2: 120.0, 4: 90.0}
    assert cmp.ideal_source == {1: "raytrain", 2: "raytrain", 4: "moshray"}
    assert cmp.steady_nodes == 4 and cmp.steady_state_vs_raytrain == pytest.approx(90 / 80)
    assert cmp.moshray_scaling.value == pytest.approx(0.9)
    assert cmp.raytrain_scaling.value == pytest.approx(80 / 120)
    out = cmp.to_json()
    assert out["moshray_rate_by_nodes"] == {"1": 50.0, "2": 100.0, "4": 90.0}
    assert out["raytrain_rate_by_nodes"] == {"1": 60.0, "2": 120.0, "4": 80.0}
    assert out["rate_by_nodes"] == {"1": 60.0, "2": 120.0, "4": 90.0}
    assert out["per_node_samples_per_s"]["4"] == pytest.approx(22.5)
    assert out["scaling_nodes"] == [2, 4]
    assert out["scaling_vs_raytrain"] == pytest.approx(0.9 / (80 / 120))
    assert json.loads(json.dumps(out)) == out
    assert gr.ideal_samples(cmp.ideal, seconds) == pytest.approx(60 * 10 + 120 * 30 + 90 * 30)
    assert cmp.ideal_total == pytest.approx(60 * 10 + 120 * 30 + 90 * 30)
    # each system at its own rates on the trace's seconds; elasticity is measured against that
    assert cmp.failure_free == {"moshray": pytest.approx(50 * 10 + 100 * 30 + 90 * 30),
                                "raytrain": pytest.approx(60 * 10 + 120 * 30 + 80 * 30)}
    assert cmp.elasticity("moshray", 3100.0) == pytest.approx(0.5)
    assert cmp.own == {"moshray": {1: 50.0, 2: 100.0, 4: 90.0},
                       "raytrain": {1: 60.0, 2: 120.0, 4: 80.0}}
    assert out["moshray_failure_free_vs_ideal"] == pytest.approx(6200 / 6900)
    assert out["raytrain_failure_free_samples"] == pytest.approx(6600)
    with pytest.raises(gr.BenchError, match=r"moshray rate .* \[4\]"):
        gr.compare_rates({1: 50.0, 2: 100.0}, {1: 60.0, 2: 120.0, 4: 80.0}, seconds)


def test_compare_rates_with_one_calibration_count_scales_the_better_per_node_rate():
    seconds = {1: 10.0, 2: 5.0, 3: 30.0}
    cmp = gr.compare_rates({2: 100.0}, {2: 80.0}, seconds, calib_nodes=2)
    assert cmp.ideal == {1: 50.0, 2: 100.0, 3: 150.0}
    assert set(cmp.ideal_source.values()) == {"moshray"}
    assert cmp.steady_nodes == 2 and cmp.steady_state_vs_raytrain == pytest.approx(1.25)
    assert cmp.moshray_scaling is None and cmp.raytrain_scaling is None
    assert cmp.to_json()["scaling_vs_raytrain"] is None
    # one count measured: each system's own per-node rate, linearly, like the ideal
    assert cmp.failure_free["moshray"] == pytest.approx(50 * 10 + 100 * 5 + 150 * 30)
    assert cmp.failure_free["raytrain"] == pytest.approx(40 * 10 + 80 * 5 + 120 * 30)
    assert cmp.own["raytrain"] == {1: 40.0, 2: 80.0, 3: 120.0}
    assert cmp.to_json()["moshray_failure_free_vs_ideal"] == pytest.approx(1.0)
    with pytest.raises(gr.BenchError, match="raytrain"):
        gr.compare_rates({2: 100.0}, {}, seconds, calib_nodes=2)


def test_baseline_refuses_a_non_positive_steady_window():
    from moshray.jobs.bench.raytrain_baseline import BaselineConfig

    base = dict(train={}, files=("f",), max_workers=2, deadline_unix=0.0, storage_path="s",
                recorder="r")
    assert BaselineConfig(**base, steady_seconds=40.0).steady_seconds == 40.0
    with pytest.raises(ValueError, match="steady_seconds"):
        BaselineConfig(**base, steady_seconds=0.0)


# --------------------------------------------------------------------------- bad input


def run_cli(*args: str) -> int:
    from moshray.jobs.cli import main

    return main(["bench", "goodput", *args])


def test_missing_trace_exits_2_with_one_line(tmp_path, capsys):
    assert run_cli("--trace", str(tmp_path / "nope.csv"), "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--trace" in err[0] and "nope.csv" in err[0]


def test_malformed_trace_exits_2_naming_the_line(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,n0\n5,explode,n0\n")
    assert run_cli("--trace", str(trace), "--out", str(tmp_path)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "t.csv:2" in err[0] and "explode" in err[0]


def test_a_shipped_trace_name_passes_the_trace_check(tmp_path, capsys):
    from moshray.autoscaler.traces import DEFAULT_TRACE

    assert run_cli("--trace", DEFAULT_TRACE, "--out", str(tmp_path), "--duration", "0") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--duration" in err[0]


@pytest.mark.parametrize("args, needle", [
    (["--duration", "0"], "--duration"),
    (["--max-nodes", "0"], "--max-nodes"),
    (["--calib-nodes", "5", "--max-nodes", "2"], "--calib-nodes"),
    (["--set", "model.n_layers"], "KEY=VALUE"),
    (["--set", "training.lr=-1"], "training.lr"),
    (["--set", "model.d_modle=64"], "model.d_modle"),
    (["--links", "lan"], "unknown link profile 'lan'; choose one of fast"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, args, needle):
    trace = tmp_path / "t.csv"
    trace.write_text("0,2\n10,1\n")
    assert run_cli("--trace", str(trace), "--out", str(tmp_path / "out"), *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]


# --------------------------------------------------------------------------- a real run

TINY = ["--set", "model.n_layers=1", "--set", "model.d_model=32", "--set", "model.d_ff=64",
        "--set", "model.n_heads=2", "--set", "model.seq_len=32",
        "--set", "training.batch_size=8", "--set", "training.target_batch_size=16",
        "--set", "training.round_timeout_s=5"]


@pytest.mark.cluster
@pytest.mark.timeout(1500)
def test_short_run_reports_consistent_figures_for_all_three(tmp_path: Path):
    # Two nodes; node1 is preempted at 60 s and node2 arrives at 65 s; 75 s per system
    # (node2 comes early enough for moshray's controller to start a replica on it).
    # The removal comes late because Ray Train alone needs ~25-50 s to start its first
    # worker group on a loaded 2-core machine, and every system must have made progress.
    # Ray Train's restart after the removal takes longer than the 15 s left, so its samples
    # come from before 60 s (as they did in the 90-s version of this run).
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,node0\n0,add,node1\n60000,remove,node1\n65000,add,node2\n")
    out = tmp_path / "out"
    calib_s, startup_s = 5, 240
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "moshray.jobs.bench.goodput", "--trace", str(trace),
         "--time-scale", "1", "--max-nodes", "2", "--duration", "75", "--calib-nodes", "2",
         "--calib-seconds", str(calib_s), "--checkpoint-every", "10",
         "--startup-timeout", str(startup_s), "--finish-timeout", "180", "--out", str(out), *TINY,
         "--set", "cluster.notice_s=5", "--json"],
        capture_output=True, text=True, timeout=1400, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == json.loads((out / "goodput.json").read_text())

    for system in ("moshray", "raytrain", "ideal"):
        assert result[f"{system}_samples"] > 0, system
        assert result[f"{system}_goodput"] == pytest.approx(result[f"{system}_samples"] / 75)
    assert result["moshray_vs_ideal"] == pytest.approx(
        result["moshray_samples"] / result["ideal_samples"])
    assert result["moshray_vs_raytrain"] == pytest.approx(
        result["moshray_samples"] / result["raytrain_samples"])
    # the ideal is the measured per-node rate times the trace's live node-seconds
    assert result["live_node_seconds"] == pytest.approx(2 * 60 + 1 * 5 + 2 * 10)
    assert result["ideal_samples"] == pytest.approx(
        result["per_node_samples_per_s"]["2"] * result["live_node_seconds"])
    # both systems calibrated with 2 nodes; the ideal takes the better rate
    m_rate, rt_rate = (result["moshray_rate_by_nodes"]["2"], result["raytrain_rate_by_nodes"]["2"])
    assert m_rate > 0 and rt_rate > 0
    assert result["rate_by_nodes"]["2"] == pytest.approx(max(m_rate, rt_rate))
    assert result["steady_state_nodes"] == 2
    assert result["steady_state_vs_raytrain"] == pytest.approx(m_rate / rt_rate)
    assert result["moshray_scaling"] is None  # one calibration count: no scaling figure
    # the gap to the ideal, split: what the node events cost and what the rates allow
    for system, rate in (("moshray", m_rate), ("raytrain", rt_rate)):
        ff = result[f"{system}_failure_free_samples"]
        assert ff == pytest.approx(rate / 2 * result["live_node_seconds"])
        assert result[f"{system}_elasticity"] == pytest.approx(result[f"{system}_samples"] / ff)
    assert result["moshray_vs_ideal"] == pytest.approx(
        result["moshray_elasticity"] * result["moshray_failure_free_vs_ideal"])
    # when the samples went missing: the parts add up to failure-free minus useful samples
    for system in ("moshray", "raytrain"):
        gap = result[f"{system}_gap"]
        assert gap["window_s"] == 20.0
        assert sum(gap[c]["slices"] for c in ("startup", "node_events", "steady")) == 4
        assert [piece[0] for piece in gap["by_slice"]] == [0.0, 20.0, 40.0, 60.0]
        assert gap["missing"] == pytest.approx(
            result[f"{system}_failure_free_samples"] - result[f"{system}_samples"])
    assert result["moshray_gap"]["node_events"]["slices"] >= 1  # 60-75 s: a removal, an add
    # moshray's joins, from its controller's replica timelines: node2 joined at 65 s
    starts = result["moshray_replica_starts"]
    assert starts["started"] >= 3 and 1 <= starts["trained"] <= starts["started"]
    assert 0 < starts["to_training_median_s"] <= starts["to_training_max_s"] < 75
    assert "moshray's joins: " in proc.stdout and " replicas started, " in proc.stdout
    assert "samples missing against each system's own rates" in proc.stdout
    assert "moshray's worst slices: " in proc.stdout
    # where the machine's CPU went in each trace run: both trained, Ray's daemons ran
    for system in ("moshray", "raytrain"):
        cpu = result[f"{system}_cpu"]
        assert cpu["wall_s"] >= 75 and cpu["cpus"] == os.cpu_count()
        assert cpu["cpu_s"]["training"] > 0 and cpu["cpu_s"]["ray_daemons"] > 0, cpu
        assert sum(cpu["cpu_s"].values()) <= cpu["wall_s"] * cpu["cpus"] * 1.02, cpu
    assert proc.stdout.count("CPU by role over ") == 3
    # Ray Train + torchft beside them: the same trace, its quorum's figures
    assert result["raytrain_torchft_missing"] is None
    # (Ray Train + torchft replaces a lost replica group only in its placement group's slot:
    # until a node comes for it, fit() does not return and the bench ends the driver, its
    # figures read from the recorder and the newest checkpoint)
    assert result["raytrain_torchft_error"] in (None, "driver killed after --finish-timeout")
    assert result["raytrain_torchft_samples"] > 0
    assert result["moshray_vs_raytrain_torchft"] == pytest.approx(
        result["moshray_samples"] / result["raytrain_torchft_samples"])
    assert result["raytrain_torchft_replica_starts"] >= 2  # one per node at the start
    assert result["raytrain_torchft_discarded_steps"] >= 0
    assert result["raytrain_torchft_eval_loss"] is not None
    assert result["raytrain_torchft_cpu"]["cpu_s"]["training"] > 0
    assert "Ray Train + torchft" in proc.stdout and "moshray / Ray Train + torchft" in proc.stdout
    # the machine's speed, read before, between and after the runs
    probes = result["machine_step_ms"]
    assert list(probes) == ["start", "after_calibrations", "after_moshray", "end"]
    assert all(ms > 0 for ms in probes.values()), probes
    assert result["machine_drift"] == pytest.approx(max(probes.values()) / min(probes.values()))
    assert "machine speed" in proc.stdout
    for system in ("moshray", "raytrain", "raytrain_torchft"):
        assert result[f"{system}_final_loss"] is not None
        assert 0 <= result[f"{system}_stall_s"] <= 75
        assert 0 < result[f"{system}_first_step_s"] <= 75
        assert result[f"{system}_eval_loss"] is not None
    assert result["raytrain_samples_processed"] >= result["raytrain_samples"]
    assert result["raytrain_error"] is None
    assert result["moshray_preemptions"] >= 1
    # Ray Train's steps are kept next to its driver's log, as moshray's history is
    rt_records = sorted(out.glob("raytrain-*/**/raytrain-records.json"))
    # its calibration and its trace run, and Ray Train + torchft's trace run
    assert len(rt_records) == 3, rt_records
    assert all(json.loads(r.read_text())["steps"] for r in rt_records)
    # moshray ran as driver processes of its own: 1 calibration and the trace run
    results = sorted(out.glob("moshray-*/**/moshray-result.json"))
    assert len(results) == 2, results
    assert all(json.loads(r.read_text())["history"] for r in results)
    for r in results:  # each driver is a job of its own: its own summary.json, its profile
        summary = json.loads(r.read_text())["summary"]
        assert json.loads((r.parent / "summary.json").read_text())["steps"] == summary["steps"]
        assert summary["step_profile"]["steps"] > 0, summary.get("step_profile")
    # the calibration ended by its steady window (stop_when), not at its max_seconds bound
    calib = json.loads(next(r for r in results if "calib" in str(r)).read_text())
    assert calib["summary"]["wall_s"] < startup_s + calib_s - 30, calib["summary"]["wall_s"]
    plot = Path(result["plot"])
    assert plot.parent == out and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_participation_counts_replicas_per_step_inside_the_window():
    records = steps((1.0, 1, 32, None), (2.0, 2, 32, None), (3.0, 3, 40, None), (9.0, 4, 32, None))
    fig = gc.participation(records, [1, 3, 2, 3], duration_s=5.0)
    assert fig["steps"] == 3 and fig["max"] == 3
    assert fig["mean"] == pytest.approx(2.0)
    assert fig["steps_by_peers"] == {"1": 1, "2": 1, "3": 1}
    assert fig["multi_step_share"] == pytest.approx(2 / 3)
    assert fig["multi_sample_share"] == pytest.approx(72 / 104)
    assert gc.participation([], [], 5.0)["mean"] is None
    with pytest.raises(ValueError):
        gc.participation(records, [1], 5.0)
