"""`moshray jobs` / `moshray stop` without a cluster, and their pure parts (no Ray started)."""

from __future__ import annotations

import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from moshray.jobs.manage import JobRow, job_state, render


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("command", [["jobs"], ["stop", "alice"]])
def test_no_cluster_at_the_address_is_one_line_and_exit_2(command):
    address = f"127.0.0.1:{_closed_port()}"
    proc = subprocess.run([sys.executable, "-m", "moshray.jobs.cli", *command, "--address",
                           address], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moshray: no Ray cluster answers at "), lines
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_a_malformed_address_is_named_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "moshray.jobs.cli", "jobs", "--address",
                           "not-an-address"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        proc.stderr.strip()] and "'not-an-address'" in proc.stderr


def test_job_state_and_table():
    record = SimpleNamespace(stopping=False, stop_requested=False)
    assert job_state(record, True) == "running"
    assert job_state(record, False) == "driver gone"
    assert job_state(SimpleNamespace(stopping=False, stop_requested=True), True) == "stopping"
    assert render([]) == "no training jobs on this cluster"
    table = render([JobRow("alice", "running", 12, 2, 3, "03000000"),
                    JobRow("bob", "driver gone", None, 1, 1, "04000000")]).splitlines()
    assert table[0].split() == ["NAME", "STATE", "STEP", "NODES", "REPLICAS", "DRIVER"]
    assert table[1].split() == ["alice", "running", "12", "2", "3", "03000000"]
    assert table[2].split() == ["bob", "driver", "gone", "?", "1", "1", "04000000"]
