"""A Ray cluster started with the real `ray start` CLI, all on 127.0.0.1 (tests only).

Every node is one ``ray start --block`` process in a session of its own: ``SpotNode.terminate``
is a node's graceful end (``ray start`` stops the Ray processes it started) and the cluster's
teardown kills each session, so the test ends exactly what it started (never ``ray stop``,
which would stop every Ray process on the machine). All ports are
chosen free on 127.0.0.1 so clusters of other runs on the same machine do not collide.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from moshray.jobs.local.cluster import SYSTEM_CONFIG

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    from moshray.jobs.local.cluster import free_ports

    return free_ports(1)[0]


def ray_env(token: str | None = None) -> dict:
    """Environment for Ray processes and CLIs of a test cluster.

    Ray's token authentication is set explicitly (on with ``token``, else off) so the
    result does not depend on whether ``~/.ray/auth_token`` exists on this machine.
    """
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    # `ray start --address` refuses to join when RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0; every
    # node is pinned to loopback by --node-ip-address 127.0.0.1 instead.
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"):
        env.pop(key, None)
    if token:
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    else:
        env["RAY_AUTH_MODE"] = "disabled"
    # These machines are no cloud instances: the SDKs' opt-outs keep notice_source = "auto"
    # (autoscaler/clouds/detect.py) on a node that names no metadata service from probing the
    # host's real 169.254.169.254. A node with an emulator names it (add_spot_node).
    env.update(AWS_EC2_METADATA_DISABLED="true", NO_GCE_CHECK="true")
    return env


NODE_PORT_FLAGS = ("--node-manager-port", "--object-manager-port", "--metrics-export-port",
                   "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                   "--runtime-env-agent-port")


def node_port_args(ports: list[int] | None = None) -> list[str]:
    """The port flags of one `ray start`: ``ports`` (one per ``NODE_PORT_FLAGS``), else
    distinct free ones picked together. One pick per flag could return the same port twice
    (a socket closed, then the OS hands its port out again): `ray start` then exits 1
    ("trying to use a port number ... that is used by other components")."""
    from moshray.jobs.local.cluster import free_ports

    ports = list(ports) if ports is not None else free_ports(len(NODE_PORT_FLAGS))
    return [arg for flag, port in zip(NODE_PORT_FLAGS, ports) for arg in (flag, str(port))]


def _end(proc: subprocess.Popen, timeout: float = 30) -> None:
    """Stop a ``ray start`` process group (SIGTERM, then SIGKILL) and reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass
class SpotNode:
    """One spot worker started by ``RayStartCluster.add_spot_node`` (the test is its cloud)."""

    name: str
    proc: subprocess.Popen
    imds: object  # its IMDSv2 emulator: ``imds.interrupt(...)`` is the spot notice
    root: Path

    def notice(self, seconds: float) -> None:
        """Publish a spot interruption notice due in ``seconds`` on the node's metadata."""
        self.imds.interrupt("terminate", time.time() + seconds)

    def terminate(self, timeout: float = 60) -> None:
        """Stop the node gracefully (``ray start --block`` stops its processes)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """SIGKILL the node's whole process group: a hard loss, no goodbye."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@dataclass
