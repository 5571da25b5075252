"""Separate hosts on one machine: a Linux network namespace per spot node (``cluster.hosts =
"netns"``).

The embedded cluster's separate-hosts mode. ``HostNetwork`` makes a bridge on a private /24
(``10.77.N.0/24``, the first free ``N``), whose ``.1`` is the head machine (this host's side
of the bridge: the driver, the head's raylet and Prometheus run there), and for each spot
node a namespace with:

* its own address on the bridge (``10.77.N.(10 + slot)``) and its own loopback; its default
  route points at ``10.77.N.254``, an address nobody holds, so a process can find its own
  address as on a real machine (Ray's drivers ask the route to a public address) while
  nothing a node sends to an outside address ever leaves its namespace;
* the address ``169.254.169.254`` on its loopback, where the node's cloud metadata service
  listens (``listen_in``: a socket made inside the namespace and served by an emulator in
  this process), as on EC2 and GCE; no environment variable names it;
* a link that can be shaped (``shape``: ``tbf`` on both ends of the veth pair, so the node
  sends and receives at most the rate) and cut (``cut``: the link set down, a partition;
  ``heal`` sets it up again).

Zones (``add_zone``): a zone's nodes can sit on a bridge of their own (same subnet, one L2
segment), joined to the head's bridge by one link shaped like a node's: traffic between two
nodes of the zone stays on its bridge (fast), every frame between the zone and the rest
crosses that link (``zone_link``: its head-side name, whose counters are the bytes crossing),
as between two cloud availability zones.

Processes run in a namespace through ``ip netns exec`` (``popen``). Every name carries the
creating process's pid (``mrh<pid>...``), so ``clean_stale`` removes what an earlier run
left when it crashed (namespaces, bridges and the process groups running in them whose
creator is gone) without touching another live run's. ``close`` removes everything this
object made, and is safe to call twice.

Needs root, ``ip`` (iproute2) with ``netns`` and ``tc``; ``unavailable()`` says in one line
why the mode cannot run here (tests skip with that reason). Failure behaviour: a failing
``ip``/``tc`` command raises ``NetnsError`` naming the command and its stderr; whatever was
made before it stays registered, so ``close`` still removes it.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import threading
from dataclasses import dataclass

log = logging.getLogger("moshray.netns")

PREFIX = "mrh"  # every bridge, veth and namespace this module makes starts with it
SUBNET_BASE = "10.77"  # 10.77.N.0/24, one N per live HostNetwork
LINK_LOCAL = "169.254.169.254"  # the clouds' metadata address, inside each namespace
FIRST_HOST = 10  # slot s is 10.77.N.(10 + s)
NOWHERE = 254  # 10.77.N.254: the nodes' default gateway, held by nobody
MAX_SLOTS = 200
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"


class NetnsError(RuntimeError):
    """An ``ip`` or ``tc`` command failed (the message names it and its stderr)."""


def unavailable() -> str | None:
    """Why the separate-hosts mode cannot run on this machine (one line), or None."""
    if os.geteuid() != 0:
        return "cluster.hosts='netns' needs root (network namespaces); use hosts='loopback'"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"cluster.hosts='netns' needs the '{tool}' command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "netns", "del", probe)
    except NetnsError as exc:
        return f"cluster.hosts='netns': network namespaces do not work here ({exc})"
    return None


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed: {done.stderr.strip()[:300]}")
    return done.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    """The creating pid encoded in a name this module made (``mrh<pid>b``, ``mrh<pid>-3``,
    ``mrh<pid>v3``), else None."""
    if not name.startswith(PREFIX):
        return None
    digits = ""
    for ch in name[len(PREFIX):]:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def _namespace_pids(ns: str) -> list[int]:
    try:
        out = _run("ip", "netns", "pids", ns)
    except NetnsError:
        return []
    return [int(x) for x in out.split()]


def _end_pids(pids: list[int]) -> None:
    """SIGKILL the process groups of ``pids`` (processes left in a stale namespace)."""
    for pid in pids:
        try:
            os.killpg(os.getpgid(pid), signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def clean_stale() -> list[str]:
    """Remove the namespaces and bridges of earlier runs whose creating process is gone (and
    kill what still runs in those namespaces); returns the names removed."""
    removed = []
    if os.path.isdir(NETNS_DIR):
        for ns in sorted(os.listdir(NETNS_DIR)):
            owner = _owner(ns)
            if owner is not None and not _pid_alive(owner):
                _end_pids(_namespace_pids(ns))
                try:
                    _run("ip", "netns", "del", ns)
                    removed.append(ns)
                except NetnsError as exc:
                    log.warning("stale namespace %s not removed: %s", ns, exc)
    for line in _run("ip", "-o", "link", "show").splitlines():
        name = line.split(":", 2)[1].strip().split("@")[0]
        owner = _owner(name)
        if owner is not None and not _pid_alive(owner):
            try:
                _run("ip", "link", "del", name)
                removed.append(name)
            except NetnsError:
                pass  # a veth end goes away with its namespace or its peer
    if removed:
        log.warning("removed what an earlier run left: %s", ", ".join(removed))
    return removed


def _used_subnets() -> set[str]:
    out = _run("ip", "-o", "-4", "addr", "show")
    return {str(ipaddress.ip_interface(f.split()[3]).network)
            for f in out.splitlines() if len(f.split()) > 3}


def _no_ipv6(dev: str, namespace: str | None = None) -> None:
    """IPv6 off on ``dev`` (in ``namespace``: all of its interfaces): the cluster speaks
    IPv4 only, and a new interface's IPv6 chatter (neighbour discovery, multicast reports)
    would cross the links the benchmarks count. Nothing where the kernel has no IPv6."""
    if not os.path.isdir("/proc/sys/net/ipv6"):
        return
    if namespace is None:
        try:
            with open(f"/proc/sys/net/ipv6/conf/{dev}/disable_ipv6", "w") as f:
                f.write("1")
        except OSError as exc:
            log.debug("IPv6 left on %s: %s", dev, exc)
        return
    subprocess.run(["ip", "netns", "exec", namespace, "sysctl", "-qw",
                    "net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1"],
                   capture_output=True, timeout=30)


def _tbf(netns: tuple, dev: str, mbit: float) -> None:
    """Shape ``dev``'s egress to ``mbit`` Mbit/s (``tbf``). ``ValueError`` for a rate that
    is not positive."""
    if not (isinstance(mbit, (int, float)) and mbit > 0):
        raise ValueError(f"a link's rate must be positive Mbit/s, got {mbit!r}")
    # The bucket holds at least 10 ms at the rate (and a few full frames); a packet waits
    # at most 200 ms in the queue, as a congested link's buffer would.
    burst = max(16 * 1514, int(mbit * 1e6 / 8 / 100))
    _run("tc", *netns, "qdisc", "replace", "dev", dev, "root", "tbf",
         "rate", f"{mbit}mbit", "burst", str(burst), "latency", "200ms")


QDISC_KEYS = ("sent_bytes", "sent_packets", "dropped", "overlimits")


def parse_qdisc_stats(text: str) -> dict[str, int]:
    """The first ``Sent N bytes M pkt (dropped D, overlimits O requeues R)`` line of
    ``tc -s qdisc show`` as ``sent_bytes``, ``sent_packets``, ``dropped``, ``overlimits``
    (zeros where missing)."""
    m = re.search(r"Sent (\d+) bytes (\d+) pkt \(dropped (\d+), overlimits (\d+)", text)
    return dict(zip(QDISC_KEYS, map(int, m.groups()))) if m else dict.fromkeys(QDISC_KEYS, 0)


@dataclass(frozen=True)
class ZoneBridge:
    """A zone's bridge and the veth pair joining it to the head's: ``link`` on the head's
    bridge, ``peer`` on the zone's."""

    zone: str
    bridge: str
    link: str
    peer: str


