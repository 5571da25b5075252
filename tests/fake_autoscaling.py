"""Ray's autoscaler on one machine: a head started with ``--autoscaling-config`` and Ray's
fake multi-node provider (every "instance" is a real raylet on 127.0.0.1), then a scenario.

Run as a script (``python tests/fake_autoscaling.py``) so that its Ray driver never meets a
cluster another test connected in the pytest process; it prints one JSON line with what
happened and exits 0, or exits 1 with the reason. tests/test_ray_autoscaler.py runs it.

Scenario: two replicas (actors needing the ``spot`` resource, as moshray's replicas do) are
created on a cluster with no worker nodes -> the autoscaler launches spot worker nodes; one
worker's raylet is then SIGKILLed (a preemption without notice) -> the autoscaler's health
check drops it and launches a replacement, where the restarted replica runs again.

Process hygiene: the head is one ``ray start --head --block`` process in its own session;
``stop`` terminates that session and then every process it ever saw below the head (by PID,
from /proc), including the raylets the fake provider started. ``ray stop`` is never used.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from moshray.jobs.bench.join_profile import ProcSample, descendants, read_procs
from raystart import free_port, node_port_args

LOOPBACK = "127.0.0.1"
SPOT = 1000  # the `spot` resource of a worker node, as in infra/ray/*.yaml
WORKER_TYPE = "ray.worker.spot"
SYSTEM_CONFIG = {  # a dead raylet is noticed within a few seconds
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


def below(pid: int) -> dict[int, ProcSample]:
    """Every process below ``pid`` (not ``pid`` itself), as ``/proc`` shows them now."""
    procs = read_procs()
    return {p: procs[p] for p in descendants(procs, [pid]) if p != pid}


def autoscaling_config(gcs_address: str, max_workers: int) -> dict:
    return {
        "cluster_name": "moshray-fake",
        "max_workers": max_workers,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": 10,
        "docker": {},
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "auth": {"ssh_user": "ubuntu"},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            WORKER_TYPE: {
                "resources": {"CPU": 1, "spot": SPOT,
                              "object_store_memory": 100 * 1024 * 1024},
                "node_config": {}, "min_workers": 0, "max_workers": max_workers,
            },
        },
        "head_node_type": "ray.head.default",
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


class AutoscalingHead:
    """``ray start --head --block`` with the fake multi-node provider's autoscaler."""

    def __init__(self, max_workers: int = 3, heartbeat_timeout_s: int = 10) -> None:
        self.port = free_port()
        self.gcs_address = f"{LOOPBACK}:{self.port}"
        self.dir = Path(tempfile.mkdtemp(prefix="moshray-autoscaling-"))
        self.config_path = self.dir / "autoscaling.json"
        self.config_path.write_text(json.dumps(autoscaling_config(self.gcs_address,
                                                                  max_workers)))
        self.env = dict(os.environ)
        for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            self.env.pop(key, None)
        self.env.update({
            "RAY_FAKE_CLUSTER": "1",  # the fake provider insists on it
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            "AUTOSCALER_HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s),
            # the raylets the fake provider starts take the node IP 127.0.0.1
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_AUTH_MODE": "disabled",
        })
        self.proc: subprocess.Popen | None = None
        self._seen: set[int] = set()

    def start(self, timeout: float = 180, attempts: int = 3) -> AutoscalingHead:
        """Start the head and wait until ``ray start`` reports it up. On a loaded machine a
        raylet may give up waiting for its agents (a fixed 15 s in Ray); retried then."""
        for attempt in range(attempts):
            self._spawn(attempt)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if "Ray runtime started" in self._log(attempt):
                    return self
                if self.proc.poll() is not None:
                    break
                time.sleep(0.5)
            self._end_processes()
            self.proc = None
        raise RuntimeError(f"the head did not start in {attempts} attempts; see {self.dir}")

    def _log(self, attempt: int) -> str:
        try:
            return (self.dir / f"head-{attempt}.log").read_text()
        except OSError:
            return ""

    def _spawn(self, attempt: int) -> None:
        from moshray.jobs.local.cluster import free_ports

        log = open(self.dir / f"head-{attempt}.log", "w")
        # one pick for all of its ports, none the GCS's: distinct (raystart.node_port_args)
        client_port, *node_ports = [p for p in free_ports(9) if p != self.port][:7]
        self.proc = subprocess.Popen(
            ["ray", "start", "--head", "--block", "--port", str(self.port),
             "--node-ip-address", LOOPBACK, "--num-cpus", "1", "--include-dashboard", "false",
             "--disable-usage-stats", "--object-store-memory", str(100 * 1024 * 1024),
             "--autoscaling-config", str(self.config_path),
             "--system-config", json.dumps(SYSTEM_CONFIG, separators=(",", ":")),
             "--ray-client-server-port", str(client_port), *node_port_args(node_ports)],
            stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)

    def track(self) -> list[int]:
        """Remember every process below the head (so ``stop`` can end them by PID)."""
        return sorted(self._below())

    def _below(self) -> dict[int, ProcSample]:
        """``below`` the head, each remembered for ``stop``."""
        assert self.proc is not None
        procs = below(self.proc.pid)
        self._seen.update(procs)
        return procs

    def raylet_pid(self, node_id: str) -> int:
        for pid, proc in self._below().items():
            if "raylet" in proc.title and f"--node_id={node_id}" in proc.title:
                return pid
        raise LookupError(f"no raylet of node {node_id} below the head")

    def stop(self, timeout: float = 60, keep_logs: bool = False) -> None:
        """End the head, its autoscaler and every raylet it started, then remove its
        directory (the autoscaling config and the head's logs) unless ``keep_logs``."""
        self._end_processes(timeout)
        if not keep_logs:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _end_processes(self, timeout: float = 60) -> None:
        if self.proc is None:
            return
        self.track()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        for pid in sorted(self._seen):  # raylets of fake nodes live in their own groups
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            if Path(f"/proc/{pid}").exists():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def wait_until(predicate, timeout: float, what: str, interval: float = 1.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"{what} not within {timeout} s")


