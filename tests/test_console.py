"""The training console (jobs/run_report.py): the progress line's figures as pure functions,
the cadence off a terminal, and the bar on a terminal. No Ray."""

from __future__ import annotations

import io

import pytest

from moshray.jobs.run_report import (
    Bounds,
    Console,
    ConsoleStream,
    Rate,
    clock_text,
    done_line,
    eta_s,
    progress_line,
    sig4,
    trailing_rate,
)


def test_loss_has_four_significant_digits():
    assert sig4(5.424000475141737) == "5.424"
    assert sig4(0.000123456) == "0.0001235"
    assert sig4(12345.6) == "1.235e+04"
    assert sig4(5.43) == "5.430" and sig4(100.0) == "100.0"
    assert sig4(None) == "-" and sig4(float("nan")) == "-"


def test_samples_per_s_is_over_the_recent_window_not_since_the_start():
    # a slow start (10 samples/s for 100 s), then 100 samples/s: the window sees only the end
    slow = [(i, float(i * 10), 100, 3.0, 2) for i in range(1, 11)]  # steps at 10..100 s
    fast = [(10 + i, 100.0 + i, 100, 2.0, 2) for i in range(1, 21)]  # one a second
    rate = trailing_rate(slow + fast, 120.0, window_s=10.0)
    assert rate.samples_per_s == pytest.approx(100.0)
    assert rate.steps_per_s == pytest.approx(1.0)
    cumulative = sum(h[2] for h in slow + fast) / 120.0
    assert cumulative < 30  # what the old console showed


def test_the_rate_is_what_was_committed_in_the_window_ending_now():
    assert trailing_rate([], 5.0) == Rate(0.0, 0.0)
    # one step in the last 10 s: a rate (the old console showed 0.0 below two steps)
    assert trailing_rate([(1, 5.0, 64, 3.0, 2)], 12.0) == Rate(6.4, 0.1)
    # no step in the last 10 s: 0.0, as the plot draws that stretch
    assert trailing_rate([(1, 5.0, 64, 3.0, 2)], 20.0) == Rate(0.0, 0.0)
    assert trailing_rate([(1, 1.0, 64, 3.0, 2)], 2.0) == Rate(32.0, 0.5)  # span: since start
    # rows of an earlier Coordinator's clock (times after now) are outside the window
    rows = [(1, 40.0, 64, 3.0, 2), (2, 50.0, 64, 3.0, 2),
            (3, 1.0, 32, 2.9, 1), (4, 2.0, 32, 2.8, 1), (5, 3.0, 32, 2.7, 1)]
    assert trailing_rate(rows, 4.0, window_s=60.0) == Rate(24.0, 0.75)
    with pytest.raises(ValueError):
        trailing_rate(rows, 4.0, window_s=0.0)


def test_the_console_reads_the_rate_at_the_coordinators_now():
    history = [(1, 5.0, 64, 3.0, 2), (2, 9.0, 64, 3.0, 2)]
    console = Console(io.StringIO(), tty=False)
    assert "12.8 samples/s" in console.line({"history": history, "now_s": 10.0}, 10.0)[0]
    assert "0.0 samples/s" in console.line({"history": history, "now_s": 30.0}, 30.0)[0]


def test_eta_takes_the_nearest_bound():
    rate = Rate(samples_per_s=640.0, steps_per_s=2.0)
    assert eta_s(Bounds(max_steps=100), 40, 30.0, rate) == pytest.approx(30.0)  # 60 steps / 2
    assert eta_s(Bounds(max_seconds=50), 40, 30.0, rate) == pytest.approx(20.0)
    assert eta_s(Bounds(max_steps=100, max_seconds=50), 40, 30.0, rate) == pytest.approx(20.0)
    # 0.5 epochs took 30 s: 1.5 more take 90 s
    assert eta_s(Bounds(max_epochs=2), 40, 30.0, rate, epochs_done=0.5) == pytest.approx(90.0)
    assert eta_s(Bounds(), 40, 30.0, rate) is None  # unbounded
    assert eta_s(Bounds(max_steps=100), 1, 0.5, Rate(0.0, 0.0)) is None  # no rate yet
    assert eta_s(Bounds(max_seconds=50), 40, 80.0, rate) == 0.0  # past the bound
    assert clock_text(65) == "1:05" and clock_text(3909) == "1:05:09" and clock_text(None) == "?"