class RayStartCluster:
    """A head (with the dashboard / job server) plus ``workers`` spot nodes.

    ``gcs_address`` is for ``ray.init`` / ``RAY_ADDRESS``; ``dashboard_url`` is the job
    API for ``ray job submit --address``. ``start`` waits (bounded) until every node is
    alive; ``stop`` terminates the ``ray start --block`` processes and waits for them.
    """

    workers: int = 2
    cpus_per_worker: int = 2
    object_store_bytes: int = 150 * 1024 * 1024
    token: str | None = field(default_factory=lambda: secrets.token_hex(32))  # None: auth off
    procs: list[subprocess.Popen] = field(default_factory=list)
    spot_nodes: list["SpotNode"] = field(default_factory=list)

    def __post_init__(self) -> None:
        from moshray.jobs.local.cluster import free_ports

        # every port of the head's `ray start` distinct (see node_port_args)
        ports = free_ports(3 + len(NODE_PORT_FLAGS))
        self.gcs_port, self.dashboard_port, self._client_port = ports[:3]
        self._head_ports = ports[3:]
        self.gcs_address = f"{LOOPBACK}:{self.gcs_port}"
        self.dashboard_url = f"http://{LOOPBACK}:{self.dashboard_port}"
        self.logdir = Path(tempfile.mkdtemp(prefix="raystart-"))
        self.env = ray_env(self.token)

    def _get(self, path: str, timeout: float = 5):
        request = urllib.request.Request(f"{self.dashboard_url}{path}")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        return urllib.request.urlopen(request, timeout=timeout)

    def _start(self, name: str, args: list[str]) -> None:
        log = open(self.logdir / f"{name}.log", "w")
        self.procs.append(subprocess.Popen(
            ["ray", "start", "--block", "--node-ip-address", LOOPBACK, "--disable-usage-stats",
             *args], stdout=log, stderr=subprocess.STDOUT, env=self.env,
            start_new_session=True))

    def start(self, timeout: float = 180) -> "RayStartCluster":
        self._start("head", [
            "--head", "--port", str(self.gcs_port), "--num-cpus", "1",
            # the embedded cluster's health-check periods: a killed node is declared dead
            # in ~3-5 s instead of Ray's default 15-30 s (a slow raylet is not, at 2 cores)
            "--system-config", json.dumps(SYSTEM_CONFIG),
            "--include-dashboard", "true", "--dashboard-host", LOOPBACK,
            "--dashboard-port", str(self.dashboard_port),
            "--ray-client-server-port", str(self._client_port),
            "--object-store-memory", str(self.object_store_bytes),
            *node_port_args(self._head_ports)])
        self._wait_dashboard(timeout)
        for i in range(self.workers):
            # One node at a time: `ray start` gives a raylet a fixed 30 s to register, which
            # a loaded 2-core machine can miss when several start at once; one retry.
            for attempt in range(2):
                self._start(f"worker{i}-{attempt}", [
                    "--address", self.gcs_address, "--num-cpus", str(self.cpus_per_worker),
                    "--resources", f'{{"spot": 1000, "slot-{i}": 1}}',
                    "--object-store-memory", str(self.object_store_bytes), *node_port_args()])
                try:
                    self._wait_nodes(i + 2, timeout)
                    break
                except RuntimeError:
                    if attempt == 1:
                        raise
                    _end(self.procs.pop())
        return self

    def add_spot_node(self, name: str, cpus: int = 2, gpus: int = 0, timeout: float = 180):
        """Start one more spot worker as a separate machine would be: its own working
        directory and HOME, its own instance-metadata service (an IMDSv2 emulator named in
        ``AWS_EC2_METADATA_SERVICE_ENDPOINT``). Returns a ``SpotNode``; waits until it is alive."""
        from moshray.autoscaler.clouds.aws.emulator import IMDSv2Server

        root = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.logdir))
        (root / "home").mkdir()
        imds = IMDSv2Server(instance_id=f"i-{name}")
        env = dict(self.env, HOME=str(root / "home"), AWS_EC2_METADATA_SERVICE_ENDPOINT=imds.url)
        for attempt in range(2):
            # `ray start` gives its raylet a fixed 30 s to register, which a loaded 2-core
            # machine can miss: one retry, as in ``start``.
            log = open(self.logdir / f"{name}-{attempt}.log", "w")
            ports = node_port_args()
            proc = subprocess.Popen(
                ["ray", "start", "--block", "--node-ip-address", LOOPBACK,
                 "--disable-usage-stats", "--address", self.gcs_address, "--num-cpus",
                 str(cpus), "--num-gpus", str(gpus), "--resources", '{"spot": 1000}',
                 "--labels", f"moshray-test-node={name}",
                 "--object-store-memory", str(self.object_store_bytes), *ports],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True)
            self.procs.append(proc)
            try:
                # This node by its raylet's port (a count of alive nodes would be off while
                # Ray still lists a node the test stopped); a failure of the head or of this
                # `ray start` ends the wait (others may have been stopped by the test).
                self._wait_raylet(int(ports[ports.index("--node-manager-port") + 1]), timeout,
                                  watch=(self.procs[0], proc))
                break
            except (RuntimeError, TimeoutError):
                self.procs.remove(proc)
                _end(proc)  # a failed attempt's `ray start` must not outlive the test
                if attempt == 1:
                    imds.close()
                    raise
        node = SpotNode(name, proc, imds, root)
        self.spot_nodes.append(node)
        return node

    def _wait_dashboard(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with self._get("/api/version"):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError(f"dashboard not up after {timeout} s; see {self.logdir}")

    def _wait_nodes(self, n: int, timeout: float) -> None:
        self._wait_for(lambda alive: len(alive) >= n, f"{n} nodes alive", timeout)

    def _wait_raylet(self, port: int, timeout: float, watch) -> None:
        """Until the raylet listening on ``port`` is alive (see ``_wait_for``)."""
        self._wait_for(lambda alive: any(x.get("nodeManagerPort") == port for x in alive),
                       f"the raylet on port {port} alive", timeout, watch)

    def _wait_for(self, done, what: str, timeout: float, watch=None) -> None:
        """Until ``done(alive raylet rows of the dashboard)``; raises ``RuntimeError`` if one
        of the ``watch`` processes (default: all) exited, ``TimeoutError`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive(watch)
            try:
                with self._get("/nodes?view=summary") as r:
                    nodes = json.load(r)["data"]["summary"]
                if done([x["raylet"] for x in nodes if x["raylet"].get("state") == "ALIVE"]):
                    return
            except (OSError, KeyError, ValueError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"not {what} after {timeout} s; see {self.logdir}")

    def _check_alive(self, procs=None) -> None:
        for p in self.procs if procs is None else procs:
            if p.poll() is not None:
                raise RuntimeError(f"`ray start` exited with {p.returncode}; see {self.logdir}")

    def stop(self, keep_logs: bool = False) -> None:
        """End every node (workers first) and each spot node's metadata service; then
        remove the logs' directory unless ``keep_logs`` (a failed test's evidence: the
        errors above name it).

        Teardown is no scenario: each ``ray start --block`` session (the CLI, its raylet,
        GCS, agents and the workers they started, all in its process group) gets SIGKILL.
        A graceful stop of three nodes took 33 s here and proves nothing a test asks; a
        node's graceful end is ``SpotNode.terminate``."""
        for node in self.spot_nodes:
            node.imds.close()
        for p in reversed(self.procs):  # workers first, the head last
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        for p in reversed(self.procs):
            p.wait(timeout=30)
        if not keep_logs:
            shutil.rmtree(self.logdir, ignore_errors=True)

    def __enter__(self) -> "RayStartCluster":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        self.stop(keep_logs=exc_type is not None)


