"""The swarm outlives its driver. On a cluster started with the real `ray start`
CLI, a job submitted with `ray job submit` has its driver SIGKILLed mid-run; the same job
submitted again under its name adopts the running replicas and Coordinator (jobs/controller/lease.py) and
trains on: no committed step lost, replicas identical, nothing left behind at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest


pytestmark = pytest.mark.cluster
JOB = Path(__file__).resolve().parent / "driver_restart_job.py"
MAX_STEPS = 60


def _ray(cluster, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    """``ray job <args[0]> --address <the cluster's job API> <args[1:]>``."""
    return subprocess.run(["ray", "job", args[0], "--address", cluster.dashboard_url, *args[1:]],
                          capture_output=True, text=True, timeout=timeout, env=cluster.env)


def _steps_seen(text: str) -> int:
    """The newest global step in the driver's progress lines (``step N ...``)."""
    found = re.findall(r"^\s*step\s+(\d+)", text, flags=re.MULTILINE)
    return max(map(int, found), default=0)


def _wait(predicate, timeout_s: float, what: str, every_s: float = 2.0):
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(every_s)


def _named_actors(cluster) -> subprocess.CompletedProcess:
    """The cluster's named actors, as a driver of its own (connected to the GCS) lists them."""
    import os
    import sys

    env = {**(cluster.env or os.environ), "RAY_ADDRESS": cluster.gcs_address}
    return subprocess.run(
        [sys.executable, "-c", "import ray; ray.init(); print(sorted(a['name'] for a in "
         "ray.util.list_named_actors(all_namespaces=True)))"],
        capture_output=True, text=True, timeout=120, env=env)


def _newest_checkpoint(root: Path) -> int:
    """The highest step of a valid checkpoint in ``root`` or a run directory under it."""
    from moshray.actors.replica.checkpoint import CheckpointStore

    steps = [0]
    for run_id in [None, *[d.name for d in root.iterdir() if d.is_dir()]]:
        found = CheckpointStore(str(root), run_id).load_latest()
        if found is not None:
            steps.append(found[0])
    return max(steps)


@pytest.mark.timeout(1500)
def test_a_driver_killed_mid_run_is_resubmitted_and_adopts_the_swarm(ray_start_cluster,
                                                                      tmp_path: Path):
    checkpoint = tmp_path / "ckpt"
    cluster = ray_start_cluster

    def entry(name: str, max_steps: int = MAX_STEPS, ckpt: Path = checkpoint,
              run: str = "run", job: str = "lm") -> list[str]:
        return ["python", str(JOB), str(tmp_path / f"{name}.pid"), str(ckpt),
                str(max_steps), str(tmp_path / run), job]

    first = _ray(cluster, "submit", "--no-wait", "--submission-id", "first", "--",
                 *entry("first"))
    assert first.returncode == 0, first.stdout + first.stderr
    logs = _wait(lambda: (lambda out: out if _steps_seen(out) >= 5 else None)(
        _ray(cluster, "logs", "first").stdout), 400, "the first driver to train 5 steps",
        every_s=3.0)
    os.kill(int((tmp_path / "first.pid").read_text()), signal.SIGKILL)  # no goodbye
    seen = _steps_seen(_ray(cluster, "logs", "first").stdout)
    assert seen >= _steps_seen(logs) and seen < MAX_STEPS
    # Resubmitted at once: the new driver waits (bounded) for Ray to list the killed
    # one as dead before it adopts (train.py _claim_cluster).

    second = _ray(cluster, "submit", "--submission-id", "second", "--", *entry("second"),
                  timeout=700)
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert "adopting the running swarm" in out, out[-4000:]
    result = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    leftovers = _named_actors(cluster)

    # `ray job stop` (SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S): the job ends
    # with a checkpoint of the step it had reached, and leaves no actor behind.
    stopped_ckpt = tmp_path / "ckpt-stopped"
    third = _ray(cluster, "submit", "--no-wait", "--submission-id", "third", "--",
                 *entry("third", 100_000, stopped_ckpt, "run-stopped", "lm-stopped"))
    assert third.returncode == 0, third.stdout + third.stderr
    _wait(lambda: _steps_seen(_ray(cluster, "logs", "third").stdout) >= 8, 400,
          "the third driver to train 8 steps", every_s=3.0)
    at_stop = _steps_seen(_ray(cluster, "logs", "third").stdout)
    stop = _ray(cluster, "stop", "third", timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    _wait(lambda: not any(name in _named_actors(cluster).stdout for name in (
        "moshray-replica", "moshray-job-lease", "moshray-coordinator")), 180,
        "the stopped job's replicas, lease and Coordinator to end", 5.0)
    newest = _newest_checkpoint(stopped_ckpt)
    assert newest >= at_stop, (newest, at_stop)
    assert result["steps"] >= MAX_STEPS and result["replicas"] == 2
    assert result["replicas_consistent"] is True
    assert result["lost_steps"] == 0 and result["rollbacks"] == 0
    # Every step committed before the kill is in the adopted run's history, and the history
    # has no hole: the swarm went on training while no driver was there.
    epochs = result["epochs"]
    assert set(range(1, seen + 1)) <= set(epochs), epochs
    assert sorted(set(epochs)) == list(range(min(epochs), max(epochs) + 1)), epochs
    names = leftovers.stdout
    assert leftovers.returncode == 0, names + leftovers.stderr
    assert "moshray-replica" not in names and "moshray-job-lease" not in names, names