def test_progress_line_says_steps_rate_loss_peers_preemptions_and_eta():
    line = progress_line(120, Rate(812.34, 2.0), 5.424000475141737, live=3, preemptions=1,
                         bounds=Bounds(max_steps=500), eta=190.0)
    assert line == ("step 120 of 500 | 812.3 samples/s | loss 5.424 | peers 3 | preemptions 1 "
                    "| ETA 3:10")
    assert "ETA" not in progress_line(5, Rate(1.0, 1.0), None, 1, 0)  # unbounded: no ETA
    assert "loss -" in progress_line(5, Rate(1.0, 1.0), None, 1, 0)


def _stats(step: int, at_s: float, loss: float = 2.5) -> dict:
    history = [(i, at_s - (step - i), 64, loss, 2) for i in range(1, step + 1)]
    return {"history": history, "epoch": step, "live": 2, "preemptions": 0}


def test_off_a_terminal_one_line_every_interval_not_one_per_step():
    now = [0.0]
    out = io.StringIO()
    console = Console(out, Bounds(max_seconds=60), tty=False, interval_s=10.0,
                      clock=lambda: now[0])
    for tick in range(1, 51):  # a step every 0.5 s for 25 s, a poll each
        now[0] = tick * 0.5
        console.show(_stats(tick, tick * 0.5), elapsed=now[0])
    console.close(_stats(51, 25.5), elapsed=25.6)
    lines = out.getvalue().splitlines()
    # the first step, then at 10.5 s and 20.5 s, then the last: not 51 lines
    assert [line.split()[1] for line in lines] == ["1", "21", "41", "51"]
    assert all("samples/s" in line and "ETA" in line for line in lines)


def test_off_a_terminal_no_new_step_prints_nothing():
    now = [0.0]
    out = io.StringIO()
    console = Console(out, tty=False, interval_s=1.0, clock=lambda: now[0])
    console.show(_stats(3, 3.0), 3.0)
    now[0] = 100.0
    console.show(_stats(3, 3.0), 100.0)  # the run is stuck at step 3: no repeat
    console.close(_stats(3, 3.0), 101.0)
    assert len(out.getvalue().splitlines()) == 1


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_one_line_is_redrawn_in_place():
    out = _Tty()
    console = Console(out, Bounds(max_steps=40))
    for step in range(1, 41):
        console.show(_stats(step, float(step)), elapsed=float(step))
    console.close(_stats(40, 40.0), elapsed=40.0)
    text = out.getvalue()
    assert text.count("\n") == 1  # one line, closed at the end
    assert text.count("\r") >= 40  # redrawn in place each time
    last = text.rstrip("\n").rsplit("\r", 1)[-1]
    assert "100%" in last and "step 40 of 40" in last and "loss 2.5" in last


def test_a_line_printed_under_the_bar_clears_it_and_keeps_it_one_line():
    raw = _Tty()
    out = ConsoleStream(raw)
    console = Console(out, Bounds(max_steps=10))
    console.show(_stats(2, 2.0), 2.0)
    print("node 1 lost", file=out)  # what the controller prints while the bar is up
    console.show(_stats(3, 3.0), 3.0)
    console.close(_stats(3, 3.0), 3.0)
    lines = raw.getvalue().split("\n")
    assert lines[0].rsplit("\r", 1)[-1].strip() == "node 1 lost"  # bar cleared, line kept
    assert "step 3 of 10" in lines[1].rsplit("\r", 1)[-1]


def test_an_error_ends_the_bar_so_its_message_starts_a_line_of_its_own():
    from moshray.jobs.run_report import close_open_consoles

    out = _Tty()
    console = Console(out, Bounds(max_steps=10))
    console.show(_stats(2, 2.0), 2.0)
    close_open_consoles()  # what run_job does when the run raises
    print("moshray: the job failed", file=out)
    assert out.getvalue().split("\n")[-2] == "moshray: the job failed"
    close_open_consoles()  # nothing open: nothing happens


def test_rays_own_processes_lines_stay_off_the_console_and_the_replicas_lines_show():
    """Ray's log monitor forwards lines of its raylet and GCS server (``gcs_server ...
    Failed to kill actor NIL_ID``) and of moshray's notice watchers to the driver's printer:
    they are dropped there (Ray's session log files keep them); a replica's own output is
    printed."""
    from ray._private.ray_logging import global_worker_stdstream_dispatcher as hub

    from moshray.jobs.run_report import quiet_ray_logs

    printed = []
    saved = list(hub.handlers)
    hub.add_handler("ray_print_logs", printed.append)  # as ray.init(log_to_driver=True)
    try:
        assert quiet_ray_logs() and quiet_ray_logs()  # idempotent
        gcs = {"pid": "gcs_server", "lines": ["[gcs_actor_manager.cc] Failed to kill actor "
                                              "NIL_ID"], "is_err": True}
        raylet = {"pid": "raylet", "lines": ["[raylet] worker died"], "is_err": True}
        replica = {"pid": 4242, "actor_name": "ReplicaActor", "lines": ["loss 2.5"],
                   "is_err": False}
        watcher = {"pid": 4343, "actor_name": "NoticeWatcher", "is_err": True,
                   "lines": ["node 423f49c1d176: terminate notice, 0.4 s left"]}
        for data in (gcs, raylet, watcher, replica):
            hub.emit(data)
    finally:
        hub.handlers = saved
    assert printed == [replica]