def leftovers(cluster: RayStartCluster, settle_s: float = 60.0) -> str | None:
    """What a test left on a shared ``cluster``, once it had ``settle_s`` to end: ``None``
    when every node it started with is alive, no job is pending or running and no moshray
    actor (replica, lease, Coordinator, watcher) is alive; else one line saying what is
    left (the job API and Ray's state API, read over the dashboard)."""
    deadline = time.monotonic() + settle_s
    while True:
        try:
            with cluster._get("/api/jobs/", timeout=10) as r:
                jobs = [j.get("submission_id") or j.get("job_id") for j in json.load(r)
                        if j.get("status") in ("PENDING", "RUNNING")]
            with cluster._get("/api/v0/actors?limit=10000&detail=false", timeout=10) as r:
                rows = json.load(r)["data"]["result"]["result"]
            actors = sorted(a.get("name") or a.get("class_name", "?") for a in rows
                            if a.get("state") == "ALIVE"
                            and "moshray" in (a.get("name") or "").lower())
            with cluster._get("/nodes?view=summary", timeout=10) as r:
                alive = sum(1 for x in json.load(r)["data"]["summary"]
                            if x["raylet"].get("state") == "ALIVE")
            problem = [f"jobs running: {jobs}"] if jobs else []
            problem += [f"moshray actors alive: {actors}"] if actors else []
            if alive < cluster.workers + 1:
                problem.append(f"{alive} nodes alive of {cluster.workers + 1}")
        except (OSError, KeyError, ValueError) as exc:
            problem = [f"its state unreadable ({exc!r})"]
        if not problem or time.monotonic() > deadline:
            return "; ".join(problem) or None
        time.sleep(2.0)
