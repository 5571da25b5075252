"""``jobs/bench/join_profile.py``: a join's instants and its CPU by role (pure), and the ``/proc``
reader on this machine's real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from moshray.jobs.bench.join_profile import (ROLES, JoinProfile, ProcSample, cpu_by_role, descendants,
                                       node_cpu, parse_stat, read_procs, role_of)


def sample(pid, ppid, title, cpu, started=100):
    return ProcSample(pid, ppid, started, title, cpu)


def test_parse_stat_reads_parent_start_cpu_and_title():
    # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice threads itrealvalue starttime ...
    stat = ("4242 (ray::Replica) S 17 4242 4242 0 -1 4194304 10 0 0 0 250 50 0 0 20 0 9 0 "
            "123456 1000 200 18446744073709551615")
    p = parse_stat(4242, stat, b"ray::ReplicaActor.run\0\0", hz=100)
    assert (p.pid, p.ppid, p.started, p.title, p.cpu_s) == (
        4242, 17, 123456, "ray::ReplicaActor.run", 3.0)
    # a name with spaces and parentheses, no command line (a kernel thread): the stat's name
    q = parse_stat(7, stat.replace("(ray::Replica)", "(a (b) c)"), b"", hz=100)
    assert q.title == "a (b) c" and q.ppid == 17
    with pytest.raises(ValueError):
        parse_stat(1, "garbage", b"", hz=100)


def test_descendants_follow_the_tree_from_live_roots_only():
    procs = {p.pid: p for p in [sample(10, 1, "raylet", 1), sample(11, 10, "agent", 1),
                                 sample(12, 11, "worker", 1), sample(20, 1, "other", 1)]}
    assert descendants(procs, [10]) == {10, 11, 12}
    assert descendants(procs, [99, 20]) == {20}  # a root that is gone adds nothing


def test_roles_by_title_and_node():
    assert role_of("ray::ReplicaActor.receive_result", True) == "replica"
    assert role_of("ray::NoticeWatcher", True) == "watcher"
    assert role_of("ray::IDLE", True) == role_of("raylet --x", True) == "node"
    assert role_of("ray::ReplicaActor", False) == "running_replicas"
    assert role_of("ray::Coordinator", False) == role_of("ray::NoticeWatcher", False) == "rest"


def test_cpu_by_role_counts_what_each_process_used_in_between():
    before = {p.pid: p for p in [
        sample(1, 0, "ray::ReplicaActor.run", 10.0),       # a running replica
        sample(2, 0, "ray::Coordinator", 5.0),
        sample(3, 0, "ray::ReplicaActor.run", 50.0),       # ends before the second sample
        sample(7, 0, "old process", 9.0, started=1),       # its pid is reused by a new one
    ]}
    after = {p.pid: p for p in [
        sample(1, 0, "ray::ReplicaActor.run", 14.5),
        sample(2, 0, "ray::Coordinator", 5.5),
        sample(30, 0, "raylet", 1.0),                      # the new node
        sample(31, 30, "ray::DashboardAgent", 2.0),
        sample(32, 30, "ray::ReplicaActor.run", 6.0),
        sample(7, 30, "ray::NoticeWatcher", 1.5, started=500),
    ]}
    got = cpu_by_role(before, after, [30])
    assert list(got) == list(ROLES)
    assert got == {"replica": 6.0, "watcher": 1.5, "node": 3.0, "running_replicas": 4.5,
                   "rest": 0.5}


def test_node_cpu_is_the_new_nodes_processes_since_they_started():
    procs = {p.pid: p for p in [sample(30, 1, "raylet", 1.0), sample(31, 30, "ray::IDLE", 0.5),
                                 sample(32, 30, "ray::ReplicaActor", 6.0),
                                 sample(33, 30, "ray::NoticeWatcher", 1.0),
                                 sample(5, 1, "ray::ReplicaActor", 99.0)]}
    assert node_cpu(procs, [30]) == {"replica": 6.0, "watcher": 1.0, "node": 1.5}


def test_profile_json_and_line():
    start = {"replica": 5.0, "watcher": 1.25, "node": 2.5}
    p = JoinProfile(9.5, 11.0, 20.25, 22.0, 2, {"replica": 7.0, "watcher": 1.5, "node": 3.0,
                                                "running_replicas": 20.0, "rest": 4.0}, start)
    assert p.to_json() == {"registered_s": 9.5, "ready_s": 11.0, "committed_s": 20.25,
                           "window_s": 22.0, "cpus": 2, "cpu_s": p.cpu_s, "start_cpu_s": start}
    assert p.line() == ("registered 9.5 s, ready 11.0 s, committed 20.2 s; CPU-s to ready: "
                        "replica 5.0, watcher 1.2, node daemons 2.5; to the commit: new node "
                        "11.5, running replicas 20.0, rest 4.0 (of 44.0 available)")
    assert JoinProfile(1, 2, 3, 4, 2, None).line() == \
        "registered 1.0 s, ready 2.0 s, committed 3.0 s"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc on this system")
def test_read_procs_sees_a_child_burn_cpu_under_this_process():
    child = subprocess.Popen([sys.executable, "-c",
                              "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\n"
                              "time.sleep(30)"])
    try:
        before = read_procs()
        assert before[os.getpid()].ppid == os.getppid()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            after = read_procs()
            if child.pid in after and after[child.pid].cpu_s >= 0.45:
                break
            time.sleep(0.05)
        else:
            pytest.fail("the child's CPU never showed in /proc")
        assert child.pid in descendants(after, [os.getpid()])
        assert sys.executable.split("/")[-1] in after[child.pid].title
        got = cpu_by_role(before, after, [child.pid])
        assert got["node"] >= 0.3  # the child is the "new node" here
    finally:
        child.kill()
        child.wait(timeout=10)
    assert read_procs("/nonexistent") == {}