def scenario(replicas: int = 2) -> dict:
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray

    head = AutoscalingHead(max_workers=replicas + 1).start()
    try:
        ray.init(address=head.gcs_address, logging_level="ERROR", log_to_driver=False)

        @ray.remote(num_cpus=1, resources={"spot": 1}, max_restarts=-1, max_task_retries=-1)
        class Replica:
            def node(self) -> str:
                return ray.get_runtime_context().get_node_id()

        def alive_workers() -> dict[str, dict]:
            return {n["NodeID"]: n for n in ray.nodes()
                    if n["Alive"] and n["Resources"].get("spot", 0) > 0}

        t0 = time.monotonic()
        # One replica at a time, each placed before the next asks: two demands at once made
        # Ray's autoscaler launch a node too many, which on this 2-core machine sometimes
        # never initialized and was then counted as pending capacity for the replacement.
        actors, homes = [], []
        for _ in range(replicas):
            actors.append(Replica.remote())
            homes.append(ray.get(actors[-1].node.remote(), timeout=300))
        launch_s = time.monotonic() - t0
        head.track()
        workers = alive_workers()
        if len(set(homes)) != replicas or not set(homes) <= set(workers):
            raise RuntimeError(f"replicas not on distinct spot nodes: {homes} vs {list(workers)}")

        victim = homes[0]
        pid = head.raylet_pid(victim)
        t1 = time.monotonic()
        os.kill(pid, signal.SIGKILL)  # preempted, no notice
        wait_until(lambda: victim not in alive_workers(), 120, "the killed node marked dead")
        dead_s = time.monotonic() - t1

        def replaced():
            try:
                home = ray.get(actors[0].node.remote(), timeout=10)
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
                return None
            return home if home != victim else None

        new_home = wait_until(replaced, 300, "the replica running on a replacement node")
        replace_s = time.monotonic() - t1
        final = alive_workers()
        summary = {
            "replicas": replicas, "initial_nodes": sorted(set(homes)), "launch_s": launch_s,
            "killed": victim, "dead_s": dead_s, "replacement": new_home,
            "replace_s": replace_s, "alive_workers": sorted(final),
            "other_replica_home": ray.get(actors[1].node.remote(), timeout=60),
        }
        ray.shutdown()
    except BaseException:
        if ray.is_initialized():
            ray.shutdown()
        head.stop(keep_logs=True)  # the head's logs for the failure
        raise
    head.stop()
    return summary


if __name__ == "__main__":
    try:
        print(json.dumps(scenario()), flush=True)
    except Exception as exc:  # one line saying what went wrong, for the test's message
        print(f"scenario failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.exit(1)
