"""The embedded local cluster: a head plus simulated spot nodes on this machine.

This is the embedded "cloud": it only acts on the cluster, as a cloud does, and never calls
into a job. Each spot node is a real raylet with the ``spot`` custom resource (the market
marker Ray's autoscaler configs in ``infra/`` also give spot workers), the label
``moshray-slot`` and optionally declared GPUs (``gpus_per_node``, to test placement on
machines without any), and its own instance-metadata service (an IMDSv2 emulator) through
which ``notice`` delivers a spot interruption notice exactly as EC2 does. Removing a node is
a preemption (graceful) or a hard kill (``hard=True``: its processes are killed with SIGKILL
and Ray finds out through its health checks). Two modes (``LocalClusterConfig.hosts``):

``loopback`` (default, no root needed)
    Every raylet on 127.0.0.1 (``ray.cluster_utils.Cluster``), each with its own ``HOME``;
    the node's metadata emulator listens on 127.0.0.1 and is named in the node's environment
    as ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, as AWS SDKs find it. Ray's health checks run at
    1 s periods (``SYSTEM_CONFIG``) so a killed raylet is noticed in seconds.
``netns`` (separate hosts; root)
    The head runs here, on a bridge address (``jobs/local/netns.py``); every spot node is a
    ``ray start --block`` process inside a network namespace of its own, with its own
    address, working directory, ``HOME`` and temporary directory, and its metadata emulator
    at the real ``169.254.169.254:80`` inside that namespace with no variable naming it
    (``notice_source = "auto"`` finds it as on EC2). Links can be shaped (``shape``) and cut
    (``cut`` / ``heal``: a partition). Ray's health checks keep Ray's defaults, and Ray's
    token authentication is on. Everything is removed at ``shutdown``, and what a crashed
    earlier run left is removed before a new one starts.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

from moshray.autoscaler.clouds.aws.emulator import IMDSv2Server
from moshray.autoscaler.clouds.aws.identity import AWS_ENDPOINT_ENV
from moshray.autoscaler.clouds.detect import metadata_env_names, search_off_environ
from moshray.cluster.placement import SLOT_LABEL, SPOT_RESOURCE, ZONE_LABEL

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


def _port_or_free(host: str, port: int) -> int:
    """``port`` if it can be bound on ``host`` now, else a port the OS finds free there."""
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
            return port
        except OSError:
            sock.bind((host, 0))
            return sock.getsockname()[1]


def pin_loopback() -> None:
    """Make Ray bind to 127.0.0.1 only (call before Ray starts any process).

    Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` when it is imported; the environment
    variable covers the processes Ray spawns, the constant covers this already-imported one.
    """
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def allow_cluster_addresses() -> None:
    """Let Ray use this machine's non-loopback addresses (the separate-hosts bridge); the
    counterpart of ``pin_loopback``. Call before Ray starts any process."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "1"
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = True


HOSTS = ("loopback", "netns")
HEAD_ENV = search_off_environ()  # every registered cloud's SDK opt-out set
# What a spot node of the separate-hosts mode must not inherit from the driver: a Ray address
# or token of another cluster, and anything that names or switches off the metadata service
# (the node finds its own at 169.254.169.254, as on a cloud).
NODE_ENV_DROP = ("RAY_ADDRESS", "RAY_AUTH_TOKEN", *metadata_env_names())


@dataclass
class _NetnsNode:
    """A spot node of the separate-hosts mode: its ``ray start --block`` process (a session
    of its own, inside the slot's namespace), the command, its directory and its Ray node
    id."""

    proc: object
    argv: tuple[str, ...]
    root: str
    node_id: str
    log_path: str


class _GcsNode(NamedTuple):
    """One row of the GCS's node table."""

    node_id: str
    address: str
    port: int  # the raylet's (node manager's)
    alive: bool


@dataclass(frozen=True)
class LocalClusterConfig:
    """Sizes of the embedded cluster (logical CPUs; object store per node in bytes) and its
    ``hosts`` mode: ``loopback`` or ``netns`` (see the module docstring)."""

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
    hosts: str = "loopback"
    node_start_s: float = 180.0  # netns: how long a spot node may take to register
    # (slot, zone) pairs: the node's ray.io/availability-zone label, as a cloud node's own
    # setup gives it (the Coordinator's grid averages inside a zone first); others have none.
    zones: tuple[tuple[int, str], ...] = ()
    # netns: (slot, Mbit/s) pairs: the slot's link is shaped to that rate each way as its
    # node starts, before its raylet joins (a node a trace adds again gets the same link);
    # others are not shaped. ``jobs/local/links.py`` lays a link profile out this way.
    link_mbit: tuple[tuple[int, float], ...] = ()
    # netns: (zone, Mbit/s or None) pairs: that zone's nodes sit on a bridge of their own,
    # joined to the head's by one link at the rate each way (``HostNetwork.add_zone``):
    # fast inside the zone, slow between zones.
    zone_links: tuple[tuple[str, float | None], ...] = ()

    def labels(self, slot: int) -> dict[str, str]:
        """The Ray node labels of ``slot``'s raylet."""
        zone = dict(self.zones).get(slot)
        return {SLOT_LABEL: str(slot), **({ZONE_LABEL: zone} if zone else {})}

    def __post_init__(self) -> None:
        if self.hosts not in HOSTS:
            raise ValueError(f"hosts must be one of {', '.join(HOSTS)}, got {self.hosts!r}")
        if self.spot_nodes < 0:
            raise ValueError(f"spot_nodes must be >= 0, got {self.spot_nodes}")
        if self.object_store_bytes < 80 * 1024 * 1024:
            raise ValueError("object_store_bytes must be at least 80 MiB")
        if self.link_mbit and self.hosts != "netns":
            raise ValueError("link_mbit shapes links between separate hosts: it needs "
                             "hosts='netns'")
        for slot, mbit in self.link_mbit:
            if not (isinstance(mbit, (int, float)) and mbit > 0):
                raise ValueError(f"link_mbit: slot {slot}'s rate must be a positive Mbit/s, "
                                 f"got {mbit!r}")
        if self.zone_links and self.hosts != "netns":
            raise ValueError("zone_links joins zones of separate hosts: it needs "
                             "hosts='netns'")
        named = {zone for _, zone in self.zones}
        for zone, mbit in self.zone_links:
            if zone not in named:
                raise ValueError(f"zone_links: zone {zone!r} has no slot in zones")
            if mbit is not None and not (isinstance(mbit, (int, float)) and mbit > 0):
                raise ValueError(f"zone_links: zone {zone!r}'s rate must be a positive "
                                 f"Mbit/s or None, got {mbit!r}")


class LocalCluster:
    """A head node and ``spot_nodes`` spot raylets on this machine.

    Use as a context manager; ``shutdown`` stops only the processes this object started
    (and, in the netns mode, removes its namespaces and bridge). Node slots are integers;
    ``add_node(slot)`` starts a raylet for the slot and ``remove_node(slot)`` stops it.
    Thread-safe (a trace replayer may call it). In the netns mode ``shape``, ``cut`` and
    ``heal`` act on a node's link; in the loopback mode they raise ``ValueError``.
    """

    def __init__(self, config: LocalClusterConfig = LocalClusterConfig()):
        import ray
        from ray.cluster_utils import Cluster

        self.config = config
        self.net = None
        self._connected = False  # whether connect() connected this process's driver
        # The head is this machine, which is no cloud instance: the clouds' SDK opt-outs keep
        # anything on it (a watcher with notice_source="auto") from probing this machine's
        # real 169.254.169.254. Restored at shutdown; spot nodes do not inherit them.
        self._saved_env = {k: os.environ.get(k) for k in
                           (*HEAD_ENV, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
        from ray._private import ray_constants

        self._saved_ray_cluster = ray_constants.ENABLE_RAY_CLUSTER
        os.environ.update(HEAD_ENV)
        if config.hosts == "netns":
            from moshray.jobs.local.netns import HostNetwork, unavailable

            why = unavailable()
            if why:
                raise RuntimeError(why)
            allow_cluster_addresses()
            self.net = HostNetwork()
            try:
                for zone, mbit in config.zone_links:
                    self.net.add_zone(zone, mbit)
            except BaseException:
                self.net.close()
                raise
            ip = self.net.head_address
        else:
            pin_loopback()
            ip = LOOPBACK
        allow_slow_node_registration()
        self._lock = threading.Lock()
        # Ray refuses unauthenticated peers on a non-loopback address: the netns mode always
        # runs with a token, as a real cluster should.
        self._auth = _TokenAuthEnv() if config.token_auth or self.net else None
        agent_port, client_port = free_ports(2)
        head_args = dict(
            node_ip_address=ip,
            num_cpus=config.head_cpus,
            object_store_memory=config.object_store_bytes,
            include_dashboard=config.dashboard,
            # Ray's fixed defaults (52365, 10001) would clash with a second cluster on this
            # machine; the head's job agent then never binds and job submission answers
            # "No available agent".
            dashboard_agent_listen_port=agent_port,
            ray_client_server_port=client_port,
        )
        if self.net is None:  # separate hosts keep Ray's own health-check periods
            head_args["_system_config"] = SYSTEM_CONFIG
        if config.dashboard:  # on the head's address only (127.0.0.1 in the loopback mode)
            head_args["dashboard_host"] = ip
            # Ray's usual 8265 unless another cluster on this machine holds it
            head_args["dashboard_port"] = config.dashboard_port or _port_or_free(ip, 8265)
        self.nodes: dict[int, object] = {}
        self.metadata: dict[int, object] = {}  # slot -> its IMDSv2 emulator
        self._homes = tempfile.mkdtemp(prefix="moshray-nodes-")
        try:
            with _driver_kept():  # a driver already connected elsewhere stays so
                self.cluster = Cluster(initialize_head=True, head_node_args=head_args)
            for slot in range(config.spot_nodes):
                self.add_node(slot)
        except BaseException:
            self.shutdown()
            raise
        self._ray = ray

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def auth_token_path(self) -> str | None:
        """File holding the token when token authentication is on (else None)."""
        return self._auth.token_path if self._auth else None

    def driver_env(self, base: dict | None = None) -> dict:
        """The environment of a driver process of its own joining this cluster (``base``,
        default this process's, with these set): ``RAY_ADDRESS``, the token where
        authentication is on (``RAY_AUTH_TOKEN`` of ``base`` dropped, so no other wins) and
        Ray's address rule of this mode (loopback only, or the bridge's addresses)."""
        env = dict(os.environ if base is None else base, RAY_ADDRESS=self.address,
                   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1" if self.net else "0")
        env.pop("RAY_AUTH_TOKEN", None)
        if self._auth is not None:
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self._auth.token_path)
        return env

    @property
    def dashboard_url(self) -> str | None:
        """``http://host:port`` of Ray's dashboard (``dashboard=True``), else None."""
        url = getattr(self.cluster, "webui_url", None)
        return f"http://{url}" if url else None

    def connect(self, namespace: str = "moshray", log_to_driver: bool = False) -> None:
        """Connect this process's Ray driver to this cluster.

        A no-op when the driver is already connected here. Raises RuntimeError when it is
        connected to another cluster: one process has one driver, and silently keeping the
        other connection would run this cluster's work elsewhere. Only a connection made here
        is ended by ``shutdown()``: a cluster started beside a connected driver (a test's
        own cluster next to the session's) leaves that driver connected.
        """
        import ray

        if ray.is_initialized():
            current = ray.get_runtime_context().gcs_address
            if current != self.address:
                raise RuntimeError(f"this process's Ray driver is connected to {current}, not to "
                                   f"this cluster ({self.address}); ray.shutdown() it first")
            return
        ray.init(address=self.address, namespace=namespace,
                 log_to_driver=log_to_driver, logging_level=logging.WARNING)
        self._connected = True

    def add_node(self, slot: int | None = None) -> int:
        """Start a spot raylet for ``slot`` (next free slot if None); returns the slot."""
        with self._lock:
            if slot is None:
                slot = next(i for i in range(len(self.nodes) + 1) if i not in self.nodes)
            if slot in self.nodes:
                raise ValueError(f"slot {slot} already has a node")
            self.nodes[slot] = None  # reserved while it starts
        try:
            if self.net is not None:
                node, imds = self._start_netns_node(slot)
            else:
                node, imds = self._start_loopback_node(slot)
        except BaseException:
            with self._lock:
                self.nodes.pop(slot, None)
            raise
        with self._lock:
            self.nodes[slot] = node
            self.metadata[slot] = imds
        log.info("spot node %d up (%s)", slot, self.node_id(slot))
        return slot

    def _start_loopback_node(self, slot: int):
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
                labels=self.config.labels(slot),
                # The node names its own metadata service (which wins over the head's opt-outs).
                env_vars={"HOME": home, AWS_ENDPOINT_ENV: imds.url},
            )
        except BaseException:
            imds.close()
            raise
        return node, imds

    def _node_env(self, root: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in NODE_ENV_DROP}
        env.update(HOME=os.path.join(root, "home"), TMPDIR=os.path.join(root, "tmp"),
                   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="1", RAY_USAGE_STATS_ENABLED="0",
                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self._auth.token_path)
        return env

    def _start_netns_node(self, slot: int):
        """A spot node in a namespace of its own: its network, metadata service at
        169.254.169.254:80, directories, and ``ray start --block`` joining the head."""
        import json
        import subprocess
        import sys

        zone = dict(self.config.zones).get(slot)
        host = self.net.add_host(slot, zone if zone in dict(self.config.zone_links) else None)
        imds = None
        proc = None
        try:
            mbit = dict(self.config.link_mbit).get(slot)
            if mbit is not None:  # shaped before anything of the node's talks on it
                self.net.shape(slot, mbit)
            imds = IMDSv2Server(instance_id=f"i-netns{slot:012d}",
                                listen=self.net.listen_in(slot))
            root = tempfile.mkdtemp(prefix=f"slot{slot}-", dir=self._homes)
            for sub in ("home", "tmp"):
                os.makedirs(os.path.join(root, sub))
            log_path = os.path.join(root, "ray-start.log")
            ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
            argv = [ray_cli if os.path.exists(ray_cli) else "ray", "start", "--block",
                    "--address", self.address, "--node-ip-address", host.address,
                    "--num-cpus", str(self.config.cpus_per_node),
                    "--num-gpus", str(self.config.gpus_per_node),
                    "--object-store-memory", str(self.config.object_store_bytes),
                    "--resources", json.dumps({SPOT_RESOURCE: 1000, f"slot-{slot}": 1}),
                    "--labels", ",".join(f"{k}={v}" for k, v in self.config.labels(slot).items()),
                    "--disable-usage-stats"]
            with open(log_path, "w") as out:
                proc = self.net.popen(slot, argv, stdout=out, stderr=subprocess.STDOUT,
                                      env=self._node_env(root), cwd=root)
            node_id = self._wait_registered(host.address, proc, log_path)
            return _NetnsNode(proc, tuple(argv), root, node_id, log_path), imds
        except BaseException:
            if proc is not None:
                _end_group(proc, graceful=False)
            if imds is not None:
                imds.close()
            self.net.remove_host(slot)
            raise

    def _gcs_nodes(self) -> list[_GcsNode]:
        """Every node the GCS knows: id (hex), address, raylet port, alive."""
        from ray._raylet import GcsClient

        infos = GcsClient(address=self.address).get_all_node_info(timeout=10)
        return [_GcsNode(info.node_id.hex() if isinstance(info.node_id, bytes) else str(node_id),
                         info.node_manager_address, info.node_manager_port, info.state == 0)
                for node_id, info in infos.items()]

    def _wait_registered(self, address: str, proc, log_path: str, old: str | None = None
                         ) -> str:
        """The node id of the alive raylet at ``address`` (other than ``old``), once the GCS
        lists it; raises ``RuntimeError`` if ``ray start`` exits or the wait runs out."""
        deadline = time.monotonic() + self.config.node_start_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"`ray start` of the node at {address} exited with "
                                   f"{proc.returncode}; see {_tail(log_path)}")
            try:
                for row in self._gcs_nodes():
                    if row.alive and row.address == address and row.node_id != old:
                        return row.node_id
            except Exception as exc:  # noqa: BLE001 - the GCS may be busy; the wait is bounded
                log.debug("GCS node table not read: %r", exc)
            time.sleep(0.5)
        raise RuntimeError(f"the node at {address} did not register within "
                           f"{self.config.node_start_s:g} s; see {_tail(log_path)}")

    def node_id(self, slot: int) -> str:
        """Ray's hex node id of ``slot``'s raylet."""
        with self._lock:
            node = self.nodes[slot]
        return node.node_id

    def node_address(self, slot: int) -> str:
        """The address ``slot``'s raylet runs on (127.0.0.1 in the loopback mode)."""
        return self.net.host(slot).address if self.net is not None else LOOPBACK

    def node_pids(self, slot: int) -> tuple[int, ...]:
        """The pids of ``slot``'s Ray daemons (its raylet and what Ray started with it); the
        node's agents and workers run below them. In the netns mode: every process in the
        node's namespace."""
        with self._lock:
            node = self.nodes[slot]
        if self.net is not None:
            from moshray.jobs.local.netns import _namespace_pids

            return tuple(_namespace_pids(self.net.host(slot).namespace))
        return tuple(process.pid for _, process in node.live_processes())

    def host_pid(self, slot: int, pid: int) -> int:
        """This machine's pid of the process that ``slot``'s node calls ``pid`` (separate
        hosts give each node a PID namespace of its own; loopback nodes share this one).
        Raises ProcessLookupError if no process of the node has that pid."""
        if self.net is None:
            return pid
        for host_pid in self.node_pids(slot):
            try:
                with open(f"/proc/{host_pid}/status") as f:
                    ns = next((line.split()[1:] for line in f if line.startswith("NSpid:")), [])
            except OSError:
                continue
            if len(ns) > 1 and int(ns[-1]) == pid:
                return host_pid
        raise ProcessLookupError(f"no process {pid} on slot {slot}'s node")

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
        if self.net is not None:
            _end_group(node.proc, graceful=not hard)
            self.net.remove_host(slot)  # and whatever still runs in its namespace
        else:
            self.cluster.remove_node(node, allow_graceful=not hard)
        if imds is not None:
            imds.close()
        log.info("spot node %d %s", slot, "killed" if hard else "removed")

    def live_slots(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(sorted(s for s, n in self.nodes.items() if n is not None))

    # -- links (separate hosts only) ---------------------------------------------------------

    def _network(self):
        if self.net is None:
            raise ValueError("links can be shaped or cut only with hosts='netns'")
        return self.net

    def shape(self, slot: int, mbit: float | None) -> None:
        """Limit ``slot``'s link to ``mbit`` Mbit/s each way (None: unlimited)."""
        self._network().shape(slot, mbit)

    def run_on(self, slot: int, argv: list[str], log_path: str):
        """Start ``argv`` on ``slot``'s machine, as its init system would (e.g. the node's
        own ``moshray watch``): inside its namespace, with its environment, directory and
        Ray token, output to ``log_path``. Returns the ``Popen`` (a session of its own); it
        ends with the node. Separate hosts only."""
        import subprocess

        net = self._network()
        with self._lock:
            node = self.nodes[slot]
        with open(log_path, "w") as out:
            return net.popen_beside(node.proc, argv, stdout=out, stderr=subprocess.STDOUT,
                                    env=self._node_env(node.root), cwd=node.root)

    def link_stats(self, slot: int) -> dict[str, int]:
        """Counters of ``slot``'s link, both ends (``HostNetwork.link_stats``: bytes and
        packets sent, dropped, held back by a shaper). Separate hosts only."""
        return self._network().link_stats(slot)

    def reachable(self, slot: int, timeout_s: float = 1.0) -> bool:
        """Whether a TCP connection from this machine to ``slot``'s raylet opens within
        ``timeout_s`` (False while the node is cut off)."""
        with self._lock:
            node = self.nodes[slot]
        port = next((r.port for r in self._gcs_nodes() if r.node_id == node.node_id), None)
        if port is None:
            return False
        try:
            socket.create_connection((self.node_address(slot), port), timeout=timeout_s).close()
            return True
        except OSError:
            return False

    def cut(self, slot: int) -> None:
        """Partition ``slot``: its link goes down; its processes keep running."""
        self._network().cut(slot)
        log.info("spot node %d cut off", slot)

    def heal(self, slot: int, timeout_s: float = 120.0) -> str:
        """End ``slot``'s partition. Returns ``"same"`` if its raylet is alive in Ray's node
        table again, or ``"new"`` if Ray had declared it dead (its raylet then exits): a new
        raylet is started in the same namespace, as a machine's init system would restart
        it. Waits at most ``timeout_s`` for either."""
        net = self._network()
        net.heal(slot)
        with self._lock:
            node = self.nodes[slot]
        address = net.host(slot).address
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                break
            try:
                rows = [r for r in self._gcs_nodes() if r.node_id == node.node_id]
            except Exception as exc:  # noqa: BLE001 - bounded wait; the GCS may be busy
                log.debug("GCS node table not read: %r", exc)
                rows = []
            if rows and rows[0].alive:
                log.info("spot node %d back (same raylet)", slot)
                return "same"
            if rows and not rows[0].alive:
                break  # declared dead: its raylet will exit; replace it now
            time.sleep(0.5)
        else:
            raise TimeoutError(f"node {slot} neither came back nor was declared dead "
                               f"within {timeout_s:g} s")
        _end_group(node.proc, graceful=False)
        from moshray.jobs.local.netns import _end_pids, _namespace_pids

        _end_pids(_namespace_pids(net.host(slot).namespace))
        import subprocess

        with open(node.log_path, "a") as out:
            proc = net.popen(slot, list(node.argv), stdout=out, stderr=subprocess.STDOUT,
                             env=self._node_env(node.root), cwd=node.root)
        try:
            node_id = self._wait_registered(address, proc, node.log_path, old=node.node_id)
        except BaseException:
            _end_group(proc, graceful=False)
            raise
        with self._lock:
            self.nodes[slot] = _NetnsNode(proc, node.argv, node.root, node_id, node.log_path)
        log.info("spot node %d back as a new raylet (%s)", slot, node_id)
        return "new"

    def shutdown(self) -> None:
        import ray

        if self._connected and ray.is_initialized():
            ray.shutdown()
        self._connected = False
        with self._lock:
            nodes = [n for n in self.nodes.values() if n is not None]
            self.nodes = {}
            servers, self.metadata = list(self.metadata.values()), {}
        if self.net is not None:
            for node in nodes:
                _end_group(node.proc, graceful=True, timeout_s=20)
        cluster = getattr(self, "cluster", None)
        if cluster is not None:
            with _driver_kept():
                cluster.shutdown()
        for imds in servers:
            imds.close()
        if self.net is not None:
            self.net.close()
        shutil.rmtree(self._homes, ignore_errors=True)
        if self._auth is not None:
            self._auth.undo()
            self._auth = None
        if self.net is not None:  # this process binds to loopback again, as before
            from ray._private import ray_constants

            ray_constants.ENABLE_RAY_CLUSTER = self._saved_ray_cluster
        else:
            self._saved_env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        for key, value in getattr(self, "_saved_env", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}

    def __enter__(self) -> "LocalCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


@contextlib.contextmanager
def _driver_kept():
    """Start or stop a cluster's head inside: a Ray driver connected (to another cluster)
    keeps its own afterwards. Ray's ``Node`` repoints the process-wide internal-KV client at
    the new head's GCS and ``Cluster.shutdown`` resets it and ``RAY_ADDRESS``; left so, the
    driver's internal-KV calls would fail, or wait on a dead GCS until Ray ends the
    process."""
    import ray

    address_env = os.environ.get("RAY_ADDRESS")
    yield
    if not ray.is_initialized():
        return
    from ray.experimental import internal_kv

    internal_kv._initialize_internal_kv(ray._private.worker.global_worker.gcs_client)
    if address_env is not None:
        os.environ["RAY_ADDRESS"] = address_env


def _tail(path: str, lines: int = 8) -> str:
    try:
        with open(path) as f:
            return f"{path}: " + " | ".join(x.strip() for x in f.readlines()[-lines:])
    except OSError:
        return path


def _end_group(proc, graceful: bool, timeout_s: float = 30.0) -> None:
    """End a spot node of the netns mode (``HostNetwork.popen``: ``unshare`` whose child is
    the node's ``ray start --block``, pid 1 of its PID namespace). ``graceful``: SIGTERM to
    ``ray start`` (it stops the node's Ray processes); otherwise, or after ``timeout_s``,
    SIGKILL to the session (its ``unshare --kill-child`` takes the whole PID namespace)."""
    import signal

    from moshray.jobs.local.netns import machine_init

    init = machine_init(proc) if graceful else None
    if proc.poll() is None:
        try:
            if init is not None:
                os.kill(init, signal.SIGTERM)
            else:
                os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=timeout_s if init is not None else 10)
    except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: no grace left
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
