"""moshray's bench runs as driver processes of their own: the parent's bounds and errors.

The whole path (calibrations and the trace run as real drivers) runs in
``test_bench_goodput.py``'s short real run; these tests stand a small script in for the
driver, to check what the parent does when a driver fails or overstays, in seconds.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

import moshray.jobs.bench.goodput_moshray as gm
from moshray.jobs.config import load_config
from moshray.jobs.bench.goodput_rates import BenchError


def _config(max_seconds: float):
    return load_config(None, {"training.max_seconds": repr(max_seconds),
                              "training.max_steps": "none"})


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def test_the_driver_command_carries_the_steady_window(tmp_path):
    cmd = gm._driver_command(tmp_path / "c.json", tmp_path / "r.json", (3, 40.0))
    assert cmd[:3] == [sys.executable, "-m", "moshray.jobs.bench.goodput_moshray"]
    assert cmd[cmd.index("--steady-nodes") + 1] == "3"
    assert float(cmd[cmd.index("--steady-seconds") + 1]) == 40.0
    assert "--steady-nodes" not in gm._driver_command(tmp_path / "c", tmp_path / "r", None)


def test_the_driver_refuses_half_a_steady_window(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        gm.main(["--config", str(tmp_path / "c.json"), "--out", str(tmp_path / "r.json"),
                 "--steady-nodes", "2"])
    assert exc.value.code == 2
    assert "--steady-seconds" in capsys.readouterr().err


def test_a_driver_that_ends_without_a_result_is_one_line_naming_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(gm, "_driver_command", lambda *_: [
        sys.executable, "-c", "import sys; print('the job failed here'); sys.exit(3)"])
    with pytest.raises(BenchError) as exc:
        gm.run_moshray_driver(_config(5), tmp_path / "run", startup_timeout_s=5,
                              finish_timeout_s=5)
    message = str(exc.value)
    assert "\n" not in message and "status 3" in message
    log = tmp_path / "run" / "moshray-driver.log"
    assert str(log) in message and "the job failed here" in log.read_text()
    assert (tmp_path / "run" / "moshray-config.json").exists()  # what the driver was given


@pytest.mark.timeout(60)
def test_a_driver_past_its_bound_is_stopped_with_everything_it_started(tmp_path, monkeypatch):
    # A driver that ignores SIGTERM and has started a child of its own (as the embedded
    # cluster's raylets are): past its bound, the whole process group is killed.
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n")
    monkeypatch.setattr(gm, "_driver_command", lambda *_: [sys.executable, "-c", script])
    monkeypatch.setattr(gm, "TERM_GRACE_S", 1.0)
    started = time.monotonic()
    with pytest.raises(BenchError, match="no result"):
        gm.run_moshray_driver(_config(1), tmp_path / "run", startup_timeout_s=1,
                              finish_timeout_s=1)
    assert time.monotonic() - started < 30
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = not _gone(grandchild)
    if left:  # never leave it behind, then fail
        os.kill(grandchild, 9)
    assert not left