@dataclass(frozen=True)
class Host:
    """One spot node's network: its namespace, address and this side's veth name."""

    slot: int
    namespace: str
    address: str
    veth: str  # the host side (on the bridge); the namespace side is ``eth0``


class HostNetwork:
    """The bridge and the spot nodes' namespaces of one embedded cluster; see the module
    docstring. Thread-safe; use as a context manager or call ``close``."""

    def __init__(self) -> None:
        clean_stale()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}b"
        used = _used_subnets()
        free = [n for n in range(1, 255) if f"{SUBNET_BASE}.{n}.0/24" not in used]
        if not free:
            raise NetnsError(f"no free {SUBNET_BASE}.N.0/24 subnet for the bridge")
        self.subnet = f"{SUBNET_BASE}.{free[0]}"
        self.head_address = f"{self.subnet}.1"
        self.hosts: dict[int, Host] = {}
        self.zones: dict[str, ZoneBridge] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._made_bridge = False
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            self._made_bridge = True
            _no_ipv6(self.bridge)
            _run("ip", "addr", "add", f"{self.head_address}/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
        except BaseException:
            self.close()
            raise
        log.info("separate hosts: bridge %s, head at %s", self.bridge, self.head_address)

    # -- nodes -------------------------------------------------------------------------------

    def add_zone(self, zone: str, mbit: float | None) -> ZoneBridge:
        """A bridge for ``zone``'s nodes (``add_host(slot, zone)``), joined to the head's by
        one link at ``mbit`` Mbit/s each way (``tbf`` on both ends; None: not shaped). A
        zone already added is returned as it is."""
        with self._lock:
            if zone in self.zones:
                return self.zones[zone]
            i = len(self.zones)
            made = ZoneBridge(zone, f"{self.tag}z{i}", f"{self.tag}l{i}", f"{self.tag}m{i}")
            self.zones[zone] = made  # (registered first: ``close`` removes what was made)
        _run("ip", "link", "add", made.bridge, "type", "bridge")
        _run("ip", "link", "add", made.link, "type", "veth", "peer", "name", made.peer)
        for dev in (made.bridge, made.link, made.peer):
            _no_ipv6(dev)
        # The zone's bridge carries frames, nothing for this host: without this the kernel
        # answers the zone's ARP for the head's address there (the head is local) and the
        # zone's traffic to the head would skip the link. (8: answer for no local address.)
        with open(f"/proc/sys/net/ipv4/conf/{made.bridge}/arp_ignore", "w") as f:
            f.write("8")
        _run("ip", "link", "set", made.bridge, "up")
        _run("ip", "link", "set", made.link, "master", self.bridge, "up")
        _run("ip", "link", "set", made.peer, "master", made.bridge, "up")
        if mbit is not None:
            for dev in (made.link, made.peer):
                _tbf((), dev, mbit)
        return made

    def zone_link(self, zone: str) -> str:
        """The head-side end of ``zone``'s link (its ``rx_bytes`` + ``tx_bytes``: every
        byte between the zone and the rest). ``KeyError`` for a zone not added."""
        with self._lock:
            return self.zones[zone].link

    def add_host(self, slot: int, zone: str | None = None) -> Host:
        """Make slot's namespace, address, link and metadata address; returns its ``Host``.
        With ``zone`` (added by ``add_zone``) its link is on that zone's bridge."""
        if not 0 <= slot < MAX_SLOTS:
            raise ValueError(f"slot must be in 0..{MAX_SLOTS - 1}, got {slot}")
        bridge = self.bridge if zone is None else self.zones[zone].bridge
        host = Host(slot, f"{self.tag}-{slot}", f"{self.subnet}.{FIRST_HOST + slot}",
                    f"{self.tag}v{slot}")
        with self._lock:
            if slot in self.hosts:
                raise ValueError(f"slot {slot} already has a host")
            self.hosts[slot] = host
        ns = host.namespace
        _run("ip", "netns", "add", ns)
        _no_ipv6("", ns)  # (before eth0 exists: it takes the default)
        _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "eth0",
             "netns", ns)
        _no_ipv6(host.veth)
        _run("ip", "link", "set", host.veth, "master", bridge, "up")
        _run("ip", "-n", ns, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "-n", ns, "addr", "add", f"{LINK_LOCAL}/32", "dev", "lo")
        _run("ip", "-n", ns, "route", "add", "default", "via", f"{self.subnet}.{NOWHERE}",
             "dev", "eth0")
        return host

    def remove_host(self, slot: int) -> None:
        """Kill what still runs in slot's namespace and remove it (its link goes with it)."""
        with self._lock:
            host = self.hosts.pop(slot, None)
        if host is None:
            return
        _end_pids(_namespace_pids(host.namespace))
        try:
            _run("ip", "netns", "del", host.namespace)
        except NetnsError as exc:
            log.warning("namespace %s not removed: %s", host.namespace, exc)
        # The veth pair goes with the namespace once nothing holds it; do not wait for that.
        subprocess.run(["ip", "link", "del", host.veth], capture_output=True, timeout=30)

    def host(self, slot: int) -> Host:
        with self._lock:
            return self.hosts[slot]

    # -- links -------------------------------------------------------------------------------

    def shape(self, slot: int, mbit: float | None) -> None:
        """Limit slot's link to ``mbit`` Mbit/s each way (``tbf`` on both veth ends); None
        lifts the limit."""
        host = self.host(slot)
        ends = ((), host.veth), (("-n", host.namespace), "eth0")
        for netns, dev in ends:
            if mbit is None:
                subprocess.run(["tc", *netns, "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, timeout=30)
                continue
            _tbf(netns, dev, mbit)

    def link_stats(self, slot: int) -> dict[str, int]:
        """Slot's link as the kernel counts it, both ends summed (the host side carries what
        the node receives, its ``eth0`` what it sends): ``sent_bytes`` and ``sent_packets``
        through the root qdiscs, ``dropped`` and ``overlimits`` (packets a ``tbf`` held
        back: traffic that met the shaped rate). Zeros where a qdisc shows none of them."""
        host = self.host(slot)
        total = dict.fromkeys(QDISC_KEYS, 0)
        for netns, dev in (((), host.veth), (("-n", host.namespace), "eth0")):
            out = subprocess.run(["tc", *netns, "-s", "qdisc", "show", "dev", dev, "root"],
                                 capture_output=True, text=True, timeout=30).stdout
            for key, value in parse_qdisc_stats(out).items():
                total[key] += value
        return total

    def cut(self, slot: int) -> None:
        """Partition slot: its link goes down (nothing passes either way)."""
        _run("ip", "link", "set", self.host(slot).veth, "down")

    def heal(self, slot: int) -> None:
        """End slot's partition: its link comes back up."""
        _run("ip", "link", "set", self.host(slot).veth, "up")

    # -- processes and sockets inside a node -----------------------------------------------------

    def popen(self, slot: int, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` inside slot's network namespace (``ip netns exec``) and a PID
        namespace of its own (``unshare --pid --mount-proc``: the node's processes see only
        each other, as on a machine of their own, and all die with it), in a session of its
        own (``os.killpg(proc.pid, ...)`` ends it and what it started)."""
        return subprocess.Popen(["ip", "netns", "exec", self.host(slot).namespace,
                                 "unshare", "--pid", "--fork", "--mount", "--mount-proc",
                                 "--kill-child", *argv], start_new_session=True, **kwargs)

    @staticmethod
    def popen_beside(machine: subprocess.Popen, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start ``argv`` on the machine that ``popen`` started as ``machine``: in its
        network, PID and mount namespaces (``nsenter`` into its first process), in a session
        of its own. Raises ``NetnsError`` if that machine is gone."""
        init = machine_init(machine)
        if init is None:
            raise NetnsError(f"the machine of process {machine.pid} is gone")
        return subprocess.Popen(["nsenter", "--target", str(init), "--net", "--pid",
                                 "--mount", "--", *argv], start_new_session=True, **kwargs)

    def listen_in(self, slot: int, port: int = 80, address: str = LINK_LOCAL) -> socket.socket:
        """A TCP socket bound to ``address:port`` inside slot's namespace (not yet listening);
        this process may serve it from any thread."""
        return socket_in_namespace(self.host(slot).namespace, address, port)

    # -- the end -----------------------------------------------------------------------------

    def close(self) -> None:
        """Remove every namespace and the bridge this object made (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            slots = list(self.hosts)
        for slot in slots:
            self.remove_host(slot)
        for made in list(self.zones.values()):  # a veth pair goes with either end
            for name in (made.link, made.bridge):
                subprocess.run(["ip", "link", "del", name], capture_output=True, timeout=30)
        if self._made_bridge:
            try:
                _run("ip", "link", "del", self.bridge)
            except NetnsError as exc:
                log.warning("bridge %s not removed: %s", self.bridge, exc)

    def __enter__(self) -> "HostNetwork":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def machine_init(machine: subprocess.Popen) -> int | None:
    """The pid (as this host sees it) of the first process of a machine ``popen`` started:
    the command itself, running as pid 1 of its PID namespace; None once it is gone."""
    try:
        with open(f"/proc/{machine.pid}/task/{machine.pid}/children") as f:
            return int(f.read().split()[0])
    except (OSError, IndexError, ValueError):
        return None


def socket_in_namespace(namespace: str, address: str, port: int) -> socket.socket:
    """A TCP socket bound to ``address:port`` inside the named network namespace.

    A thread joins the namespace (``setns``, which moves only the calling thread), makes and
    binds the socket there and returns to this process's namespace; the socket stays in the
    namespace it was made in. Raises ``OSError`` if the namespace or the bind fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    result: dict = {}

    def work() -> None:
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
        except OSError as exc:
            os.close(own)
            result["error"] = exc
            return
        try:
            if libc.setns(target, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns into {namespace}: {os.strerror(err)}")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, port))
            result["socket"] = sock
        except OSError as exc:
            result["error"] = exc
        finally:
            if libc.setns(own, CLONE_NEWNET) != 0:  # never leave a thread in the wrong place
                result.setdefault("error", OSError(ctypes.get_errno(), "setns back"))
            os.close(own)
            os.close(target)

    thread = threading.Thread(target=work, name=f"netns-{namespace}")
    thread.start()
    thread.join(timeout=30)
    if "error" in result:
        if "socket" in result:
            result["socket"].close()
        raise result["error"]
    return result["socket"]
