"""The training job on a cluster of separate hosts: one network namespace per spot node.

The embedded cluster's ``hosts="netns"`` mode plays the cloud (``jobs/local/cluster.py``,
from a process of its own: ``netns_scenarios.py``):
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
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster


def _unavailable() -> str | None:
    from moshray.jobs.local.netns import unavailable

    return unavailable()


needs_netns = pytest.mark.skipif(_unavailable() is not None,
                                 reason=_unavailable() or "netns available")


@needs_netns
def test_host_network_links_and_cleanup():
    """Namespaces with their own addresses reach the head's bridge address; a cut link
    passes nothing and a healed one does again; a shaped link carries its qdisc; a
    namespace left by a dead run is removed; ``close`` removes everything."""
    import moshray.jobs.local.netns as netns_hosts
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


def _scenario(name: str, tmp_path: Path, timeout_s: float) -> dict:
    """Run ``netns_scenarios.py NAME`` in a process of its own; its figures (JSON)."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("netns_scenarios.py")),
                           name, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=tmp_path)
    assert done.returncode == 0, f"{name} failed:\n{done.stderr[-6000:]}"
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"\n{name}: {figures}")
    return figures


@needs_netns
@pytest.mark.timeout(1500)
def test_job_on_separate_hosts_survives_notice_kill_and_partition(tmp_path: Path):
    """Four spot nodes, each a separate host (``netns_scenarios.partition``). Node w runs its
    own ``moshray watch`` before the job starts; the job hears a notice on a through the
    default ``auto`` source, loses c to SIGKILL, and loses b to a partition: b's replica is
    dropped from plans by the round deadline (steps go on before Ray declares b dead), and
    when b's link comes back Ray has declared it dead, so a new raylet starts there and its
    replica trains again after a donor sync. Nothing lost or repeated, the staying replicas
    equal; after the job nothing is requested and w's own watcher still runs."""
    figures = _scenario("partition", tmp_path, 1400)
    assert figures["lost_steps"] == 0 and figures["rollbacks"] == 0
    assert figures["replicas_consistent"] is True and figures["replicas"] == 2
    assert figures["notices"] >= 1 and figures["hard_losses"] >= 2
    assert figures["nodes_joined"] >= 1  # b's new raylet


@needs_netns
@pytest.mark.timeout(900)
def test_slow_link_and_durability_on_a_growing_cluster(tmp_path: Path):
    """A job started on the head alone with a node-local checkpoint path stops with one line
    when a second host joins (a 50 Mbit/s one), leaving nothing requested; a second job
    trains on that node and a full-speed one with the slow replica in every step and no
    round missing its deadline; the full-speed node then goes as a pod does (its
    ``moshray watch --source sigterm`` gets SIGTERM): its replica leaves before the node
    dies, nothing lost (``netns_scenarios.slow_link``)."""
    figures = _scenario("slow_link", tmp_path, 850)
    assert figures["failed_rounds"] == 0
    assert figures["replicas"] == 1 and figures["replicas_consistent"] is True
    assert figures["lost_steps"] == 0 and figures["steps"] >= 20
    assert figures["notices"] >= 1 and figures["hard_losses"] == 0