def test_the_end_line_names_the_run_directory_the_plot_and_the_summary(tmp_path):
    summary = {"steps": 10, "samples": 640, "wall_s": 5.0, "samples_per_s": 128.0,
               "preemptions": 1, "initial_loss": 5.424000475141737,
               "final_loss": 3.2109876, "replicas_consistent": True,
               "plot": str(tmp_path / "training.png")}
    text = done_line(summary, str(tmp_path))
    assert "loss 5.424 -> 3.211" in text
    last = text.splitlines()[-1]
    assert str(tmp_path) in last and "summary.json" in last and "training.png" in last


def test_the_end_lines_say_what_the_replica_starts_came_to():
    from moshray.jobs.controller.replica_states import replica_starts

    timelines = {"r0": [("starting", 0.0), ("syncing", 4.0), ("training", 9.0)],
                 "r1": [("starting", 10.0), ("training", 16.5), ("gone", 40.0)],
                 "r2": [("starting", 20.0), ("gone", 23.0)],  # its node went first
                 "r3": [("starting", 50.0)]}  # still starting at the end
    summary = {"steps": 10, "samples": 640, "wall_s": 5.0, "samples_per_s": 128.0,
               "preemptions": 1, "initial_loss": 5.0, "final_loss": 3.0,
               "replicas_consistent": True,
               "replica_starts": replica_starts(timelines).to_json()}
    assert summary["replica_starts"] == {
        "started": 4, "trained": 2, "to_training_median_s": 7.75, "to_training_max_s": 9.0,
        "gone_untrained": 1, "gone_untrained_s": 3.0}
    assert done_line(summary).splitlines()[1] == (
        "replica starts: 4 replicas started, 2 trained (start -> training median 7.8 s, "
        "max 9.0 s), 1 gone before training (3.0 s of starting)")
    assert len(done_line(dict(summary, replica_starts=None)).splitlines()) == 1


@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.skipif(__import__("shutil").which("tmux") is None, reason="needs tmux")
def test_moshray_train_on_a_terminal_shows_one_redrawn_line_and_no_ray_internals(tmp_path):
    """A newcomer's first run: `moshray train --max-seconds 40` in a real terminal (tmux, its own
    server socket), the screen captured at the end: one progress line, the end lines, and
    none of Ray's own processes' lines or the metadata emulator's tracebacks."""
    import os
    import shlex
    import subprocess
    import sys
    import time

    sock = f"moshray-test-{os.getpid()}"
    done = tmp_path / "rc"
    run_dir = tmp_path / "run"
    command = (f"{shlex.quote(sys.executable)} -m moshray.jobs.cli train --max-seconds 40 "
               f"--metrics-port 0 --set run_dir={shlex.quote(str(run_dir))}; "
               f"echo $? > {shlex.quote(str(done))}; sleep 600")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "TMUX")}
    tmux = ["tmux", "-L", sock]
    subprocess.run([*tmux, "new-session", "-d", "-x", "160", "-y", "60", command],
                   check=True, env=env, timeout=30)
    try:
        deadline = time.monotonic() + 400
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(1.0)
        screen = subprocess.run([*tmux, "capture-pane", "-p", "-J", "-S", "-2000"],
                                capture_output=True, text=True, timeout=30).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], timeout=30)
    (tmp_path / "screen.txt").write_text(screen)
    assert done.exists(), "moshray train did not end within 400 s:\n" + screen[-3000:]
    assert done.read_text().strip() == "0", screen[-3000:]
    lines = [line for line in screen.splitlines() if line.strip()]
    progress = [line for line in lines if "samples/s | loss" in line]
    assert len(progress) == 1, screen  # one line, redrawn in place
    assert "step " in progress[0] and "preemptions" in progress[0] and "ETA" in progress[0]
    assert any(line.startswith("done:") for line in lines), screen
    assert any(line.startswith(f"run directory: {run_dir} (summary.json, training.png)")
               for line in lines), screen
    for internal in ("gcs_server", "raylet", "Traceback", "ConnectionResetError",
                     "NIL_ID", "INFO worker.py"):
        assert internal not in screen, screen
