"""The training job on a cluster it did not start (``RAY_ADDRESS``), the test playing the cloud.

The cluster is real ``ray start`` processes on 127.0.0.1; every spot node is started by the
test with its own working directory, HOME and instance-metadata service, so nothing on the
driver's disk is visible to a replica. The job starts with no worker node at all (it must
say it waits, then train when nodes come), two more nodes join mid-run, the Coordinator is
killed (Ray restarts it, the replicas rebuild it), one node gets a spot notice through its
metadata service and leaves at its deadline, one is SIGKILLed. A last one gets its notice
while its replica is still starting: that replica is stopped at once and never trains.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raystart import RayStartCluster, free_port
from test_train import SMALL, _scrape

pytestmark = pytest.mark.cluster

KILL_COORDINATOR = """
import os, ray
from moshray.cluster import placement
ray.init(address=os.environ["RAY_ADDRESS"], namespace=placement.NAMESPACE)
ray.kill(placement.sole_coordinator(), no_restart=False)
"""


def _wait(what: str, check, timeout: float, proc: subprocess.Popen, err: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc.poll() is not None:
            raise AssertionError(f"job ended while waiting for {what}: "
                                 f"{err.read_text()[-3000:]}")
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; job stderr: "
                         f"{err.read_text()[-3000:]}")


def _metric(port: int, name: str) -> float:
    return (_scrape(port) or {}).get(name, 0.0)


@pytest.mark.timeout(1200)
def test_job_follows_nodes_that_come_and_go(tmp_path: Path):
    driver_home = tmp_path / "driver-home"
    driver_home.mkdir()
    port = free_port()
    with RayStartCluster(workers=0) as cluster:
        env = dict(cluster.env, RAY_ADDRESS=cluster.gcs_address, HOME=str(driver_home))
        out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        with open(out, "w") as stdout, open(err, "w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "moshray.jobs.train", *SMALL, "--json",
                 "--max-seconds", "900", "--metrics-port", str(port),
                 "--set", "cluster.max_nodes=4", "--set", "cluster.wait_for_nodes_s=300",
                 # Steps of 128 samples: a joiner's state copy keeps up with the steps.
                 "--set", "training.target_batch_size=128",
                 "--set", f"run_dir={tmp_path / 'run'}"],
                stdout=stdout, stderr=stderr, text=True, env=env, cwd=tmp_path)
            try:
                # No worker node yet: the job says so on one line and waits.
                _wait("the waiting line", lambda: "waiting for worker nodes: 0 of at least 1"
                      in err.read_text(), 120, proc, err)
                a = cluster.add_spot_node("a")
                b = cluster.add_spot_node("b")
                _wait("training on a and b", lambda: _metric(
                    port, "moshray_global_step{}") >= 5, 240, proc, err)
                c = cluster.add_spot_node("c")
                d = cluster.add_spot_node("d")
                # Every replica (a, b and the two that joined) contributed to a step.
                _wait("the joiners' first contributions", lambda: _metric(
                    port, "moshray_join_to_first_contribution_seconds_count{}") >= 4,
                    240, proc, err)
                # The controller sees them ready on its next tick.
                _wait("four training replicas", lambda: _metric(
                    port, "moshray_replicas{state=training}") == 4, 120, proc, err)
                assert _metric(port, "moshray_nodes{market=spot}") == 4
                # The Coordinator dies (Ray restarts it): the replicas rebuild it and the
                # step count goes on from where they are.
                at_kill = _metric(port, "moshray_global_step{}")
                subprocess.run([sys.executable, "-c", KILL_COORDINATOR],
                               env=dict(env, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0"),
                               timeout=120, check=True)
                _wait("progress after the Coordinator restart", lambda: _metric(
                    port, "moshray_global_step{}") >= at_kill + 10, 180, proc, err)
                c.notice(6.0)  # through c's own metadata service, as EC2 does
                _wait("the notice to drain c", lambda: _metric(
                    port, "moshray_preemption_notices_total{cloud=aws,pool=unknown}") >= 1,
                    60, proc, err)
                time.sleep(6.0)
                c.terminate()
                d.kill()
                # Ray's node table shows both losses once its health checks give up on them.
                _wait("both losses counted", lambda: _metric(
                    port, "moshray_nodes_lost_total{notice=true}") >= 1 and _metric(
                    port, "moshray_nodes_lost_total{notice=false}") >= 1, 180, proc, err)
                at_loss = _metric(port, "moshray_global_step{}")
                _wait("progress after the losses", lambda: _metric(
                    port, "moshray_global_step{}") >= at_loss + 10, 120, proc, err)
                # A node noticed while its replica is still starting: the controller
                # stops that replica at once; it never trains, and its node's end counts
                # as a loss with notice.
                e = cluster.add_spot_node("e")
                _wait("a replica starting on e", lambda: _metric(
                    port, "moshray_replicas{state=starting}") >= 1, 120, proc, err)
                e.notice(6.0)
                _wait("e's replica stopped before it was ready", lambda: _metric(
                    port, "moshray_preemption_notices_total{cloud=aws,pool=unknown}") >= 2
                    and _metric(port, "moshray_replicas{state=starting}") == 0
                    and _metric(port, "moshray_replicas{state=syncing}") == 0, 60, proc, err)
                e.terminate()
                _wait("e's loss counted", lambda: _metric(
                    port, "moshray_nodes_lost_total{notice=true}") >= 2, 180, proc, err)
                last = _scrape(port)
                proc.terminate()  # SIGTERM: the job stops as at its time limit, summarized
                proc.wait(timeout=300)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=30)
        assert proc.returncode == 0, err.read_text()[-3000:]
        summary = json.loads([x for x in out.read_text().splitlines() if x.startswith("{")][-1])
        assert a.proc.poll() is None and b.proc.poll() is None
    assert summary["lost_steps"] == 0 and summary["rollbacks"] == 0
    assert summary["replicas"] == 2  # the staying replicas, on a and b
    assert summary["replicas_consistent"] is True
    assert summary["hard_losses"] == 1 and summary["notices"] >= 2
    assert summary["preemptions"] >= 3
    assert summary["nodes_joined"] == 5  # all came after the job started
    # c's, d's and e's replicas (and any replacement tried on d before Ray declared it dead)
    assert summary["replica_lifecycle"]["gone"] >= 3
    timelines = summary["replica_timelines"]
    e_replica = max(timelines, key=lambda r: timelines[r][0][1])  # the last one started
    e_states = [state for state, _ in timelines[e_replica]]
    assert e_states[-1] == "gone" and "training" not in e_states, timelines[e_replica]
    assert "leaving" not in e_states  # stopped, not left to finish starting
    assert summary["steps"] > at_loss
    assert last["moshray_nodes_lost_total{notice=true}"] >= 2
    assert last["moshray_nodes_lost_total{notice=false}"] >= 1
    assert last["moshray_replicas{state=training}"] == 2
