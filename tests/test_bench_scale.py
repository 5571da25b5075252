"""`moshray bench scale` at its smallest: the figures come from what the simulated peers and
the real Coordinator core and averagers did (no Ray)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from moshray.jobs.bench import scale


def test_held_and_error_reads_whose_weight_each_part_holds():
    n, w = 4, np.array([1.0, 2.0, 3.0, 4.0])
    full = np.tile(w / w.sum(), 3)  # every block holds all four
    held, err = scale.held_and_error(full, n, w)
    assert held.all() and err < 1e-12
    # a part boundary inside block 1: its first two places from the block before ({0..3}),
    # the rest from the block after ({0, 1, 2}: peer 3's part lost it); no error
    after = np.where(np.arange(4) < 3, w / 6.0, 0.0)
    cut = np.concatenate([w / w.sum(), np.concatenate([(w / w.sum())[:2], after[2:]]),
                          after])
    held, err = scale.held_and_error(cut, n, w)
    assert held.tolist() == [True, True, True, False] and err < 1e-12
    # a wrong weight is an error, wherever it is
    wrong = full.copy()
    wrong[5] *= 1.5
    assert scale.held_and_error(wrong, n, w)[1] > 0.1


def test_fit_tells_growth_apart():
    ns = [16, 64, 256, 1024]
    assert scale.fit(ns, [3.0 * n + 5 for n in ns]) == "O(N)"
    assert scale.fit(ns, [0.01 * n * n for n in ns]) == "O(N^2)"
    assert scale.fit(ns, [7.0, 7.0, 7.0, 7.0]) == "O(1)"
    assert scale.fit(ns[:2], [1.0, 2.0]) == ""


def test_control_plane_figures_come_from_the_calls_it_made():
    figures = scale.control_plane(16, steps=3, memory_steps=5, churn=0.1, max_group=8, seed=0)
    # the real core planned and committed steps (fewer than the simulated seconds: a peer
    # that died in the last plan holds the next step until it missed two heartbeats)
    assert 1 <= figures["global_steps_made"] <= 3
    assert scale.control_plane(16, 3, 0, 0.0, 8, 0)["global_steps_made"] == 3  # no churn
    assert figures["coordinator_ms_per_step"] > 0
    # the same CPU per simulated second, whatever the step rate
    assert figures["coordinator_ms_per_second"] * 3 == pytest.approx(
        figures["coordinator_ms_per_step"] * figures["global_steps_made"], rel=0.01)
    assert 0 <= figures["global_steps_per_second"] <= 1
    # each peer heartbeats and reports at least once per step; the plan went to each
    assert figures["messages_per_peer_per_step"] >= 4
    assert figures["plan_bytes"] > 0 and figures["control_bytes_per_peer_per_step"] > 0
    assert figures["store_writes_per_step"] > 0  # the history row, at least
    assert figures["rounds"] == 2 and 2 <= figures["group_size_max"] <= 8  # a 4 x 4 grid
    assert figures["coordinator_memory_mb"] > 0
    assert figures["silent_deaths"] >= 1  # churn 0.1 of 16 peers over 11 steps


def test_the_long_memory_run_counts_global_steps_and_says_how_far_it_got():
    figures = scale.memory_run(16, 20, churn=0.1, max_group=8, seed=0, points=4)
    assert figures["global_steps_for_memory"] >= 20 and figures["memory_complete"]
    assert figures["steps_for_memory"] >= 20  # simulated seconds (the churn slows steps)
    assert [e for e, _ in figures["memory_curve"]] == sorted(
        e for e, _ in figures["memory_curve"]) and len(figures["memory_curve"]) == 4
    assert 0 < figures["coordinator_memory_mb"] == figures["memory_curve"][-1][1]
    assert figures["history_rows"] == figures["global_steps_for_memory"]
    short = scale.memory_run(16, 10**6, churn=0.1, max_group=8, seed=0, budget_s=0.5)
    assert not short["memory_complete"] and 0 < short["global_steps_for_memory"] < 10**6
    via = scale.control_plane(16, 2, 0, 0.1, 8, 0, memory_global_steps=5)
    assert via["memory_method"] == "object graph" and via["global_steps_for_memory"] >= 5


def test_retained_bytes_counts_what_an_object_holds_once():
    shared = list(range(1000))
    holder = {"a": shared, "b": shared}
    alone = scale.retained_bytes(shared)
    assert alone < scale.retained_bytes(holder) < 2 * alone  # the shared list once
    assert scale.retained_bytes(holder, (shared,)) < alone / 10  # excluded


def test_collective_is_exact_without_deaths_and_counts_what_deaths_cost():
    figures = scale.collective(16, steps=2, numel=256, deaths=0.25, max_group=8,
                               compression="none", seed=0)
    assert figures["grid_rounds"] == 2 and figures["numel"] == 256
    assert figures["averaged_share"] == 1.0  # every live contribution, exactly
    assert 0 < figures["bytes_per_peer_per_step"] <= figures["grid_bytes_per_peer_per_step"]
    assert 0 < figures["averaged_share_with_deaths"] < 1.0  # a quarter died mid-round
    # whatever each survivor holds, it holds it as the exact weighted mean
    assert figures["exact_results_with_deaths"] == 1.0
    assert figures["max_abs_error"] <= scale.EXACT
    clean = scale.collective(16, steps=1, numel=256, deaths=0.0, max_group=8,
                             compression="none", seed=1)
    assert clean["max_abs_error"] <= scale.EXACT and clean["averaged_share_with_deaths"] == 1.0


def test_the_command_prints_one_json_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "moshray.jobs.cli", "bench", "scale", "--peers", "4,9,16",
         "--steps", "2", "--memory-global-steps", "3", "--avg-steps", "1", "--numel", "64",
         "--out", str(tmp_path), "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(result["by_peers"]) == ["16", "4", "9"]
    for figures in result["by_peers"].values():
        for key in ("coordinator_ms_per_step", "coordinator_memory_mb",
                    "bytes_per_peer_per_step", "grid_bytes_per_peer_per_step",
                    "averaged_share_with_deaths", "max_abs_error"):
            assert key in figures, key
        assert figures["global_steps_for_memory"] >= 3 and figures["memory_complete"]
    assert set(result["fits"]) == set(scale.FIGURES)
    assert (tmp_path / "scale.png").stat().st_size > 0
    assert json.loads((tmp_path / "scale.json").read_text())["peers"] == [4, 9, 16]


@pytest.mark.parametrize("argv,says", [(["--peers", "1,4"], "every count must be >= 2"),
                                        (["--peers", "x"], "give peer counts"),
                                        (["--churn", "0.7"], "--churn must be")])
def test_bad_arguments_are_one_line(argv, says):
    proc = subprocess.run([sys.executable, "-m", "moshray.jobs.cli", "bench", "scale", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and says in proc.stderr
