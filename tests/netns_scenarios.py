"""The separate-hosts scenarios of ``test_netns_cluster.py``, each run in a process of its
own (``python tests/netns_scenarios.py NAME DIR``): this process plays the cloud with a
``LocalCluster(hosts="netns")`` and connects its own Ray driver to it, which must not
happen inside pytest's process (its session cluster holds that process's connection).
Each scenario asserts as it goes (a failure exits 1 with the traceback) and the last stdout
line is a JSON object of its figures.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from raystart import free_port  # noqa: E402
from test_train import SMALL, _scrape  # noqa: E402


def _metric(port: int, name: str) -> float:
    return (_scrape(port) or {}).get(name, 0.0)


def _wait(what: str, check, timeout: float, proc: subprocess.Popen | None, err: Path | None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"job ended while waiting for {what}: "
                                 f"{err.read_text()[-3000:]}")
        time.sleep(1.0)
    tail = err.read_text()[-3000:] if err is not None else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; job stderr: {tail}")


def _job(cluster, tmp_path: Path, port: int, *args: str):
    env = dict(os.environ, RAY_ADDRESS=cluster.address, RAY_AUTH_MODE="token",
               RAY_AUTH_TOKEN_PATH=cluster.auth_token_path,
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", HOME=str(tmp_path / "driver-home"))
    env.pop("RAY_AUTH_TOKEN", None)
    env.pop("MOSHRAY_CHECKPOINT_URI", None)
    (tmp_path / "driver-home").mkdir(exist_ok=True)
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "moshray.jobs.train", *SMALL, "--json",
             "--metrics-port", str(port), "--set", f"run_dir={tmp_path / 'run'}", *args],
            stdout=stdout, stderr=stderr, text=True, env=env, cwd=tmp_path)
    return proc, out, err


def _end(proc: subprocess.Popen, timeout: float = 300) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)  # the job stops as at its time limit, summarized
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def _nsentered(proc: subprocess.Popen) -> int:
    """The pid of the command ``popen_beside`` started (nsenter forks it into the machine's
    PID namespace and exits with its status)."""
    pid = proc.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    assert children, f"nsenter {pid} has no child"
    return int(children[0])


def _summary(out: Path) -> dict:
    return json.loads([x for x in out.read_text().splitlines() if x.startswith("{")][-1])


def partition(tmp_path: Path) -> dict:
    """Four spot nodes, each a separate host. Node w runs its own ``moshray watch`` (as an
    ``infra/`` node does) before the job starts; the job hears a notice on a through the
    default source, loses c to SIGKILL, and loses b to a partition: b's replica is dropped
    from plans by the round deadline (steps go on before Ray declares b dead), and when b's
    link comes back Ray has declared it dead, so a new raylet starts there and its replica
    trains again after a donor sync. Nothing lost or repeated, the staying replicas equal;
    after the job nothing is requested and w's own watcher still runs."""
    from moshray.autoscaler.watch.config import watcher_name
    from moshray.cluster import placement
    from moshray.jobs.controller.elastic import capacity_requested
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

    port = free_port()
    cluster = LocalCluster(LocalClusterConfig(spot_nodes=0, hosts="netns", cpus_per_node=2,
                                              object_store_bytes=150 * 1024 * 1024))
    watch = None
    try:
        w, a, b, c = (cluster.add_node(slot) for slot in range(4))
        moshray_cli = str(Path(sys.executable).with_name("moshray"))
        watch = cluster.run_on(w, [moshray_cli, "watch", "--address", cluster.address],
                               str(tmp_path / "watch-w.log"))
        cluster.connect()
        import ray

        def own_watcher():
            try:
                return ray.get_actor(watcher_name(cluster.node_id(w)),
                                     namespace=placement.NAMESPACE)
            except ValueError:
                return None

        _wait("w's own watcher", lambda: own_watcher() is not None, 120, None, None)
        status = ray.get(own_watcher().status.remote(), timeout=30)
        assert "169.254.169.254" in status["source"], status  # found, not configured
        proc, out, err = _job(cluster, tmp_path, port, "--max-seconds", "1200",
                              "--set", "cluster.max_nodes=4",
                              "--set", "training.target_batch_size=128",
                              "--set", "checkpoint.optional=true")
        try:
            _wait("four training replicas", lambda: _metric(
                port, "moshray_replicas{state=training}") == 4, 300, proc, err)
            assert capacity_requested(), "the job asked Ray's autoscaler for its nodes"
            _wait("steps", lambda: _metric(port, "moshray_global_step{}") >= 5, 120, proc,
                  err)
            # A spot notice on a's own metadata service, heard through notice_source=auto.
            cluster.notice(a, 6.0)
            _wait("the notice to drain a", lambda: _metric(
                port, "moshray_preemption_notices_total{cloud=aws,pool=unknown}") >= 1,
                60, proc, err)
            time.sleep(6.0)
            cluster.remove_node(a)
            cluster.remove_node(c, hard=True)  # SIGKILL: no goodbye
            _wait("a's and c's losses counted", lambda: _metric(
                port, "moshray_nodes_lost_total{notice=true}") >= 1 and _metric(
                port, "moshray_nodes_lost_total{notice=false}") >= 1, 240, proc, err)
            # The partition: b is cut off. The round deadline drops its replica from the
            # plans: steps go on while Ray still counts b alive.
            at_cut = _metric(port, "moshray_global_step{}")
            cut_at = time.monotonic()
            cluster.cut(b)
            _wait("steps without b", lambda: _metric(
                port, "moshray_global_step{}") >= at_cut + 3, 120, proc, err)
            progressed_s = time.monotonic() - cut_at
            assert _metric(port, "moshray_nodes_lost_total{notice=false}") == 1, \
                "steps went on only once Ray declared b dead, not by the round deadline"
            _wait("b declared dead", lambda: _metric(
                port, "moshray_nodes_lost_total{notice=false}") >= 2, 300, proc, err)
            came_back = cluster.heal(b, timeout_s=240)
            assert came_back == "new"  # Ray had declared it dead: a new raylet there
            joins = _metric(port, "moshray_join_to_first_contribution_seconds_count{}")
            _wait("b's new replica contributing after its donor sync", lambda: _metric(
                port, "moshray_join_to_first_contribution_seconds_count{}") > joins,
                300, proc, err)
            _wait("two training replicas", lambda: _metric(
                port, "moshray_replicas{state=training}") == 2, 120, proc, err)
            at_back = _metric(port, "moshray_global_step{}")
            _wait("progress with b back", lambda: _metric(
                port, "moshray_global_step{}") >= at_back + 5, 120, proc, err)
            _end(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        stderr = err.read_text()
        assert proc.returncode == 0, stderr[-3000:]
        summary = _summary(out)
        # After the job: nothing requested from Ray's autoscaler, w's own watcher alive.
        assert capacity_requested() == ()
        watcher = own_watcher()
        assert watcher is not None, "the job stopped a watcher it did not start"
        assert ray.get(watcher.status.remote(), timeout=30)["state"] == "running"
        assert watch.poll() is None
    finally:
        if watch is not None and watch.poll() is None:
            os.killpg(watch.pid, signal.SIGTERM)
            try:
                watch.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(watch.pid, signal.SIGKILL)
                watch.wait(timeout=10)
        cluster.shutdown()
    assert summary["lost_steps"] == 0 and summary["rollbacks"] == 0
    assert summary["replicas_consistent"] is True
    assert summary["replicas"] == 2  # on w and on b's new raylet
    assert summary["notices"] >= 1 and summary["hard_losses"] >= 2
    return {"steps": summary["steps"], "nodes_joined": summary["nodes_joined"],
            "notices": summary["notices"], "hard_losses": summary["hard_losses"],
            "partition_progress_s": round(progressed_s, 2), "lost_steps": summary["lost_steps"],
            "rollbacks": summary["rollbacks"], "replicas": summary["replicas"],
            "replicas_consistent": summary["replicas_consistent"]}


def slow_link(tmp_path: Path) -> dict:
    """A job started on the head alone with a node-local checkpoint path: it waits; a node
    joins on a 50 Mbit/s link and a second at full speed. The node-local path is refused
    the moment a second host is present (one line, exit 2, nothing left requested); a
    second job (checkpoints optional) trains on both with the slow replica in every step
    and no round missing its deadline. Then the full-speed node goes as a Kubernetes pod
    does (``infra/kuberay/``): its ``moshray watch --source sigterm --grace-s 8`` gets
    SIGTERM, the node's replica leaves before the node is removed at the deadline, and
    the slow node trains on alone: nothing lost, no hard loss."""
    from moshray.jobs.controller.elastic import capacity_requested
    from moshray.jobs.local.cluster import LocalCluster, LocalClusterConfig

    cluster = LocalCluster(LocalClusterConfig(spot_nodes=0, hosts="netns", cpus_per_node=2,
                                              object_store_bytes=150 * 1024 * 1024))
    watch = None
    try:
        port = free_port()
        local_ckpt = tmp_path / "node-local-checkpoints"
        proc, out, err = _job(cluster, tmp_path, port, "--max-seconds", "600",
                              "--checkpoint", str(local_ckpt))
        try:
            _wait("the waiting line", lambda: "waiting for worker nodes" in err.read_text(),
                  120, proc, err)
            slow = cluster.add_node(0)
            cluster.shape(slow, 50)
            proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        lines = [x for x in err.read_text().splitlines() if x.strip()]
        assert proc.returncode == 2, lines[-20:]
        assert "checkpoint.uri" in lines[-1] and str(local_ckpt) in lines[-1], lines[-5:]
        cluster.connect()
        assert capacity_requested() == ()
        import ray

        ray.shutdown()
        fast = cluster.add_node(1)
        moshray_cli = str(Path(sys.executable).with_name("moshray"))
        watch = cluster.run_on(fast, [moshray_cli, "watch", "--source", "sigterm",
                                      "--grace-s", "8", "--address", cluster.address],
                               str(tmp_path / "watch-fast.log"))
        _wait("the fast node's own watcher", lambda: "watching node" in
              (tmp_path / "watch-fast.log").read_text(), 120, None, None)
        port = free_port()
        (tmp_path / "second").mkdir()
        proc, out, err = _job(cluster, tmp_path / "second", port, "--max-seconds", "600",
                              "--set", "checkpoint.optional=true",
                              "--set", "training.target_batch_size=64")
        try:
            _wait("two training replicas", lambda: _metric(
                port, "moshray_replicas{state=training}") == 2, 300, proc, err)
            at = _metric(port, "moshray_global_step{}")
            _wait("20 steps with both", lambda: _metric(
                port, "moshray_global_step{}") >= at + 20, 300, proc, err)
            last = _scrape(port)
            # The pod's termination: SIGTERM to the node's watcher, the grace its deadline.
            os.kill(_nsentered(watch), signal.SIGTERM)  # the watcher, not nsenter
            _wait("the SIGTERM notice", lambda: _metric(
                port, "moshray_preemption_notices_total{cloud=sigterm,pool=unknown}") >= 1,
                60, proc, err)
            assert watch.wait(timeout=60) == 0, (tmp_path / "watch-fast.log").read_text()
            cluster.remove_node(fast)  # the deadline: the node goes
            _wait("the fast node's loss counted as noticed", lambda: _metric(
                port, "moshray_nodes_lost_total{notice=true}") >= 1, 120, proc, err)
            at = _metric(port, "moshray_global_step{}")
            _wait("steps on the slow node alone", lambda: _metric(
                port, "moshray_global_step{}") >= at + 3, 120, proc, err)
            _end(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        assert proc.returncode == 0, err.read_text()[-3000:]
        summary = _summary(out)
    finally:
        if watch is not None and watch.poll() is None:
            os.killpg(watch.pid, signal.SIGKILL)
            watch.wait(timeout=30)
        cluster.shutdown()
    failed = sum(v for k, v in last.items()
                  if k.startswith("moshray_allreduce_failed_rounds_total"))
    sent = sum(v for k, v in last.items() if k.startswith("moshray_allreduce_sent_bytes_total"))
    assert failed == 0  # the slow replica never made a round miss its deadline
    assert summary["replicas"] == 1 and summary["replicas_consistent"] is True
    assert summary["lost_steps"] == 0 and summary["rollbacks"] == 0
    assert summary["notices"] >= 1 and summary["hard_losses"] == 0
    return {"steps": summary["steps"], "failed_rounds": failed, "sent_mb": round(sent / 1e6, 1),
            "replicas": summary["replicas"], "lost_steps": summary["lost_steps"],
            "notices": summary["notices"], "hard_losses": summary["hard_losses"],
            "replicas_consistent": summary["replicas_consistent"]}


SCENARIOS = {"partition": partition, "slow_link": slow_link}

if __name__ == "__main__":
    figures = SCENARIOS[sys.argv[1]](Path(sys.argv[2]))
    print(json.dumps(figures), flush=True)
