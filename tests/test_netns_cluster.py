"""The training job on a cluster of separate hosts: one network namespace per spot node.

The embedded cluster's ``hosts="netns"`` mode plays the cloud (``jobs/local_cluster.py``):
each spot node has its own address on a bridge, its own HOME and temporary directory, and
its EC2 metadata service at the real ``169.254.169.254`` inside its namespace, named by no
environment variable. The job runs as in cluster mode (``RAY_ADDRESS``, a process of its
own on the head machine) with the default ``notice_source = "auto"``. Ray's health checks
keep Ray's defaults. The tests skip, with the reason, where namespaces cannot be made (no
root).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raystart import free_port
from test_train import SMALL, _scrape

pytestmark = pytest.mark.cluster


def _unavailable() -> str | None:
    from moshray.jobs.netns_hosts import unavailable

    return unavailable()


needs_netns = pytest.mark.skipif(_unavailable() is not None,
                                 reason=_unavailable() or "netns available")


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


def _summary(out: Path) -> dict:
    return json.loads([x for x in out.read_text().splitlines() if x.startswith("{")][-1])


@needs_netns
def test_host_network_links_and_cleanup():
    """Namespaces with their own addresses reach the head's bridge address; a cut link
    passes nothing and a healed one does again; a shaped link carries its qdisc; a
    namespace left by a dead run is removed; ``close`` removes everything."""
    from moshray.jobs import netns_hosts

    stale = f"{netns_hosts.PREFIX}4999999-0"  # a pid above Linux's limit: never alive
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=30)
    try:
        net = netns_hosts.HostNetwork()  # cleans the stale one first
    except BaseException:
        subprocess.run(["ip", "netns", "del", stale], timeout=30)
        raise
    with net:
        assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                           text=True, timeout=30).stdout
        host = net.add_host(0)
        srv = net.listen_in(0, 8080, host.address)  # a server inside node 0's namespace
        srv.listen(4)
        srv.settimeout(10)
        probe = ("import socket,sys; s=socket.create_connection((sys.argv[1], 8080), "
                 "timeout=3); s.sendall(b'x'); print('ok')")
        reach = subprocess.run(["ip", "netns", "exec", host.namespace, sys.executable, "-c",
                                f"import socket; socket.create_connection(('{host.address}', "
                                f"8080), timeout=3); print('ok')"],
                               capture_output=True, text=True, timeout=30)
        assert reach.stdout.strip() == "ok", reach.stderr
        srv.accept()[0].close()
        # From the head side (this namespace) over the bridge, then cut, then healed.
        ok = subprocess.run([sys.executable, "-c", probe, host.address], capture_output=True,
                            text=True, timeout=30)
        assert ok.stdout.strip() == "ok", ok.stderr
        srv.accept()[0].close()
        net.cut(0)
        cut = subprocess.run([sys.executable, "-c", probe, host.address], capture_output=True,
                             text=True, timeout=30)
        assert cut.returncode != 0
        net.heal(0)
        deadline = time.monotonic() + 30
        while True:  # the bridge port takes a moment to forward again
            healed = subprocess.run([sys.executable, "-c", probe, host.address],
                                    capture_output=True, text=True, timeout=30)
            if healed.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert healed.stdout.strip() == "ok", healed.stderr
        srv.close()
        net.shape(0, 50)
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", host.veth], capture_output=True,
                               text=True, timeout=30).stdout
        assert "tbf" in qdisc and "50Mbit" in qdisc
        with pytest.raises(ValueError):
            net.shape(0, 0)
        namespace, bridge = host.namespace, net.bridge
    assert namespace not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                           text=True, timeout=30).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True,
                           timeout=30).stdout
    assert bridge not in links


@needs_netns
@pytest.mark.timeout(1500)
def test_job_on_separate_hosts_survives_notice_kill_and_partition(tmp_path: Path):
    """Four spot nodes, each a separate host. Node w runs its own ``moshray watch`` (as an
    ``infra/`` node does) before the job starts; the job hears a notice on a through the
    default source, loses c to SIGKILL, and loses b to a partition: b's replica is dropped
    from plans by the round deadline (steps go on before Ray declares b dead), and when b's
    link comes back Ray has declared it dead, so a new raylet starts there and its replica
    trains again after a donor sync. Nothing lost or repeated, the staying replicas equal;
    after the job nothing is requested and w's own watcher still runs."""
    from moshray.autoscaler.watcher_config import watcher_name
    from moshray.cluster import placement
    from moshray.jobs.controller import capacity_requested
    from moshray.jobs.local_cluster import LocalCluster, LocalClusterConfig

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
    print(f"\nseparate hosts: steps {summary['steps']}, joins {summary['nodes_joined']}, "
          f"notices {summary['notices']}, hard losses {summary['hard_losses']}, partition "
          f"dropped by the round deadline after {progressed_s:.1f} s, lost steps "
          f"{summary['lost_steps']}")
    assert summary["lost_steps"] == 0 and summary["rollbacks"] == 0
    assert summary["replicas_consistent"] is True
    assert summary["replicas"] == 2  # on w and on b's new raylet
    assert summary["notices"] >= 1 and summary["hard_losses"] >= 2


@needs_netns
@pytest.mark.timeout(900)
def test_slow_link_and_durability_on_a_growing_cluster(tmp_path: Path):
    """A job started on the head alone with a node-local checkpoint path: it waits; a node
    joins on a 50 Mbit/s link and a second at full speed. The node-local path is refused
    the moment a second host is present (one line, exit 2, nothing left requested); a
    second job (checkpoints optional) trains on both with the slow replica in every step
    and no round missing its deadline."""
    from moshray.jobs.controller import capacity_requested
    from moshray.jobs.local_cluster import LocalCluster, LocalClusterConfig

    cluster = LocalCluster(LocalClusterConfig(spot_nodes=0, hosts="netns", cpus_per_node=2,
                                              object_store_bytes=150 * 1024 * 1024))
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
        cluster.add_node(1)
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
            _end(proc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        assert proc.returncode == 0, err.read_text()[-3000:]
        summary = _summary(out)
    finally:
        cluster.shutdown()
    failed = sum(v for k, v in last.items()
                  if k.startswith("moshray_allreduce_failed_rounds_total"))
    sent = sum(v for k, v in last.items() if k.startswith("moshray_allreduce_sent_bytes_total"))
    print(f"\n50 Mbit/s link: steps {summary['steps']}, failed rounds {failed}, "
          f"sent {sent / 1e6:.1f} MB")
    assert failed == 0  # the slow replica never made a round miss its deadline
    assert summary["replicas"] == 2 and summary["replicas_consistent"] is True
    assert summary["lost_steps"] == 0
