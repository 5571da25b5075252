"""The embedded local cluster: a head plus simulated spot nodes, all on 127.0.0.1.

This is the embedded "cloud": it only acts on the cluster, as a cloud does, and never calls
into a job. Each spot node is a real raylet (``ray.cluster_utils.Cluster``) with the ``spot``
custom resource (the market marker Ray's autoscaler configs in ``infra/`` also give spot
workers), the label ``moshray-slot`` and optionally declared GPUs (``gpus_per_node``, to test
placement on machines without any). Each node is a separate machine as far as it can be on
one host: its processes get their own ``HOME`` (a fresh directory per node), and its own
instance-metadata service (an IMDSv2 emulator on 127.0.0.1, named in the node's environment
as ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, as AWS SDKs find it), through which ``notice``
delivers a spot interruption notice exactly as EC2 does. Removing a node is a preemption
(graceful) or a hard kill (``hard=True``: its processes are killed with SIGKILL and Ray
finds out through its health checks). Everything binds to loopback (127.0.0.1).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass

from moshray.autoscaler.metadata_emulator import IMDSv2Server
from moshray.autoscaler.notices import AWS_ENDPOINT_ENV
from moshray.cluster.placement import SLOT_LABEL, SPOT_RESOURCE

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
# Fast failure detection for a local cluster: a dead raylet is noticed in ~3-5 s, while a
# raylet that is merely slow on a loaded 2-core machine is not declared dead by mistake.
SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 1000,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 2000,
    "health_check_failure_threshold": 3,
}


NODE_REGISTRATION_S = 180.0


def allow_slow_node_registration(timeout_s: float = NODE_REGISTRATION_S) -> None:
    """Give a starting raylet up to ``timeout_s`` to register with the GCS (this process).

    Ray's ``Node`` waits a fixed 30 s for its raylet to register and then fails; on a
    loaded 2-core machine starting several raylets that is sometimes too short, and the
    half-started node's processes would be left behind. The wait loop asks
    ``services.get_node`` until it answers: this makes each of those calls itself retry
    until ``timeout_s``, so the loop's 30 s limit is never reached early. Idempotent.
    """

    from ray._private import services

    if getattr(services.get_node, "_moshray_patient", False):
        return
    get_node = services.get_node

    def patient_get_node(gcs_address, node_id):
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return get_node(gcs_address, node_id)
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.5)

    patient_get_node._moshray_patient = True
    services.get_node = patient_get_node


class _TokenAuthEnv:
    """Ray token auth (``RAY_AUTH_MODE=token``) for this process and the Ray processes it starts.

    A fresh token (Ray's own generator, 256 bits) goes to a file readable only by this user
    (``token_path``, in a private temporary directory) named by ``RAY_AUTH_TOKEN_PATH``;
    ``RAY_AUTH_TOKEN`` is unset so no other token wins. ``undo`` restores the environment
    and removes the file. Clients need the same two variables (or the token as a
    ``Authorization: Bearer`` header) to reach the cluster.
    """

    KEYS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")

    def __init__(self) -> None:
        import tempfile

        from ray._private.authentication.authentication_token_generator import (
            generate_new_authentication_token,
        )

        self._saved = {k: os.environ.get(k) for k in self.KEYS}
        self._dir = tempfile.mkdtemp(prefix="moshray-auth-")  # mode 0700
        self.token_path = os.path.join(self._dir, "auth_token")
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, generate_new_authentication_token().encode())
        os.close(fd)
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token_path)
        self._reload()

    @staticmethod
    def _reload() -> None:
        # Ray caches the auth mode (RayConfig) and the token; re-read both from the env.
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()

    def undo(self) -> None:
        import shutil

        for key, value in self._saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._reload()
        shutil.rmtree(self._dir, ignore_errors=True)


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on loopback right now (the OS picks them; every socket
    is held until all ports are known, so no two of the ``n`` are the same)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind((LOOPBACK, 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def pin_loopback() -> None:
    """Make Ray bind to 127.0.0.1 only (call before Ray starts any process).

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported; the environment
    variable covers the processes Ray spawns, the constant covers this already-imported one.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


@dataclass(frozen=True)
class LocalClusterConfig:
    """Sizes of the embedded cluster (logical CPUs; object store per node in bytes)."""

    spot_nodes: int = 2
    cpus_per_node: float = 2
    head_cpus: float = 1
    object_store_bytes: int = 200 * 1024 * 1024
    dashboard: bool = False
    dashboard_port: int | None = None
    gpus_per_node: int = 0  # declared on each spot raylet (no real device behind them)
    # Ray token authentication: every Ray process, this driver and the job API require a
    # fresh token (see LocalCluster.auth_token_path); off by default.
    token_auth: bool = False

    def __post_init__(self) -> None:
        if self.spot_nodes < 0:
            raise ValueError(f"spot_nodes must be >= 0, got {self.spot_nodes}")
        if self.object_store_bytes < 80 * 1024 * 1024:
            raise ValueError("object_store_bytes must be at least 80 MiB")


class LocalCluster:
    """A head node and ``spot_nodes`` spot raylets on this machine.

    Use as a context manager; ``shutdown`` stops only the processes this object started.
    Node slots are integers; ``add_node(slot)`` starts a raylet for the slot and
    ``remove_node(slot)`` stops it. Thread-safe (a trace replayer may call it).
    """

    def __init__(self, config: LocalClusterConfig = LocalClusterConfig()):
        import ray
        from ray.cluster_utils import Cluster

        pin_loopback()
        allow_slow_node_registration()
        self.config = config
        self._lock = threading.Lock()
        self._auth = _TokenAuthEnv() if config.token_auth else None
        agent_port, client_port = free_ports(2)
        head_args = dict(
            node_ip_address=LOOPBACK,
            num_cpus=config.head_cpus,
            object_store_memory=config.object_store_bytes,
            include_dashboard=config.dashboard,
            _system_config=SYSTEM_CONFIG,
            # Ray's fixed defaults (52365, 10001) would clash with a second cluster on this
            # machine; the head's job agent then never binds and job submission answers
            # "No available agent".
            dashboard_agent_listen_port=agent_port,
            ray_client_server_port=client_port,
        )
        if config.dashboard:
            head_args["dashboard_host"] = LOOPBACK
            if config.dashboard_port:
                head_args["dashboard_port"] = config.dashboard_port
        self.cluster = Cluster(initialize_head=True, head_node_args=head_args)
        self.nodes: dict[int, object] = {}
        self.metadata: dict[int, object] = {}  # slot -> its IMDSv2 emulator
        self._homes = tempfile.mkdtemp(prefix="moshray-nodes-")
        for slot in range(config.spot_nodes):
            self.add_node(slot)
        self._ray = ray

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def auth_token_path(self) -> str | None:
        """File holding the token when ``token_auth`` is on (else None)."""
        return self._auth.token_path if self._auth else None

    @property
    def dashboard_url(self) -> str | None:
        url = getattr(self.cluster, "webui_url", None)
        return f"http://{url}" if url else None

    def connect(self, namespace: str = "moshray", log_to_driver: bool = False) -> None:
        import ray

        ray.init(address=self.address, namespace=namespace, ignore_reinit_error=True,
                 log_to_driver=log_to_driver)

    def add_node(self, slot: int | None = None) -> int:
        """Start a spot raylet for ``slot`` (next free slot if None); returns the slot."""
        with self._lock:
            if slot is None:
                slot = next(i for i in range(len(self.nodes) + 1) if i not in self.nodes)
            if slot in self.nodes:
                raise ValueError(f"slot {slot} already has a node")
            imds = IMDSv2Server(instance_id=f"i-local{slot:012d}")
            home = tempfile.mkdtemp(prefix=f"slot{slot}-", dir=self._homes)
            try:
                node = self.cluster.add_node(
                    node_ip_address=LOOPBACK,
                    num_cpus=self.config.cpus_per_node,
                    num_gpus=self.config.gpus_per_node,
                    object_store_memory=self.config.object_store_bytes,
                    # slot-N: lets tests and benchmarks pin an actor to a slot; the training
                    # job never uses it (it places by node affinity).
                    resources={SPOT_RESOURCE: 1000, f"slot-{slot}": 1},
                    labels={SLOT_LABEL: str(slot)},
                    env_vars={"HOME": home, AWS_ENDPOINT_ENV: imds.url},
                )
            except BaseException:
                imds.close()
                raise
            self.nodes[slot] = node
            self.metadata[slot] = imds
            log.info("spot node %d up (%s)", slot, node.node_id)
            return slot

    def node_id(self, slot: int) -> str:
        """Ray's hex node id of ``slot``'s raylet."""
        return self.nodes[slot].node_id

    def node_pids(self, slot: int) -> tuple[int, ...]:
        """The pids of ``slot``'s Ray daemons (its raylet and what Ray started with it); the
        node's agents and workers run below them."""
        with self._lock:
            node = self.nodes[slot]
        return tuple(process.pid for _, process in node.live_processes())

    @property
    def head_node_id(self) -> str:
        return self.cluster.head_node.node_id

    def notice(self, slot: int, notice_s: float, action: str = "terminate") -> None:
        """A spot interruption notice for ``slot``'s node, due in ``notice_s`` seconds,
        published on the node's metadata service (whoever watches the node hears it there)."""
        with self._lock:
            imds = self.metadata[slot]
        imds.interrupt(action, time.time() + notice_s)
        log.info("spot node %d noticed (%s in %.1f s)", slot, action, notice_s)

    def remove_node(self, slot: int, hard: bool = False) -> None:
        """Stop the raylet of ``slot``; ``hard`` kills its processes without grace."""
        with self._lock:
            node = self.nodes.pop(slot)
            imds = self.metadata.pop(slot, None)
        self.cluster.remove_node(node, allow_graceful=not hard)
        if imds is not None:
            imds.close()
        log.info("spot node %d %s", slot, "killed" if hard else "removed")

    def live_slots(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(self.nodes))

    def shutdown(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        self.cluster.shutdown()
        with self._lock:
            servers, self.metadata = list(self.metadata.values()), {}
        for imds in servers:
            imds.close()
        shutil.rmtree(self._homes, ignore_errors=True)
        if self._auth is not None:
            self._auth.undo()
            self._auth = None

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
